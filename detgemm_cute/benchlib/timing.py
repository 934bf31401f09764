"""CUDA-graph timing of several calls on one problem, interleaved.

For one problem:
1. **Input sets**: n sets (a, b, out), n = ceil(l2_factor x L2 / bytes of one set), capped
   at `max_sets`; the calls inside one graph cycle through them, so a weight is not still in
   L2 from the previous call. Inputs are fresh random numbers, never zeros (zeros run faster
   and hide unwritten outputs).
2. **Warm-up** of every unit on the default stream and on the capture stream (compilation,
   cuBLAS handles and workspaces stay out of the timings), then an eager, event-timed
   estimate of the time per call.
3. **R** calls per graph: enough that the fastest unit's replay lasts `target_ms`, at least
   n, at most `max_r`. Every unit runs the same R calls over the same sets, captured as one
   CUDA graph (strict capture; else relaxed; else an eager loop of R calls between two
   events, reported as `method`). All graphs of a problem share one memory pool (their
   outputs are never read, so they may share memory). If a replay is shorter than half the
   target (the eager estimate included launch gaps), R is scaled up and the graphs rebuilt.
4. **Interleaved replays**: `warm_rounds` untimed rounds, then `reps` timed rounds; a round
   replays every unit once, the order rotating each round, each replay between two CUDA
   events. (An H100 under sustained load lowers its clock within tens of ms; interleaving
   spreads that over all units instead of the one timed last.) With `budget_ms`, reps is
   lowered (not below `min_reps`) so a round of timed replays costs about budget_ms per unit.
5. **Time per call** = median replay time / R.

Importing this module touches no CUDA state.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from .fmt import err_str
from . import gpu


@dataclass(frozen=True)
class TimingPlan:
    target_ms: float = 1.0   # one replay lasts at least this long
    reps: int = 20           # timed rounds (at most)
    min_reps: int = 5        # timed rounds (at least, when budget_ms lowers reps)
    budget_ms: float | None = None  # timed replay time per unit to aim for
    warm_rounds: int = 3     # untimed interleaved rounds
    warm_replays: int = 2    # per unit, after capture
    max_r: int = 2000        # calls per graph, at most
    est_min_ms: float = 2.0  # the eager estimate runs at least this long
    max_sets: int = 64
    l2_factor: int = 4


BENCH_PLAN = TimingPlan(budget_ms=300.0)
QUICK_PLAN = TimingPlan(reps=7, budget_ms=150.0)
# Tuning: many candidates per problem, each in tens of ms.
TUNE_PLAN = TimingPlan(target_ms=0.5, reps=7, min_reps=3, budget_ms=6.0, warm_rounds=1,
                       warm_replays=1, est_min_ms=0.3)


class InputSet:
    """One set of operands: fwd a=X[M,K] b=W[N,K]; dx a=dY[M,N] b=W[N,K]; dw a=dY[M,N]
    b=X[M,K]. `out` is a NaN-filled output buffer for calls that write into one."""

    __slots__ = ("a", "b", "out")

    def __init__(self, a, b, out):
        self.a, self.b, self.out = a, b, out


def n_sets_for(set_bytes: int, l2: int, plan: TimingPlan = BENCH_PLAN) -> int:
    return max(1, min(plan.max_sets, -(-plan.l2_factor * l2 // max(set_bytes, 1))))


def make_sets(problem, dtype: torch.dtype, l2: int, plan: TimingPlan = BENCH_PLAN,
              with_out: bool = True):
    """(sets, set_bytes) for a `shapes.Problem`."""
    from .pedantic import out_buffer

    m, k, n = problem.m, problem.k, problem.n
    el = torch.empty((), dtype=dtype).element_size()
    set_bytes = problem.nbytes(el)
    sets = []
    for _ in range(n_sets_for(set_bytes, l2, plan)):
        if problem.op == "fwd":
            a = torch.randn(m, k, device=gpu.DEVICE, dtype=dtype)
            b = torch.randn(n, k, device=gpu.DEVICE, dtype=dtype).mul_(k ** -0.5)
        elif problem.op == "dx":
            a = torch.randn(m, n, device=gpu.DEVICE, dtype=dtype)
            b = torch.randn(n, k, device=gpu.DEVICE, dtype=dtype).mul_(n ** -0.5)
        else:
            a = torch.randn(m, n, device=gpu.DEVICE, dtype=dtype).mul_(m ** -0.5)
            b = torch.randn(m, k, device=gpu.DEVICE, dtype=dtype)
        out = out_buffer(problem.op, a, b) if with_out else None
        sets.append(InputSet(a, b, out))
    return sets, set_bytes


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def eager_median_us(fn, reps: int = 20, warmup: int = 1) -> float:
    """Median event-timed time of `reps` eager calls of fn(), in us (launch gaps included):
    for what cannot be graph-captured (host syncs) or should include host time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = _events()
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def estimate_ms(fn, sets, min_ms: float = 2.0) -> float:
    """Eager, event-timed time per call (launch gaps included)."""
    n = 3
    while True:
        s, e = _events()
        s.record()
        for i in range(n):
            fn(sets[i % len(sets)])
        e.record()
        e.synchronize()
        ms = s.elapsed_time(e)
        if ms >= min_ms or n > 1000:
            return ms / n
        n *= 8


def warm(fn, sets, cap_stream) -> None:
    """Compile / create handles / allocate workspaces, on the default and capture streams."""
    for i in range(min(len(sets), 3)):
        fn(sets[i])
    torch.cuda.synchronize()
    cap_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap_stream):
        fn(sets[0])
    torch.cuda.current_stream().wait_stream(cap_stream)
    torch.cuda.synchronize()


def replay_ms(g, n: int) -> list[float]:
    evs = [_events() for _ in range(n)]
    for s, e in evs:
        s.record()
        g.replay()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in evs]


class _Unit:
    """One call's timed unit: a graph of R calls, or R eager calls."""

    def __init__(self, name, fn, est_ms, capturable=True):
        self.name, self.fn, self.est_ms, self.capturable = name, fn, est_ms, capturable
        self.graph, self.method, self.cap_err, self.error = None, None, None, None

    def capture(self, sets, r, cap_stream, pool) -> None:
        self.graph = None
        if not self.capturable:
            self.method = "events-loop"
            return
        for mode in ("global", "relaxed"):
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=cap_stream, capture_error_mode=mode):
                    for i in range(r):
                        self.fn(sets[i % len(sets)])
                self.graph = g
                self.method = "graph" if mode == "global" else "graph (relaxed capture)"
                return
            except Exception as e:  # noqa: BLE001
                self.cap_err = err_str(e, 120)
                gpu.safe_sync()
        self.method = "events-loop"

    def run(self, sets, r) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            for i in range(r):
                self.fn(sets[i % len(sets)])


def time_units(fns: dict, sets, plan: TimingPlan, cap_stream, not_capturable=()) -> dict:
    """{name: result} for the calls `fns` ({name: fn(set)}) on the same sets (see the module
    docstring). A result has `us` (median time per call), `R`, `reps`, `method`, the replay
    min / median / max, or `error`."""
    n_sets = len(sets)
    out = {name: {} for name in fns}
    units = []
    for name, fn in fns.items():
        try:
            warm(fn, sets, cap_stream)
            units.append(_Unit(name, fn, estimate_ms(fn, sets, plan.est_min_ms),
                               name not in not_capturable))
        except Exception as e:  # noqa: BLE001
            out[name]["error"] = err_str(e, 120)
            gpu.safe_sync()
    if not units:
        return out
    r = max(n_sets, min(plan.max_r, math.ceil(plan.target_ms / max(min(u.est_ms for u in units),
                                                                   1e-4))))
    pool = torch.cuda.graph_pool_handle()

    def build(r_):
        for u in units:
            if u.error is None:
                u.capture(sets, r_, cap_stream, pool)
        once = {}
        for u in units:
            if u.error is not None:
                continue
            try:
                for _ in range(plan.warm_replays):
                    u.run(sets, r_)
                s, e = _events()
                s.record()
                u.run(sets, r_)
                e.record()
                e.synchronize()
                once[u.name] = s.elapsed_time(e)
            except Exception as ex:  # noqa: BLE001
                u.error = err_str(ex, 120)
                u.graph = None
                gpu.safe_sync()
        return once

    once = build(r)
    if once and min(once.values()) < 0.5 * plan.target_ms and r < plan.max_r:
        r = max(r + 1, min(plan.max_r,
                           math.ceil(r * plan.target_ms / max(min(once.values()), 1e-3))))
        for u in units:
            u.graph = None
        gpu.safe_sync()
        once = build(r)
    reps = plan.reps
    if plan.budget_ms and once:
        typical = statistics.median(once.values())
        reps = max(plan.min_reps, min(plan.reps, int(plan.budget_ms // max(typical, 1e-3))))

    live = [u for u in units if u.error is None]
    records = []
    for rnd in range(plan.warm_rounds + reps):
        k = rnd % max(1, len(live))
        for u in live[k:] + live[:k]:
            if u.error is not None:
                continue
            try:
                s, e = _events()
                s.record()
                u.run(sets, r)
                e.record()
                if rnd >= plan.warm_rounds:
                    records.append((u, s, e))
            except Exception as ex:  # noqa: BLE001
                u.error = err_str(ex, 120)
                gpu.safe_sync()
    torch.cuda.synchronize()
    times: dict = {}
    for u, s, e in records:
        times.setdefault(u.name, []).append(s.elapsed_time(e))
    for u in units:
        res = out[u.name]
        res.update({"n_sets": n_sets, "est_ms": u.est_ms, "R": r, "method": u.method})
        if u.cap_err and u.method != "graph":
            res["capture_error"] = u.cap_err
        if u.error is not None:
            res["error"] = u.error
            continue
        t = times.get(u.name) or []
        if not t:
            res["error"] = "no timings"
            continue
        med = statistics.median(t)
        res.update({"us": med / r * 1000.0, "replay_ms_median": med, "replay_ms_min": min(t),
                    "replay_ms_max": max(t), "reps": len(t)})
        u.graph = None
    del units, live, records
    return out
