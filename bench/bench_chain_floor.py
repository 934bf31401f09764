"""The chain floor: time per dependent 16-wide K step of one accumulator, per MMA form, on
this GPU; plus the device copy bandwidth and the launch time a decode row pays.

Per probe (`detgemm_cute/benchlib/chain_kernel.py`: operands in shared memory or registers,
no global loads in the loop) and CTA count (1, and one per SM): the kernel runs at several
chain lengths, each timed with CUDA events over a few back-to-back launches (median of
repeats), and t_step is the least-squares slope of time against steps; the intercept is the
fixed cost (launch, shared-memory fill, store). Writes chain_floor_<device>.{json,md}, which
`bench_gemm.py --floor FILE` reads to put every decode row against
max(bytes / copy bandwidth, K/16 x t_step) + launch (`benchlib/floor.py`).

Usage (GPU machine, repository root):  python bench/bench_chain_floor.py --out "$OUT"
Importing this module touches no CUDA state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from detgemm_cute.benchlib.fmt import device_slug, err_str, fmt_num  # noqa: E402
from detgemm_cute.benchlib.gpu import log  # noqa: E402

# (form, n, steps per batch, depth, warps): the decode tiles' widths at BK 128 (8 steps), two
# at BK 64, the wait-every-batch variant, TF32 and SM80 forms.
PROBES = ([("wgmma", n, 8, 1, 1) for n in (8, 16, 24, 32, 48, 64, 96, 112, 128, 192, 256)]
          + [("wgmma", 16, 4, 1, 1), ("wgmma", 128, 4, 1, 1), ("wgmma", 16, 8, 0, 1)]
          + [("wgmma_tf32", n, 8, 1, 1) for n in (16, 64, 128)]
          + [("mma_sync", n, 8, 1, w) for n in (8, 32) for w in (1, 4)])
QUICK_PROBES = [("wgmma", 16, 8, 1, 1), ("wgmma_tf32", 16, 8, 1, 1), ("mma_sync", 8, 8, 1, 1)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"))
    p.add_argument("--quick", action="store_true", help="three probes, shorter chains")
    p.add_argument("--max-steps", type=int, default=65536,
                   help="the longest chain, in MMA steps (default 65536: K = 1M)")
    p.add_argument("--repeats", type=int, default=5, help="timings per length (median)")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="start no new probe after this many seconds")
    args = p.parse_args(argv)
    if args.max_steps < 64 or args.repeats < 1:
        p.error("--max-steps must be >= 64 and --repeats >= 1")
    return args


def timed_us(fn, launches: int, repeats: int) -> float:
    """Median over `repeats` of (event time of `launches` back-to-back calls) / launches."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(launches):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / launches)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> dict:
    """Device copy (read + write) and read-only (sum) bandwidth in TB/s, CUDA-event timed."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_us = timed_us(lambda: dst.copy_(src), 1, repeats)
    read_us = timed_us(lambda: src.view(torch.float32).sum(), 1, repeats)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "copy_tbs": 2 * nbytes / (copy_us * 1e6), "copy_us": copy_us,
            "read_tbs": nbytes / (read_us * 1e6), "read_us": read_us}


def graph_launch_us(fn, calls: int = 200, repeats: int = 7) -> float:
    """Time per call of `calls` captured calls of fn() replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        for _ in range(calls):
            fn()
    return timed_us(g.replay, 1, repeats) / calls


def lengths(max_steps: int, steps: int) -> list[int]:
    """Batch counts of the chain lengths timed: max_steps / 8, / 4, / 2, / 1 MMA steps."""
    top = max(4, max_steps // steps)
    return sorted({max(1, top // d) for d in (8, 4, 2, 1)})


def run_probe(spec, ctas: int, args, compiled: dict, gpu_arch: str) -> dict:
    """One probe at `ctas` CTAs; `compiled` caches the compiled probe per spec."""
    from detgemm_cute.benchlib.chain_kernel import ChainProbe, compile_probe
    from detgemm_cute.benchlib.floor import fit_line

    form, n, steps, depth, warps = spec
    probe = ChainProbe(form, n, steps, depth, warps)
    rec = {"form": form, "n": n, "steps": steps, "depth": depth, "warps": warps,
           "ctas": ctas, "label": probe.label, "compile_s": 0.0}
    if spec not in compiled:
        t0 = time.time()
        compiled[spec] = compile_probe(probe, gpu_arch)
        rec["compile_s"] = round(time.time() - t0, 2)
    fn = compiled[spec]
    out = torch.zeros(ctas, probe.threads, dtype=torch.float32, device="cuda")
    xs, ys = [], []
    for groups in lengths(args.max_steps, steps):
        xs.append(groups * steps)
        ys.append(timed_us(lambda: fn(out, groups), 3, args.repeats))
    b, a = fit_line(xs, ys)
    rec.update({"points": [[x, round(y, 4)] for x, y in zip(xs, ys)],
                "t_step_ns": a * 1e3, "fixed_us": b,
                "t_step_ns_longest": ys[-1] / xs[-1] * 1e3,
                "finite": bool(torch.isfinite(out).all())})
    return rec


def render(data: dict) -> str:
    bw = data["bandwidth"]
    lines = [f"# Chain floor on {data['device']}", "",
             f"- date {data['date']}; torch {data['torch']}, CUDA {data['cuda']}, "
             f"nvidia-cutlass-dsl {data.get('cutlass_dsl')}; {data['sms']} SMs",
             f"- device copy (read + write) {bw['copy_tbs']:.3f} TB/s, read (sum) "
             f"{bw['read_tbs']:.3f} TB/s, {bw['bytes'] / 2**30:.0f} GiB",
             f"- launch: {data['launch_us']:.2f} us per call (the smallest probe, one CTA per "
             f"SM, 200 calls in one CUDA graph)",
             "- t_step: least-squares slope of the time against the chain length in MMA steps "
             "(lengths in `points`); fixed: the intercept (launch, shared-memory fill, store)",
             ""]
    lines += ["| form | MMA | steps/batch | depth | warps | CTAs | t_step ns | t/step at the "
              "longest ns | fixed us | compile s |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in data["probes"]:
        if p.get("error"):
            lines.append(f"| {p['form']} | n{p['n']} | {p['steps']} | {p['depth']} | "
                         f"{p['warps']} | {p['ctas']} | error: {p['error']} | | | |")
            continue
        lines.append(f"| {p['form']} | {p['label'].split()[1]} | {p['steps']} | {p['depth']} | "
                     f"{p['warps']} | {p['ctas']} | {fmt_num(p['t_step_ns'], '{:.2f}')} | "
                     f"{fmt_num(p['t_step_ns_longest'], '{:.2f}')} | "
                     f"{fmt_num(p['fixed_us'], '{:.2f}')} | {p['compile_s']} |")
    for note in data.get("notes") or []:
        lines.append(f"\n- note: {note}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from detgemm_cute.benchlib.gpu import device_meta, gpu_check

    why, arch = gpu_check()
    if why is not None or arch != "sm90":
        print(f"bench_chain_floor: needs an SM90 GPU (H100/H200): {why or arch}. Nothing was "
              f"run.", flush=True)
        return 2
    from detgemm_cute.benchlib.chain_kernel import ChainProbe, compile_probe
    from detgemm_cute.compile import gpu_arch_for

    gpu_arch = gpu_arch_for(arch, torch.cuda.get_device_capability(0))
    meta = device_meta()
    sms = meta["sm_count"]
    data = dict(meta, sms=sms, gpu_arch=gpu_arch, notes=[], probes=[])
    t_start = time.time()
    data["bandwidth"] = copy_bandwidth()
    log(f"copy {data['bandwidth']['copy_tbs']:.3f} TB/s, read {data['bandwidth']['read_tbs']:.3f}")
    small = compile_probe(ChainProbe("wgmma", 8, 1, 0), gpu_arch)
    out = torch.zeros(sms, 128, dtype=torch.float32, device="cuda")
    data["launch_us"] = graph_launch_us(lambda: small(out, 1))
    log(f"launch {data['launch_us']:.2f} us per call in a graph")
    compiled = {}
    for spec in QUICK_PROBES if args.quick else PROBES:
        for ctas in (sms, 1):
            if time.time() - t_start > args.max_seconds:
                data["notes"].append(f"time box ({args.max_seconds:g} s) reached: "
                                     f"{len(data['probes'])} probe runs")
                break
            try:
                rec = run_probe(spec, ctas, args, compiled, gpu_arch)
            except Exception as e:  # noqa: BLE001
                rec = {"form": spec[0], "n": spec[1], "steps": spec[2], "depth": spec[3],
                       "warps": spec[4], "ctas": ctas, "error": err_str(e, 160)}
                torch.cuda.synchronize()
            data["probes"].append(rec)
            log(f"{rec.get('label', spec)} ctas {ctas}: t_step "
                f"{fmt_num(rec.get('t_step_ns'), '{:.2f}')} ns, fixed "
                f"{fmt_num(rec.get('fixed_us'), '{:.2f}')} us")
        else:
            continue
        break
    data["elapsed_s"] = round(time.time() - t_start, 1)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"chain_floor_{device_slug(meta['device'])}")
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1)
    md = render(data)
    with open(base + ".md", "w") as f:
        f.write(md)
    log(f"wrote {base}.json, {base}.md in {data['elapsed_s']} s")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
