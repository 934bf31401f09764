"""Coverage of a dispatch table: which (M, N, K) >= 1 no bucket serves.

Computed exactly on the cell grid the buckets' own bounds cut [1, inf)^3 into, so a table
can be proven to cover every problem (the built-in table must) without sampling.
"""

from __future__ import annotations

_DIMS = ("m", "n", "k")


def fmt_range(r: tuple[int, int | None]) -> str:
    lo, hi = r
    return f"{lo}.." if hi is None else f"{lo}..{hi}"


def meet(a, b):
    """The intersection of two inclusive ranges (hi None = unbounded), or None."""
    lo = max(a[0], b[0])
    his = [h for h in (a[1], b[1]) if h is not None]
    hi = min(his) if his else None
    return None if hi is not None and hi < lo else (lo, hi)


def _cells(buckets, dim):
    """Split [1, inf) at every bucket boundary: cells no bucket edge crosses."""
    bounds = {1}
    for b in buckets:
        lo, hi = getattr(b, dim)
        bounds.add(lo)
        if hi is not None:
            bounds.add(hi + 1)
    starts = sorted(bounds)
    return [(s, e - 1) for s, e in zip(starts, starts[1:])] + [(starts[-1], None)]


def _cell_span(r, cells):
    """Index range (first, last) of the cells inside range r."""
    lo, hi = r
    first = next(i for i, c in enumerate(cells) if c[0] == lo)
    last = len(cells) - 1 if hi is None else next(i for i, c in enumerate(cells) if c[1] == hi)
    return first, last


def _merge(boxes):
    """Merge index boxes that abut along one dim and agree on the others (K, then N, M)."""
    for d in (2, 1, 0):
        groups: dict = {}
        for box in boxes:
            groups.setdefault(box[:d] + box[d + 1:], []).append(box)
        merged = []
        for group in groups.values():
            group.sort(key=lambda bx: bx[d][0])
            cur = group[0]
            for box in group[1:]:
                if box[d][0] == cur[d][1] + 1:
                    cur = cur[:d] + ((cur[d][0], box[d][1]),) + cur[d + 1:]
                else:
                    merged.append(cur)
                    cur = box
            merged.append(cur)
        boxes = merged
    return sorted(boxes)


def coverage_gaps(buckets) -> list[tuple]:
    """Boxes ((lo, hi) per M, N, K) of points no bucket serves; buckets of one op/dtype."""
    cells = [_cells(buckets, d) for d in _DIMS]
    nm, nn, nk = (len(c) for c in cells)
    count = [0] * (nm * nn * nk)
    for b in buckets:
        (m0, m1), (n0, n1), (k0, k1) = (_cell_span(getattr(b, d), c) for d, c in zip(_DIMS, cells))
        for i in range(m0, m1 + 1):
            for j in range(n0, n1 + 1):
                base = (i * nn + j) * nk
                for l in range(k0, k1 + 1):
                    count[base + l] += 1
    gaps = [((i, i), (j, j), (l, l)) for i in range(nm) for j in range(nn) for l in range(nk)
            if count[(i * nn + j) * nk + l] == 0]
    return [tuple((cells[d][box[d][0]][0], cells[d][box[d][1]][1]) for d in range(3))
            for box in _merge(gaps)]


def gap_problem(op, dtype, gap, buckets):
    """(field, text) for one uncovered box, naming the buckets that border it."""
    dims = [d for d in range(3) if gap[d] != (1, None)] or [0]
    d = dims[0]
    others = ", ".join(f"{_DIMS[o].upper()} {fmt_range(gap[o])}" for o in range(3) if o != d)
    text = (f"op {op} dtype {dtype}: {_DIMS[d].upper()} {fmt_range(gap[d])} ({others}) is "
            f"covered by no bucket")
    near = []
    for b in buckets:
        for e in dims:
            lo, hi = getattr(b, _DIMS[e])
            touches = hi == gap[e][0] - 1 or (gap[e][1] is not None and lo == gap[e][1] + 1)
            if touches and all(meet(getattr(b, _DIMS[o]), gap[o]) is not None
                               for o in range(3) if o != e):
                near.append(f"bucket {b.name!r} (line {b.line}, {_DIMS[e]} {fmt_range((lo, hi))})")
                break
    if near:
        text += "; next to " + ", ".join(near)
    return _DIMS[d], text


def coverage_problems(buckets, ops, dtypes, required) -> list[tuple]:
    """(line, text, where, field) for each way `buckets` (a complete table) fail to serve
    every (M, N, K) of each op in `ops` they declare, per dtype of `dtypes`: a dtype of
    `required` with no bucket, or the boxes no bucket covers (20 named, then a count)."""
    out = []
    for op in sorted({b.op for b in buckets}, key=ops.index):
        for dtype in dtypes:
            serving = [b for b in buckets if b.op == op and dtype in b.dtypes]
            if not serving:
                if dtype in required:
                    out.append((None, f"op {op} dtype {dtype} has no bucket; every op in the "
                                      f"built-in table must serve {' and '.join(required)}",
                                "coverage", "dtypes"))
                continue
            gaps = coverage_gaps(serving)
            for gap in gaps[:20]:
                field, text = gap_problem(op, dtype, gap, serving)
                out.append((None, text, "coverage", field))
            if len(gaps) > 20:
                out.append((None, f"op {op} dtype {dtype}: {len(gaps) - 20} more gaps",
                            "coverage", None))
    return out


def overlap_problems(buckets) -> list[tuple]:
    """(line, message, bucket label, field) for each bucket whose box meets an earlier one's
    for the same op and a shared dtype (alternatives of one bucket share their box)."""
    out = []
    for i, b in enumerate(buckets):
        for a in buckets[:i]:
            shared = [d for d in a.dtypes if d in b.dtypes]
            if a.op != b.op or not shared or (b.group and a.group == b.group):
                continue
            box = tuple(meet(getattr(a, d), getattr(b, d)) for d in _DIMS)
            if None not in box:
                field = next((d for d in _DIMS if getattr(a, d) != getattr(b, d)), "m")
                where = ", ".join(f"{d.upper()} {fmt_range(r)}" for d, r in zip(_DIMS, box))
                out.append((b.line, f"overlaps bucket {a.name!r} (line {a.line}) for op {b.op} "
                                    f"dtype {'/'.join(shared)} at {where}",
                            f"bucket {b.name!r}", field))
    return out


__all__ = ["coverage_gaps", "coverage_problems", "gap_problem", "fmt_range", "meet",
           "overlap_problems"]

