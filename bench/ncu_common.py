"""What the Nsight Compute probes share: one profiled launch of each call, after warm-up, and
the CUDA kernels (with their times) that one call launches.

    ncu --profile-from-start off ... python bench/probe_*.py ncu ...

`profiled(calls)` runs every call a few times, then once more each between
cudaProfilerStart/Stop (what `--profile-from-start off` captures); `kernel_times(fn)` is
torch.profiler's view of one warmed-up call (for kernel names without ncu).
"""
from __future__ import annotations

import torch


def profiled(calls, warm: int = 3) -> None:
    """Warm every call up, then run each once between cudaProfilerStart and Stop."""
    for _ in range(warm):
        for call in calls:
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def kernel_times(fn, warm: int = 3) -> list[tuple[str, float]]:
    """(kernel name, device us) of every CUDA kernel one call of `fn` launches, warmed up."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total) for e in prof.key_averages()
            if e.device_time_total > 0]


def write_kernel_table(out: str, title: str, columns, problems, row) -> None:
    """A markdown table of the kernels a peer launches, one line per problem: `row(spec)`
    gives (the detgemm cell, the peer's call); the line adds the call's kernels and their
    device times (`kernel_times`). Printed as it goes and written to `out`."""
    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for spec in problems:
        cell, fn = row(spec)
        kern = kernel_times(fn)
        lines.append(f"| {spec} | {cell} | " + "<br>".join(nm for nm, _ in kern)
                     + " | " + ", ".join(f"{t:.1f}" for _, t in kern) + " |")
        print(lines[-1], flush=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
