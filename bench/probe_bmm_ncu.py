"""q @ k^T at long sequences (output-bound: the S x S scores are most of the bytes): which kernel
torch.bmm (cuBLAS) runs and what Nsight Compute sees in it and in detgemm's table pick.

    python bench/probe_bmm_ncu.py names --out F.md       # cuBLAS's kernel per problem
    ncu --profile-from-start off --clock-control none --metrics M \\
        python bench/probe_bmm_ncu.py ncu 64x4000x128 64x3000x128

Problems are LxSxD: L entries of q [S, D] @ k^T [D, S], k a transposed view as attention
makes it. `names` records the CUDA kernel(s) of one torch.bmm call (torch.profiler) next to
detgemm's bucket and how it stores the output; `ncu` runs dg.bmm then torch.bmm once per
problem between cudaProfilerStart/Stop, after warm-up, on fresh random bf16 inputs.
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
import detgemm_cute as dg  # noqa: E402
from detgemm_cute import batched, dispatch  # noqa: E402
from ncu_common import profiled, write_kernel_table  # noqa: E402

PROBLEMS = ["64x4000x128", "64x4000x80", "64x4000x64", "64x3000x128", "256x1000x128",
            "160x1500x128", "96x2500x96"]


def _inputs(spec: str):
    lb, s, d = (int(v) for v in spec.split("x"))
    q = torch.randn(lb, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(lb, s, d, device="cuda", dtype=torch.bfloat16)
    return q, k.transpose(1, 2)


def _layout(q, kt) -> str:
    lb, s, d = q.shape
    bucket = dispatch.lookup("bmm", "bf16", "sm90", s, s, d)
    key = batched.kernel_layout(q, kt, None, torch.bfloat16, bucket)[0]
    how = "threads" if key.c_direct else "TMA"
    return (f"{bucket.name} {'x'.join(map(str, key.tile))} c{key.cluster[0]}x{key.cluster[1]} "
            f"s{key.stages}{' p' if key.persistent else ''}, stores by {how}")


def names(problems, out):
    def row(spec):
        q, kt = _inputs(spec)
        return _layout(q, kt), lambda: torch.bmm(q, kt)

    write_kernel_table(out, f"# torch.bmm (cuBLAS) kernels for q @ k^T on "
                       f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
                       ("L x S x D", "detgemm bucket", "cuBLAS kernel(s)", "cuBLAS us (profiler)"),
                       problems, row)


def ncu(problems):
    sets = [_inputs(p) for p in problems]
    profiled([call for q, kt in sets
              for call in (lambda q=q, kt=kt: dg.bmm(q, kt), lambda q=q, kt=kt: torch.bmm(q, kt))])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("names", "ncu"))
    p.add_argument("problems", nargs="*", default=None)
    p.add_argument("--out", default="bmm_qk_kernels.md", help="markdown file for names")
    a = p.parse_args(argv)
    probs = a.problems or PROBLEMS
    if a.mode == "names":
        names(probs, a.out)
    else:
        ncu(probs)


if __name__ == "__main__":
    main()
