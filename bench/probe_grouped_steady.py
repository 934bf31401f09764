"""Where a grouped launch loses to a loop of dense GEMMs when nothing is ragged (needs an SM90
GPU). Mixtral 8x7B's unfused layers at 16384 tokens, top-2, groups of exactly 4096 rows (so
every tile is whole and the tile count sits far from a wave boundary), one kernel for all:
128x256 tiles on 1x2 clusters, 4 stages, persistent (the grouped table's pick there until
its 2026-11-29 refit put ping-pong tiles at 225 rows per expert and more), forced by name in
both ops. On the same operands, in one interleaved `time_units`
run per layer:

- `grouped8`: one grouped launch over the 8 groups;
- `grouped1`: one grouped launch over the first group alone (4096 rows, one weight);
- `dense1`: `dg.mm` on the first group's rows and weight (the same tiles as `grouped1`);
- `dense_loop8`: `dg.mm` per group; `lt_loop`: cuBLASLt with split-K off per group.

`grouped1` against `dense1` isolates the grouped kernel's own cost per tile; `grouped8`
against 8 x `grouped1` what several groups add. `ncu` profiles one launch of each of the
first three (up projection) for Nsight Compute.

    python bench/probe_grouped_steady.py --out F.json
    ncu --profile-from-start off --set full python bench/probe_grouped_steady.py ncu
"""
import sys
import tempfile
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute.benchlib.timing import time_units
from moe_layers import lt_loop
from ncu_common import profiled
from probe_grouped_gap import PLAN
from sweep_common import candidate_layer, probe_args, write_probe

KERNEL = {"tile": (128, 256, 64), "cluster": (1, 2), "stages": 4, "persistent": True}
LAYERS = [("mixtral up T=16384", 4096, 14336), ("mixtral down T=16384", 14336, 4096)]
EXPERTS, ROWS = 8, 4096


def forced_names(tmp: Path) -> tuple[str, str]:
    """(grouped bucket, dense fwd bucket) names of KERNEL, as user layers."""
    g = candidate_layer(tmp / "grouped.yaml", "grouped", "steady_grouped", [KERNEL])[0]
    d = candidate_layer(tmp / "dense.yaml", "fwd", "steady_dense", [KERNEL])[0]
    return g, d


def layer_set(k, n, gen):
    """(x [E*ROWS, K], w^T view [E, K, N] of a row-major [E, N, K], offs, ends) as in
    moe_layers.make_set's fwd pass, with equal groups."""
    x = torch.randn(EXPERTS * ROWS, k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(EXPERTS, n, k, generator=gen) * k ** -0.5).to("cuda", torch.bfloat16)
    ends = [ROWS * (g + 1) for g in range(EXPERTS)]
    return x, w.transpose(1, 2), torch.tensor(ends, dtype=torch.int32, device="cuda"), ends


def calls(names):
    """{name: fn(set)} of the module docstring's launches."""
    g, d = names

    def grouped8(s):
        with dg.force_bucket(g):
            return dg.grouped_mm(s[0], s[1], s[2])

    def grouped1(s):
        with dg.force_bucket(g):
            return dg.grouped_mm(s[0][:ROWS], s[1][:1], s[2][:1])

    def dense1(s):
        with dg.force_bucket(d):
            return dg.mm(s[0][:ROWS], s[1][0])

    def dense_loop8(s):
        with dg.force_bucket(d):
            return [dg.mm(s[0][e * ROWS:(e + 1) * ROWS], s[1][e]) for e in range(EXPERTS)]

    return {"grouped8": grouped8, "grouped1": grouped1, "dense1": dense1,
            "dense_loop8": dense_loop8, "lt_loop": lt_loop}


def main(argv=None) -> int:
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        fns = calls(forced_names(Path(tmp)))
        if argv and argv[0] == "ncu":
            s = layer_set(*LAYERS[0][1:], gen)
            profiled([lambda f=fns[nm]: f(s) for nm in ("grouped8", "grouped1", "dense1")])
            return 0
        args = probe_args(__doc__, argv)
        if args is None:
            return 1
        cap, rows = torch.cuda.Stream(), []
        for label, k, n in LAYERS:
            s = layer_set(k, n, gen)
            ref = fns["dense1"](s)
            same = torch.equal(fns["grouped8"](s)[:ROWS].view(torch.int16),
                               ref.view(torch.int16))
            us = {nm: r.get("us") for nm, r in time_units(fns, [s], PLAN, cap).items()}
            rows.append({"layer": label, "K": k, "N": n, "us": us, "bits_equal": same})
            ratios = ""
            if all(us.get(nm) for nm in ("grouped8", "grouped1", "dense1")):
                ratios = (f"  grouped1/dense1 {us['grouped1'] / us['dense1']:.3f}  grouped8/"
                          f"(8 grouped1) {us['grouped8'] / (8 * us['grouped1']):.3f}")
            print(f"{label:22s} " + "  ".join(f"{nm} {v:8.1f}" for nm, v in us.items() if v)
                  + ratios + f"  bits {same}", flush=True)
        return write_probe(args.out, rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
