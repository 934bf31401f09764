"""The same GEMM timed two ways: a short burst after the GPU has idled (clocks at boost, below
the board's power limit) and a sustained replay at the power limit (SM clock and board power
sampled by nvidia-smi). A kernel that keeps up with cuBLASLt only at the power limit is less
efficient per clock; one that keeps up only in bursts spends more energy per GEMM.

    python bench/probe_clock_regimes.py 4096x4096x14336 8192x14336x4096 --out F.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from detgemm_cute.benchlib import gpu, peers, timing  # noqa: E402
from detgemm_cute.benchlib.shapes import Problem  # noqa: E402
from probe_onewave import _graph, _replay_us, _sustained  # noqa: E402


def _burst(g, reps, idle_s, shots):
    """Median us per call of `shots` single replays of g right after `idle_s` of idling."""
    times = []
    for _ in range(shots):
        torch.cuda.synchronize()
        time.sleep(idle_s)
        times.append(_replay_us(g, reps))
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("problems", nargs="+", help="M x K x N (fwd)")
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=2.0, help="sustained replay per peer")
    p.add_argument("--idle", type=float, default=1.0, help="idle before each burst shot")
    p.add_argument("--shots", type=int, default=5)
    a = p.parse_args(argv)
    lines = [f"# Burst vs sustained on {torch.cuda.get_device_name()}, torch {torch.__version__}",
             "", f"burst: one graph replay of R calls after {a.idle}s idle, median of "
             f"{a.shots}; sustained: {a.seconds}s of replays, median of the last three "
             "quarters, nvidia-smi every 50 ms. speed = Lt time / detgemm time.", "",
             "| M x K x N | R | detgemm burst us | Lt burst us | burst speed | detgemm "
             "sustained us | Lt sustained us | sustained speed | detgemm MHz / W | Lt MHz / W |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for spec in a.problems:
        m, k, n = (int(v) for v in spec.split("x"))
        sets, _ = timing.make_sets(Problem("fwd", m, k, n), torch.bfloat16, gpu.l2_bytes(),
                                   with_out=False)
        res = {}
        for name, fn in (("detgemm", peers.detgemm_call("fwd", peers.detgemm_api())),
                         ("Lt", peers.lt_call("fwd"))):
            reps = max(1, len(sets))
            g = _graph(fn, sets, reps)
            burst = _burst(g, reps, a.idle, a.shots)
            us, mhz, watt = _sustained(g, reps, a.seconds)
            res[name] = (burst, us, mhz, watt)
        d, lt = res["detgemm"], res["Lt"]
        lines.append(f"| {spec} | {max(1, len(sets))} | {d[0]:.1f} | {lt[0]:.1f} | "
                     f"{lt[0] / d[0]:.3f} | {d[1]:.1f} | {lt[1]:.1f} | {lt[1] / d[1]:.3f} | "
                     f"{d[2]:.0f} / {d[3]:.0f} | {lt[2]:.0f} / {lt[3]:.0f} |")
        print(lines[-1], flush=True)
        del sets
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
