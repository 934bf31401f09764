"""From tune records to tables, notes, summaries and the `--check` report (pure Python)."""

from __future__ import annotations

import math

from ..benchlib.stats import BANDS, geomean
from .table import Point, box_note, build_boxes


def points_of(records, op: str) -> list[Point]:
    """One Point per record of `op` with at least one candidate time (GEMM dims)."""
    out = []
    for rec in records:
        if rec.get("op") != op:
            continue
        times = {k: v for k, v in (rec.get("cands") or {}).items()
                 if v is not None and k not in (rec.get("bad_bits") or [])}
        if not times:
            continue
        m, n, k = rec["gemm"]
        out.append(Point(m, n, k, times, dict(rec.get("peers") or {}), rec.get("label", "")))
    return out


def all_fields(records) -> dict:
    fields = {}
    for rec in records:
        fields.update(rec.get("fields") or {})
    return fields


def build_tables(records, ops, device: str, date: str, tol: float, max_buckets: int) -> dict:
    """{op: [Box]} with notes, for the ops that have points."""
    tables = {}
    for op in ops:
        pts = points_of(records, op)
        if not pts:
            continue
        boxes = build_boxes(pts, tol=tol, max_buckets=max_buckets)
        for b in boxes:
            b.note = box_note(b, device, date)
        tables[op] = boxes
    return tables


def chosen_for(point: Point, boxes) -> str | None:
    for b in boxes:
        if all(lo <= c and (hi is None or c <= hi)
               for (lo, hi), c in zip(b.ranges, (point.m, point.n, point.k))):
            return b.choice
    return None


def _ratio(peer_us, us):
    return peer_us / us if peer_us and us else None


def compare(records, tables) -> dict:
    """Geomean of detgemm speed / peer speed on the measured problems, for the current table
    (the incumbent), the tuned table (its bucket's choice) and each problem's own winner,
    per op and M band (M = tokens)."""
    out = {}
    for op, boxes in tables.items():
        rows = []
        for rec in records:
            if rec.get("op") != op:
                continue
            pts = points_of([rec], op)
            if not pts:
                continue
            p = pts[0]
            choice = chosen_for(p, boxes)
            rows.append({"M": rec["m"], "inc": p.times.get(rec.get("incumbent")),
                         "new": p.times.get(choice), "best": p.best, "peers": p.peers})
        per = {}
        for label, pred in (("all", lambda m: True),) + BANDS:
            sel = [r for r in rows if pred(r["M"])]
            if not sel:
                continue
            entry = {"n": len(sel)}
            for peer in ("cublas", "cublaslt"):
                for which in ("inc", "new", "best"):
                    entry[f"{which}_vs_{peer}"] = geomean(_ratio(r["peers"].get(peer), r[which])
                                                          for r in sel)
            per[label] = entry
        out[op] = per
    return out


def check_report(records, threshold: float) -> list[dict]:
    """Problems where the best candidate beats the table's bucket by more than `threshold`
    (a fraction), largest gain first."""
    out = []
    for rec in records:
        times = {k: v for k, v in (rec.get("cands") or {}).items()
                 if v is not None and k not in (rec.get("bad_bits") or [])}
        inc = rec.get("incumbent")
        if not times or times.get(inc) is None:
            continue
        best = min(times, key=times.get)
        gain = times[inc] / times[best] - 1.0
        if gain > threshold:
            out.append({"op": rec["op"], "m": rec["m"], "k": rec["k"], "n": rec["n"],
                        "label": rec.get("label", ""), "table": inc, "table_us": times[inc],
                        "best": best, "best_us": times[best], "gain": gain,
                        "cublas_us": (rec.get("peers") or {}).get("cublas")})
    return sorted(out, key=lambda r: -r["gain"])


def _f(v, fmt="{:.3f}"):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def render_tables(tables) -> list[str]:
    lines = []
    for op, boxes in tables.items():
        lines.append(f"{op}: {len(boxes)} bucket{'s' * (len(boxes) != 1)}")
        for b in boxes:
            rng = " ".join(f"{d}={lo}..{'' if hi is None else hi}"
                           for d, (lo, hi) in zip("MNK", b.ranges))
            lines.append(f"  {rng:40s} {b.choice:28s} {b.note}")
    return lines


def render_compare(comp) -> list[str]:
    lines = ["detgemm speed / peer speed (geomean over the measured problems): current table / "
             "tuned table / best candidate per problem"]
    for op, per in comp.items():
        for label, e in per.items():
            lines.append(
                f"  {op:3s} {label:11s} n={e['n']:<4d} vs cuBLAS {_f(e['inc_vs_cublas'])} / "
                f"{_f(e['new_vs_cublas'])} / {_f(e['best_vs_cublas'])}   vs cuBLASLt no split-K "
                f"{_f(e['inc_vs_cublaslt'])} / {_f(e['new_vs_cublaslt'])} / "
                f"{_f(e['best_vs_cublaslt'])}")
    return lines


def render_check(rows, threshold: float, total: int) -> list[str]:
    lines = [f"check: {len(rows)} of {total} problems have a candidate more than "
             f"{100 * threshold:.0f}% faster than the table's bucket"]
    for r in rows:
        lines.append(f"  {r['op']} {r['m']}x{r['k']}x{r['n']}: table {r['table']} "
                     f"{r['table_us']:.1f} us, best {r['best']} {r['best_us']:.1f} us "
                     f"(+{100 * r['gain']:.0f}%), cuBLAS {_f(r['cublas_us'], '{:.1f}')} us"
                     + (f"  [{r['label']}]" if r.get("label") else ""))
    return lines
