"""`detgemm-cute fuzz`: the differential fuzzer. Random problems (`fuzz_cases`: every public
GEMM op, shapes log-uniform with 0 included, bf16/fp16/fp32 at both precisions, transposed,
sliced, odd-offset and broadcast operands, special values) computed two ways and compared
bit for bit.

    detgemm-cute fuzz --seconds 600 --seed 1                    # GPU vs the CPU reference
    detgemm-cute fuzz --seconds 5 --seed 1 --device cpu         # the reference vs itself
    detgemm-cute fuzz --seconds 60 --ops linear,grouped_mm --json fuzz.json

- ``--device cuda``: each case runs through the public function on CUDA tensors stored as
  the case says (outputs landing in NaN-poisoned memory), and through the same function on
  contiguous CPU copies, which runs `detgemm_cute.reference` (in ``--jobs`` worker
  processes). NaNs are compared bit for bit where the reference models their bits
  (`reference.ChainModel.nan_bits` == "canonical"), else as NaN.
- ``--device cpu``: the CPU path on the case's layouts against contiguous copies of the same
  values: equal bits, NaN bits included.

A failure is wrong bits, or an exception on one side where the other gave a result (a
crash). A call both sides refuse is counted as refused, not as a failure. Each failure is
printed as a one-line Python reproducer, then shrunk: every dim halved while the same
failure persists. The i-th case of a seed is the same on every machine; the number of cases
depends on the time budget. Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from . import fuzz_cases as fc
from . import reference
from .dispatch import FAMILIES
from .fuzz_summary import KINDS, Summary, print_summary, summary_json
from .gemm import forced_family, use_family
from .fuzz_cases import Case

_FATAL = ("CUDA error", "illegal memory access", "unspecified launch failure",
          "device-side assert")


@dataclass
class Outcome:
    kind: str  # one of KINDS
    detail: str = ""


# ---------------------------------------------------------------------------------------
# One case

def check(case: Case, device: str = "cuda", family: str | None = None) -> Outcome:
    """Run `case` on `device` (on kernel `family`, default the GPU's own) and judge it:
    against the CPU reference (a GPU device), or the case's layouts against contiguous
    operands (``"cpu"``). The reproducer's entry point."""
    if family is not None:
        with use_family(family):
            return check(case, device)
    got = _attempt(lambda: _on_device(case, device))
    want = _attempt(lambda: fc.evaluate(case, "cpu", layouts=False))
    return judge(got, want, exact_nan=device == "cpu" or nan_bits_modelled())


def nan_bits_modelled() -> bool:
    """Whether the reference claims the GPU's NaN bits (then they are compared exactly)."""
    return reference.MODEL.nan_bits == "canonical"


def _on_device(case: Case, device: str):
    if device == "cpu":
        return fc.evaluate(case, "cpu", layouts=True)
    _poison(device)
    y = fc.evaluate(case, device)
    torch.cuda.synchronize(device)
    return y


def _poison(device) -> None:
    """NaN-filled blocks left in the caching allocator: an unwritten output shows as NaN."""
    blocks = [torch.full((n,), float("nan"), device=device) for n in (1 << 14, 1 << 20)]
    del blocks


def _attempt(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - every exception is an outcome to judge
        return ("error", f"{type(e).__name__}: {e}".splitlines()[0][:300])


def judge(got, want, exact_nan: bool) -> Outcome:
    """Compare two `_attempt` results (the device's first)."""
    if got[0] == "error" and want[0] == "error":
        return Outcome("refused", got[1])
    if got[0] == "error":
        return Outcome("crash", got[1])
    if want[0] == "error":
        return Outcome("crash", f"the reference refused what the device computed: {want[1]}")
    diff = bit_difference(got[1], want[1], exact_nan)
    return Outcome("wrong_bits", diff) if diff else Outcome("ok")


_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bit_difference(got: torch.Tensor, want: torch.Tensor, exact_nan: bool) -> str:
    """'' when equal: same dtype, shape and bits (NaNs as NaN unless `exact_nan`); else
    where and how they differ."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return (f"got {got.dtype} {tuple(got.shape)}, the reference {want.dtype} "
                f"{tuple(want.shape)}")
    if exact_nan:
        width = 8 * got.element_size()
        a = got.contiguous().view(_INT_OF[got.dtype]).to(torch.int64) & ((1 << width) - 1)
        b = want.contiguous().view(_INT_OF[want.dtype]).to(torch.int64) & ((1 << width) - 1)
    else:
        a, b = reference.bits(got), reference.bits(want)
    diff = a != b
    n = int(diff.sum())
    if not n:
        return ""
    first = tuple(int(i) for i in torch.nonzero(diff)[0])
    digits = 2 * got.element_size()
    return (f"{n} of {diff.numel()} outputs differ; first at {first}: got "
            f"0x{int(a[first]):0{digits}x}, reference 0x{int(b[first]):0{digits}x}")


def reproducer(case: Case, device: str) -> str:
    """One line of shell that reruns `case` (on this thread's kernel family, if one is
    forced) and prints its outcome."""
    family = forced_family() if device != "cpu" else None
    extra = f", family={family!r}" if family else ""
    return (f"python -c \"from detgemm_cute.fuzz import Case, check; "
            f"print(check({case!r}, device={device!r}{extra}))\"")


def shrink(case: Case, outcome: Outcome, device: str, seconds: float = 30.0) -> Case:
    """A smaller case with the same failure: each dim halved (one at a time, repeatedly)
    while the failure persists, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    same = lambda o: o.kind == outcome.kind and (  # noqa: E731
        o.kind != "crash" or o.detail.split(":")[0] == outcome.detail.split(":")[0])
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for i, (name, v) in enumerate(case.dims):
            if v <= 1 or time.monotonic() >= deadline:
                continue
            dims = list(case.dims)
            dims[i] = (name, v // 2)
            smaller = case.with_dims(dims)
            if same(check(smaller, device)):
                case, changed = smaller, True
    return case


# ---------------------------------------------------------------------------------------
# Many cases

def _worker_init() -> None:
    torch.set_num_threads(1)


def _reference(case: Case):
    """The reference side of a case, in a worker process."""
    return _attempt(lambda: fc.evaluate(case, "cpu", layouts=False))


def default_jobs() -> int:
    return max(1, min(16, (os.cpu_count() or 2) - 2))


# A `min_cases` floor stretches the time budget by at most this factor: on a machine whose
# kernel cache is cold, the first problems of a family spend their time compiling.
MIN_CASES_STRETCH = 4.0


def _more_time(elapsed: float, seconds: float, drawn: int, min_cases: int) -> bool:
    """Whether `run` draws another case: within its budget, or short of `min_cases` and
    within the stretched budget."""
    return elapsed < seconds or (drawn < min_cases and elapsed < seconds * MIN_CASES_STRETCH)


def run(seconds: float, seed: int, device: str = "cuda", ops=fc.OPS, jobs: int | None = None,
        max_macs: int | None = None, shrink_seconds: float = 60.0, out=print,
        cases: int | None = None, min_cases: int = 0) -> Summary:
    """Draw and check cases for `seconds` (or the first `cases` of the seed, if that comes
    first), and past `seconds` until `min_cases` are drawn (for at most MIN_CASES_STRETCH x
    `seconds`); print failures and a summary; return it."""
    rng = random.Random(seed)
    gpu = device != "cpu"
    max_macs = max_macs or ((1 << 22) if gpu else (1 << 14))
    summary = Summary(seed, device, nan_bits=(
        "bit for bit" if (not gpu or nan_bits_modelled()) else "compared as NaN (the "
        "reference does not model NaN bits: reference.ChainModel.nan_bits)"))
    jobs = default_jobs() if jobs is None else jobs
    pool = _pool(jobs) if gpu and jobs > 0 else None
    pending = collections.deque()
    start = time.monotonic()
    last_report = start
    index = 0
    try:
        while (_more_time(time.monotonic() - start, seconds, index, min_cases)
               and summary.fatal is None and (cases is None or index < cases)):
            case = fc.draw(rng, ops, max_macs)
            index += 1
            if not gpu:
                _record(summary, case, check(case, "cpu"), device, out)
            else:
                got = _attempt(lambda: _on_device(case, device))
                if got[0] == "error" and any(s in got[1] for s in _FATAL):
                    summary.fatal = got[1]
                    _record(summary, case, Outcome("crash", got[1]), device, out)
                    break
                if pool is None:
                    want = _reference(case)
                    _record(summary, case, judge(got, want, nan_bits_modelled()), device, out)
                else:
                    pending.append((case, got, pool.submit(_reference, case)))
                    while len(pending) > 4 * jobs or (pending and pending[0][2].done()):
                        _finish(summary, pending.popleft(), device, out)
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                out(f"fuzz: {summary.problems} checked, {summary.failed} failed "
                    f"({last_report - start:.0f} s)")
        while pending:
            _finish(summary, pending.popleft(), device, out)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    summary.seconds = time.monotonic() - start
    if summary.fatal is None:
        _shrink_all(summary, device, shrink_seconds, out)
    print_summary(summary, out)
    return summary


def _pool(jobs: int):
    return cf.ProcessPoolExecutor(max_workers=jobs, initializer=_worker_init,
                                  mp_context=multiprocessing.get_context("spawn"))


def _finish(summary, item, device, out) -> None:
    case, got, future = item
    _record(summary, case, judge(got, future.result(), nan_bits_modelled()), device, out)


def _record(summary: Summary, case: Case, outcome: Outcome, device: str, out) -> None:
    summary.count(case.op, outcome.kind)
    if outcome.kind in ("wrong_bits", "crash"):
        line = reproducer(case, device)
        summary.failures.append({"case": repr(case), "kind": outcome.kind,
                                 "detail": outcome.detail, "reproducer": line, "shrunk": None,
                                 "_case": case, "_outcome": outcome})
        out(f"FAIL {outcome.kind} {case.op}: {outcome.detail}\n  {line}")


def _shrink_all(summary: Summary, device: str, seconds: float, out) -> None:
    """Shrink the first failure of each (op, kind) within `seconds` in all."""
    deadline = time.monotonic() + seconds
    seen = set()
    for f in summary.failures:
        key = (f["_case"].op, f["kind"])
        left = deadline - time.monotonic()
        if key in seen or left <= 0:
            continue
        seen.add(key)
        small = shrink(f["_case"], f["_outcome"], device, min(left, 30.0))
        if small != f["_case"]:
            f["shrunk"] = reproducer(small, device)
            out(f"shrunk {f['kind']} {small.op} to {dict(small.dims)}:\n  {f['shrunk']}")


# ---------------------------------------------------------------------------------------
# The command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0,
                   help="time for drawing and checking cases (default 60); draining the "
                        "references and shrinking failures come after")
    p.add_argument("--seed", type=int, default=0, help="the case sequence (default 0)")
    p.add_argument("--cases", type=int, default=None,
                   help="stop after this many cases (the same cases on every machine)")
    p.add_argument("--device", default=None,
                   help="cuda (GPU vs the CPU reference; the default with a GPU) or cpu "
                        "(the reference vs itself under layouts)")
    p.add_argument("--ops", default=",".join(fc.OPS),
                   help=f"comma-separated ops (default all: {','.join(fc.OPS)})")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes computing the CPU reference (GPU mode; default: the CPU "
                        "count minus 2, at most 16; 0 = in this process)")
    p.add_argument("--max-macs", type=int, default=None,
                   help="largest problem in multiply-adds (default 2^22 on a GPU, 2^14 on "
                        "the CPU)")
    p.add_argument("--shrink-seconds", type=float, default=60.0,
                   help="time for shrinking failures (default 60)")
    p.add_argument("--json", metavar="FILE", help="write the summary and failures here")
    p.add_argument("--family", default=None, choices=(*FAMILIES, "all"),
                   help="kernel family the GPU cases run on (default: the GPU's own; all: "
                        "each family in turn, with --procs)")
    p.add_argument("--procs", type=int, default=1,
                   help="fuzzing processes (seeds SEED..SEED+N-1) sharing the kernel cache; "
                        "their summaries are added up (default 1)")


def command(args, out=print) -> int:
    """Run the fuzzer from parsed arguments; a bad argument is a message and status 1."""
    problem = _argument_problem(args)
    if problem:
        print(f"detgemm-cute: fuzz: {problem}", file=sys.stderr)
        return 1
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    families = list(FAMILIES) if args.family == "all" else (
        [args.family] if args.family else [])
    if args.procs > 1:
        from .fuzz_campaign import run_campaign

        summary = run_campaign(args, families, out)
    else:
        with use_family(families[0] if families and device != "cpu" else None):
            summary = run(args.seconds, args.seed, device, tuple(args.ops.split(",")),
                          args.jobs, args.max_macs, args.shrink_seconds, out, args.cases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary_json(summary), f, indent=1)
    return 1 if summary.failed else 0


def _argument_problem(args) -> str:
    ops = [o for o in args.ops.split(",")]
    unknown = [o for o in ops if o not in fc.OPS]
    if unknown:
        return f"unknown op(s) {unknown}; known: {', '.join(fc.OPS)}"
    device = args.device or "cuda"
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        return f"--device must be cuda or cpu, got {device!r}"
    if args.device not in (None, "cpu") and not torch.cuda.is_available():
        return "--device cuda needs a CUDA GPU (use --device cpu)"
    if not args.seconds > 0:
        return f"--seconds must be > 0, got {args.seconds}"
    if args.jobs is not None and args.jobs < 0:
        return f"--jobs must be >= 0, got {args.jobs}"
    if args.cases is not None and args.cases < 1:
        return f"--cases must be >= 1, got {args.cases}"
    if args.procs < 1:
        return f"--procs must be >= 1, got {args.procs}"
    if args.family == "all" and args.procs < 2:
        return "--family all needs --procs 2 or more (one family per process)"
    return ""


__all__ = ["Case", "Outcome", "Summary", "check", "judge", "bit_difference", "shrink", "run",
           "reproducer", "add_arguments", "command", "nan_bits_modelled", "print_summary"]
