"""Per-problem timings -> non-overlapping buckets that cover every (M, N, K) -> YAML.

Input: points of one op and dtype, each a GEMM (M, N, K) of the dispatch table with the time
of every candidate measured on it. Output: boxes of (M, N, K), each with one candidate, that
together cover every (M, N, K) >= 1 exactly once.

The decision procedure (plain arithmetic):
- On a point p, candidate c costs  cost(c, p) = ln(t(c, p) / t_best(p)) : 0 for p's
  winner, ln(1.02) for a candidate 2 % slower. A candidate not measured on p costs ln(10).
- A box takes the candidate with the smallest total cost over its points; the box's loss is
  that total.
- Start with one box, all of (M, N, K). A box is split when its candidate is more than
  `tol` (2 %) slower than the winner on some point in it. Splits are tried on M, N and K at
  the midpoint between every two neighbouring measured values, (a + b) // 2 (the left part
  ends there, the right part starts one above); a split's gain is the box's loss minus the
  two parts' losses. The split with the largest gain over all boxes is made, as long as it
  gains more than ln(1 + tol) and there are fewer than `max_buckets` boxes.
- Then neighbouring boxes with the same candidate whose union is a box are merged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MISSING_COST = math.log(10.0)
DIMS = ("m", "n", "k")


@dataclass
class Point:
    m: int
    n: int
    k: int
    times: dict  # candidate name -> us
    peers: dict = field(default_factory=dict)  # "cublas" / "cublaslt" -> us
    label: str = ""

    @property
    def best(self) -> float:
        return min(self.times.values())

    def coord(self, d: int) -> int:
        return (self.m, self.n, self.k)[d]


@dataclass
class Box:
    ranges: list  # [(lo, hi|None)] for m, n, k
    points: list
    choice: str | None = None
    loss: float = 0.0
    note: str = ""


def cost(name: str, p: Point) -> float:
    t = p.times.get(name)
    if t is None or not (t > 0):
        return MISSING_COST
    return math.log(t / p.best)


def choose(points, names) -> tuple[str | None, float]:
    """(candidate with the least total cost, that cost); ties -> the earlier name in `names`."""
    best, best_loss = None, math.inf
    for name in names:
        loss = sum(cost(name, p) for p in points)
        if loss < best_loss - 1e-12:
            best, best_loss = name, loss
    return best, best_loss


def worst_slowdown(name: str, points) -> float:
    """max over points of t(name) / t_best (inf when not measured on one)."""
    w = 1.0
    for p in points:
        t = p.times.get(name)
        w = max(w, t / p.best if t else math.inf)
    return w


def _split_options(box: Box):
    for d in range(3):
        values = sorted({p.coord(d) for p in box.points})
        for a, b in zip(values, values[1:]):
            yield d, (a + b) // 2


def _split(box: Box, d: int, cut: int, names):
    left_r, right_r = list(box.ranges), list(box.ranges)
    lo, hi = box.ranges[d]
    left_r[d], right_r[d] = (lo, cut), (cut + 1, hi)
    parts = []
    for r, pts in ((left_r, [p for p in box.points if p.coord(d) <= cut]),
                   (right_r, [p for p in box.points if p.coord(d) > cut])):
        choice, loss = choose(pts, names)
        parts.append(Box(r, pts, choice, loss))
    return parts


def best_split(box: Box, names, tol: float):
    """(gain, parts) of the best split of `box`, or None when it needs none."""
    if worst_slowdown(box.choice, box.points) <= 1 + tol:
        return None
    best = None
    for d, cut in _split_options(box):
        parts = _split(box, d, cut, names)
        gain = box.loss - sum(p.loss for p in parts)
        if best is None or gain > best[0] + 1e-12:
            best = (gain, parts)
    return best


def _abut(a: Box, b: Box):
    """The merged ranges when a and b differ in one dim only and touch there, else None."""
    diff = [d for d in range(3) if a.ranges[d] != b.ranges[d]]
    if len(diff) != 1:
        return None
    d = diff[0]
    (alo, ahi), (blo, bhi) = a.ranges[d], b.ranges[d]
    if ahi is not None and ahi + 1 == blo:
        merged = (alo, bhi)
    elif bhi is not None and bhi + 1 == alo:
        merged = (blo, ahi)
    else:
        return None
    r = list(a.ranges)
    r[d] = merged
    return r


def merge_same(boxes) -> list:
    changed = True
    while changed:
        changed = False
        for i, a in enumerate(boxes):
            for j in range(i + 1, len(boxes)):
                b = boxes[j]
                if a.choice != b.choice:
                    continue
                r = _abut(a, b)
                if r is not None:
                    pts = a.points + b.points
                    boxes[i] = Box(r, pts, a.choice, sum(cost(a.choice, p) for p in pts))
                    del boxes[j]
                    changed = True
                    break
            if changed:
                break
    return boxes


def build_boxes(points, names=None, tol: float = 0.02, max_buckets: int = 12) -> list[Box]:
    """The boxes (see the module docstring), sorted by M, N, K."""
    if not points:
        return []
    names = list(names or dict.fromkeys(n for p in points for n in p.times))
    choice, loss = choose(points, names)
    boxes = [Box([(1, None), (1, None), (1, None)], list(points), choice, loss)]
    while len(boxes) < max_buckets:
        best = None
        for i, box in enumerate(boxes):
            s = best_split(box, names, tol)
            if s is not None and (best is None or s[0] > best[1][0] + 1e-12):
                best = (i, s)
        if best is None or best[1][0] <= math.log(1 + tol):
            break
        i, (_gain, parts) = best
        boxes[i:i + 1] = parts
    boxes = merge_same(boxes)
    return sorted(boxes, key=lambda b: tuple(r[0] for r in b.ranges))


def _rng(r) -> str:
    lo, hi = r
    return f"{lo}.." if hi is None else (str(lo) if lo == hi else f"{lo}..{hi}")


def _name_part(d: str, r) -> str:
    lo, hi = r
    return f"{d}{lo}_{'up' if hi is None else hi}"


def bucket_name(op: str, ranges) -> str:
    parts = [_name_part("m", ranges[0])]
    for d, r in zip("nk", ranges[1:]):
        if tuple(r) != (1, None):
            parts.append(_name_part(d, r))
    return f"tuned_{op}_" + "_".join(parts)


def _minmax(vals, fmt) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def box_note(box: Box, device: str, date: str) -> str:
    """The measured numbers behind a box, one line."""
    from ..benchlib.stats import geomean

    pts = box.points
    us = [p.times.get(box.choice) for p in pts]

    def ratios(peer):
        return [p.peers.get(peer) / p.times[box.choice] for p in pts
                if p.peers.get(peer) and p.times.get(box.choice)]

    dims = ", ".join(f"{d.upper()} {_rng((min(p.coord(i) for p in pts), max(p.coord(i) for p in pts)))}"
                     for i, d in enumerate(DIMS))
    parts = [f"tune on {device} ({date}): {len(pts)} shape{'s' * (len(pts) != 1)} ({dims})",
             f"{_minmax(us, '{:.1f}')} us"]
    for peer, label in (("cublas", "cuBLAS"), ("cublaslt", "cuBLASLt no split-K")):
        r = ratios(peer)
        if r:
            parts.append(f"{geomean(r):.2f}x {label} ({_minmax(r, '{:.2f}')})")
    w = worst_slowdown(box.choice, pts)
    parts.append("best on every shape" if w <= 1.0 + 1e-9 else
                 f"within {100 * (w - 1):.0f}% of each shape's best" if math.isfinite(w)
                 else "not measured on every shape")
    return "; ".join(parts)


def buckets_yaml(arch: str, tables: dict, fields: dict, header: str = "") -> str:
    """YAML text of a user layer. tables: {(op, dtypes tuple): [Box]}; fields: name -> dict."""
    from .layer import bucket_lines

    lines = [f"# {line}".rstrip() for line in header.splitlines()] + [f"arch: {arch}",
                                                                      "buckets:"]
    for (op, dtypes), boxes in tables.items():
        for box in boxes:
            lines += bucket_lines({"name": bucket_name(op, box.ranges), "op": op,
                                   "dtypes": list(dtypes), "m": list(box.ranges[0]),
                                   "n": list(box.ranges[1]), "k": list(box.ranges[2]),
                                   **fields[box.choice], "note": box.note})
            lines.append("")
    return "\n".join(lines)
