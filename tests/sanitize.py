"""Run every bucket of every op on boundary shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck --report-api-errors no python tests/sanitize.py
    compute-sanitizer --tool racecheck python tests/sanitize.py --dtypes bf16

(`--report-api-errors no`: the DSL probes driver entry points with cuGetProcAddress at
compile time, which the tool otherwise lists as API errors.)

Each bucket is forced (`force_bucket`) onto shapes at its tile edges: 1, tile-1, tile,
tile+1 and a multi-tile ragged shape in each of M, N, K (odd sizes also take the staging and
padded-output paths), plus M = 0 (no launch). fwd runs with a bias, dx through `input_grad`,
dw through `weight_grad` both from zero and continuing an fp32 buffer, and the bias gradient.
Outputs land in NaN-poisoned memory and are checked for NaN, so an unwritten element fails
even where the sanitizer is silent. Prints the number of kernel launches checked; exits 1 on
any failure (the sanitizer's own exit code reports its findings).
"""

from __future__ import annotations

import argparse
import sys

import torch

import detgemm_cute as dg
from detgemm_cute import gemm as _gemm
from detgemm_cute import registry

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "tf32": torch.float32}


def edge_shapes(op, tile, quick: bool):
    """GEMM (M, N, K) at the tile's edges; the empty case is M = 0 rows for fwd/dx and
    K = 0 tokens for dw (no launch: an empty result, or the buffer unchanged)."""
    bm, bn, bk = tile
    shapes = [(1, 1, 1), (bm - 1, bn - 1, bk - 1), (bm, bn, bk), (bm + 1, bn + 1, bk + 1),
              (2 * bm + 3, 3 * bn + 7, 2 * bk + 5), (bm, bn, 0) if op == "dw" else (0, bn, bk)]
    return shapes[1:4] if quick else shapes


def _poison():
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 16, 1 << 20)]
    del blocks


def _count_launches():
    """Wrap the launch so every kernel call is counted."""
    counter = {"n": 0}
    real = _gemm._make_plan

    def make_plan(*args, **kwargs):
        plan = real(*args, **kwargs)
        fn = plan.fn

        def counted(*a):
            counter["n"] += 1
            return fn(*a)

        plan.fn = counted
        return plan

    _gemm._make_plan = make_plan
    return counter


def run_bucket(b, dtype, quick) -> list[str]:
    bad = []
    for m, n, k in edge_shapes(b.op, b.tile, quick):
        def rnd(*s):
            return torch.randn(*s, device="cuda").to(dtype)

        _poison()
        with dg.force_bucket(b.name):
            if b.op == "fwd":
                outs = [dg.linear(rnd(m, k), rnd(n, k), rnd(n))]
            elif b.op == "dx":  # GEMM (M, N, K) = (tokens, in, out)
                outs = [dg.input_grad(rnd(m, k), rnd(k, n))]
            else:  # GEMM (M, N, K) = (out, in, tokens)
                dy, x = rnd(k, m), rnd(k, n)
                acc = torch.randn(m, n, device="cuda")
                outs = [dg.weight_grad(dy, x), dg.weight_grad(dy, x, acc=acc),
                        dg.bias_grad(dy), dg.bias_grad(dy, acc=torch.randn(m, device="cuda"))]
        torch.cuda.synchronize()
        for o in outs:
            if torch.isnan(o).any():
                bad.append(f"{b.name} {dtype} M={m} N={n} K={k}: NaN in output (unwritten?)")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="fwd,dx,dw")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--quick", action="store_true", help="3 shapes per bucket instead of 6")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="only buckets whose name contains TEXT (repeatable: any of them), "
                         "e.g. pingpong or swap_ab")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sanitize: needs a CUDA GPU (SM90)")
        return 0
    counter = _count_launches()
    ops = args.ops.split(",")
    failures = []
    buckets = [b for b in registry.get_registry("sm90").buckets if b.op in ops
               and (not args.only or any(t in b.name for t in args.only))]
    for b in buckets:
        for dt in args.dtypes.split(","):
            if dt in b.dtypes:
                with dg.fp32_precision("tf32" if dt == "tf32" else "ieee"):
                    failures += run_bucket(b, DTYPES[dt], args.quick)
    print(f"sanitize: {counter['n']} kernel launches over {len(buckets)} buckets "
          f"({args.ops}; {args.dtypes}); {len(failures)} output failures")
    for f in failures:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
