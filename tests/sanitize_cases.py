"""What tests/sanitize.py runs, as data: every kernel family and bucket at its tile edges.

An `Item` is one bucket of one kernel family (sm90, sm80) at one dtype with its calls; a
`Call` is one public call on shapes at the bucket's tile edges. Listing them needs no GPU
(`items`, `Call.launches`, `Item.tags`), so CI checks that the plan reaches every kernel
path: row tiles, 64/128-row tiles, ping-pong, swapped operands, 2/4/8-CTA clusters,
persistent and `raster_n` schedules, the direct-store epilogue, bmm, the a-rows producer,
both grouped kernels with empty / short / long groups and trailing rows (columns), the fp32
split (fp16 parts and dW's exact parts), TF32, and the staging helpers (row copy, transpose).
`run_call` runs one call on the GPU and returns its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("bf16", "fp16", "fp32", "tf32")  # tf32: fp32 tensors at precision "tf32"
SECTIONS = ("gemm", "bmm", "grouped", "grouped_k")


@dataclass(frozen=True)
class Call:
    kind: str  # linear | linear_mmajor | input_grad | weight_grad[_acc] | bias_grad[_acc]
    #            | bmm | grouped | grouped_k
    dims: tuple  # (name, size) pairs
    opts: tuple = ()  # (name, value) pairs

    def dim(self, name):
        return dict(self.dims)[name]

    def opt(self, name, default=None):
        return dict(self.opts).get(name, default)

    def launches(self) -> int:
        """GEMM kernel launches the call makes: 0 for empty work, else 1 (helpers apart)."""
        d = dict(self.dims)
        if self.kind == "grouped":
            return 1 if sum(self.opt("groups")) + self.opt("tail") else 0
        if self.kind == "grouped_k":  # nothing to read (T = 0): zeros, no launch
            return 1 if sum(self.opt("groups")) + self.opt("tail") else 0
        work = [d.get(n, 1) for n in ("L", "M", "N", "K")]
        return 0 if 0 in work else 1


@dataclass
class Item:
    family: str  # sm90 | sm80
    section: str  # gemm | bmm | grouped | grouped_k
    bucket: object  # a registry bucket
    dtype: str
    calls: list = field(default_factory=list)
    tags: set = field(default_factory=set)

    @property
    def label(self) -> str:
        return f"{self.family} {self.bucket.name} {self.dtype}"


def edge_shapes(tile, empty, quick: bool):
    """(M, N, K) at the tile's edges: 1, tile-1, tile, tile+1 and a ragged multi-tile shape,
    plus `empty` (a shape with no work). `quick`: tile-1, tile, tile+1."""
    bm, bn, bk = tile
    shapes = [(1, 1, 1), (bm - 1, bn - 1, bk - 1), (bm, bn, bk), (bm + 1, bn + 1, bk + 1),
              (2 * bm + 3, 3 * bn + 7, 2 * bk + 5), empty]
    return shapes[1:4] if quick else shapes


def signature(bucket) -> tuple:
    """What selects distinct kernel code in a bucket (tile sizes aside): `--dedupe` keeps
    one bucket per signature."""
    bm, bn, _ = bucket.tile
    return (bucket.op, tuple(bucket.dtypes), "row" if bm < 64 else bm, bn % 64 != 0,
            tuple(bucket.cluster), bucket.persistent, bucket.pingpong, bucket.swap_ab,
            bucket.raster_n)


def items(families, sections=SECTIONS, dtypes=("bf16", "fp32", "tf32"), only=(),
          quick=False, dedupe=False) -> list:
    """Every item of the plan, sections interleaved (a time budget that stops early still
    reaches each section)."""
    from detgemm_cute import registry

    per_section = {s: [] for s in sections}
    for family in families:
        seen = set()
        for b in registry.get_registry(family).buckets:
            section = b.op if b.op in ("bmm", "grouped", "grouped_k") else "gemm"
            if section not in per_section or (only and not any(t in b.name for t in only)):
                continue
            if dedupe:
                if signature(b) in seen:
                    continue
                seen.add(signature(b))
            for dt in _bucket_dtypes(b, dtypes, dedupe):
                item = Item(family, section, b, dt)
                _BUILD[section](item, quick)
                item.tags |= _bucket_tags(item)
                per_section[section].append(item)
    out, lists = [], [lst for lst in per_section.values() if lst]
    for i in range(max((len(lst) for lst in lists), default=0)):
        out += [lst[i] for lst in lists if i < len(lst)]
    return out


def _bucket_dtypes(bucket, dtypes, dedupe):
    names = [d for d in dtypes if d in bucket.dtypes]
    return names[:1] if dedupe else names


def _bucket_tags(item) -> set:
    b = item.bucket
    size = b.cluster[0] * b.cluster[1]
    tags = {item.family, b.op, f"bm{b.tile[0]}" if b.tile[0] >= 64 else "row-tile"}
    tags |= {t for t, on in (("pingpong", b.pingpong), ("swap", b.swap_ab),
                             ("persistent", b.persistent), ("raster_n", b.raster_n),
                             (f"cluster{size}", size > 1), ("split", item.dtype == "fp32"),
                             ("tf32", item.dtype == "tf32")) if on}
    if item.dtype == "fp32":
        tags.add("exact-split" if b.op == "dw" else "fp16-split")
    return tags


def _gemm_calls(item, quick):
    b, op = item.bucket, item.bucket.op
    empty = (b.tile[0], b.tile[1], 0) if op == "dw" else (0, b.tile[1], b.tile[2])
    for i, shape in enumerate(edge_shapes(b.tile, empty, quick)):
        m, n, k = shape
        if b.swap_ab and shape is not empty:  # the kernel's tile rows run along the caller's
            m, n = n, m                       # N; the empty shape keeps its 0 where it was
        dims = (("M", m), ("N", n), ("K", k))
        if op == "fwd":
            item.calls.append(Call("linear", dims))
            if i == (2 if quick else 3):
                item.calls.append(Call("linear_mmajor", dims))
        elif op == "dx":
            item.calls.append(Call("input_grad", dims))
        else:
            item.calls += [Call(kind, dims) for kind in ("weight_grad", "weight_grad_acc",
                                                         "bias_grad", "bias_grad_acc")]
    _call_tags(item)


def _bmm_calls(item, quick):
    b = item.bucket
    for i, (m, n, k) in enumerate(edge_shapes(b.tile, (0, b.tile[1], b.tile[2]), quick)):
        item.calls.append(Call("bmm", (("L", 3), ("M", m), ("N", n), ("K", k)),
                               (("bias", i % 2 == 0),)))
    from detgemm_cute.batched import A_ROWS_MIN_K

    bm, bn, bk = b.tile  # a K-major A of an odd row pitch, K >= 256: the a-rows producer
    item.calls.append(Call("bmm", (("L", 3), ("M", bm + 1), ("N", bn + 1),
                                   ("K", max(4 * bk, A_ROWS_MIN_K) + 3))))
    # rows the threads store 8 bytes at once (a half-sector pitch, a pitch of 8 mod 16
    # bytes), and one element at a time (4 mod 8)
    for extra in (8, 4, 2):
        item.calls.append(Call("bmm", (("L", 3), ("M", bm + 1), ("N", bn + extra),
                                       ("K", bk))))
    _call_tags(item)


# Group sizes at the tile's edges (rows per group; `tail`: rows past the last group).
def _group_plans(bm, quick):
    plans = [("edges", [0, 1, bm - 1, bm, bm + 1, 2 * bm + 5], 3, "kn"),
             ("all-empty", [0, 0, 0], 2, "kn"),
             ("tiny", [1, 2, 3, 0] * 5, 0, "nk")]
    if not quick:
        plans += [("edges-nk", [0, 1, bm - 1, bm, bm + 1, 2 * bm + 5], 0, "nk"),
                  ("one-long", [3 * bm + 1], 0, "kn")]
    return plans


def _grouped_calls(item, quick):
    bm, bn, bk = item.bucket.tile
    nk = [(bn + 1, bk + 1), (bn - 1, 2 * bk + 5)]
    for i, (name, groups, tail, layout) in enumerate(_group_plans(bm, quick)):
        n, k = nk[i % 2]
        item.calls.append(Call("grouped", (("N", n), ("K", k)),
                               (("plan", name), ("groups", tuple(groups)), ("tail", tail),
                                ("w", layout))))
    item.tags |= {"empty-group", "short-group", "long-group", "trailing-rows", "all-empty"}
    _call_tags(item)


def _grouped_k_calls(item, quick):
    """The 2-D x 2-D form: the same group plans along T (cut at BK), a = x^T and b = dy as the
    MoE backward passes them, or both T-contiguous (T padded by trailing columns to a
    multiple of 8, so TMA reads them in place); M and N not multiples of the tile."""
    bm, bn, bk = item.bucket.tile
    for i, (name, groups, tail, layout) in enumerate(_group_plans(bk, quick)):
        m, n = (bm + 8, bn + 8) if i % 2 else (2 * bm + 16, bn - 8)  # 16-byte rows: TMA's
        if layout == "nk":  # T-contiguous operands; an odd N (the threads store C)
            m, n = bm - 8, 2 * bn + 5
            tail += -(sum(groups) + tail) % 8
        item.calls.append(Call("grouped_k", (("M", m), ("N", n)),
                               (("plan", name), ("groups", tuple(groups)), ("tail", tail),
                                ("major", "t" if layout == "nk" else "mn"))))
    item.tags |= {"empty-group", "short-group", "long-group", "trailing-columns", "all-empty"}
    _call_tags(item)


_BUILD = {"gemm": _gemm_calls, "bmm": _bmm_calls, "grouped": _grouped_calls,
          "grouped_k": _grouped_k_calls}


def _call_tags(item) -> None:
    """Tags for the paths the item's calls take (as gemm/batched decide them)."""
    import torch

    from detgemm_cute import batched, gemm

    b, sixteen = item.bucket, item.dtype in ("bf16", "fp16")
    for c in item.calls:
        if not c.launches():
            continue
        d = dict(c.dims)
        n = d.get("N")
        if (c.kind in ("linear", "linear_mmajor", "bmm") and sixteen and n % 8
                and gemm.stores_direct(item.family, b, plain=True)):
            item.tags.add("direct-store")
        if (c.kind == "bmm" and sixteen and gemm.direct_align(
                gemm.output_rows(item.family, b.direct_kernel(8) or b, n, torch.bfloat16, True,
                                 half_sectors=True)[0], n, torch.bfloat16)):
            item.tags.add("direct-store-8b")  # 8 bytes a store (`c_align`)
        if c.kind in ("linear", "input_grad", "bmm") and sixteen and d["K"] % 8:
            item.tags.add("row-copy")  # a K-major 16-bit operand of odd K: padded rows
        if (c.kind == "bmm" and sixteen and d["K"] % 8
                and batched.reads_a_rows(item.family, b, d["K"])):
            item.tags.add("a-rows")
        if item.dtype == "tf32" and c.kind == "input_grad":
            # sm90's swapped dX reads its weight through registers (an M-major A, whose rows
            # of N elements TMA reads at a 16-byte pitch); else the transpose kernel stages it
            item.tags.add("a-registers" if item.family == "sm90" and b.swap_ab and n % 4 == 0
                          else "transpose")
        if c.kind == "linear_mmajor":
            item.tags.add("m-major-a")


# ---------------------------------------------------------------------------------------
# Running (GPU)

def run_call(call: Call, dtype: str, device="cuda") -> list:
    """The call's outputs (CUDA tensors); run inside ``force_bucket``/``fp32_precision``."""
    import torch

    import detgemm_cute as dg

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)

    def rnd(*shape):
        return torch.randn(*shape, device=device).to(dt)

    d = dict(call.dims)
    m, n, k = d.get("M"), d.get("N"), d.get("K")
    if call.kind == "linear":
        return [dg.linear(rnd(m, k), rnd(n, k), rnd(n))]
    if call.kind == "linear_mmajor":  # X stored transposed: an M-major A
        return [dg.linear(rnd(k, m).t(), rnd(n, k), rnd(n))]
    if call.kind == "input_grad":  # GEMM (M, N, K) = (tokens, in, out)
        return [dg.input_grad(rnd(m, k), rnd(k, n))]
    if call.kind.startswith(("weight_grad", "bias_grad")):  # (M, N, K) = (out, in, tokens)
        dy, x = rnd(k, m), rnd(k, n)
        if call.kind == "weight_grad":
            return [dg.weight_grad(dy, x)]
        if call.kind == "weight_grad_acc":
            return [dg.weight_grad(dy, x, acc=torch.randn(m, n, device=device))]
        if call.kind == "bias_grad":
            return [dg.bias_grad(dy)]
        return [dg.bias_grad(dy, acc=torch.randn(m, device=device))]
    if call.kind == "bmm":
        lb = d["L"]
        return [dg.bmm(rnd(lb, m, k), rnd(lb, k, n), bias=rnd(n) if call.opt("bias") else None)]
    groups, tail = call.opt("groups"), call.opt("tail")
    ends = torch.tensor(groups, device=device).cumsum(0).to(torch.int32)
    g, t = len(groups), sum(groups) + tail
    if call.kind == "grouped_k":
        if call.opt("major") == "t":
            return [dg.grouped_mm(rnd(m, t), rnd(n, t).t(), ends)]
        return [dg.grouped_mm(rnd(t, m).t(), rnd(t, n), ends)]
    w = rnd(g, k, n) if call.opt("w") == "kn" else rnd(g, n, k).transpose(1, 2)
    return [dg.grouped_mm(rnd(t, k), w, ends)]
