"""Run a few problems once per peer inside NVTX ranges, for a profiler (Nsight Compute).

Each problem (op, M, K, N as bench_gemm.py counts them) gets fresh inputs; every peer is
called a few times first (kernel compile or load, cuBLAS heuristics, warm clocks) outside
any range, then once inside the range ``prof/<op> MxKxN/<peer>``, so

    ncu --nvtx --nvtx-include "prof/" ... python bench/profile_shapes.py --shapes ...

profiles exactly one launch of each peer per problem (detgemm's bucket is printed, so the
report's kernels can be matched to buckets). Peers: detgemm, cuBLASLt with split-K off (the
same chain) and cuBLAS default. Importing this module touches no CUDA state.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from detgemm_cute.benchlib.shapes import OPS, Problem, parse_shape  # noqa: E402

PEERS = ("detgemm", "cublaslt", "cublas")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", required=True, metavar="MxKxN")
    p.add_argument("--op", choices=OPS, default="fwd")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--warmup", type=int, default=3, help="unprofiled calls per peer first")
    args = p.parse_args(argv)
    try:
        args.problems = [Problem(args.op, *parse_shape(s)) for s in args.shapes]
    except ValueError as e:
        p.error(f"--shapes: {e}")
    args.peer_list = [x for x in args.peers.split(",") if x]
    bad = [x for x in args.peer_list if x not in PEERS]
    if bad or not args.peer_list:
        p.error(f"--peers: {bad[0] if bad else 'empty'}: expected a subset of {','.join(PEERS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from detgemm_cute.benchlib import peers as P
    from detgemm_cute.benchlib.fmt import fmt_bucket
    from detgemm_cute.benchlib.gpu import gpu_check, l2_bytes
    from detgemm_cute.benchlib.timing import BENCH_PLAN, make_sets
    from detgemm_cute.dispatch import lookup

    why, arch = gpu_check()
    if why is not None:
        print(f"profile_shapes: needs a GPU detgemm has kernels for: {why}. Nothing was run.")
        return 2
    dg = P.detgemm_api()
    calls = {"detgemm": P.detgemm_call(args.op, dg), "cublaslt": P.lt_call(args.op),
             "cublas": P.torch_call(args.op)}
    with torch.no_grad():
        for prob in args.problems:
            sets, _ = make_sets(prob, torch.bfloat16, l2_bytes(), BENCH_PLAN, with_out=False)
            s = sets[0]
            m, n, k = prob.gemm_mnk
            name = f"{prob.op} {prob.m}x{prob.k}x{prob.n}"
            print(f"[profile] {name}: detgemm bucket "
                  f"{fmt_bucket(lookup(prob.op, 'bf16', arch, m, n, k))}", flush=True)
            for peer in args.peer_list:
                for _ in range(args.warmup):
                    calls[peer](s)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(f"prof/{name}/{peer}")
                calls[peer](s)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
            del sets, s
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
