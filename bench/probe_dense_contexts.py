"""The dense kernel's speed against cuBLASLt (split-K off) in two contexts: one GEMM replayed
on the same operands (the bench's context for a GEMM larger than L2), and eight GEMMs of the
same shape back to back, each on its own weight and rows (a per-expert loop's context), both
under the MoE sweep's timing plan and the bench's. On an H100 the dense loop ran 0.85-0.89x a
torch.mm loop at two Mixtral shapes (`grouped-gap_*`) where the bench has the single GEMM at
0.98-1.00x; this separates the context from the kernel (needs an SM90 GPU).

    python bench/probe_dense_contexts.py --out F.json
"""
import sys

import torch

import detgemm_cute as dg
from detgemm_cute.benchlib.peers import LtNoSplit
from detgemm_cute.benchlib.timing import BENCH_PLAN, time_units
from probe_grouped_gap import PLAN as SWEEP_PLAN
from sweep_common import probe_args, write_probe

# (M, K, N): Mixtral 8x7B's expert GEMMs at ~4096 and ~1024 rows per expert.
SHAPES = [(4096, 4096, 14336), (4079, 4096, 14336), (1024, 14336, 4096), (4096, 14336, 4096)]
EXPERTS = 8


def lt_mm(x, w):
    with LtNoSplit():
        return torch.mm(x, w.t())


def one(mm):
    return lambda s: mm(s[0][0], s[1][0])


def loop(mm):
    def run(s):
        x, w = s
        for e in range(EXPERTS):
            mm(x[e], w[e])
    return run


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 1
    cap = torch.cuda.Stream()
    rows = []
    for m, k, n in SHAPES:
        sets = [(torch.randn(EXPERTS, m, k, device="cuda", dtype=torch.bfloat16),
                 torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)]
        fns = {"dg_one": one(lambda x, w: dg.mm(x, w.t())), "lt_one": one(lt_mm),
               "dg_loop": loop(lambda x, w: dg.mm(x, w.t())), "lt_loop": loop(lt_mm)}
        for plan_name, plan in (("sweep", SWEEP_PLAN), ("bench", BENCH_PLAN)):
            res = time_units(fns, sets, plan, cap)
            us = {nm: r.get("us") for nm, r in res.items()}
            us["dg_loop"] /= EXPERTS
            us["lt_loop"] /= EXPERTS
            row = {"M": m, "K": k, "N": n, "plan": plan_name, "us": us,
                   "one": us["lt_one"] / us["dg_one"], "loop": us["lt_loop"] / us["dg_loop"]}
            rows.append(row)
            print(f"{m}x{k}x{n} {plan_name:5s} " + "  ".join(f"{nm} {v:7.1f}" for nm, v in
                                                         us.items())
                  + f"  speed one {row['one']:.3f} loop {row['loop']:.3f}", flush=True)
        del sets
    return write_probe(args.out, rows)


if __name__ == "__main__":
    sys.exit(main())
