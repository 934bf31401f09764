"""Batch-invariance probe and host overhead (bench only).

Probe: for each (K, N), X = randn(8192, K); for M in PROBE_MS the first M rows of op(X) are
compared bit for bit with op(X[:M].clone()), for every peer; and two runs of op(X) are
compared. Overhead: 2000 calls of a 64x64x64 product, then one synchronize, per call."""

from __future__ import annotations

import statistics
import time

import torch

from . import peers as P
from .checks import rows_equal_bitwise
from . import gpu
from .fmt import err_str

PROBE_MS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PROBE_ROWS = 8192
OVERHEAD_CALLS = 2000
OVERHEAD_REPEATS = 5


def probe_ops(ctx) -> dict:
    """{peer: op(x, w)} for the forward product on the peers that can run."""
    ops = {}
    if "cublas" in ctx.peers:
        ops["cublas"] = lambda x, w: torch.mm(x, w.t())
    if ctx.ped is not None and "pedantic" in ctx.peers:
        ops["pedantic"] = lambda x, w: ctx.ped.run("fwd", x, w)
    if ctx.lt_reason is None and "cublaslt" in ctx.peers:
        lt = P.LtNoSplit()

        def lt_mm(x, w):
            with lt:
                return torch.mm(x, w.t())

        ops["cublaslt"] = lt_mm
    if ctx.dg is not None and "detgemm" in ctx.peers:
        ops["detgemm"] = lambda x, w: ctx.dg.mm(x, w.t())
    return ops


def run_probe(kn_list, ctx, log=print) -> list[dict]:
    ops = probe_ops(ctx)
    out = []
    for (k, n) in kn_list:
        entry = {"K": k, "N": n, "rows": PROBE_ROWS, "ms": list(PROBE_MS),
                 "breaks": {}, "errors": {}, "rerun_same": {}}
        for p in P.PEERS:
            if p not in ops:
                entry["errors"][p] = "not run"
        try:
            x = torch.randn(PROBE_ROWS, k, device=gpu.DEVICE, dtype=ctx.dtype)
            w = torch.randn(n, k, device=gpu.DEVICE, dtype=ctx.dtype).mul_(k ** -0.5)
        except Exception as e:  # noqa: BLE001
            entry["errors"] = {p: "inputs: " + err_str(e, 60) for p in P.PEERS}
            out.append(entry)
            continue
        for p, op in ops.items():
            try:
                full = op(x, w)
                again = op(x, w)
                torch.cuda.synchronize()
                entry["rerun_same"][p] = rows_equal_bitwise(full, again)
                del again
                entry["breaks"][p] = [m for m in PROBE_MS
                                      if not rows_equal_bitwise(full, op(x[:m].clone(), w))]
                del full
            except Exception as e:  # noqa: BLE001
                entry["errors"][p] = err_str(e, 100)
        log(f"probe K={k} N={n}: " + "; ".join(
            f"{P.SHORT[p]}: {entry['breaks'].get(p, 'error')}" for p in ops))
        del x, w
        torch.cuda.empty_cache()
        out.append(entry)
    return out


def run_overhead(ctx) -> dict:
    from .timing import replay_ms

    x = torch.randn(64, 64, device=gpu.DEVICE, dtype=ctx.dtype)
    w = torch.randn(64, 64, device=gpu.DEVICE, dtype=ctx.dtype)
    wt = w.t()
    res = {"shape": [64, 64, 64], "calls": OVERHEAD_CALLS, "repeats": OVERHEAD_REPEATS}
    fns = {"cublas": lambda: torch.mm(x, wt)}
    if ctx.dg is not None:
        fns["detgemm"] = lambda: ctx.dg.mm(x, wt)
    else:
        res["detgemm"] = {"error": "detgemm_cute not importable"}
    for peer, fn in fns.items():
        try:
            for _ in range(OVERHEAD_CALLS):  # one untimed repetition
                fn()
            torch.cuda.synchronize()
            reps, enq = [], []
            for _ in range(OVERHEAD_REPEATS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(OVERHEAD_CALLS):
                    fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                reps.append((t2 - t0) / OVERHEAD_CALLS * 1e6)
                enq.append((t1 - t0) / OVERHEAD_CALLS * 1e6)
            try:  # device time of one such GEMM: host-bound or device-bound?
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=ctx.cap_stream):
                    for _ in range(200):
                        fn()
                g.replay()
                dev_us = statistics.median(replay_ms(g, 5)) / 200 * 1000.0
                del g
            except Exception:  # noqa: BLE001
                dev_us = None
                torch.cuda.synchronize()
            res[peer] = {"us_per_call": statistics.median(reps), "reps_us": reps,
                         "enqueue_us": statistics.median(enq), "device_us": dev_us}
        except Exception as e:  # noqa: BLE001
            res[peer] = {"error": err_str(e, 100)}
    return res
