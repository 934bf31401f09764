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
    from torch.profiler import ProfilerActivity, profile
    lines = [f"# torch.bmm (cuBLAS) kernels for q @ k^T on {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}", "",
             "| L x S x D | detgemm bucket | cuBLAS kernel(s) | cuBLAS us (profiler) |",
             "|---|---|---|---|"]
    for spec in problems:
        q, kt = _inputs(spec)
        for _ in range(3):
            torch.bmm(q, kt)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.bmm(q, kt)
            torch.cuda.synchronize()
        kern = [(e.key, e.device_time_total) for e in prof.key_averages()
                if e.device_time_total > 0]
        lines.append(f"| {spec} | {_layout(q, kt)} | " + "<br>".join(nm for nm, _ in kern)
                     + " | " + ", ".join(f"{t:.1f}" for _, t in kern) + " |")
        print(lines[-1], flush=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def ncu(problems):
    sets = [_inputs(p) for p in problems]
    for _ in range(3):
        for q, kt in sets:
            dg.bmm(q, kt)
            torch.bmm(q, kt)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for q, kt in sets:
        dg.bmm(q, kt)
        torch.bmm(q, kt)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


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
