"""Problems: one GEMM of a Linear layer, named by op and the layer's dimensions.

A Linear layer has a weight W[N, K] (N output features, K input features) and M tokens.
Its three GEMMs, all written with the layer's M, K, N:

  fwd  Y[M, N]  = X[M, K] @ W[N, K]^T          GEMM (rows M, cols N, reduction K)
  dx   dX[M, K] = dY[M, N] @ W[N, K]           GEMM (rows M, cols K, reduction N)
  dw   dW[N, K] = dY[M, N]^T @ X[M, K], fp32   GEMM (rows N, cols K, reduction M)

The dispatch tables are keyed by the GEMM's own (M, N, K): `Problem.gemm_mnk`.
Shapes are written "MxKxN" (M tokens, K inputs, N outputs), e.g. 2048x4096x14336.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

OPS = ("fwd", "dx", "dw")
OP_FORMULAS = {
    "fwd": "Y[M,N] = X[M,K] @ W[N,K]^T",
    "dx": "dX[M,K] = dY[M,N] @ W[N,K]",
    "dw": "dW[N,K] = dY[M,N]^T @ X[M,K] (fp32 out)",
}


@dataclass(frozen=True, order=True)
class Problem:
    op: str
    m: int
    k: int
    n: int
    label: str = field(default="", compare=False)  # where the shape comes from

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; one of {', '.join(OPS)}")
        for name, v in (("M", self.m), ("K", self.k), ("N", self.n)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def key(self) -> tuple:
        return (self.op, self.m, self.k, self.n)

    @property
    def gemm_mnk(self) -> tuple[int, int, int]:
        """(M, N, K) of the GEMM the op runs, as the dispatch table sees it."""
        if self.op == "fwd":
            return self.m, self.n, self.k
        if self.op == "dx":
            return self.m, self.k, self.n
        return self.n, self.k, self.m

    @property
    def out_fp32(self) -> bool:
        return self.op == "dw"

    def nbytes(self, in_bytes: int = 2) -> int:
        """Bytes moved if every operand is read once and the output written once."""
        m, k, n = self.m, self.k, self.n
        out_el = 4 if self.out_fp32 else in_bytes
        if self.op == "fwd":
            return (m * k + n * k) * in_bytes + m * n * out_el
        if self.op == "dx":
            return (m * n + n * k) * in_bytes + m * k * out_el
        return (m * n + m * k) * in_bytes + n * k * out_el

    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def text(self) -> str:
        return f"{self.op} {self.m}x{self.k}x{self.n}"


def parse_shape(text: str) -> tuple[int, int, int]:
    """'MxKxN' (also ',' or ':' as separator) -> (M, K, N)."""
    parts = re.split(r"[x,:X*]", str(text).strip())
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape {text!r}: expected MxKxN, e.g. 2048x4096x14336")
    m, k, n = (int(p) for p in parts)
    if min(m, k, n) <= 0:
        raise ValueError(f"shape {text!r}: all dims must be positive")
    return m, k, n


def parse_ops(text) -> tuple[str, ...]:
    """'fwd,dx' -> ('fwd', 'dx'); a list/tuple passes through (validated)."""
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    ops = tuple(dict.fromkeys(o.strip() for o in items if o and o.strip()))
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise ValueError(f"ops {text!r}: expected a comma-separated list drawn from "
                         f"{', '.join(OPS)}")
    return ops


def read_shapes_file(path) -> list[tuple[tuple[int, int, int], str]]:
    """Shapes from a text file: one 'MxKxN [label]' per line; '#' starts a comment.
    Returns [((M, K, N), label)]; a bad line raises ValueError naming file:line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            head, _, label = text.partition(" ")
            try:
                out.append((parse_shape(head), label.strip()))
            except ValueError as e:
                raise ValueError(f"{path}:{i}: {e}") from None
    return out


def problems_for(shapes, ops, label: str = "") -> list[Problem]:
    """Every shape (M, K, N) or ((M, K, N), label) for every op, shape-major."""
    out = []
    for s in shapes:
        (m, k, n), lab = (s, label) if isinstance(s[0], int) else s
        for op in ops:
            out.append(Problem(op, m, k, n, lab))
    return out


def dedup(problems) -> list[Problem]:
    """Drop repeated (op, M, K, N), keeping the first; labels of repeats are merged."""
    seen: dict = {}
    for p in problems:
        if p.key in seen:
            first = seen[p.key]
            if p.label and p.label not in first.label.split(" / "):
                labels = [x for x in first.label.split(" / ") if x] + [p.label]
                seen[p.key] = Problem(first.op, first.m, first.k, first.n, " / ".join(labels))
        else:
            seen[p.key] = p
    return list(seen.values())


def subsample(items, every: int = 1, limit: int | None = None, offset: int = 0,
              key=None) -> list:
    """Every `every`-th item starting at `offset`, then the first `limit` of those. With
    `key` (e.g. a problem's op) the count runs per key, in the items' order: a suite that
    lists fwd, dx and dw per weight keeps the same weights of every op (a plain count with
    `every` equal to the number of ops would keep one op only)."""
    if every < 1:
        raise ValueError(f"--every must be >= 1, got {every}")
    if limit is not None and limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    if key is None:
        picked = list(items)[offset::every]
    else:
        seen: dict = {}
        picked = []
        for item in items:
            i = seen[key(item)] = seen.get(key(item), -1) + 1
            if i >= offset and (i - offset) % every == 0:
                picked.append(item)
    return picked if limit is None else picked[:limit]


def distinct_weights(problems) -> list[tuple[int, int]]:
    """Distinct (K, N) in first-seen order."""
    return list(dict.fromkeys((p.k, p.n) for p in problems))
