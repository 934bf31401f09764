"""Arithmetic on measured times: ratios, geometric means, throughput, summaries by M band.

Pure Python; rows are plain dicts (see `runner.new_row`)."""

from __future__ import annotations

import math

# Peers compared with detgemm (ratios are detgemm speed / peer speed = t_peer / t_detgemm).
RATIO_PEERS = ("cublas", "pedantic", "cublaslt")

# M bands of the summaries (M = tokens, the rows of X / dY).
BANDS = (
    ("M<=64", lambda m: m <= 64),
    ("64<M<128", lambda m: 64 < m < 128),
    ("128<=M<512", lambda m: 128 <= m < 512),
    ("M>=512", lambda m: m >= 512),
)


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def tflops(m: int, n: int, k: int, us) -> float | None:
    if us is None or not (us > 0) or not math.isfinite(us):
        return None
    return gemm_flops(m, n, k) / (us * 1e-6) / 1e12


def tbytes_per_s(nbytes, us) -> float | None:
    """Achieved DRAM traffic in TB/s for `nbytes` moved once in `us` microseconds."""
    if not nbytes or not us or not (us > 0) or not math.isfinite(us):
        return None
    return nbytes / (us * 1e-6) / 1e12


def speed_ratio(t_det_us, t_peer_us) -> float | None:
    """detgemm speed / peer speed = t_peer / t_det (> 1 means detgemm is faster)."""
    if t_det_us is None or t_peer_us is None:
        return None
    if not (t_det_us > 0 and t_peer_us > 0):
        return None
    return t_peer_us / t_det_us


def geomean(values) -> float | None:
    """Geometric mean of the positive finite values; None when there are none."""
    vals = [float(v) for v in values
            if v is not None and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def band_of(m: int) -> str:
    for label, pred in BANDS:
        if pred(m):
            return label
    raise ValueError(f"M={m} is in no band")


def _stats(vals, n_rows) -> dict:
    return {"geomean": geomean(vals), "n": len(vals), "rows": n_rows,
            "min": min(vals) if vals else None, "max": max(vals) if vals else None}


def summary_groups(rows) -> list[tuple[str, list]]:
    """(label, rows) groups: all rows, each M band with rows, and per op when several ops."""
    groups = [("all", list(rows))]
    for label, pred in BANDS:
        sel = [r for r in rows if pred(r["M"])]
        if sel:
            groups.append((label, sel))
    ops = list(dict.fromkeys(r.get("op", "fwd") for r in rows))
    if len(ops) > 1:
        for op in ops:
            op_rows = [r for r in rows if r.get("op", "fwd") == op]
            groups.append((f"{op}: all", op_rows))
            for label, pred in BANDS:
                sel = [r for r in op_rows if pred(r["M"])]
                if sel:
                    groups.append((f"{op}: {label}", sel))
    return groups


def summarize(rows, peers=RATIO_PEERS) -> dict:
    """{peer: {group label: {geomean, n, rows, min, max}}} over rows that have the ratio."""
    out = {}
    groups = summary_groups(rows)
    for peer in peers:
        per = {}
        for label, sel in groups:
            vals = [(r.get("ratio") or {}).get(peer) for r in sel]
            per[label] = _stats([v for v in vals if v is not None], len(sel))
        out[peer] = per
    return out


def worst_rows(rows, peer: str, n: int = 5) -> list:
    """The n rows with the lowest detgemm/peer speed ratio (slowest relative to the peer)."""
    have = [r for r in rows if (r.get("ratio") or {}).get(peer) is not None]
    return sorted(have, key=lambda r: r["ratio"][peer])[:n]
