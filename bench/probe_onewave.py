"""Forward rows that fill about one wave of long-K tiles (M 200..777, outputs of 1.5k-14k
columns, below 0.9x cuBLASLt in the prefill bench; three larger-M rows as controls): which
kernel cuBLASLt (split-K off, the same bits) runs, what Nsight Compute sees in it and in
detgemm's pick, and how both run at the board's power limit.

    python bench/probe_onewave.py names --out F.md     # Lt's kernel name per problem
    python bench/probe_onewave.py clocks --out F.md    # sustained replay: time, SM clock, power
    ncu --profile-from-start off --clock-control none --metrics M \\
        python bench/probe_onewave.py ncu 600x9216x2304 296x8192x5120

`names` records the CUDA kernel(s) each Lt call launches (torch.profiler) next to detgemm's
bucket; `clocks` replays a CUDA graph of each peer's calls (inputs rotating over sets that
exceed L2, as the bench does; detgemm first, then Lt) for a few seconds while nvidia-smi
samples the SM clock and the board power of this GPU; `ncu` runs detgemm then Lt once per
problem between cudaProfilerStart/Stop, after warm-up, on fresh random bf16 inputs.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
import detgemm_cute as dg  # noqa: E402
from detgemm_cute import dispatch  # noqa: E402
from detgemm_cute.benchlib import gpu, peers, timing  # noqa: E402
from detgemm_cute.benchlib.shapes import Problem  # noqa: E402
from ncu_common import profiled, write_kernel_table  # noqa: E402

PROBLEMS = ["256x8192x5120", "296x8192x5120", "200x14336x3584", "256x7168x3584",
            "256x8192x10240", "256x4096x14336", "512x1024x3072", "512x896x3584",
            "512x7168x4096", "512x14336x3584", "520x4096x3584", "520x8960x1536",
            "600x9216x2304", "640x768x3072", "777x3584x4608", "777x1792x3584",
            "5000x4096x1024", "3000x8192x7392", "2048x3072x768"]


def _inputs(spec: str):
    m, k, n = (int(v) for v in spec.split("x"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    return x, w


def _lt(x, w):
    with peers.LtNoSplit():
        return torch.mm(x, w.t())


def names(problems, out):
    def row(spec):
        x, w = _inputs(spec)
        m, k, n = (int(v) for v in spec.split("x"))
        return dispatch.explain("fwd", "bf16", "sm90", m, n, k).bucket.name, lambda: _lt(x, w)

    write_kernel_table(out, f"# cuBLASLt (split-K off) kernels on {torch.cuda.get_device_name()}, "
                       f"torch {torch.__version__}",
                       ("M x K x N", "detgemm bucket", "Lt kernel(s)", "Lt us (profiler)"),
                       problems, row)


def _graph(fn, sets, reps):
    """A CUDA graph of `reps` calls of fn over the rotating input sets (benchlib's warm-up)."""
    stream = torch.cuda.Stream()
    timing.warm(fn, sets, stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for i in range(reps):
            fn(sets[i % len(sets)])
    return g


def _replay_us(g, reps):
    """One replay of g (`reps` calls), timed with CUDA events: us per call."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def _sustained(g, reps, seconds):
    """Replay g for about `seconds`; (median us per call, median SM MHz, median W)."""
    import statistics
    import subprocess
    import time
    gpu = str(torch.cuda.current_device())
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        gpu = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[int(gpu)]
    smi = subprocess.Popen(["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    times, t_end = [], time.time() + seconds
    while time.time() < t_end:
        times.append(_replay_us(g, reps))
    smi.terminate()
    rows = [r.split(",") for r in smi.communicate()[0].splitlines() if r.count(",") == 1]
    mhz = statistics.median(float(r[0]) for r in rows) if rows else float("nan")
    watt = statistics.median(float(r[1]) for r in rows) if rows else float("nan")
    return statistics.median(times[len(times) // 4:]), mhz, watt


def clocks(problems, out, seconds=3.0):
    lines = [f"# Sustained CUDA-graph replay on {torch.cuda.get_device_name()}: time per call, "
             f"median SM clock and board power (nvidia-smi every 50 ms)", "",
             "| M x K x N | peer | us per call | SM MHz | W |", "|---|---|---|---|---|"]
    for spec in problems:
        m, k, n = (int(v) for v in spec.split("x"))
        # the bench's input sets: fresh random operands, enough of them to exceed L2
        sets, _ = timing.make_sets(Problem("fwd", m, k, n), torch.bfloat16, gpu.l2_bytes(),
                                   with_out=False)
        for name, fn in (("detgemm", peers.detgemm_call("fwd", peers.detgemm_api())),
                         ("cuBLASLt", peers.lt_call("fwd"))):
            reps = 4 * len(sets)
            us, mhz, watt = _sustained(_graph(fn, sets, reps), reps, seconds)
            lines.append(f"| {spec} | {name} | {us:.1f} | {mhz:.0f} | {watt:.0f} |")
            print(lines[-1], flush=True)
        del sets
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def ncu(problems):
    sets = [_inputs(p) for p in problems]
    profiled([call for x, w in sets
              for call in (lambda x=x, w=w: dg.mm(x, w.t()), lambda x=x, w=w: _lt(x, w))])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("names", "ncu", "clocks"))
    p.add_argument("problems", nargs="*", default=None)
    p.add_argument("--out", default=None,
                   help="markdown file (default: onewave_lt_kernels.md for names, "
                        "onewave_clocks.md for clocks)")
    a = p.parse_args(argv)
    probs = a.problems or PROBLEMS
    if a.mode == "names":
        names(probs, a.out or "onewave_lt_kernels.md")
    elif a.mode == "clocks":
        clocks(probs, a.out or "onewave_clocks.md")
    else:
        ncu(probs)


if __name__ == "__main__":
    main()
