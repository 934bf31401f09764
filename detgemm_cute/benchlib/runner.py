"""One benchmark row: fresh inputs, correctness and same-bits on set 0, interleaved timing.

A row (plain dict, strict-JSON friendly):
  op, M, K, N, label, bucket, bytes   the problem, detgemm's bucket, bytes moved once
  peers[p]   {us, tflops, R, reps, method, n_sets, replay_ms_*, error}
  err[p]     norm(p - reference) / norm(reference), fp32; the reference is cuBLAS default
  ok[p]      finite and err below the tolerance (a wrong result is not timed)
  same_bits[p]  p's output bit-identical to detgemm's
  ratio[p]   detgemm speed / p speed (t_p / t_detgemm)
  notes      errors and anything unusual
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass, field

import torch

from . import peers as P
from .checks import all_finite, rel_err, same_bits
from .fmt import err_str, fmt_bucket, fmt_num, short
from .stats import speed_ratio, tflops
from .timing import BENCH_PLAN, TimingPlan, make_sets, time_units

DET_TOL = 2e-2   # detgemm vs the reference (bf16 rounding alone gives a few 1e-3)
PEER_TOL = 1e-2  # PEDANTIC, cuBLASLt vs the reference


@dataclass
class BenchContext:
    dtype: torch.dtype
    dtype_name: str
    arch: str
    l2: int
    cap_stream: object
    dg: object = None
    dg_reason: str | None = None
    ped: object = None
    ped_reason: str | None = None
    lt_reason: str | None = None     # why cuBLASLt no-split cannot run (None: it can)
    dw_reason: str | None = None     # why torch.mm(out_dtype=fp32) cannot run
    plan: TimingPlan = BENCH_PLAN
    peers: tuple = P.PEERS           # the peers asked for
    extra: dict = field(default_factory=dict)


def new_row(problem) -> dict:
    return {"op": problem.op, "M": problem.m, "K": problem.k, "N": problem.n,
            "label": problem.label, "bucket": None, "bytes": None, "notes": [],
            "peers": {p: {} for p in P.PEERS}, "err": {}, "ok": {}, "same_bits": {},
            "ratio": {}}


def bucket_for(problem, ctx: BenchContext) -> str:
    try:
        from ..dispatch import lookup

        m, n, k = problem.gemm_mnk
        return fmt_bucket(lookup(problem.op, ctx.dtype_name, ctx.arch, m, n, k))
    except Exception as e:  # noqa: BLE001
        return "? (" + short(err_str(e), 40) + ")"


def peer_calls(op: str, ctx: BenchContext, row: dict) -> dict:
    """{peer: fn(set)} for the peers that can run; the others get an error in the row."""
    fns = {}
    for p in P.PEERS:
        cell = row["peers"][p]
        if p not in ctx.peers:
            cell["error"] = "not run (option)"
        elif p == "detgemm":
            if ctx.dg is None:
                cell["error"] = f"detgemm_cute not importable ({ctx.dg_reason})"
            else:
                fns[p] = P.detgemm_call(op, ctx.dg)
        elif p == "pedantic":
            if ctx.ped is None:
                cell["error"] = ctx.ped_reason or "no PEDANTIC backend"
            else:
                fns[p] = P.pedantic_call(op, ctx.ped)
        elif op == "dw" and ctx.dw_reason:
            cell["error"] = ctx.dw_reason
        elif p == "cublaslt":
            if ctx.lt_reason:
                cell["error"] = ctx.lt_reason
            else:
                fns[p] = P.lt_call(op)
        else:
            fns[p] = P.torch_call(op)
    return fns


def _reference(op, s0, fns):
    """cuBLAS default's output; for dw without out_dtype, an fp32 matmul."""
    if "cublas" in fns:
        return fns["cublas"](s0)
    if op == "dw":
        return torch.mm(s0.a.t().float(), s0.b.float())
    if "cublaslt" in fns:
        return fns["cublaslt"](s0)
    return None


def check_outputs(op, s0, fns, row) -> None:
    """err / ok / same_bits on set 0; removes the peers that may not be timed from fns."""
    ref = _reference(op, s0, fns)
    torch.cuda.synchronize()
    if ref is not None and not all_finite(ref):
        row["notes"].append("reference output not finite")
    y_det = None
    if "detgemm" in fns:
        try:
            y_det = fns["detgemm"](s0)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            row["peers"]["detgemm"]["error"] = err_str(e, 120)
            fns.pop("detgemm")
    for p in [p for p in P.PEERS if p in fns]:
        try:
            if p == "detgemm":
                y = y_det
            elif p == "cublas":
                y = ref
            else:
                if p == "pedantic":
                    s0.out.fill_(float("nan"))
                y = fns[p](s0)
                torch.cuda.synchronize()
            if ref is not None:
                row["err"][p] = rel_err(y, ref)
                tol = DET_TOL if p == "detgemm" else PEER_TOL
                row["ok"][p] = all_finite(y) and row["err"][p] < tol
            if y_det is not None and p != "detgemm":
                row["same_bits"][p] = same_bits(y_det, y)
            del y
        except Exception as e:  # noqa: BLE001
            row["peers"][p]["error"] = err_str(e, 120)
            fns.pop(p)
    del ref, y_det
    for p in [p for p in P.PEERS if p in fns and p != "cublas"]:
        if row["ok"].get(p) is not True:
            why = (f"wrong result (rel err {fmt_num(row['err'].get(p), '{:.1e}')})"
                   if row["ok"].get(p) is False else "unchecked (no reference)")
            row["peers"][p]["error"] = why
            fns.pop(p)


def bench_problem(problem, ctx: BenchContext) -> dict:
    row = new_row(problem)
    if ctx.dg is not None:
        row["bucket"] = bucket_for(problem, ctx)
    fns = peer_calls(problem.op, ctx, row)
    try:
        sets, set_bytes = make_sets(problem, ctx.dtype, ctx.l2, ctx.plan,
                                    with_out=ctx.ped is not None)
    except Exception as e:  # noqa: BLE001
        row["notes"].append("inputs: " + err_str(e, 120))
        return row
    row["bytes"] = set_bytes
    check_outputs(problem.op, sets[0], fns, row)
    not_capturable = () if ctx.ped is None or ctx.ped.graph_capturable else ("pedantic",)
    try:
        timed = time_units(fns, sets, ctx.plan, ctx.cap_stream, not_capturable)
    except Exception as e:  # noqa: BLE001
        timed = {p: {"error": err_str(e, 120)} for p in fns}
        torch.cuda.synchronize()
    m, n, k = problem.m, problem.n, problem.k
    for p, res in timed.items():
        if res.get("us") is not None:
            res["tflops"] = tflops(m, n, k, res["us"])
        row["peers"][p].update(res)
    det_us = row["peers"]["detgemm"].get("us")
    for p in P.PEERS[1:]:
        row["ratio"][p] = speed_ratio(det_us, row["peers"][p].get("us"))
    del sets
    torch.cuda.empty_cache()
    return row


def row_notes(row) -> list[str]:
    """Human notes for a row: errors of each peer, cells not timed from a strict graph."""
    notes = list(row.get("notes") or [])
    for p in P.PEERS:
        cell = (row.get("peers") or {}).get(p) or {}
        if cell.get("error") and cell["error"] != "not run (option)":
            notes.append(f"{P.SHORT[p]}: {cell['error']}")
        elif cell.get("method") and cell["method"] != "graph":
            notes.append(f"{P.SHORT[p]} timed by {cell['method']}")
    return notes


@contextlib.contextmanager
def stop_on_sigterm():
    """A list that receives the signal number when SIGTERM arrives (what `timeout` sends), so
    a loop over problems can stop between rows and still write the rows it has; the previous
    handler comes back on exit. Outside the main thread (no handler can be set) it stays empty."""
    got: list = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    prev = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, prev)


def run_time_boxed(items, measure, stem, meta: dict, max_seconds: float, report,
                   on_row=None) -> list:
    """Rows `measure(item)` for the items in order, starting none after `max_seconds`;
    `stem`.json (device meta and rows so far) is rewritten after every row, `stem`.md from
    `report(rows, meta)` (lines) at the end; `on_row(item, row)` logs a row. SIGTERM stops it
    after the current row the same way (`stop_on_sigterm`)."""
    import json
    import time
    from pathlib import Path

    from . import gpu
    from .fmt import json_default

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    t0, rows = time.time(), []
    with stop_on_sigterm() as stopped:
        for item in items:
            if time.time() - t0 > max_seconds or stopped:
                gpu.log(f"{'stopped by SIGTERM' if stopped else 'time box reached'} after "
                        f"{len(rows)} problems")
                break
            rows.append(measure(item))
            if on_row is not None:
                on_row(item, rows[-1])
            stem.with_suffix(".json").write_text(json.dumps(
                {"device": meta, "rows": rows}, indent=1, default=json_default))
    stem.with_suffix(".md").write_text("\n".join(report(rows, meta)) + "\n")
    gpu.log(f"wrote {stem}.md/.json")
    return rows
