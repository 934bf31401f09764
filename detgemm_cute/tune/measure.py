"""Timing one problem's candidates and peers on the GPU (used by `command`).

For one problem: fresh input sets (`benchlib.timing.make_sets`); on set 0, the reference
(cuBLAS default, or an fp32 matmul for dw when torch.mm has no out_dtype), the incumbent's
output (the table's current bucket) and every other candidate's output, which must be
bit-identical to the incumbent's (tiles never change bits; one that does is excluded and
reported); then every candidate and the peers (cuBLAS default, cuBLASLt with split-K off)
timed together with `benchlib.timing.time_units` (CUDA graphs, interleaved replays)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..benchlib import peers as P
from ..benchlib.checks import all_finite, rel_err, same_bits
from ..benchlib.fmt import err_str
from ..benchlib.runner import DET_TOL
from ..benchlib.timing import TUNE_PLAN, TimingPlan, make_sets, time_units
from .layer import bucket_name

PEER_UNITS = {"cublas": "peer:cublas", "cublaslt": "peer:cublaslt"}


class FatalGpuError(RuntimeError):
    """A kernel left the CUDA context unusable (e.g. an illegal memory access)."""


def is_fatal(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in ("illegal memory access", "illegal instruction",
                                   "unspecified launch failure", "misaligned address",
                                   "device-side assert", "CUDA_ERROR_ILLEGAL", "Xid"))


@dataclass
class TuneContext:
    dtype: torch.dtype
    dtype_name: str
    arch: str
    device: str
    l2: int
    cap_stream: object
    dg: object
    lt_reason: str | None = None
    dw_reason: str | None = None
    plan: TimingPlan = TUNE_PLAN
    log: object = print
    extra: dict = field(default_factory=dict)


def new_record(problem, ctx: TuneContext, cands) -> dict:
    m, n, k = problem.gemm_mnk
    return {"device": ctx.device, "arch": ctx.arch, "dtype": ctx.dtype_name, "op": problem.op,
            "m": problem.m, "k": problem.k, "n": problem.n, "gemm": [m, n, k],
            "label": problem.label, "incumbent": cands[0].name if cands else None,
            "cands": {}, "errors": {}, "bad_bits": [], "peers": {}, "peer_errors": {},
            "fields": {c.name: c.fields() for c in cands}, "notes": []}


def _peer_fns(op, ctx, rec) -> dict:
    fns = {}
    if op == "dw" and ctx.dw_reason:
        rec["peer_errors"] = {p: ctx.dw_reason for p in PEER_UNITS}
        return fns
    fns[PEER_UNITS["cublas"]] = P.torch_call(op)
    if ctx.lt_reason:
        rec["peer_errors"]["cublaslt"] = ctx.lt_reason
    else:
        fns[PEER_UNITS["cublaslt"]] = P.lt_call(op)
    return fns


def check_candidates(problem, s0, cand_fns: dict, peer_fns: dict, rec: dict) -> None:
    """Set-0 outputs: the incumbent (first) against the reference, every other candidate
    bit for bit against the incumbent. Candidates that fail leave `cand_fns`."""
    op = problem.op
    if PEER_UNITS["cublas"] in peer_fns:
        ref = peer_fns[PEER_UNITS["cublas"]](s0)
    elif op == "dw":
        ref = torch.mm(s0.a.t().float(), s0.b.float())
    else:
        ref = None
    names = list(cand_fns)
    y_inc = None
    for name in names:
        try:
            y = cand_fns[name](s0)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            if is_fatal(e):
                raise FatalGpuError(f"candidate {name} on {problem.text}: {err_str(e, 300)}") \
                    from e
            rec["errors"][name] = err_str(e, 200)
            cand_fns.pop(name)
            continue
        if y_inc is None:
            y_inc = y
            if ref is not None:
                err = rel_err(y, ref)
                rec["incumbent_err"] = err
                if not (all_finite(y) and err < DET_TOL):
                    rec["notes"].append(f"{name}: rel err {err:.1e} against cuBLAS")
            continue
        if not same_bits(y_inc, y):
            rec["bad_bits"].append(name)
            cand_fns.pop(name)
        del y
    del ref, y_inc


def measure_problem(problem, cands, ctx: TuneContext) -> dict:
    """Time `cands` (incumbent first) and the peers on `problem`; returns the record."""
    rec = new_record(problem, ctx, cands)
    cand_fns = {c.name: P.detgemm_call(problem.op, ctx.dg, bucket=bucket_name(c))
                for c in cands}
    peer_fns = _peer_fns(problem.op, ctx, rec)
    sets, _bytes = make_sets(problem, ctx.dtype, ctx.l2, ctx.plan, with_out=False)
    try:
        check_candidates(problem, sets[0], cand_fns, peer_fns, rec)
        timed = time_units({**peer_fns, **cand_fns}, sets, ctx.plan, ctx.cap_stream)
    finally:
        del sets
    for peer, unit in PEER_UNITS.items():
        res = timed.get(unit) or {}
        if res.get("us") is not None:
            rec["peers"][peer] = res["us"]
        elif unit in timed:
            rec["peer_errors"][peer] = res.get("error", "no time")
    for name in cand_fns:
        res = timed.get(name) or {}
        if res.get("us") is not None:
            rec["cands"][name] = res["us"]
            rec.setdefault("R", res.get("R"))
            rec.setdefault("reps", res.get("reps"))
        else:
            rec["errors"][name] = res.get("error", "no time")
    for name in rec["bad_bits"]:
        rec["errors"].setdefault(name, "output bits differ from the incumbent's")
    return rec
