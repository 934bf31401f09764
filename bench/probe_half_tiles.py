"""What a grouped tile with only its first 64 rows in its group costs against a full one
(needs an SM90 GPU). Mixtral 8x7B's up projection (8 experts, 4096 -> 14336), equal groups,
so the tile counts pair up: 1024 rows a group (8 full 128-row tiles) against 960 (7 full and
one of 64 rows: the same 64 row tiles), and 1152 (9 full) against 1088 (8 full and one of 64
rows: 72 row tiles); 27-31 waves of 1x2 clusters, so the last partial wave weighs little. If
a 64-row tile (its second warpgroup idle) cost half a full one, 960 would run 1/16 faster
than 1024 and 1088 1/18 faster than 1152. Also the 64x256 kernel (one consumer warpgroup, A
loads 64 rows) on the 1024-row groups, twice the tiles of half the rows. One interleaved
`time_units` run, CUDA graphs, the MoE sweep's plan.

    python bench/probe_half_tiles.py --out F.json
"""
import sys
import tempfile
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute import registry
from detgemm_cute.benchlib.timing import time_units
from probe_grouped_gap import PLAN
from sweep_common import probe_args, write_probe

EXPERTS, K, N = 8, 4096, 14336
KERNELS = {"t128x256": ([128, 256, 64], 4), "t64x256": ([64, 256, 64], 5)}
UNITS = [("t128x256", 1024), ("t128x256", 960), ("t128x256", 1152), ("t128x256", 1088),
         ("t64x256", 1024)]


def user_layer(directory: str) -> Path:
    """One grouped bucket per kernel of KERNELS, serving no M a call reaches (forced)."""
    lines = ["arch: sm90", "buckets:"]
    for i, (name, (tile, stages)) in enumerate(KERNELS.items()):
        m = 10**12 + i
        lines += [f"  - name: {name}", "    op: grouped", "    dtypes: [bf16]",
                  f"    m: [{m}, {m}]", f"    tile: {tile}", "    cluster: [1, 2]",
                  f"    stages: {stages}", "    persistent: true"]
    path = Path(directory) / "half_tiles.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def unit(w, kernel: str, rows: int):
    x = torch.randn(EXPERTS * rows, K, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * rows

    def run(_s):
        with dg.force_bucket(kernel):
            return dg.grouped_mm(x, w, offs)
    return run


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        registry.add_config(user_layer(tmp))
    w = (torch.randn(EXPERTS, N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5)
    w = w.transpose(1, 2)
    fns = {f"{kernel}/{rows}": unit(w, kernel, rows) for kernel, rows in UNITS}
    res = time_units(fns, [None], PLAN, torch.cuda.Stream())
    rows = []
    for (kernel, r), (name, out) in zip(UNITS, res.items()):
        us = out.get("us")
        rows.append({"unit": name, "kernel": kernel, "rows_per_group": r, "us": us,
                     "error": out.get("error"),
                     "tflops": 2 * EXPERTS * r * K * N / us / 1e6 if us else None})
        print(f"{name:16s} {us or float('nan'):9.1f} us  "
              f"{rows[-1]['tflops'] or float('nan'):6.0f} TFLOP/s  {out.get('error') or ''}",
              flush=True)
    return write_probe(args.out, rows)


if __name__ == "__main__":
    sys.exit(main())
