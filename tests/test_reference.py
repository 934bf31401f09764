"""CPU tests of detgemm_cute.reference, the exact model of the GPU accumulation chain.

The vectorised model is checked against an independent scalar one written straight from
the definition with Python fractions, against fp64 where it must be close, and against
itself for the invariances the contract promises. Golden GPU bits, once recorded under
tests/golden/, are recomputed here bit-for-bit.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
from fractions import Fraction

import pytest
import torch

from detgemm_cute import reference as R

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HERE = os.path.dirname(os.path.abspath(__file__))
MAX_FP32 = (2 - 2.0 ** -23) * 2.0 ** 127


def eq_bits(x, y):
    """Bit equality (NaN as NaN), with a readable failure."""
    assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
    bx, by = R.bits(x), R.bits(y)
    if not torch.equal(bx, by):
        i = tuple(int(v) for v in torch.nonzero(bx != by)[0])
        pytest.fail(f"{int((bx != by).sum())} of {bx.numel()} differ; first at {i}: "
                    f"{hex(int(bx[i]))} vs {hex(int(by[i]))} ({x[i].item()} vs {y[i].item()})")


def rand(shape, dtype, seed, spread=0, scale=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if spread:
        x = x * torch.pow(2.0, torch.randint(-spread, spread + 1, shape, generator=g).double())
    big = torch.finfo(dtype).max
    return (x * 2.0 ** scale).clamp(-big, big).to(dtype)


def sprinkle(x, seed, frac, values):
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(values), x.shape, generator=g)
    vals = torch.tensor(values, dtype=x.dtype)[pick]
    return torch.where(torch.rand(x.shape, generator=g) < frac, vals, x)


def subnormals(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mant = 7 if dtype == BF16 else 10
    m = torch.randint(1, 2 ** mant, shape, generator=g).double()
    s = torch.randint(0, 2, shape, generator=g).double() * 2 - 1
    return (s * m * torch.finfo(dtype).tiny * 2.0 ** -mant).to(dtype)


# ---------------------------------------------------------------------------------------
# An independent scalar model: one output at a time, exact rationals, from the definition


def _scalar_nominal(v, dtype, model):
    """(value, nominal exponent or None for a zero term)."""
    if v == 0:
        return 0.0, None
    tiny = torch.finfo(dtype).tiny
    if abs(v) < tiny:
        if model.subnormal_inputs == "flush":
            return 0.0, None
        if model.subnormal_inputs == "emin":
            return v, int(math.log2(tiny))
    return v, math.frexp(v)[1] - 1


def _scalar_rz_fp32(v: Fraction, model) -> float:
    if v == 0:
        return 0.0
    sign = -1.0 if v < 0 else 1.0
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    if e > 127:
        return sign * (math.inf if model.overflow == "inf" else MAX_FP32)
    zero_sign = 1.0 if model.underflow_sign == "plus" else sign
    if e < -126 and model.acc_subnormals == "flush":
        return math.copysign(0.0, zero_sign)
    lsb = Fraction(2) ** (max(e, -126) - 23)
    q = int(a / lsb) * lsb
    return math.copysign(float(q), sign if q else zero_sign)


def scalar_chain(xrow, wrow, dtype, model=R.MODEL, acc=0.0):
    """fp32 accumulator of one output, as a Python float."""
    xs = [float(v) for v in xrow]
    ws = [float(v) for v in wrow]
    specials = [a * b for a, b in zip(xs, ws) if not (math.isfinite(a) and math.isfinite(b))]
    if specials or not math.isfinite(acc):
        total = sum(specials, acc if not math.isfinite(acc) else 0.0)  # IEEE: order-free
        if math.isnan(total) or math.isinf(total):
            return total
    k = len(xs)
    kp = -(-k // 16) * 16
    xs += [0.0] * (kp - k)
    ws += [0.0] * (kp - k)
    for j in range(0, kp, 16):
        terms = []
        for a, b in zip(xs[j:j + 16], ws[j:j + 16]):
            if not (math.isfinite(a) and math.isfinite(b)):
                continue
            va, na = _scalar_nominal(a, dtype, model)
            vb, nb = _scalar_nominal(b, dtype, model)
            if na is None or nb is None:
                continue
            terms.append((Fraction(va) * Fraction(vb), na + nb))
        if acc != 0:
            terms.append((Fraction(acc), max(math.frexp(acc)[1] - 1, -126)))
        elif model.zero_acc == "emin":
            terms.append((Fraction(0), -126))
        if not terms:
            acc = 0.0
            continue
        unit = Fraction(2) ** (max(n for _, n in terms) - R.ALIGN_BITS)
        acc = _scalar_rz_fp32(sum(int(t / unit) for t, _ in terms) * unit, model)
        if math.isinf(acc):  # overflow="inf": later finite sums cannot change it
            return acc
    return acc


def scalar_matrix(x, w, model=R.MODEL, acc=None):
    rows = []
    for i in range(x.shape[0]):
        rows.append([scalar_chain(x[i].tolist(), w[j].tolist(), x.dtype, model,
                                  0.0 if acc is None else float(acc[i, j]))
                     for j in range(w.shape[0])])
    return torch.tensor(rows, dtype=FP32)


# ---------------------------------------------------------------------------------------
# The chain against the scalar model


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("k", [1, 15, 16, 17, 48, 83])
def test_chain_matches_scalar_model(dtype, k):
    spread = 20 if dtype == BF16 else 6
    x = rand((5, k), dtype, 10 + k, spread)
    w = rand((6, k), dtype, 20 + k, spread)
    x = sprinkle(x, 30 + k, 0.15, [0.0, -0.0])
    eq_bits(R.chain(x, w.t()), scalar_matrix(x, w))


def _hard_cases(dtype):
    """Inputs where the unsettled model choices change bits (see ChainModel)."""
    k, bf = 64, dtype == BF16
    # The largest products cancel exactly; tiny survivors are cut at the cancelled E.
    x = rand((6, k), dtype, 1, 24 if bf else 6)
    w = rand((5, k), dtype, 2, 24 if bf else 6)
    x[:, 1::2] = -x[:, 0::2]
    w[:, 1::2] = w[:, 0::2]
    x[:, 9] = rand((6,), dtype, 3, scale=-12)
    yield x, w
    # Subnormal inputs set E: x near the bottom of the range, w near the top.
    x = rand((6, k), dtype, 4, 2, scale=-124 if bf else -12)
    x = torch.where(torch.rand(6, k, generator=torch.Generator().manual_seed(5)) < 0.7,
                    subnormals((6, k), dtype, 6), x)
    yield x, rand((5, k), dtype, 7, 12 if bf else 6, scale=90 if bf else 8)
    if bf:  # sums in fp32's subnormal range, while the accumulator is still zero
        yield rand((6, k), dtype, 8, 6, scale=-68), rand((5, k), dtype, 9, 6, scale=-70)


@pytest.mark.parametrize("field", ["subnormal_inputs", "zero_acc", "acc_subnormals"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_chain_matches_scalar_model_hard_cases(dtype, field):
    """Both models agree under every choice; the inputs do tell the choices apart."""
    acc = rand((6, 5), FP32, 10, 30)
    outs = {}
    for value, model in R.MODEL.variants(field).items():
        outs[value] = []
        for x, w in _hard_cases(dtype):
            got = R.chain(x, w.t(), model=model)
            eq_bits(got, scalar_matrix(x, w, model))
            eq_bits(R.chain(x, w.t(), acc, model=model), scalar_matrix(x, w, model, acc))
            outs[value].append(R.bits(got))
    if dtype == BF16 or field == "subnormal_inputs":
        values = list(outs)
        for value in values[1:]:
            assert any(not torch.equal(a, b) for a, b in zip(outs[value], outs[values[0]])), (
                f"no input tells {field}={value!r} from {values[0]!r}")


def test_chain_matches_scalar_model_tiny_and_huge():
    """Sums below fp32's normal range, and above its largest value."""
    x = rand((4, 40), BF16, 7, spread=3, scale=-68)
    w = rand((3, 40), BF16, 8, spread=3, scale=-68)
    x[0, :5] = -x[0, :5]
    for model in [*R.MODEL.variants("acc_subnormals").values(),
                  *R.MODEL.variants("underflow_sign").values()]:
        eq_bits(R.chain(x, w.t(), model=model), scalar_matrix(x, w, model))
    x = rand((3, 40), BF16, 9, spread=3, scale=100)
    w = rand((4, 40), BF16, 10, spread=3, scale=100)
    for model in R.MODEL.variants("overflow").values():
        eq_bits(R.chain(x, w.t(), model=model), scalar_matrix(x, w, model))


def test_chain_matches_scalar_model_specials():
    x = sprinkle(rand((6, 40), BF16, 11, 8), 12, 0.04,
                 [math.nan, math.inf, -math.inf, 0.0])
    w = sprinkle(rand((7, 40), BF16, 13, 8), 14, 0.04,
                 [math.nan, math.inf, -math.inf, 0.0])
    got = R.chain(x, w.t())
    eq_bits(got, scalar_matrix(x, w))
    assert torch.isnan(got).any() and torch.isinf(got).any() and torch.isfinite(got).any()


# ---------------------------------------------------------------------------------------
# Properties


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_close_to_fp64_for_tame_inputs(dtype):
    x = rand((32, 1000), dtype, 21)
    w = rand((48, 1000), dtype, 22)
    exact = x.double() @ w.double().t()
    err = (R.chain(x, w.t()).double() - exact).abs().max()
    # Each of 63 blocks loses under 17 units of 2^(E-25) plus one fp32 ulp (RZ).
    assert err <= 63 * 2.0 ** -20 * (x.double().abs() @ w.double().abs().t()).max()
    assert err < 1e-5 * exact.abs().max()


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_exact_when_nothing_is_truncated(dtype):
    """Small integers: every product and partial sum is exact in fp32, as is the model."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-8, 9, (20, 300), generator=g).to(dtype)
    w = torch.randint(-8, 9, (30, 300), generator=g).to(dtype)
    exact = (x.double() @ w.double().t()).float()
    eq_bits(R.chain(x, w.t()), exact)
    # Equal exponents: powers of two 2^e times +-1, all the same e.
    x = (torch.randint(0, 2, (8, 64), generator=g) * 2 - 1).to(dtype) * 2.0 ** -3
    w = (torch.randint(0, 2, (9, 64), generator=g) * 2 - 1).to(dtype) * 2.0 ** 5
    eq_bits(R.chain(x, w.t()), (x.double() @ w.double().t()).float())


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_k_padding_changes_nothing(dtype):
    x = rand((9, 37), dtype, 31, 10 if dtype == BF16 else 4)
    w = rand((11, 37), dtype, 32, 10 if dtype == BF16 else 4)
    bias = rand((11,), dtype, 33)
    y = R.linear(x, w, bias)
    for extra in (1, 11, 27, 64):
        xp = torch.cat([x, torch.zeros(9, extra, dtype=dtype)], 1)
        wp = torch.cat([w, torch.zeros(11, extra, dtype=dtype)], 1)
        eq_bits(R.linear(xp, wp, bias), y)


def test_rows_are_independent_of_m():
    x = rand((70, 100), BF16, 41, 12)
    w = rand((24, 100), BF16, 42, 12)
    bias = rand((24,), BF16, 43)
    full = R.linear(x, w, bias)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(17, 70)):
        eq_bits(R.linear(x[rows], w, bias), full[rows])
    eq_bits(R.linear(x.reshape(7, 10, 100), w, bias), full.reshape(7, 10, 24))


def test_tiling_inside_the_model_changes_nothing(monkeypatch):
    x = rand((13, 50), FP16, 44, 5)
    w = rand((29, 50), FP16, 45, 5)
    y = R.chain(x, w.t())
    monkeypatch.setattr(R, "_TILE_ELEMS", 16 * 7)  # 7 columns x 1 row per tile
    eq_bits(R.chain(x, w.t()), y)


@pytest.mark.parametrize("out_dtype", [BF16, FP16, FP32])
def test_epilogue_is_one_fp32_add_then_one_rounding(out_dtype):
    x = rand((12, 70), BF16, 51, 6)
    w = rand((10, 70), BF16, 52, 6)
    bias = rand((10,), BF16, 53, 6)
    acc = R.chain(x, w.t())
    eq_bits(R.linear(x, w, bias, out_dtype), (acc + bias.float()).to(out_dtype))
    eq_bits(R.linear(x, w, None, out_dtype), acc.to(out_dtype))
    eq_bits(R.mm(x, w.t(), out_dtype), acc.to(out_dtype))
    eq_bits(R.addmm(bias, x, w.t(), out_dtype), (acc + bias.float()).to(out_dtype))


def test_epilogue_rounds_to_nearest_even_once():
    """1 + 2^-8 + 2^-9 (fp32) -> bf16 is 1 + 2^-7; rounding twice (via 1 + 2^-8) would tie."""
    x = torch.tensor([[1.0, 2.0 ** -8, 2.0 ** -9]], dtype=BF16)
    w = torch.ones((1, 3), dtype=BF16)
    assert R.chain(x, w.t()).item() == 1 + 2.0 ** -8 + 2.0 ** -9
    assert R.linear(x, w).item() == 1 + 2.0 ** -7
    # Bias joins in fp32: 2^-9 + 2^-9 lifts an exact tie (1 + 2^-8) above it.
    x = torch.tensor([[1.0, 2.0 ** -8]], dtype=BF16)
    w = torch.ones((2, 2), dtype=BF16)
    bias = torch.tensor([0.0, 2.0 ** -9], dtype=BF16)
    assert R.linear(x, w, bias).tolist() == [[1.0, 1 + 2.0 ** -7]]


def test_truncation_is_toward_zero_at_the_block_exponent():
    ones = torch.ones((1, 9), dtype=BF16)
    # Eight terms of 1.5 * 2^-26 beside 1.0: each is cut to 0 at unit 2^-25, so the sum
    # stays 1.0 (summed exactly first, they would reach 1 + 2^-23).
    x = torch.tensor([[1.0] + [1.5 * 2.0 ** -26] * 8], dtype=BF16)
    assert R.chain(x, ones.t()).item() == 1.0
    # Toward zero, not down: negative terms are cut to 0 too (floor would give 1 - 2^-22).
    x = torch.tensor([[1.0] + [-1.5 * 2.0 ** -26] * 8], dtype=BF16)
    assert R.chain(x, ones.t()).item() == 1.0
    # The block sum rounds toward zero: 1 + 0.75 ulp -> 1 (nearest would give 1 + ulp).
    x = torch.tensor([[1.0, 1.5 * 2.0 ** -24]], dtype=BF16)
    assert R.chain(x, ones[:, :2].t()).item() == 1.0
    assert R.chain(-x, ones[:, :2].t()).item() == -1.0


def test_nominal_exponent_ignores_the_product_carry():
    """1.5 * 1.5 = 2.25 has nominal exponent 0 (not 1): the unit stays 2^-25, and twelve
    terms of 1.5 * 2^-25 keep one unit each, adding up to one fp32 ulp of 2.25."""
    x = torch.tensor([[1.5] + [1.5 * 2.0 ** -25] * 12], dtype=BF16)
    w = torch.tensor([[1.5] + [1.0] * 12], dtype=BF16)
    assert R.chain(x, w.t()).item() == 2.25 + 2.0 ** -22  # with unit 2^-24: 2.25


def test_chain_continues_from_a_starting_accumulator():
    """dW += dY^T X: splitting K at multiples of 16 and carrying the fp32 value is exact."""
    a = rand((20, 96), BF16, 61, 10)
    b = rand((96, 12), BF16, 62, 10)
    whole = R.chain(a, b)
    part = R.chain(a[:, :32], b[:32])
    part = R.chain(a[:, 32:80], b[32:80], part)
    eq_bits(R.chain(a[:, 80:], b[80:], part), whole)
    eq_bits(R.chain(a, b, torch.zeros(20, 12)), whole)
    # Zero-padded tokens change nothing.
    eq_bits(R.chain(torch.zeros(20, 16, dtype=BF16), torch.zeros(16, 12, dtype=BF16), whole),
            whole)


def test_strides_do_not_matter():
    x = rand((40, 24), FP16, 71, 4).t()  # [24, 40] transposed view
    w = rand((30, 40), FP16, 72, 4)
    eq_bits(R.linear(x, w), R.linear(x.contiguous(), w))
    eq_bits(R.mm(x, w.t()), R.linear(x.contiguous(), w))
    eq_bits(R.linear(x[::2], w[:, :]), R.linear(x.contiguous()[::2], w))


def test_empty_rows():
    w = rand((5, 16), BF16, 73)
    assert R.linear(torch.zeros(0, 16, dtype=BF16), w).shape == (0, 5)
    assert R.linear(torch.zeros(2, 0, 16, dtype=BF16), w).shape == (2, 0, 5)


# ---------------------------------------------------------------------------------------
# Special values, zeros, overflow (model choices pending GPU confirmation; see docs)


def one(x_vals, w_vals, dtype=BF16, out=FP32, bias=None, model=None):
    x = torch.tensor([x_vals], dtype=dtype)
    w = torch.tensor([w_vals], dtype=dtype)
    b = None if bias is None else torch.tensor([bias], dtype=dtype)
    return R.linear(x, w, b, out, model=model)[0, 0]


def test_nan_and_inf_follow_ieee():
    nan, inf = math.nan, math.inf
    assert math.isnan(one([1.0, nan], [1.0, 1.0]))
    assert math.isnan(one([inf, 1.0], [0.0, 1.0]))  # Inf * 0
    assert math.isnan(one([inf, inf], [1.0, -1.0]))  # +Inf + -Inf
    assert math.isnan(one([inf] + [0.0] * 20 + [inf], [1.0] + [0.0] * 20 + [-1.0]))  # blocks
    assert one([inf, 5.0], [-2.0, 1.0]) == -inf
    assert one([inf, -inf], [inf, -inf]) == inf
    assert one([1.0, 2.0], [1.0, 1.0], bias=inf) == inf
    assert math.isnan(one([inf], [1.0], bias=-inf))
    assert math.isnan(one([1.0], [1.0], bias=nan))


def test_alignment_never_finer_than_2_to_the_minus_158():
    """A block whose products all lie far below fp32's normal range: E is at least -133,
    so a term below 2^-158 is cut away and the sum 2^-149 - 2^-170 lands on 2^-149 (the
    H100 does this: exact sums a hair below a subnormal step came back on the step)."""
    a, b = [2.0 ** -75, -(2.0 ** -85)], [2.0 ** -74, 2.0 ** -85]
    assert one(a, b) == 2.0 ** -149
    assert one(a, b, model=R.ChainModel(align_floor="none")) == 0.0
    # Normal-range blocks are untouched: the same two terms scaled by 2^100.
    assert one([2.0 ** 25, -(2.0 ** 15)], [2.0 ** -74, 2.0 ** -85]) == 2.0 ** -49 - 2.0 ** -70


def test_zeros_and_signs():
    z = one([-0.0, 0.0], [1.0, -1.0])
    assert z == 0 and math.copysign(1, z) == 1  # an exactly-zero chain is +0
    z = one([-0.0], [1.0], bias=-0.0, out=BF16)
    assert z == 0 and math.copysign(1, z) == 1  # +0 + -0 = +0 under round-to-nearest
    z = one([2.0, -2.0], [3.0, 3.0], bias=-0.0, out=FP16)
    assert z == 0 and math.copysign(1, z) == 1
    # A nonzero negative sum below 2^-149 becomes +0 (as measured), or -0 under IEEE.
    z = one([-(2.0 ** -75)], [2.0 ** -75])
    assert z == 0 and math.copysign(1, z) == 1
    z = one([-(2.0 ** -75)], [2.0 ** -75], model=R.ChainModel(underflow_sign="keep"))
    assert z == 0 and math.copysign(1, z) == -1
    # Below the alignment floor (2^-158) a lone term is cut to an exact zero: +0 either way.
    z = one([-(2.0 ** -80)], [2.0 ** -80], model=R.ChainModel(underflow_sign="keep"))
    assert z == 0 and math.copysign(1, z) == 1
    # Zero products do not raise E: 0 * 2^125 (nominal -1 if its exponent counted) would
    # cut the small term (bits 2^-40 .. 2^-54) to 0.
    small = (1 + 2.0 ** -7) ** 2 * 2.0 ** -40
    assert one([0.0, 2.0 ** -40 * (1 + 2.0 ** -7)], [2.0 ** 125, 1 + 2.0 ** -7]) == small


def test_overflow_gives_inf_and_model_can_say_saturate():
    big = 2.0 ** 100
    assert one([big], [big]) == math.inf
    assert one([-big, -big], [big, big]) == -math.inf
    sat = R.ChainModel(overflow="saturate")
    assert one([big], [big], model=sat) == MAX_FP32
    assert one([-big, -big], [big, big], model=sat) == -MAX_FP32
    # Below 2^128 the sum rounds toward zero: 2^128 - 2^103 (a tie for nearest) and
    # 2^128 - 2^102 (nearest: 2^128) both give the largest finite fp32.
    powers = [2.0 ** e for e in range(127, 102, -1)]  # 2^127 .. 2^103, two blocks
    assert sum(powers) == 2.0 ** 128 - 2.0 ** 103
    assert one([p / 2.0 ** 60 for p in powers], [2.0 ** 60] * 25) == MAX_FP32
    assert one([p / 2.0 ** 60 for p in powers + [2.0 ** 102]], [2.0 ** 60] * 26) == MAX_FP32
    pad = [0.0] * 16  # the next term lands in the next K-block
    # An infinite accumulator absorbs later finite sums, however large ...
    assert one([big] + pad + [big], [big] + pad + [-big]) == math.inf
    # ... but not an opposite infinity; and an Inf product absorbs a later overflow.
    assert math.isnan(one([big] + pad + [-math.inf], [big] + pad + [1.0]))
    assert one([-math.inf] + pad + [big], [1.0] + pad + [big]) == -math.inf
    assert one([-math.inf] + pad + [big], [1.0] + pad + [big], model=sat) == -math.inf
    assert one([big], [big], out=BF16, model=sat) == math.inf  # the output rounding: RNE
    assert one([2.0 ** 9, 2.0 ** 9], [2.0 ** 7, 1.0], out=FP16) == math.inf


def test_subnormal_input_choices_are_distinguishable():
    """One block where a subnormal product sets E: the three readings differ."""
    tiny = 2.0 ** -133  # smallest bf16 subnormal: nominal -126 ("emin") or -133 ("exact")
    x, w = [tiny, 1.0 + 2.0 ** -7], [2.0 ** 100, 2.0 ** -40 * (1 + 2.0 ** -7)]
    got = {name: one(x, w, model=m).item()
           for name, m in R.MODEL.variants("subnormal_inputs").items()}
    small = (1 + 2.0 ** -7) ** 2 * 2.0 ** -40
    assert got["flush"] == small
    assert got["exact"] == 2.0 ** -33 + small  # all bits fit: E=-33, unit 2^-58
    assert got["emin"] == 2.0 ** -33 + math.floor(small / 2.0 ** -51) * 2.0 ** -51
    assert len(set(got.values())) == 3


def test_model_is_validated():
    with pytest.raises(ValueError, match="overflow"):
        R.ChainModel(overflow="wrap")
    with pytest.raises(TypeError, match="model"):
        R.chain(torch.ones(1, 1, dtype=BF16), torch.ones(1, 1, dtype=BF16), model="emin")


# ---------------------------------------------------------------------------------------
# Input checking


def test_bad_inputs_name_the_argument():
    x = torch.ones(2, 4, dtype=BF16)
    w = torch.ones(3, 4, dtype=BF16)
    with pytest.raises(TypeError, match="weight"):
        R.linear(x, w.half())
    with pytest.raises(TypeError, match="input"):
        R.linear(x.double(), w.double())
    with pytest.raises(ValueError, match="K mismatch"):
        R.linear(x, torch.ones(3, 5, dtype=BF16))
    with pytest.raises(ValueError, match="bias"):
        R.linear(x, w, torch.ones(4, dtype=BF16))
    with pytest.raises(TypeError, match="bias"):
        R.linear(x, w, torch.ones(3))
    with pytest.raises(TypeError, match="out_dtype"):
        R.linear(x, w, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="input"):
        R.linear([1.0], w)
    with pytest.raises(ValueError, match="b"):
        R.mm(x, torch.ones(4, dtype=BF16))
    with pytest.raises(TypeError, match="acc"):
        R.chain(x, w.t(), torch.zeros(2, 3, dtype=FP16))
    with pytest.raises(ValueError, match="acc"):
        R.chain(x, w.t(), torch.zeros(3, 2))
    with pytest.raises(TypeError, match="bias"):
        R.addmm(None, x, w.t())


# ---------------------------------------------------------------------------------------
# verify()


def test_verify_accepts_the_reference_and_finds_a_flipped_bit():
    x = rand((2, 5, 48), BF16, 81, 8)
    w = rand((16, 48), BF16, 82, 8)
    bias = rand((16,), BF16, 83)
    y = R.linear(x, w, bias)
    r = R.verify(x, w, y, bias)
    assert r.ok and bool(r) and r.checked == 160 and r.mismatches == 0
    assert "ok" in str(r)
    bad = y.clone()
    flat = bad.view(torch.int16).view(-1)
    flat[77] ^= 1  # the last significand bit of one output
    r = R.verify(x, w, bad, bias)
    assert not r.ok and r.mismatches == 1 and r.first_index == (0, 4, 13)
    want = int(y.view(torch.int16).view(-1)[77]) & 0xFFFF
    assert r.expected == f"0x{want:04x}" and r.got == f"0x{want ^ 1:04x}"
    assert "MISMATCH" in str(r) and "(0, 4, 13)" in str(r)
    # fp32 results, and a result that lost its bias.
    y32 = R.linear(x, w, bias, FP32)
    assert R.verify(x, w, y32, bias).ok
    assert not R.verify(x, w, y32, None).ok
    with pytest.raises(ValueError, match="shape"):
        R.verify(x, w, y[:, :3], bias)


def test_bits_canonicalises_nan_only():
    t = torch.tensor([math.nan, -math.nan, 0.0, -0.0, 1.0], dtype=FP32)
    t[1] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(FP32)
    b = R.bits(t)
    assert b[0] == b[1] == 0x7FC00000 and b[2] == 0 and b[3] == 0x80000000
    assert R.same_bits(t, t.clone()) and not R.same_bits(t, t.abs())


# ---------------------------------------------------------------------------------------
# Golden GPU bits


def _golden_files():
    return sorted(glob.glob(os.path.join(HERE, "golden", "*.json")))


def _make_golden_module():
    spec = importlib.util.spec_from_file_location(
        "make_golden_under_test", os.path.join(HERE, "golden", "make_golden.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_golden_problem_recipes_build():
    """The recipes make what they promise (zeros, subnormals, specials) on any machine."""
    mg = _make_golden_module()
    problems = mg.PROBLEMS + mg.TF32_PROBLEMS + mg.IEEE_PROBLEMS
    names = [p["name"] for p in problems]
    assert len(names) == len(set(names))
    for p in problems:
        x, w, bias = mg.make_inputs(p)
        assert x.shape == (p["M"], p["K"]) and w.shape == (p["N"], p["K"])
        assert (bias is None) == (not p["bias"])
        has_special = not (torch.isfinite(x).all() and torch.isfinite(w).all()
                           and (bias is None or torch.isfinite(bias).all()))
        assert has_special == ("special" in p["tags"] and "overflow" not in p["tags"])
        if p["recipe"].get("x_subnormals"):
            assert ((x != 0) & (x.abs() < torch.finfo(x.dtype).tiny)).any()


@pytest.mark.skipif(not _golden_files(),
                    reason="no tests/golden/*.json yet: record one on a GPU with "
                           "`python tests/golden/make_golden.py --out tests/golden`")
@pytest.mark.parametrize("path", _golden_files(), ids=os.path.basename)
def test_golden_gpu_bits_are_reproduced(path):
    mg = _make_golden_module()
    with open(path) as f:
        doc = json.load(f)
    assert doc["format"] == mg.FORMAT
    failures, checked = [], 0
    for p in doc["problems"]:
        x, w, bias = mg.make_inputs(p)
        if mg.input_hash(x, w, bias) != p["input_sha"]:
            failures.append(f"{p['name']}: inputs regenerate differently (torch's CPU "
                            f"generator changed?); the golden file cannot be checked")
            continue
        with mg.precision_of(p):
            y = R.linear(x, w, bias, mg.DTYPES[p["out_dtype"]])
        checked += y.numel()
        rows = mg.row_hashes(y)
        bad = [i for i, (a, b) in enumerate(zip(rows, p["row_sha"])) if a != b]
        if bad:
            failures.append(f"{p['name']} {p['tags']}: {len(bad)} of {len(rows)} rows differ "
                            f"(first row {bad[0]})")
        if "full_hex" in p and not torch.equal(
                mg.hex_to_canonical(p["full_hex"], y.dtype), R.bits(y)):
            failures.append(f"{p['name']}: full output differs")
    assert not failures, (f"{doc['gpu']} / torch {doc['torch']}: "
                          + "; ".join(failures))
    assert checked > 0
