"""Tune records -> one bucket with alternatives, chosen per shape by the wave-cost model.

Boxes (`table.py`) give each region of (M, N, K) one kernel; a tile that fits one M's wave
count can be far off for an M between the tuned ones. A bucket with alternatives instead
keeps a few kernels and lets `wave_cost.py` pick one per problem. This module builds one
from the tune records (plain arithmetic, pure Python):

1. Fit: for every candidate measured on at least `min_points` problems, the coefficients
   of `wave_cost.predict_us` that minimise the squared relative error over its timings
   (least squares; a coefficient that comes out below its floor is fixed there and the
   rest are fitted again). Floors are 0, except c1 (one k-block on one SM): at least the
   time the tile's MMAs, or the bytes fed to the SM for them, take at the `Machine`'s
   per-SM rates. Without it a candidate timed only with every SM busy can fit c1 = 0 and
   be predicted fast where few tiles leave most SMs idle.
2. Select, among the `contenders` (timed on nearly every problem and close to the best on a
   few: a kernel that never comes close only adds ways for the model to pick wrong):
   start from no alternative; add the candidate that most raises the geomean over
   the problems of t_best / (the fastest measured time among the alternatives), stop at
   `max_alternatives` or when no candidate gains `min_gain`. (Selecting on the times the
   model's own picks reach instead scored lower on left-out token counts.)
3. `cross_validate`: the same, fitted and selected without one token count (M for fwd and
   dx, K for dW) at a time and scored on it: an estimate for shapes the tune never saw.
"""

from __future__ import annotations

import math

from ..wave_cost import N_COEFFS, features, predict_us

MISSING_RATIO = 0.5  # t_best / t for a problem none of the alternatives was measured on


def fit_cost(samples, floor=(0.0,) * N_COEFFS) -> tuple | None:
    """Coefficients c >= floor minimising sum(((f . c) - t) / t)^2 over (features, t); as
    many coefficients as `floor` has (the first len(floor) features)."""
    import torch

    if not samples:
        return None
    terms = len(floor)
    f = torch.tensor([s[0][:terms] for s in samples], dtype=torch.float64)
    t = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    lo = torch.tensor(floor, dtype=torch.float64)
    x = f / t[:, None]  # relative error: every row divided by its time
    free = list(range(terms))
    while free:
        fixed = [j for j in range(terms) if j not in free]
        rest = 1.0 - x[:, fixed] @ lo[fixed]
        # gelsd: least squares by SVD, so collinear features (e.g. every problem filling
        # every SM) still give the minimum-norm solution
        sol = torch.linalg.lstsq(x[:, free], rest[:, None], driver="gelsd").solution[:, 0]
        below = sol - lo[free]
        if bool((below >= 0).all()):
            out = lo.clone()
            out[free] = sol
            return tuple(out.tolist())
        free.pop(int(below.argmin()))
    return tuple(floor)


def kblock_floor_us(tile, machine=None) -> float:
    """One k-block of a (BM, BN, BK) tile on one SM at the machine's MMA and feed rates."""
    from .candidates import Machine

    m = machine or Machine()
    bm, bn, bk = tile
    return max(2 * bm * bn * bk / m.mma_flops_per_us_sm, 2 * (bm + bn) * bk / m.feed_bytes_per_us_sm)


def _kernel(fields: dict) -> tuple:
    return (tuple(fields["tile"]), tuple(fields.get("cluster", (1, 1))),
            bool(fields.get("swap_ab", False)))


def fit_all(points, fields: dict, sms: int, min_points: int = 8, terms: int = N_COEFFS,
            only=None) -> dict:
    """{candidate: cost} for every candidate measured on >= min_points of `points` (of those
    in `only`, when given); `terms`: fit the first that many coefficients only (5: a table
    fitted before the padding term)."""
    samples: dict = {}
    for p in points:
        for name, t in p.times.items():
            if only is not None and name not in only:
                continue
            samples.setdefault(name, []).append((features(*_kernel(fields[name]), p.m, p.n,
                                                          p.k, sms), t))
    out = {}
    for name, s in samples.items():
        if len(s) >= min_points:
            floor = (0.0, kblock_floor_us(fields[name]["tile"])) + (0.0,) * (terms - 2)
            cost = fit_cost(s, floor)
            if cost is not None:  # as a table writes it (`bucket_yaml`), so the picks that
                out[name] = tuple(float(f"{x:.4g}") for x in cost)  # selection scores hold
    return out


def pick(point, names, costs: dict, fields: dict, sms: int):
    """The name among `names` measured on `point` that the model predicts fastest, or None."""
    best, best_t = None, math.inf
    for name in names:
        if name in point.times:
            t = predict_us(costs[name], *_kernel(fields[name]), point.m, point.n, point.k, sms)
            if t < best_t:
                best, best_t = name, t
    return best


def reach(points, names) -> float:
    """Geomean of t_best / (the fastest of `names` measured) over `points`."""
    logs = 0.0
    for p in points:
        ts = [p.times[c] for c in names if c in p.times]
        logs += math.log(p.best / min(ts) if ts else MISSING_RATIO)
    return math.exp(logs / len(points))


def contenders(points, coverage: float = 0.95, near: float = 1.03,
               min_near: int = 3) -> set[str]:
    """Candidates worth fitting: timed on at least `coverage` of `points` and within `near`
    of the fastest candidate on at least `min_near` of them (a kernel that never comes
    close to the best only adds ways for the model to pick wrong)."""
    timed: dict = {}
    close: dict = {}
    for p in points:
        for name in p.times:
            timed[name] = timed.get(name, 0) + 1
    wide = {n for n, c in timed.items() if c >= coverage * len(points)}
    for p in points:
        best = min((t for n, t in p.times.items() if n in wide), default=None)
        if best is None:  # none of the widely timed candidates ran on this problem
            continue
        for n, t in p.times.items():
            if n in wide and t <= near * best:
                close[n] = close.get(n, 0) + 1
    return {n for n in wide if close.get(n, 0) >= min_near}


def select(points, costs: dict, max_alternatives: int = 12, min_gain: float = 0.001) -> list[str]:
    """Greedy forward selection of the alternatives (step 2 of the module docstring)."""
    chosen, current = [], 0.0
    pool = sorted(costs)
    while len(chosen) < max_alternatives:
        gains = [(reach(points, chosen + [c]), c) for c in pool if c not in chosen]
        if not gains:
            break
        best, name = max(gains)
        if chosen and best < current * (1 + min_gain):
            break
        chosen.append(name)
        current = best
    return chosen


def cross_validate(points, fields: dict, sms: int, token_dim: str, max_alternatives: int = 12,
                   min_points: int = 8, min_gain: float = 0.001, also=()) -> list[tuple]:
    """[(point, chosen name or None)] with each token count left out of fitting and
    selection in turn (among the contenders of all points and the candidates in `also`);
    `token_dim` is "m" (fwd, dx) or "k" (dW)."""
    out = []
    keep = contenders(points) | set(also)
    for hold in sorted({getattr(p, token_dim) for p in points}):
        train = [p for p in points if getattr(p, token_dim) != hold]
        costs = fit_all(train, fields, sms, min_points, only=keep)
        names = select(train, costs, max_alternatives, min_gain)
        out += [(p, pick(p, names, costs, fields, sms))
                for p in points if getattr(p, token_dim) == hold]
    return out


def bucket_yaml(name: str, op: str, dtypes, ranges, sms: int, names, costs: dict,
                fields: dict, note: str = "") -> list[str]:
    """YAML lines of one bucket with alternatives (the registry's schema)."""
    from .layer import yaml_value, bucket_lines

    lines = bucket_lines({"name": name, "op": op, "dtypes": list(dtypes),
                          "m": list(ranges[0]), "n": list(ranges[1]), "k": list(ranges[2]),
                          "sms": sms, "note": note})
    lines.append("    alternatives:")
    for c in names:
        f = dict(fields[c], cost=[float(f"{x:.4g}") for x in costs[c]])
        lines.append("      - {" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in f.items()) + "}")
    return lines


__all__ = ["fit_cost", "fit_all", "contenders", "pick", "reach", "select", "cross_validate",
           "bucket_yaml", "MISSING_RATIO"]
