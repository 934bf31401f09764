"""Exact CPU reproduction of the GPU kernels' bits (their accumulation chain, docs/reference.md).

Why it exists: the kernels' fp32 accumulator is a known function of the inputs, so a CPU can
compute the very bits a GPU returns. That gives tests an oracle that needs no GPU, and users
a way to check a GPU result (`verify`).

The chain, per output element: K is zero-padded to a multiple of 16 and walked in 16-wide
blocks, ascending. For each block, take the 16 exact products and the fp32 accumulator; E is
the largest *nominal* exponent among them (a product's is floor(log2|a|) + floor(log2|b|),
the accumulator's its own), but at least -133; every term is truncated toward zero to a
multiple of 2^(E-25) (so never finer than 2^-158);
the terms are added exactly and the sum is rounded toward zero to fp32. Epilogue: bias (if
any) converted to fp32 and added with one IEEE fp32 add, then one round-to-nearest-even to
the output dtype. fp32 inputs at precision "tf32" run the same chain in 8-wide blocks on
their TF32-rounded values (TF32 WGMMA); at "ieee" the split tier's chunks (`split`). The
edge cases (subnormals, tiny and huge sums, the sign of zero) are
fields of `ChainModel`, in one place, with an H100's behaviour as defaults; see
docs/reference.md.

All arithmetic is exact in float64: bf16/fp16 products have at most 22 significant bits,
scaling by powers of two is exact (exponents stay far inside float64's range), and a block
sum is an integer below 2^33.
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import split
from .errors import IN_DTYPES, OUT_DTYPES, check_gemm_args

BLOCK_K = 16
# TF32 operands (the fp32 tier's "tf32" precision): the same chain in 8-wide blocks.
TF32_BLOCK_K = 8
# Product terms are truncated to multiples of 2^(E - ALIGN_BITS).
ALIGN_BITS = 25
# Elements of one [rows, cols, 16] working tensor. At most torch's grain size (32768), so
# each op of a tile runs inline in its thread: the tiles run on a pool of
# torch.get_num_threads() Python threads instead of every small op opening an OpenMP
# parallel region. Those regions wait for every thread at each op; on a busy machine one
# descheduled thread stalls them all (37 x 4096 x 11008 took 322 s with 2 OpenMP threads
# on a loaded 2-core machine, 20 s with one).
_TILE_ELEMS = 1 << 15
_FP32_TINY = 2.0 ** -126
_FP32_OVERFLOW = 2.0 ** 128


@dataclass(frozen=True)
class ChainModel:
    """The edge cases the chain's first measurements left open, each a named choice (first
    value: default).

    The defaults are what an H100's WGMMA did (docs/reference.md, "Measured"); the other
    values exist so a probe can tell them apart on new hardware.

    subnormal_inputs: the nominal exponent of a subnormal bf16/fp16 input.
        "emin"  - its exponent field reads as the smallest normal exponent (bf16 -126,
                  fp16 -14); the value itself stays exact.
        "exact" - floor(log2|x|) of the subnormal value.
        "flush" - the input counts as zero.
    zero_acc: how a zero accumulator enters E.
        "ignore" - it does not (the accumulator starts at +0).
        "emin"   - as exponent -126 (its exponent field read like a subnormal's).
    acc_subnormals: a block sum below 2^-126.
        "keep"  - gradual underflow: truncated toward zero to a multiple of 2^-149.
        "flush" - becomes zero.
    overflow: a block sum of magnitude >= 2^128.
        "inf"      - infinity of the same sign.
        "saturate" - IEEE round-toward-zero: the largest finite fp32.
    align_floor: the smallest block exponent E the alignment uses.
        "-133" - E is at least -133: terms are never truncated finer than 2^-158, which
                 only matters for blocks whose products all lie below about 2^-133
                 (results in fp32's subnormal range). Measured on an H100, both kernel
                 families (bench/probe_subnormal.py): 98,304 outputs of tiny, nearly
                 cancelling bf16 sums all matched; 156 of them differ under "none".
        "none" - E is the largest nominal exponent, however small.
    underflow_sign: a nonzero block sum that rounds to zero.
        "plus" - gives +0.
        "keep" - keeps its sign, so a negative one gives -0 (IEEE).
    An exactly zero block sum is always +0 (an integer adder has no -0).
    nan_bits: the bit pattern of a NaN result (`canonical_nans`).
        "unmodelled" - whatever the CPU's arithmetic and conversions give (payloads and
                       signs of the inputs may survive); compare NaNs as NaN (`bits`).
        "canonical"  - the output dtype's canonical NaN, whatever the inputs' payloads and
                       signs: 0x7FFFFFFF (fp32), 0x7FFF (bf16 and fp16), as PTX arithmetic
                       and conversions write it. The default: measured on an H100 by
                       bench/probe_nan.py (every NaN of 84 paths, both kernel families).
    """

    subnormal_inputs: str = "emin"
    zero_acc: str = "ignore"
    acc_subnormals: str = "keep"
    align_floor: str = "-133"
    overflow: str = "inf"
    underflow_sign: str = "plus"
    nan_bits: str = "canonical"

    def __post_init__(self):
        for field, values in _CHOICES.items():
            if getattr(self, field) not in values:
                raise ValueError(f"ChainModel.{field} must be one of {values}, "
                                 f"got {getattr(self, field)!r}")

    def variants(self, field: str) -> dict:
        """{value: this model with `field` set to value} for every allowed value."""
        if field not in _CHOICES:
            raise ValueError(f"ChainModel has no choice {field!r}; it has {list(_CHOICES)}")
        return {v: dataclasses.replace(self, **{field: v}) for v in _CHOICES[field]}


_CHOICES = {"subnormal_inputs": ("emin", "exact", "flush"), "zero_acc": ("ignore", "emin"),
            "acc_subnormals": ("keep", "flush"), "align_floor": ("-133", "none"),
            "overflow": ("inf", "saturate"),
            "underflow_sign": ("plus", "keep"), "nan_bits": ("unmodelled", "canonical")}


# The model every function uses unless given another; change it here once measured.
# nan_bits="canonical": bench/probe_nan.py on an H100 (2026-11-26) found every NaN written by
# 84 paths of both kernel families (NaN of four payloads and both signs in X, W, bias and the
# dW buffer; Inf - Inf; Inf x 0) to be the canonical NaN of its dtype.
MODEL = ChainModel()


# ---------------------------------------------------------------------------------------
# Operands


def _operand(t: torch.Tensor, model: ChainModel):
    """(values, nominal exponents, special-value masks) of one bf16/fp16 operand.

    Values are float64 with NaN/Inf replaced by 0 (the special-value path handles those);
    nominal exponents are float64 integers, -inf for zeros so they never raise E."""
    v = t.to(torch.float64)
    finite = torch.isfinite(v)
    masks = None
    if not bool(finite.all()):
        masks = {"nan": torch.isnan(v), "pos": v > 0, "neg": v < 0, "inf": torch.isinf(v)}
    v = torch.where(finite, v, torch.zeros((), dtype=v.dtype))
    tiny = torch.finfo(t.dtype).tiny
    subnormal = (v != 0) & (v.abs() < tiny)
    if model.subnormal_inputs == "flush":
        v = torch.where(subnormal, torch.zeros((), dtype=v.dtype), v)
    nom = _floor_log2(v)
    if model.subnormal_inputs == "emin":
        nom = nom.clamp(min=math.log2(tiny))  # only subnormals lie below emin
    nom = torch.where(v == 0, torch.full((), -math.inf, dtype=v.dtype), nom)
    if masks is not None:
        masks["zero"] = (v == 0) & finite
        masks["pos_fin"] = masks["pos"] & ~masks["inf"] & ~masks["zero"]
        masks["neg_fin"] = masks["neg"] & ~masks["inf"] & ~masks["zero"]
        masks["pos"] = masks["pos"] & ~masks["zero"]  # a flushed subnormal is a zero
        masks["neg"] = masks["neg"] & ~masks["zero"]
    return v, nom, masks


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2|v|) as float64, exact (frexp gives |v| = m * 2^e with 0.5 <= m < 1)."""
    _, e = torch.frexp(v)
    return (e - 1).to(torch.float64)


def _blocks(v: torch.Tensor, nom: torch.Tensor, block: int = BLOCK_K):
    """[rows, K] -> [K/block, rows, block] (K zero-padded), contiguous per block."""
    rows, k = v.shape
    kp = -(-k // block) * block
    if kp != k:
        v = torch.nn.functional.pad(v, (0, kp - k))
        nom = torch.nn.functional.pad(nom, (0, kp - k), value=-math.inf)
    shape = (rows, kp // block, block)
    return (v.reshape(shape).transpose(0, 1).contiguous(),
            nom.reshape(shape).transpose(0, 1).contiguous())


# ---------------------------------------------------------------------------------------
# The chain


def _round_to_fp32_rz(x: torch.Tensor, model: ChainModel) -> torch.Tensor:
    """Round exact float64 values toward zero to fp32, with the model's edge cases."""
    y = x.to(torch.float32)  # round to nearest even (overflow -> inf) ...
    too_big = y.to(torch.float64).abs() > x.abs()
    y = torch.where(too_big, torch.nextafter(y, torch.zeros_like(y)), y)  # ... then toward 0
    if model.overflow == "inf":
        y = torch.where(x.abs() >= _FP32_OVERFLOW,
                        torch.copysign(torch.full_like(y, math.inf), y), y)
    if model.acc_subnormals == "flush":
        y = torch.where(x.abs() < _FP32_TINY, torch.copysign(torch.zeros_like(y), y), y)
    if model.underflow_sign == "plus":
        y = torch.where(y == 0, torch.zeros_like(y), y)
    return y


def _acc_nominal(acc64: torch.Tensor, model: ChainModel) -> torch.Tensor:
    """Nominal exponent of the fp32 accumulator: its exponent field (-126 if subnormal)."""
    nom = _floor_log2(acc64).clamp(min=-126.0)
    zero = -126.0 if model.zero_acc == "emin" else -math.inf
    return torch.where(acc64 == 0, torch.full((), zero, dtype=acc64.dtype), nom)


def _block_step(a_vj, a_nj, b_vj, b_nj, acc, model, prod, nom, e_max):
    """One block (16 wide; 8 for tf32) onto the fp32 accumulators: a_* [..., m, w],
    b_* [..., n, w], acc fp32 [..., m, n]; prod/nom [..., m, n, w] and e_max [..., m, n] are
    scratch."""
    torch.mul(a_vj.unsqueeze(-2), b_vj.unsqueeze(-3), out=prod)  # exact products
    torch.add(a_nj.unsqueeze(-2), b_nj.unsqueeze(-3), out=nom)  # nominal exponents
    torch.amax(nom, dim=-1, out=e_max)
    acc64 = acc.to(torch.float64)
    torch.maximum(e_max, _acc_nominal(acc64, model), out=e_max)
    e_max.masked_fill_(e_max == -math.inf, 0.0)  # every term is zero: any scale works
    if model.align_floor != "none":
        e_max.clamp_(min=float(model.align_floor))
    # s = 2^(25 - E), built from its bits (exact on every platform): terms in units of
    # 2^(E - 25); trunc() is the truncation toward zero.
    s = ((1023 + ALIGN_BITS - e_max).to(torch.int64) << 52).view(torch.float64)
    prod.mul_(s.unsqueeze(-1)).trunc_()
    total = prod.sum(dim=-1)
    total.add_(torch.trunc(acc64 * s)).add_(0.0)  # exact integer sum; 0 is +0
    return _round_to_fp32_rz(total.div_(s), model)


def _scratch(*lead, block: int = BLOCK_K):
    return (torch.empty((*lead, block), dtype=torch.float64),
            torch.empty((*lead, block), dtype=torch.float64),
            torch.empty(lead, dtype=torch.float64))


def _chain_tile(a_v, a_n, b_v, b_n, acc, model, seen=None, a_nf=None, b_nf=None):
    """Run all K-blocks for one output tile. a_*: [KB, m, w], b_*: [KB, n, w]; acc fp32
    [m, n] (finite). Returns (acc fp32, +Inf mask, -Inf mask) where the last two mark
    accumulators that overflowed to infinity (only with model.overflow == "inf").

    seen [m, n] marks accumulators already NaN/Inf; a_nf [KB, m] / b_nf [KB, n] mark rows /
    columns with a NaN/Inf input in each block. An infinite accumulator absorbs later
    finite sums, so only an overflow before the first NaN/Inf product counts."""
    kb, m, block = a_v.shape
    n = b_v.shape[1]
    scratch = _scratch(m, n, block=block)
    ovf_pos = ovf_neg = None
    for j in range(kb):
        acc = _block_step(a_v[j], a_n[j], b_v[j], b_n[j], acc, model, *scratch)
        if model.overflow == "inf":
            if a_nf is not None:
                seen = seen | a_nf[j].unsqueeze(1) | b_nf[j].unsqueeze(0)
            inf = torch.isinf(acc)
            if bool(inf.any()):
                if ovf_pos is None:
                    ovf_pos = torch.zeros_like(inf)
                    ovf_neg = torch.zeros_like(inf)
                new = inf & ~seen & ~ovf_pos & ~ovf_neg
                ovf_pos |= new & (acc > 0)
                ovf_neg |= new & (acc < 0)
                acc = torch.where(inf, torch.zeros_like(acc), acc)
    return acc, ovf_pos, ovf_neg


def _special_counts(am, bm):
    """Counts per output of NaN, +Inf and -Inf products, from 0/1 masks via exact matmuls.

    am: masks of a [M, K]; bm: masks of b as [K, N]. A product is NaN if a factor is NaN or
    it is Inf * 0; it is infinite if a factor is infinite and neither is zero or NaN."""
    f = lambda mask: mask.to(torch.float64)  # noqa: E731
    nan = (f(am["nan"]).sum(1, keepdim=True) + f(bm["nan"]).sum(0, keepdim=True)
           + f(am["inf"]) @ f(bm["zero"]) + f(am["zero"]) @ f(bm["inf"]))
    pp = f(am["pos"]) @ f(bm["pos"]) - f(am["pos_fin"]) @ f(bm["pos_fin"])
    nn = f(am["neg"]) @ f(bm["neg"]) - f(am["neg_fin"]) @ f(bm["neg_fin"])
    pn = f(am["pos"]) @ f(bm["neg"]) - f(am["pos_fin"]) @ f(bm["neg_fin"])
    np_ = f(am["neg"]) @ f(bm["pos"]) - f(am["neg_fin"]) @ f(bm["pos_fin"])
    return nan > 0, (pp + nn) > 0, (pn + np_) > 0


def _nonfinite_blocks(masks, blocks):
    """[KB, rows] bool: the rows with a NaN/Inf input inside each K-block."""
    nf = masks["nan"] | masks["inf"]
    kb, rows, block = blocks.shape
    nf = torch.nn.functional.pad(nf, (0, kb * block - nf.shape[1]))
    return nf.reshape(rows, kb, block).any(dim=2).t().contiguous()


def _no_specials(v):
    z = torch.zeros(v.shape, dtype=torch.bool)
    return {"nan": z, "inf": z, "zero": v == 0, "pos": v > 0, "neg": v < 0,
            "pos_fin": v > 0, "neg_fin": v < 0}


def _each_tile(m: int, n: int, depth: int, run) -> None:
    """run(r0, r1, c0, c1) for every output tile of at most _TILE_ELEMS / depth outputs
    (`depth`: the working tensors' last dimensions), on torch.get_num_threads() threads.
    Each tile writes only its own outputs, so the order changes no bit."""
    cols = min(n, max(1, _TILE_ELEMS // depth))
    rows = max(1, _TILE_ELEMS // (cols * depth))
    tiles = [(r0, min(m, r0 + rows), c0, min(n, c0 + cols))
             for r0 in range(0, m, rows) for c0 in range(0, n, cols)]
    workers = min(len(tiles), torch.get_num_threads())
    if workers <= 1:
        for t in tiles:
            run(*t)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="detgemm-reference") as pool:
        for f in [pool.submit(run, *t) for t in tiles]:
            f.result()  # re-raises a tile's exception here


def _chain(a: torch.Tensor, b_nk: torch.Tensor, acc: torch.Tensor | None,
           model: ChainModel, block: int = BLOCK_K) -> torch.Tensor:
    """fp32 accumulators of a [M, K] @ b_nk[N, K]^T, starting from acc (or +0), in
    `block`-wide K blocks (16; 8 for TF32 operands)."""
    m, n = a.shape[0], b_nk.shape[0]
    a_val, a_n, a_masks = _operand(a, model)
    b_val, b_n, b_masks = _operand(b_nk, model)
    out = torch.zeros((m, n), dtype=torch.float32)
    if m == 0:
        return out
    acc_special = None
    if acc is not None:
        out.copy_(acc)
        if not bool(torch.isfinite(out).all()):
            acc_special = out.clone()
            out = torch.where(torch.isfinite(out), out, torch.zeros_like(out))
    a_v, a_n = _blocks(a_val, a_n, block)
    b_v, b_n = _blocks(b_val, b_n, block)
    a_nf = b_nf = None
    if a_masks is not None or b_masks is not None:
        a_masks = a_masks if a_masks is not None else _no_specials(a_val)
        b_masks = b_masks if b_masks is not None else _no_specials(b_val)
        a_nf = _nonfinite_blocks(a_masks, a_v)
        b_nf = _nonfinite_blocks(b_masks, b_v)
    seen = (torch.zeros((m, n), dtype=torch.bool) if acc_special is None
            else ~torch.isfinite(acc_special))
    ovf_pos = torch.zeros((m, n), dtype=torch.bool)
    ovf_neg = torch.zeros((m, n), dtype=torch.bool)

    def tile(r0, r1, c0, c1):
        res, op, on = _chain_tile(
            a_v[:, r0:r1], a_n[:, r0:r1], b_v[:, c0:c1], b_n[:, c0:c1],
            out[r0:r1, c0:c1], model, seen[r0:r1, c0:c1],
            None if a_nf is None else a_nf[:, r0:r1],
            None if b_nf is None else b_nf[:, c0:c1])
        out[r0:r1, c0:c1] = res
        if op is not None:
            ovf_pos[r0:r1, c0:c1] |= op
            ovf_neg[r0:r1, c0:c1] |= on

    _each_tile(m, n, block, tile)
    if a_masks is None and b_masks is None and acc_special is None and not bool(
            (ovf_pos | ovf_neg).any()):
        return out
    # IEEE special values: the outcome does not depend on the order of the additions.
    if a_masks is not None:
        nan, pinf, ninf = _special_counts(a_masks, {k: v.t() for k, v in b_masks.items()})
    else:
        nan, pinf, ninf = (torch.zeros((m, n), dtype=torch.bool) for _ in range(3))
    pinf |= ovf_pos
    ninf |= ovf_neg
    if acc_special is not None:
        nan |= torch.isnan(acc_special)
        pinf |= acc_special == math.inf
        ninf |= acc_special == -math.inf
    return _with_specials(out, nan, pinf, ninf)


def _with_specials(out, nan, pinf, ninf):
    """out with +Inf / -Inf / NaN where those masks say (NaN also where both Infs meet)."""
    nan = nan | (pinf & ninf)
    out = torch.where(pinf, torch.full_like(out, math.inf), out)
    out = torch.where(ninf, torch.full_like(out, -math.inf), out)
    return torch.where(nan, torch.full_like(out, math.nan), out)


def _chain_fp32(a: torch.Tensor, b_nk: torch.Tensor, acc: torch.Tensor | None,
                model: ChainModel, op: str, precision: str) -> torch.Tensor:
    """fp32 operands. dW: exact bf16 parts (`split`), the chunked chain continuing `acc`.
    fwd/dX at "tf32": both operands rounded to TF32 (`split.tf32_round`), the chain in
    8-wide blocks from `acc`. At "ieee": per-row scales, the chunked chain on fp16 parts from
    the scaled `acc`, unscaled."""
    m, n = a.shape[0], b_nk.shape[0]
    if op == "dw":
        out = torch.zeros((m, n), dtype=torch.float32) if acc is None else acc.clone()
        return out if m == 0 else _chunked(split.exact_operand(a, "a"),
                                           split.exact_operand(b_nk, "b"), out, model)
    if precision == "tf32":
        return _chain(split.tf32_round(a), split.tf32_round(b_nk), acc, model, TF32_BLOCK_K)
    sa, sb = split.row_scales(a), split.row_scales(b_nk)
    acc = None if acc is None else split.scale_acc(acc, sa, sb)
    out = torch.zeros((m, n), dtype=torch.float32) if acc is None else acc
    if m:
        out = _chunked(split.operand(a, sa, "a"), split.operand(b_nk, sb, "b"), out, model)
    return split.unscale(out, sa, sb)


def _chunked(a2, b2, out, model):
    """out + the chunks of a2 [M, K'] @ b2 [N, K']^T (16-bit parts, six steps per chunk)."""
    m, n = a2.shape[0], b2.shape[0]
    a_val, a_n, a_masks = _operand(a2, model)
    b_val, b_n, b_masks = _operand(b2, model)
    steps = split.STEPS
    a_v, a_n = (t.view(-1, steps, m, BLOCK_K).transpose(0, 1) for t in _blocks(a_val, a_n))
    b_v, b_n = (t.view(-1, steps, n, BLOCK_K).transpose(0, 1) for t in _blocks(b_val, b_n))
    chunks = a_v.shape[1]

    def tile(r0, r1, c0, c1):
        scratch = _scratch(chunks, r1 - r0, c1 - c0)
        part = torch.zeros((chunks, r1 - r0, c1 - c0), dtype=torch.float32)
        for st in range(steps):
            part = _block_step(a_v[st, :, r0:r1], a_n[st, :, r0:r1], b_v[st, :, c0:c1],
                               b_n[st, :, c0:c1], part, model, *scratch)
        total = out[r0:r1, c0:c1]
        for c in range(chunks):
            total = total + part[c]  # IEEE fp32, round to nearest even
        out[r0:r1, c0:c1] = total

    _each_tile(m, n, BLOCK_K * chunks, tile)
    if a_masks is not None or b_masks is not None:
        # NaN/Inf part products: an Inf or NaN input has NaN lower parts.
        a_masks = a_masks if a_masks is not None else _no_specials(a_val)
        b_masks = b_masks if b_masks is not None else _no_specials(b_val)
        nan, pinf, ninf = _special_counts(a_masks, {k: v.t() for k, v in b_masks.items()})
        # The fp32 adds already made NaN/Inf of overflowed chunks: they meet the products'.
        nan = nan | torch.isnan(out) | (pinf & (out == -math.inf)) | (ninf & (out == math.inf))
        out = _with_specials(out, nan, pinf, ninf)
    return out


def _accumulate(a, b_nk, acc, model, op="fwd", precision=None):
    """The chain of the inputs' tier: fp32 inputs take the split chain (of `op`: dW has its
    own scheme; `precision`, default `split.precision()`), 16-bit inputs the plain one."""
    if a.dtype == torch.float32:
        precision = precision or split.precision()
        return _chain_fp32(a, b_nk, acc, model, op, precision)
    return _chain(a, b_nk, acc, model)


def _epilogue(acc: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
              model: ChainModel):
    """Bias as fp32, one IEEE fp32 add (round to nearest even), one rounding to out_dtype;
    NaNs as the model writes them."""
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return canonical_nans(acc.to(out_dtype), model)


_CANONICAL_NAN = {torch.float32: 0x7FFFFFFF, torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF}


def canonical_nans(t: torch.Tensor, model: ChainModel | None = None) -> torch.Tensor:
    """`t` with every NaN as the model writes it: the dtype's canonical NaN when
    ``model.nan_bits == "canonical"`` (default model: `MODEL`), else `t` unchanged. The CPU
    paths of the ops apply it to what they compute, so their NaN bits are the GPU's where
    the model claims them."""
    model = MODEL if model is None else model
    if model.nan_bits != "canonical" or t.dtype not in _CANONICAL_NAN:
        return t
    nan = torch.isnan(t)
    if not bool(nan.any()):
        return t
    pattern = torch.tensor(_CANONICAL_NAN[t.dtype], dtype=_INT_OF[t.dtype]).view(t.dtype)
    return torch.where(nan, pattern.to(t.device), t)


# ---------------------------------------------------------------------------------------
# Public API


def _cpu(t):
    return None if t is None else t.detach().to("cpu").contiguous()


def _model(model):
    if model is None:
        return MODEL
    if not isinstance(model, ChainModel):
        raise TypeError(f"model must be a ChainModel or None, got {type(model).__name__}")
    return model


def chain(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None, *,
          model: ChainModel | None = None, op: str = "dw",
          precision: str = "ieee") -> torch.Tensor:
    """The raw fp32 accumulator of ``a [M, K] @ b [K, N]``, continuing from ``acc``.

    ``acc`` (fp32 [M, N]) is where a previous chain stopped, as in ``dW += dY^T X``; without
    it the chain starts at +0. No epilogue, no rounding beyond the chain's own. `op` ("dw",
    "fwd" or "dx") and `precision` ("ieee" or "tf32") matter for fp32 inputs only: dW's
    split scheme differs, and fwd/dX at "tf32" run the chain in 8-wide blocks on the
    TF32-rounded operands (`split.tf32_round`)."""
    if precision not in split.PRECISIONS:
        raise ValueError(f"detgemm_cute.reference.chain: precision must be one of "
                         f"{split.PRECISIONS}, got {precision!r}")
    if op not in ("fwd", "dx", "dw"):
        raise ValueError(f"detgemm_cute.reference.chain: op must be 'fwd', 'dx' or 'dw', "
                         f"got {op!r}")
    gemm_op, op = op, "detgemm_cute.reference.chain"
    check_gemm_args(a, b, "kn", None, None, op, ("a", "b", "bias"), check_device=False)
    if acc is not None:
        if not isinstance(acc, torch.Tensor):
            raise TypeError(f"{op}: acc must be a torch.Tensor or None, got "
                            f"{type(acc).__name__}")
        if acc.dtype != torch.float32:
            raise TypeError(f"{op}: acc must be torch.float32, got {acc.dtype}")
        want = (a.shape[0], b.shape[1])
        if tuple(acc.shape) != want:
            raise ValueError(f"{op}: acc must have shape [M, N] = {list(want)}, got "
                             f"{tuple(acc.shape)}")
    model = _model(model)
    return canonical_nans(_accumulate(_cpu(a), _cpu(b).t(), _cpu(acc), model, gemm_op,
                                      precision), model)


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, *,
       model: ChainModel | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` -> [M, N] in ``out_dtype`` (default a's dtype), on CPU."""
    op = "detgemm_cute.reference.mm"
    check_gemm_args(a, b, "kn", None, out_dtype, op, ("a", "b", "bias"), check_device=False)
    model = _model(model)
    acc = _accumulate(_cpu(a), _cpu(b).t(), None, model)
    return _epilogue(acc, None, out_dtype or a.dtype, model)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
          out_dtype: torch.dtype | None = None, *, model: ChainModel | None = None):
    """``bias [N] + a [M, K] @ b [K, N]``, the bias added in fp32 before the one rounding."""
    op = "detgemm_cute.reference.addmm"
    if bias is None:
        raise TypeError(f"{op}: bias must be a torch.Tensor, got None (use mm)")
    check_gemm_args(a, b, "kn", bias, out_dtype, op, ("a", "b", "bias"), check_device=False)
    model = _model(model)
    acc = _accumulate(_cpu(a), _cpu(b).t(), None, model)
    return _epilogue(acc, _cpu(bias), out_dtype or a.dtype, model)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, *, model: ChainModel | None = None):
    """Like ``F.linear``: ``x [..., K] @ weight [N, K]^T (+ bias [N])`` -> [..., N]."""
    op = "detgemm_cute.reference.linear"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{op}: input must have shape [..., K], got a 0-d tensor")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    check_gemm_args(x2, weight, "nk", bias, out_dtype, op, ("input", "weight", "bias"),
                    check_device=False)
    model = _model(model)
    acc = _accumulate(_cpu(x2), _cpu(weight), None, model)
    y = _epilogue(acc, _cpu(bias), out_dtype or x.dtype, model)
    return y if x.dim() == 2 else y.reshape(*lead, weight.shape[0])  # 2-D: not a view


# ---------------------------------------------------------------------------------------
# Comparing bits

_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a float tensor as int64 (unsigned), every NaN as one canonical NaN.

    NaN payloads and signs differ between CPU and GPU conversions and are not part of the
    contract; every other bit is, including the sign of zero."""
    if t.dtype not in _INT_OF:
        raise TypeError(f"bits: expected a bf16, fp16 or fp32 tensor, got {t.dtype}")
    t = t.detach().to("cpu").contiguous()
    width = 32 if t.dtype == torch.float32 else 16
    raw = t.view(_INT_OF[t.dtype]).to(torch.int64) & ((1 << width) - 1)
    return torch.where(torch.isnan(t), torch.full_like(raw, _NAN_BITS[t.dtype]), raw)


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """True when x and y have the same dtype, shape and bits (NaNs compared as NaN)."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of `verify`. Hex strings are the raw bit patterns of the first mismatch."""

    ok: bool
    checked: int
    mismatches: int
    first_index: tuple | None = None
    expected: str | None = None
    got: str | None = None

    def __bool__(self):
        return self.ok

    def __str__(self):
        if self.ok:
            return f"ok: all {self.checked} outputs bit-identical to the reference"
        return (f"MISMATCH: {self.mismatches} of {self.checked} outputs differ; first at "
                f"{self.first_index}: expected {self.expected}, got {self.got}")


def verify(x: torch.Tensor, weight: torch.Tensor, result: torch.Tensor,
           bias: torch.Tensor | None = None, *, model: ChainModel | None = None) -> VerifyResult:
    """Check a ``linear(x, weight, bias)`` result (any device) bit-for-bit against the model.

    The output dtype is ``result.dtype``. The reference runs on CPU: a few seconds per
    5e8 multiply-adds on a small machine."""
    op = "detgemm_cute.reference.verify"
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"{op}: result must be a torch.Tensor, got {type(result).__name__}")
    if result.dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: result must be bf16, fp16 or fp32, got {result.dtype}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"{op}: input must be a torch.Tensor of shape [..., K]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"{op}: weight must be a 2-D torch.Tensor [N, K]")
    want = (*x.shape[:-1], weight.shape[0])
    if tuple(result.shape) != want:
        raise ValueError(f"{op}: result has shape {tuple(result.shape)}, expected {want}")
    expected = linear(x, weight, bias, result.dtype, model=model)
    eb, gb = bits(expected), bits(result)
    diff = eb != gb
    n_bad = int(diff.sum())
    if n_bad == 0:
        return VerifyResult(True, expected.numel(), 0)
    first = tuple(int(i) for i in torch.nonzero(diff)[0])
    digits = 8 if result.dtype == torch.float32 else 4
    raw = lambda t: int(t.detach().to("cpu").contiguous().view(  # noqa: E731
        _INT_OF[t.dtype])[first]) & ((1 << (4 * digits)) - 1)
    return VerifyResult(False, expected.numel(), n_bad, first,
                        f"0x{raw(expected):0{digits}x}", f"0x{raw(result):0{digits}x}")


__all__ = ["ChainModel", "MODEL", "chain", "mm", "addmm", "linear", "verify",
           "VerifyResult", "bits", "same_bits", "canonical_nans", "IN_DTYPES", "OUT_DTYPES"]
