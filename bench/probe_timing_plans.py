"""Do the tuner's short timing bursts rank kernels as the bench's sustained runs do? (needs an
SM90 GPU)

`detgemm-cute tune` times each kernel for about 6 ms a round (`TUNE_PLAN`); `bench_gemm.py`
for about 300 ms (`BENCH_PLAN`), long enough for the board to reach its power limit. On
problems where a pool fit and the bench disagreed, this times the disputed kernels (forced
through a user layer) and cuBLASLt without split-K under both plans, alternating
tune / bench / tune / bench in one process, and prints each kernel's speed relative to Lt.

    python bench/probe_timing_plans.py --out "$OUT/timing_plans.json"
"""

import sys
import tempfile
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute import registry
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.peers import LtNoSplit
from detgemm_cute.benchlib.shapes import Problem
from detgemm_cute.benchlib.timing import BENCH_PLAN, TUNE_PLAN, make_sets, time_units
from sweep_common import probe_args, write_probe

# The kernels in dispute (tile, cluster, stages, options) and the problems (op, M, K, N of the
# layer, kernels): the first from the dX bench, the second from the pool, the third both.
KERNELS = {
    "208_c1x1_swap": ((128, 208, 64), (1, 1), 4, {"swap_ab": True}),
    "128_c1x2_swap_rn": ((128, 128, 64), (1, 2), 6, {"swap_ab": True, "raster_n": True}),
    "160_c1x1_swap": ((128, 160, 64), (1, 1), 5, {"swap_ab": True}),
}
PROBLEMS = [("dx", 1234, 8192, 128256, ("208_c1x1_swap", "128_c1x2_swap_rn")),
            ("dx", 896, 4096, 128256, ("208_c1x1_swap", "128_c1x2_swap_rn")),
            ("dx", 777, 14784, 8192, ("208_c1x1_swap", "160_c1x1_swap"))]


def layer(path: Path) -> None:
    """One dx bucket per kernel, serving no real M (each is forced by name)."""
    lines = ["arch: sm90", "buckets:"]
    for i, (name, (tile, cluster, stages, opts)) in enumerate(KERNELS.items()):
        lines += [f"  - name: probe_{name}", "    op: dx", "    dtypes: [bf16]",
                  f"    m: [{10**12 + i}, {10**12 + i}]", f"    tile: {list(tile)}",
                  f"    cluster: {list(cluster)}", f"    stages: {stages}",
                  "    persistent: true"]
        lines += [f"    {k}: {str(v).lower()}" for k, v in opts.items()]
    path.write_text("\n".join(lines) + "\n")
    registry.add_config(path)


def forced(name):
    def run(s):
        with dg.force_bucket(f"probe_{name}"):
            return dg.input_grad(s.a, s.b)
    return run


def lt(s):
    with LtNoSplit():
        return s.a @ s.b


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 1
    tmp = tempfile.TemporaryDirectory()
    layer(Path(tmp.name) / "probe.yaml")
    l2 = gpu.l2_bytes()
    cap = torch.cuda.Stream()
    rows = []
    for op, m, k, n, names in PROBLEMS:
        sets, _ = make_sets(Problem(op, m, k, n, ""), torch.bfloat16, l2, BENCH_PLAN,
                            with_out=False)
        fns = {nm: forced(nm) for nm in names}
        fns["lt"] = lt
        for round_ in range(2):
            for plan_name, plan in (("tune", TUNE_PLAN), ("bench", BENCH_PLAN)):
                res = time_units(fns, sets, plan, cap)
                us = {nm: r.get("us") for nm, r in res.items()}
                row = {"op": op, "M": m, "K": k, "N": n, "plan": plan_name, "round": round_,
                       "us": us, "vs_lt": {nm: us["lt"] / v for nm, v in us.items()
                                           if v and nm != "lt"}}
                rows.append(row)
                print(f"{op} {m}x{k}x{n} {plan_name:5s} round {round_}: "
                      + "  ".join(f"{nm} {v:.3f}x" for nm, v in row["vs_lt"].items()),
                      flush=True)
        del sets
    return write_probe(args.out, rows)


if __name__ == "__main__":
    sys.exit(main())
