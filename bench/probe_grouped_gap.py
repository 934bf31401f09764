"""Where the one-launch grouped kernel loses to a per-expert loop on few large experts (needs
an SM90 GPU). For Mixtral-shaped layers (8 experts, 256..4096 rows each) it times, in one
interleaved `time_units` run per layer (CUDA graphs, the sweep's timing plan):

- `grouped`: dg.grouped_mm (the table's pick), and the same with the groups' rows made
  multiples of 128 (`grouped_even`: no ragged last tile in any group);
- `dg_loop`: one dg.mm per expert (the dense table's pick for each group's rows), copied
  into the group's rows (dg.mm has no `out=`), against `torch_loop_copy`, the same loop of
  torch.mm with the same copies;
- `torch_loop`, `lt_loop`, `torch_grouped_mm`: the peers of `sweep_grouped.py`.

If dg_loop keeps up with torch_loop_copy while grouped does not keep up with torch_loop, the
loss is the grouped kernel's own (schedule, ragged tiles); if dg_loop loses too, it is the
dense kernels' at these sizes.

    python bench/probe_grouped_gap.py --out "$OUT/grouped_gap.json"
"""

import sys

import torch

import detgemm_cute as dg
from detgemm_cute.benchlib.timing import TimingPlan, time_units
from moe_layers import BF16, lt_loop, make_set, torch_grouped, torch_loop
from sweep_common import probe_args, write_probe

# (label, experts, rows, K, N): Mixtral 8x7B's unfused up and down projections at 2 and 8
# thousand tokens x top-2, and its fused up projection at 1024 tokens.
LAYERS = [("mixtral up T=4096", 8, 8192, 4096, 14336),
          ("mixtral down T=4096", 8, 8192, 14336, 4096),
          ("mixtral up T=16384", 8, 32768, 4096, 14336),
          ("mixtral down T=16384", 8, 32768, 14336, 4096),
          ("mixtral fused up T=1024", 8, 2048, 4096, 28672)]
PLAN = TimingPlan(target_ms=0.5, reps=7, min_reps=3, budget_ms=20.0, warm_rounds=1,
                  warm_replays=1, est_min_ms=0.3)


def even_set(s, bm=128):
    """The set with its group sizes rounded to multiples of `bm` (total kept, last group
    takes the rest)."""
    a, b, _offs, ends = s
    starts = [0] + ends[:-1]
    sizes = [max(bm, round((e - st) / bm) * bm) for st, e in zip(starts, ends)]
    sizes[-1] = a.shape[0] - sum(sizes[:-1])
    new_ends = torch.tensor(sizes).cumsum(0)
    return a, b, new_ends.to(torch.int32).to(a.device), new_ends.tolist()


def copy_loop(mm):
    """One `mm` per non-empty group, its result copied into the group's rows."""
    def run(s):
        a, b, _, ends = s
        out = torch.empty(a.shape[0], b.shape[2], device=a.device, dtype=BF16)
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                out[start:end] = mm(a[start:end], b[g])
            start = end
        return out
    return run


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 1
    gen = torch.Generator().manual_seed(0)
    cap = torch.cuda.Stream()
    rows = []
    for label, experts, n_rows, k, n in LAYERS:
        sets = [make_set("fwd", experts, n_rows, k, n, gen) for _ in range(2)]
        even = [even_set(s) for s in sets]
        fns = {"grouped": lambda s: dg.grouped_mm(s[0], s[1], s[2]),
               "dg_loop": copy_loop(dg.mm), "torch_loop_copy": copy_loop(torch.mm),
               "torch_loop": torch_loop, "lt_loop": lt_loop, "torch_grouped_mm": torch_grouped}
        res = time_units(fns, sets, PLAN, cap)
        res_even = time_units({"grouped_even": fns["grouped"], "torch_loop_even": torch_loop},
                              even, PLAN, cap)
        us = {nm: r.get("us") for nm, r in {**res, **res_even}.items()}
        flop = 2 * n_rows * k * n
        row = {"layer": label, "experts": experts, "rows": n_rows, "K": k, "N": n,
               "group_rows": [e - s for s, e in zip([0] + sets[0][3][:-1], sets[0][3])],
               "us": us, "tflops": {nm: flop / v / 1e6 for nm, v in us.items() if v}}
        rows.append(row)
        best = min(us[p] for p in ("torch_loop", "lt_loop", "torch_grouped_mm") if us.get(p))
        print(f"{label:26s} " + "  ".join(f"{nm} {v:8.1f}" for nm, v in us.items() if v)
              + f"  grouped/torch-best {best / us['grouped']:.3f}"
              f"  dg_loop/torch_loop_copy {us['torch_loop_copy'] / us['dg_loop']:.3f}",
              flush=True)
    return write_probe(args.out, rows)


if __name__ == "__main__":
    sys.exit(main())
