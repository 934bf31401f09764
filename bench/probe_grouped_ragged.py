"""What a grouped launch pays for ragged groups at Mixtral sizes (8 experts, ~1024..4096 rows
each; needs an SM90 GPU). `probe_grouped_gap.py` times random routing and groups rounded to
multiples of 128 rows in separate runs (5-21% apart on an H100); here every layout runs in
one interleaved `time_units` run per layer, every unit on the same operands with its own
group ends:

- `random`: the routing's group sizes; `even`: rounded to multiples of 128 (the last group
  takes the rest);
- `shifted`: 128-row multiples, but the first group 40 rows longer and the last 40 shorter,
  so every other group starts 40 rows off a 128-row boundary and has only whole tiles;
- `round64`: the routing's sizes rounded to multiples of 64 (a last tile of exactly 64 rows:
  one warpgroup idle, no tile moved back);
- `round16`: rounded to multiples of 16;
- `torch_loop`: a per-expert torch.mm loop on the random groups (the drift reference);
  `lt_loop` the same under cuBLASLt with split-K off (the same bits as detgemm).

    python bench/probe_grouped_ragged.py --out F.json
"""
import sys

import torch

import detgemm_cute as dg
from detgemm_cute.benchlib.timing import time_units
from moe_layers import lt_loop, make_set, torch_loop
from probe_grouped_gap import PLAN
from sweep_common import probe_args, write_probe

LAYERS = [("mixtral fused up T=1024", 8, 2048, 4096, 28672),
          ("mixtral fused up T=2048", 8, 4096, 4096, 28672),
          ("mixtral down T=4096", 8, 8192, 14336, 4096),
          ("mixtral up T=16384", 8, 32768, 4096, 14336),
          ("mixtral down T=16384", 8, 32768, 14336, 4096)]


def rounded(sizes, step, total):
    out = [max(step, round(s / step) * step) for s in sizes[:-1]]
    return out + [total - sum(out)]


def layouts_of(sizes, n_rows) -> dict:
    """The group sizes of each layout (see the module docstring) from the routing's."""
    even = rounded(sizes, 128, n_rows)
    return {"random": sizes, "even": even,
            "shifted": [even[0] + 40] + even[1:-1] + [even[-1] - 40],
            "round64": rounded(sizes, 64, n_rows), "round16": rounded(sizes, 16, n_rows)}


def time_layer(layer, gen, cap) -> dict:
    """One layer's row: every layout's grouped launch and the torch loop, timed together."""
    label, experts, n_rows, k, n = layer
    s = make_set("fwd", experts, n_rows, k, n, gen)
    layouts = layouts_of([e - b for b, e in zip([0] + s[3][:-1], s[3])], n_rows)
    offs = {nm: torch.tensor(v).cumsum(0).to(torch.int32).cuda() for nm, v in layouts.items()}
    fns = {nm: (lambda o: lambda st: dg.grouped_mm(st[0], st[1], o))(o)
           for nm, o in offs.items()}
    fns["torch_loop"], fns["lt_loop"] = torch_loop, lt_loop
    us = {nm: r.get("us") for nm, r in time_units(fns, [s], PLAN, cap).items()}
    print(f"{label:22s} " + "  ".join(f"{nm} {v:8.1f}" for nm, v in us.items() if v)
          + f"  random/even {us['even'] / us['random']:.3f}", flush=True)
    return {"layer": label, "K": k, "N": n, "layouts": layouts, "us": us}


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 1
    gen, cap = torch.Generator().manual_seed(0), torch.cuda.Stream()
    return write_probe(args.out, [time_layer(layer, gen, cap) for layer in LAYERS])


if __name__ == "__main__":
    sys.exit(main())
