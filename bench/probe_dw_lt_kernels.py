"""dW with small outputs (out_features <= 767, long token chains): which kernel cuBLASLt with
split-K off (the same bits) and cuBLAS default run, next to detgemm's pick.

    python bench/probe_dw_lt_kernels.py names --shapes-file bench/shapes/dw_small.txt --out F.md
    DETGEMM_CUTE_CONFIG=bench/shapes/dw_small_wide_pool.yaml ncu --profile-from-start off \\
        --clock-control none --metrics M python bench/probe_dw_lt_kernels.py ncu 16384x1024x512 \\
        --buckets dw_small_wide_pool.64x64x128_c1x1_s6_swap_ab,...

Each problem is 'MxKxN' (M tokens, K in_features, N out_features), dW[N, K] = dY^T @ X in
fp32, as `bench_gemm.py --ops dw` times it. The kernel names (torch.profiler) carry the
tile, the k depth, the stage count and the cluster (e.g. nvjet_sm90_tst_64x72_64x12_4x2:
a 64x72 tile, 64-deep k blocks, 12 stages, a 4x2 cluster): the shapes a pool of candidate
kernels should hold.
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from detgemm_cute import dispatch  # noqa: E402
from detgemm_cute.benchlib import peers  # noqa: E402
from detgemm_cute.benchlib.shapes import read_shapes_file  # noqa: E402
from ncu_common import profiled, write_kernel_table  # noqa: E402


def _operands(spec: str):
    """Fresh random dY [M, N] and X [M, K] of a 'MxKxN' problem, as the peers' `a` and `b`."""
    m, k, n = (int(v) for v in spec.split("x"))
    return types.SimpleNamespace(a=torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
                                 b=torch.randn(m, k, device="cuda", dtype=torch.bfloat16))


def _ncu(spec: str, buckets: list[str]) -> None:
    """One launch of each forced detgemm kernel, then of cuBLASLt (split-K off), on fresh
    random inputs, between cudaProfilerStart/Stop; then each forced kernel again on K-major
    copies of the operands (the same GEMM and chain through `dg.mm`), so the operands'
    layout can be told apart from the tile."""
    dg = peers.detgemm_api()
    s = _operands(spec)
    # dW = dY^T X as the forward's GEMM on K-major copies: A = dY^T, B^T = X^T
    k_major = types.SimpleNamespace(a=s.a.t().contiguous(), b=s.b.t().contiguous())

    def on(call, operands):
        return lambda: call(operands)

    def forced_k_major(name):
        def call(o):
            with dg.force_bucket(name):
                return dg.mm(o.a, o.b.t(), out_dtype=torch.float32)
        return call
    profiled([on(peers.detgemm_call("dw", dg, b), s) for b in buckets]
             + [on(peers.lt_call("dw"), s)]
             + [on(forced_k_major(b), k_major) for b in buckets])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("names", help="the kernels cuBLASLt and cuBLAS run, per problem")
    n.add_argument("--shapes-file", required=True)
    n.add_argument("--every", type=int, default=1, help="keep every N-th problem")
    n.add_argument("--out", required=True, metavar="F.md")
    c = sub.add_parser("ncu", help="forced detgemm kernels, then cuBLASLt, for Nsight Compute")
    c.add_argument("problem", help="MxKxN: tokens x in_features x out_features")
    c.add_argument("--buckets", required=True, help="comma-separated bucket names to force")
    a = p.parse_args(argv)
    if a.cmd == "ncu":
        _ncu(a.problem, [b for b in a.buckets.split(",") if b])
        return 0
    if a.every < 1:
        p.error(f"--every: expected a count >= 1, got {a.every}")
    out = Path(a.out)
    if out.suffix != ".md":
        p.error(f"--out: expected a markdown file name ending in .md, got {a.out!r}")
    specs = list(dict.fromkeys("x".join(map(str, mkn))
                               for mkn, _ in read_shapes_file(a.shapes_file)))[::a.every]

    def row(spec, lt):
        m, k, n = (int(v) for v in spec.split("x"))
        s, call = _operands(spec), (peers.lt_call if lt else peers.torch_call)("dw")
        return dispatch.explain("dw", "bf16", "sm90", n, k, m).bucket.name, lambda: call(s)

    title = f"kernels on {torch.cuda.get_device_name()}, torch {torch.__version__}"
    cols = ("M x K x N", "detgemm bucket", "kernel(s)", "us (profiler)")
    write_kernel_table(a.out, f"# dW, cuBLASLt (split-K off) {title}", cols, specs,
                       lambda s: row(s, True))
    write_kernel_table(str(out.with_name(out.stem + "_cublas.md")),
                       f"# dW, cuBLAS default {title}", cols, specs, lambda s: row(s, False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
