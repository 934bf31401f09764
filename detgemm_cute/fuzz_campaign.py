"""`detgemm-cute fuzz --procs N`: a fuzz campaign in N processes, for long GPU runs.

One fuzzing process spends most of its first minutes compiling: every new (bucket, dtypes,
layouts, bias, output) combination a random case reaches is a kernel to build (1-2 s of one
CPU core). N processes share the on-disk kernel cache (`aot_cache`), so they compile N
kernels at a time and then load what the others built. Process i fuzzes seed + i (with
``--family all``: the GPU's kernel families in turn), each with its own reference workers;
the campaign's summary adds up theirs. A failure is reported by the process that found it,
with its one-line reproducer, which names the case (and so its seed) in full.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .fuzz_summary import KINDS, Summary, print_summary

_FORWARDED = ("seconds", "cases", "device", "ops", "max_macs", "shrink_seconds")


def child_commands(args, families: list, json_dir: str) -> list:
    """(seed, family, argv, json path) of each process of the campaign."""
    jobs = args.jobs if args.jobs is not None else _jobs_per_process(args.procs)
    plans = []
    for i in range(args.procs):
        seed = args.seed + i
        family = families[i % len(families)] if families else None
        path = str(Path(json_dir) / f"fuzz_{seed}.json")
        argv = [sys.executable, "-m", "detgemm_cute.cli", "fuzz", "--seed", str(seed),
                "--jobs", str(jobs), "--json", path]
        for name in _FORWARDED:
            value = getattr(args, name)
            if value is not None:
                argv += [f"--{name.replace('_', '-')}", str(value)]
        if family:
            argv += ["--family", family]
        plans.append((seed, family, argv, path))
    return plans


def _jobs_per_process(procs: int) -> int:
    """Reference workers per process: the cores left after one per fuzzing process."""
    cores = os.cpu_count() or 2
    return max(1, (cores - procs) // procs)


def run_campaign(args, families: list, out=print) -> Summary:
    """Run the processes, echo their lines (prefixed with their seed), merge the summaries."""
    with tempfile.TemporaryDirectory(prefix="detgemm-fuzz-") as json_dir:
        plans = child_commands(args, families, json_dir)
        lock = threading.Lock()
        procs, echoes = [], []
        for seed, family, argv, _ in plans:
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, bufsize=1)
            tag = f"[seed {seed}{' ' + family if family else ''}]"
            t = threading.Thread(target=_echo, args=(p.stdout, tag, out, lock), daemon=True)
            t.start()
            procs.append(p)
            echoes.append(t)
        codes = [p.wait() for p in procs]
        for t in echoes:
            t.join()
        parts = []
        for (seed, family, _, path), code in zip(plans, codes):
            if Path(path).exists():
                with open(path) as f:
                    parts.append(json.load(f))
            else:
                parts.append({"seed": seed, "device": args.device or "cuda", "per_op": {},
                              "failures": [], "seconds": 0.0, "nan_bits": "",
                              "fatal": f"the process for seed {seed} exited with status "
                                       f"{code} and wrote no summary"})
    summary = merge(parts, args.seed)
    print_summary(summary, out, label=f"seeds {args.seed}..{args.seed + args.procs - 1} "
                                      f"({args.procs} processes)")
    return summary


def _echo(stream, tag, out, lock) -> None:
    for line in stream:
        with lock:
            out(f"{tag} {line.rstrip()}")


def merge(parts: list, seed: int) -> Summary:
    """One summary from the processes' JSON summaries: counts added, failures kept, the
    longest time, the first fatal error."""
    summary = Summary(seed, parts[0]["device"] if parts else "cuda",
                      nan_bits=next((p["nan_bits"] for p in parts if p.get("nan_bits")), ""))
    for p in parts:
        for op, counts in p["per_op"].items():
            for kind in KINDS:
                summary.per_op.setdefault(op, dict.fromkeys(KINDS, 0))[kind] += \
                    counts.get(kind, 0)
        summary.failures.extend(p["failures"])
        summary.seconds = max(summary.seconds, p.get("seconds", 0.0))
        if p.get("fatal") and summary.fatal is None:
            summary.fatal = p["fatal"]
    return summary


__all__ = ["child_commands", "run_campaign", "merge"]
