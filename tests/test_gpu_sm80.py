"""SM80 kernels (cp.async + ldmatrix + mma.sync) on the GPU, compiled directly through
`compile.build` (no dispatch, no op layer).

What is checked, on any GPU from sm_80 up (built for `compile.gpu_arch_for("sm80", cap)`):
- values against an fp64 reference, for every operand layout the op layer passes in place
  (A K- or M-major; B as [N, K] or [K, N], either dim contiguous), bias, bf16/fp16/fp32 out,
  and ``accumulate`` (dW +=) from random fp32 values;
- nothing is read past an operand's end (padding around every operand is NaN, and a NaN read
  past K would poison the products) and nothing is written past M or N (the output's padding
  keeps its NaN bits); outputs start as NaN, so an element never written shows up;
- every tile shape gives the same bits, and each row's bits do not depend on M;
- the bits equal the CPU model of the chain (`reference`) on small problems.
On an H100 (capability 9.0) also: the bits equal the SM90 (TMA + WGMMA) kernel's, which is the
claim that both families compute one chain (`same bits as SM90` tests).

Run on the GPU machine:  python3 -m pytest -q tests/test_gpu_sm80.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU", allow_module_level=True)

from gpu_helpers import bits, poison, same_bits  # noqa: E402,F401
from detgemm_cute import compile as kcompile  # noqa: E402
from detgemm_cute import reference, registry  # noqa: E402

DEV = "cuda"
CAP = torch.cuda.get_device_capability()
ARCH80 = kcompile.gpu_arch_for("sm80", CAP)
HAS_SM90 = CAP == (9, 0)
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}

SHAPES = [(1, 4096, 4096), (100, 520, 776), (257, 1001, 7), (1000, 3072, 768), (64, 9, 100),
          (3, 17, 33)]
LAYOUTS = [(a, bf, bc) for a in ("k", "m") for bf in ("nk", "kn") for bc in ("last", "first")]
TILE80 = ((128, 128, 32), 4)
TILE90 = ((128, 128, 64), 4)
# Every tile shape the kernel supports (3 stages), then the built-in table's (tile, stages).
ALL_TILES80 = [((bm, bn, bk), 3) for bm in (64, 128) for bn in (16, 32, 64, 128, 256)
               for bk in (32, 64)]
ALL_TILES80 += sorted({(b.tile, b.stages) for b in registry.get_registry("sm80").buckets}
                      - set(ALL_TILES80))

_fns: dict = {}


def kernel(family, tile, stages, dtype, out_dtype, a_major, b_form, b_contig, bias,
           accumulate=False):
    key = kcompile.KernelKey(
        tile=tile, cluster=(1, 1), stages=stages, persistent=False, dtype=NAMES[dtype],
        out_dtype=NAMES[out_dtype], a_major=a_major, b_form=b_form, b_contig=b_contig,
        has_bias=bias, arch=ARCH80 if family == "sm80" else "sm_90a", accumulate=accumulate)
    if key not in _fns:
        _fns[key] = kcompile.build(key)
    return _fns[key]


# ------------------------------------------------------------------------------ helpers

def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _pad8(n):
    return -(-n // 8) * 8


def padded(rows, cols, dtype, g, values=None):
    """A [rows, cols] row-major view into a NaN-filled [rows + 1, pad8(cols) + 8] buffer:
    strides are multiples of 8 elements, and every element around the view is NaN."""
    buf = torch.full((rows + 1, _pad8(cols) + 8), float("nan"), device=DEV, dtype=dtype)
    view = buf[:rows, :cols]
    view.copy_(values if values is not None else
               torch.randn(rows, cols, device=DEV, generator=g).to(dtype))
    return view, buf


def operands(m, n, k, dtype, a_major, b_form, b_contig, seed=0):
    """A [M, K] and B ([N, K] or [K, N]) in the requested memory orders, surrounded by NaN;
    also returns the plain (A, B as [N, K]) values for references."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    a_val = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    b_val = torch.randn(n, k, device=DEV, generator=g).to(dtype)  # [N, K]
    a = padded(m, k, dtype, g, a_val)[0] if a_major == "k" else padded(k, m, dtype, g,
                                                                        a_val.t())[0].t()
    b_given = b_val if b_form == "nk" else b_val.t()  # the shape the kernel is handed
    r, c = b_given.shape
    b = padded(r, c, dtype, g, b_given)[0] if b_contig == "last" else padded(
        c, r, dtype, g, b_given.t())[0].t()
    assert a.shape == (m, k) and b.shape == b_given.shape
    return a, b, a_val, b_val


def run(fn, a, b, n, out_dtype, bias=None, acc=None, strict=True):
    """Call a compiled kernel into a NaN-padded output; check nothing was written outside
    [M, N] (`strict`; else only past the row's 16-byte padding, pad8(N) columns: the SM90
    kernel's TMA store may fill that padding, which the op layer allocates for it)."""
    m = a.shape[0]
    if acc is not None:
        c, buf = padded(m, n, torch.float32, None, acc)
    else:
        poison()
        buf = torch.full((m + 1, _pad8(n) + 8), float("nan"), device=DEV, dtype=out_dtype)
        c = buf[:m, :n]
    fn(a, b, c, bias, 132)
    torch.cuda.synchronize()
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[:m, :n if strict else _pad8(n)] = False
    assert torch.isnan(buf[outside]).all(), "the kernel wrote outside [M, N]"
    return c.clone()


# -------------------------------------------------------------------------------- tests

CASES = ([(torch.bfloat16, lay, torch.bfloat16, True) for lay in LAYOUTS]
         + [(torch.bfloat16, lay, torch.float32, False) for lay in LAYOUTS]
         + [(torch.float16, ("k", "nk", "last"), torch.float16, True),
            (torch.float16, ("k", "kn", "last"), torch.float16, False),
            (torch.float16, ("m", "kn", "first"), torch.float32, False),
            (torch.float16, ("m", "nk", "first"), torch.float16, True)])


@pytest.mark.parametrize("dtype, layout, out_dtype, has_bias", CASES,
                         ids=[f"{NAMES[d]}-A{l[0]}-B{l[1]}{l[2]}-{NAMES[o]}{'-bias' * b}"
                              for d, l, o, b in CASES])
def test_values_and_same_bits_as_sm90(dtype, layout, out_dtype, has_bias):
    fn80 = kernel("sm80", *TILE80, dtype, out_dtype, *layout, has_bias)
    fn90 = kernel("sm90", *TILE90, dtype, out_dtype, *layout, has_bias) if HAS_SM90 else None
    for m, n, k in SHAPES:
        a, b, a_val, b_val = operands(m, n, k, dtype, *layout, seed=m + n + k)
        bias = torch.randn(n, device=DEV).to(dtype) if has_bias else None
        y = run(fn80, a, b, n, out_dtype, bias)
        assert not torch.isnan(y).any(), (m, n, k)
        ref = a_val.double() @ b_val.double().t()
        if bias is not None:
            ref = ref + bias.double()
        assert rel_err(y, ref) < TOL[out_dtype], (m, n, k)
        if fn90 is not None:
            y90 = run(fn90, a, b, n, out_dtype, bias, strict=False)
            assert same_bits(y, y90), f"bits differ from SM90 at M={m} N={n} K={k}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", [("m", "kn", "last"), ("m", "nk", "last"),
                                    ("k", "kn", "first"), ("k", "nk", "last")])
def test_accumulate_continues_the_chain(dtype, layout):
    """dW += dY^T X: starting from random fp32 values in C; equals SM90's bits, and two calls
    over K halves split at a multiple of 16 equal one call over the whole K."""
    fn80 = kernel("sm80", *TILE80, dtype, torch.float32, *layout, False, accumulate=True)
    fn90 = (kernel("sm90", *TILE90, dtype, torch.float32, *layout, False, accumulate=True)
            if HAS_SM90 else None)
    for m, n, k in [(64, 9, 100), (257, 1001, 96), (768, 520, 1024), (1, 16, 7)]:
        a, b, a_val, b_val = operands(m, n, k, dtype, *layout, seed=7 * m + k)
        c0 = torch.randn(m, n, device=DEV)
        y = run(fn80, a, b, n, None, acc=c0)
        ref = c0.double() + a_val.double() @ b_val.double().t()
        assert not torch.isnan(y).any() and rel_err(y, ref) < TOL[torch.float32], (m, n, k)
        if fn90 is not None:
            assert same_bits(y, run(fn90, a, b, n, None, acc=c0, strict=False)), (m, n, k)
        if k >= 32:
            h = (k // 32) * 16  # split at a multiple of 16
            a1, b1, _, _ = operands_from(a_val[:, :h], b_val[:, :h], *layout)
            a2, b2, _, _ = operands_from(a_val[:, h:], b_val[:, h:], *layout)
            y1 = run(fn80, a1, b1, n, None, acc=c0)
            y2 = run(fn80, a2, b2, n, None, acc=y1)
            assert same_bits(y2, y), (m, n, k)


def operands_from(a_val, b_val, a_major, b_form, b_contig):
    """Like `operands`, from given values (A [M, K], B [N, K])."""
    m, k = a_val.shape
    n = b_val.shape[0]
    dtype = a_val.dtype
    a = padded(m, k, dtype, None, a_val)[0] if a_major == "k" else padded(
        k, m, dtype, None, a_val.t())[0].t()
    b_given = b_val if b_form == "nk" else b_val.t()
    r, c = b_given.shape
    b = padded(r, c, dtype, None, b_given)[0] if b_contig == "last" else padded(
        c, r, dtype, None, b_given.t())[0].t()
    return a, b, a_val, b_val


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_tile_gives_the_same_bits(dtype):
    """Tiles trade speed only: every supported tile shape and every (tile, stages) of the
    built-in table give the same bits (and SM90's)."""
    layout = ("k", "nk", "last")
    cases = [(m, n, k) for m, n, k in [(1, 4096, 4096), (100, 520, 776), (257, 1001, 7),
                                       (129, 300, 70)]]
    data = []
    for m, n, k in cases:
        a, b, _, _ = operands(m, n, k, dtype, *layout, seed=m * k)
        data.append((a, b, n, torch.randn(n, device=DEV).to(dtype)))
    first = None
    for tile, stages in ALL_TILES80:
        fn = kernel("sm80", tile, stages, dtype, dtype, *layout, True)
        ys = [run(fn, a, b, n, dtype, bias) for a, b, n, bias in data]
        if first is None:
            first = ys
            if HAS_SM90:
                fn90 = kernel("sm90", *TILE90, dtype, dtype, *layout, True)
                for y, (a, b, n, bias) in zip(ys, data):
                    assert same_bits(y, run(fn90, a, b, n, dtype, bias, strict=False))
        else:
            for y, y0, (m, n, k) in zip(ys, first, cases):
                assert same_bits(y, y0), f"tile {tile}: bits differ at M={m} N={n} K={k}"


@pytest.mark.parametrize("tile", [((128, 128, 32), 4), ((64, 16, 64), 4), ((64, 256, 32), 3)])
def test_rows_do_not_depend_on_m(tile):
    """Batch invariance: row i alone gives the bits row i gets inside a batch of 1000."""
    dtype = torch.bfloat16
    fn = kernel("sm80", *tile, dtype, dtype, "k", "nk", "last", True)
    a, b, _, _ = operands(1000, 1536, 1000, dtype, "k", "nk", "last", seed=3)
    bias = torch.randn(1536, device=DEV).to(dtype)
    y = run(fn, a, b, 1536, dtype, bias)
    for lo, hi in [(0, 1), (17, 18), (999, 1000), (5, 70), (128, 257)]:
        assert same_bits(run(fn, a[lo:hi], b, 1536, dtype, bias), y[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bits_match_the_cpu_chain_model(dtype):
    """The CPU model of the ascending 16-wide chain (`reference`, docs/reference.md) predicts
    the SM80 kernel's bits, bias and rounding included."""
    fn = kernel("sm80", *TILE80, dtype, dtype, "k", "nk", "last", True)
    fn32 = kernel("sm80", *TILE80, dtype, torch.float32, "k", "nk", "last", False)
    for m, n, k in [(64, 9, 100), (3, 17, 33), (70, 130, 7), (33, 65, 1000)]:
        a, b, a_val, b_val = operands(m, n, k, dtype, "k", "nk", "last", seed=m + k)
        bias = torch.randn(n, device=DEV).to(dtype)
        y = run(fn, a, b, n, dtype, bias)
        assert reference.same_bits(y, reference.linear(a_val, b_val, bias)), (m, n, k)
        y32 = run(fn32, a, b, n, torch.float32)
        assert reference.same_bits(y32, reference.linear(a_val, b_val, None,
                                                         out_dtype=torch.float32)), (m, n, k)
