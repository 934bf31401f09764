"""The kernels' tensor needs (`detgemm_cute.kernels.tensor_needs`) against what a launch
checks, on the CPU.

TVM-FFI checks every launch's tensors against the fake tensors the kernel was compiled
with (base alignment; per dim of more than one entry, the stride: equal to a constant or a
multiple of a symbol's divisibility) and raises ``ValueError('Misaligned Tensor data ...')``
otherwise. `launch_accepts` below is that check. It proves:
- for every need and dtype, a tensor the need accepts (`Need.meets`) is accepted by the
  fake tensor built from the same need (random strides, offsets and shapes);
- the fp32 split's staging (`split.scaled_operand_cuda`, `split.exact_operand_cuda`) hands
  its kernel tensors the kernel's fakes accept, at the shapes where an fp32 operand at an
  odd storage offset or inside a wider buffer crashed on an H100, and with the bits of the
  PyTorch split (the kernel is emulated by the PyTorch version of the same split)."""

import random

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")
import cutlass  # noqa: E402

from detgemm_cute import split  # noqa: E402
from detgemm_cute.kernels import tensor_needs as needs  # noqa: E402

NEEDS = {name: getattr(needs, name) for name in needs.__all__
         if isinstance(getattr(needs, name), needs.Need)}
NEEDS.update({"a_rows": needs.a_rows(), "a_rows_batch": needs.a_rows(True),
              "c_direct": needs.c_direct(False), "c_direct_swapped": needs.c_direct(True),
              "c_direct_batch": needs.c_direct(False, True),
              "c_direct_batch_swapped": needs.c_direct(True, True)})
NEEDS.update({f"c_direct_{align}B{'_batch' if b else ''}{'_swapped' if sw else ''}":
              needs.c_direct(sw, b, align)
              for align in (0, 8) for b in (False, True) for sw in (False, True)})
CUTLASS = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
           torch.float32: cutlass.Float32, torch.int16: cutlass.Int16,
           torch.int32: cutlass.Int32}


def spec(fake_tensor):
    """(alignment, per-dim stride rule) of a fake tensor: an int stride, or ("div", d)."""
    rules = [s if isinstance(s, int) else ("div", s.divisibility) for s in fake_tensor.stride]
    return fake_tensor._assumed_align, rules


def launch_accepts(fake_spec, t) -> bool:
    """TVM-FFI's launch-time check of tensor `t` against a fake tensor's spec."""
    align, rules = fake_spec
    if t.dim() != len(rules) or t.data_ptr() % align:
        return False
    for rule, size, stride in zip(rules, t.shape, t.stride()):
        if size == 1:
            continue
        if isinstance(rule, int) and stride != rule:
            return False
        if not isinstance(rule, int) and stride % rule[1]:
            return False
    return True


def random_view(rng, dtype, dims):
    """A view of a fresh buffer with random shape (1..6 per dim), strides (0, 1, small, odd,
    aligned) and storage offset (0..7 elements)."""
    shape = [rng.choice((1, 1, 2, 3, 5, 6)) for _ in range(dims)]
    strides = [rng.choice((0, 1, 1, 1, 2, 3, 4, 8, 8, 16, 16, 24, 40, 77)) for _ in range(dims)]
    offset = rng.choice((0, 0, 0, 0, 1, 2, 3, 4, 8))
    span = offset + sum((s - 1) * st for s, st in zip(shape, strides)) + 1
    return torch.zeros(span + 64, dtype=dtype).as_strided(shape, strides, offset)


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_a_tensor_the_need_accepts_passes_the_launch_check(name):
    need = NEEDS[name]
    dims = len(need.strides)
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    if name == "OFFS":
        dtypes = [torch.int32]
    elif name.startswith("COPY_ROWS"):
        dtypes = [torch.int16]
    elif name.startswith(("TRANSPOSE", "SPLIT_SCALES", "SPLIT_ROWS")):
        dtypes = [torch.float32]
    rng = random.Random(name)
    accepted = 0
    for dtype in dtypes:
        shape = tuple(cute.sym_int() for _ in range(dims))
        fake_spec = spec(needs.fake(CUTLASS[dtype], shape, need))
        for _ in range(1000):
            t = random_view(rng, dtype, dims)
            if need.meets(t):
                accepted += 1
                assert launch_accepts(fake_spec, t), (name, dtype, t.shape, t.stride(),
                                                      t.storage_offset())
    assert accepted > 20  # the check is not vacuous


def test_a_tma_need_is_strict_on_single_entry_dims():
    """TMA descriptors encode every stride, so a [1, K] row of an odd pitch is staged even
    though the launch's own check would pass it."""
    row = torch.zeros(3, 7, dtype=torch.bfloat16)[:1]  # stride (7, 1): 14 bytes
    assert not needs.TMA_K_LAST.meets(row)
    assert needs.tma_unit_dim(row) is None
    assert needs.tma_unit_dim(torch.zeros(1, 8, dtype=torch.bfloat16)) == "last"


def test_rows_sharing_memory_are_staged_for_tma():
    """An expanded operand (row or batch stride 0) is not read in place by TMA."""
    row = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert needs.tma_unit_dim(row.expand(5, 64)) is None
    assert needs.tma_unit_dim(torch.zeros(1, 8, 64, dtype=torch.bfloat16).expand(3, 8, 64)) \
        is None
    assert needs.tma_unit_dim(torch.zeros(1, 8, 64, dtype=torch.bfloat16)) == "last"
    assert needs.SPLIT_ROWS.meets(torch.zeros(1, 64).expand(5, 64))  # plain loads: fine


def test_conform_copies_what_contiguous_would_keep():
    """An already contiguous view at an odd offset: ``contiguous()`` returns it unchanged
    (misaligned); `conform` copies it into aligned memory."""
    buf = torch.randn(1 + 19 * 128)
    x = buf[1:].view(19, 128)
    assert x.is_contiguous() and x.contiguous().data_ptr() % 16
    y = needs.conform(x, needs.SPLIT_ROWS)
    assert needs.SPLIT_ROWS.meets(y) and y.data_ptr() % 16 == 0 and torch.equal(x, y)
    assert needs.conform(y, needs.SPLIT_ROWS) is y


# ---------------------------------------------------------------------------------------
# The fp32 split's staging against its kernels' fakes, the kernels emulated on the CPU.

def _emulated_split_kernel(compiled_args):
    """A stand-in for a compiled split kernel: checks each tensor as TVM-FFI would against
    the fake it was compiled with, then writes the PyTorch split's values."""
    fakes = [a for a in compiled_args if hasattr(a, "_assumed_align")]

    def launch(*tensors):
        for i, (fake_tensor, t) in enumerate(zip(fakes, tensors)):
            if not launch_accepts(spec(fake_tensor), t):
                raise ValueError(f"Misaligned Tensor data on argument #{i} (shape "
                                 f"{tuple(t.shape)}, strides {t.stride()}, offset "
                                 f"{t.storage_offset()})")
        x4, out = tensors[0], tensors[-1]
        rows, blocks, quads, _ = x4.shape
        x = x4.reshape(rows, blocks * quads * 4)
        side = launch.side
        if len(tensors) == 3:  # scaled: X, S, out
            scale = split.row_scales(x)
            tensors[1].copy_(scale)
            out.copy_(split.operand(x, scale, side).view(out.shape))
        else:
            out.copy_(split.exact_operand(x, side).view(out.shape))

    return launch


@pytest.fixture
def emulated_split(monkeypatch):
    compiled = {}

    def fake_compile(kernel, *args, **kwargs):
        return args

    def kernel(scheme, side, device):
        if (scheme, side) not in compiled:
            with monkeypatch.context() as m:
                m.setattr(cute, "compile", fake_compile)
                args = split._compile_kernel(scheme, side, "sm_90")
            compiled[(scheme, side)] = _emulated_split_kernel(args)
        fn = compiled[(scheme, side)]
        fn.side = side
        return fn

    monkeypatch.setattr(split, "_kernel", kernel)
    monkeypatch.setattr(split, "_kernels_on", lambda: True)


def _placed(m, k, where, g):
    """fp32 [m, k] values at an odd storage offset, inside a wider buffer, or as a single
    misaligned row's transpose."""
    x = torch.randn(m, k, generator=g)
    if where == "offset":
        buf = torch.empty(1 + m * k)
        out = buf[1:].view(m, k)
    elif where == "wider":
        out = torch.empty(m, k + 3)[:, 1:k + 1]
    else:  # "sliced": rows of a wider buffer, then a column window at an odd element
        out = torch.empty(m + 2, k + 5)[1:m + 1, 3:k + 3]
    out.copy_(x)
    return out


# (M, K, N) where fp32 "ieee" linear crashed on an H100 (issue: misaligned split operand)
CRASH_SHAPES = [(101, 160, 5), (19, 640, 1), (19, 128, 1), (37, 64, 39), (29, 1344, 8)]


@pytest.mark.parametrize("m,k,n", CRASH_SHAPES)
@pytest.mark.parametrize("where", ["offset", "wider", "sliced"])
def test_split_staging_meets_its_kernel_at_the_crash_shapes(emulated_split, m, k, n, where):
    g = torch.Generator().manual_seed(m * 31 + k + n)
    x, w = _placed(m, k, where, g), _placed(n, k, where, g)
    assert x.data_ptr() % 16 or w.data_ptr() % 16 or where != "offset"
    for t, side in ((x, "a"), (w, "b")):
        parts, scale = split.scaled_operand_cuda(t, side)
        want_scale = split.row_scales(t.contiguous())
        assert torch.equal(scale, want_scale)
        assert torch.equal(parts, split.operand(t.contiguous(), want_scale, side))
        # dW's exact parts: the same staging (a row of tokens, a transposed view, ...)
        assert torch.equal(split.exact_operand_cuda(t, side),
                           split.exact_operand(t.contiguous(), side))


def test_split_staging_of_a_single_misaligned_row(emulated_split):
    """dW at N = 1 reads dY^T as a [1, T] row: contiguous, and misaligned at an odd offset."""
    dy = torch.empty(1 + 64)[1:].view(64, 1).copy_(torch.randn(64, 1))
    row = dy.t()
    assert row.is_contiguous() and row.data_ptr() % 16
    assert torch.equal(split.exact_operand_cuda(row, "a"), split.exact_operand(row, "a"))
    parts, _ = split.scaled_operand_cuda(row, "a")
    assert torch.equal(parts, split.operand(row, split.row_scales(row), "a"))


# The in-place split of a weight whose reduction runs down its columns (dX's W), emulated.

def _compiled_args(monkeypatch, scheme, side):
    """What `split._compile_kernel(scheme, side)` compiles its kernel with: the fake tensors
    (None where the kernel takes no tensor), then the stream."""
    with monkeypatch.context() as m:
        m.setattr(cute, "compile", lambda kernel, *args, **kwargs: args)
        return split._compile_kernel(scheme, side, "sm_90")


def _check_launch(args, tensors):
    """TVM-FFI's check at a launch: each tensor against the fake it was compiled with."""
    for i, (fake_tensor, t) in enumerate(zip(args, tensors)):
        if fake_tensor is None:
            assert t is None, f"argument #{i}: a tensor where the kernel takes none"
        elif not launch_accepts(spec(fake_tensor), t):
            raise ValueError(f"Misaligned Tensor data on argument #{i}")


def _emulate(monkeypatch, scheme, compute):
    """`split._kernel(scheme, ...)` as a CPU stand-in: each launch checks its tensors against
    the fakes its kernel was compiled with (`_check_launch`), then `compute(side, *tensors)`
    writes what the kernel would, with PyTorch."""
    def kernel(got, side, device):
        assert got == scheme
        args = _compiled_args(monkeypatch, scheme, side)

        def launch(*tensors):
            _check_launch(args, tensors)
            compute(side, *tensors)
        return launch

    monkeypatch.setattr(split, "_kernel", kernel)
    monkeypatch.setattr(split, "_kernels_on", lambda: True)


def _columns_step(step, w3, top, *rest):
    """What `kernels.split_columns`' maxima ("max") or split ("b") kernel writes."""
    w = w3.reshape(w3.shape[0], -1)
    if step == "max":
        bits = w.view(torch.int32) & 0x7FFFFFFF
        top.view(-1).copy_(torch.maximum(top.view(-1), bits.amax(dim=0)))
        return
    # the scales from the maxima step's `top`, by the kernel's exponent rule
    parts, scales = rest
    e = (split.TOP_EXP + 254 - (top.view(-1) >> 23)).clamp(1, 254)
    s = (e << 23).view(torch.float32)
    scales.view(-1).copy_(s)
    parts.copy_(split.operand(w.t(), s, "b").t().reshape(parts.shape))


@pytest.fixture
def emulated_columns(monkeypatch):
    """The in-place column split's two kernels, emulated (`_emulate`)."""
    _emulate(monkeypatch, "columns", _columns_step)


@pytest.mark.parametrize("r,c", [(40, 8), (300, 264), (1, 32)])
@pytest.mark.parametrize("where", ["plain", "sliced"])
def test_column_split_staging_meets_its_kernels(emulated_columns, r, c, where):
    """W [R, C] split in place: the launch tensors meet the fakes, the column maxima and the
    exponent rule give `split.row_scales` of W^T, and the parts are the transpose of the
    split of W^T (zero rows up to a multiple of 32)."""
    g = torch.Generator().manual_seed(r + c)
    w = torch.randn(r, c, generator=g) * torch.exp2(torch.randint(-30, 31, (c,), generator=g))
    w[0, 0] = float("nan")  # a NaN's bits dominate its column's maximum
    if where == "sliced":  # rows of a wider buffer, 16-byte aligned
        w = torch.empty(r + 1, c + 4)[1:, 4:].copy_(w)
    assert split.columns_apply(w)
    parts, scale = split.scaled_columns_cuda(w)
    want_s = split.row_scales(w.t().contiguous())
    assert torch.equal(scale, want_s)
    assert torch.equal(parts.t().view(torch.int16),
                       split.operand(w.t().contiguous(), want_s, "b").view(torch.int16))
    assert not split.columns_apply(torch.randn(r, c + 4)[:, 1:c + 1])  # misaligned rows
    assert not split.columns_apply(torch.randn(r, 12))  # parts rows not 16 bytes


# The fp32 tier's last step in one kernel (unscale, bias, rounding), emulated.

def _unscale_step(side, c4, sa, sb4, b4, o4):
    """What `kernels.unscale.UnscaleFp32` writes: `split.finish`'s PyTorch ops."""
    y = split.unscale(c4.reshape(c4.shape[0], -1), sa, sb4.reshape(-1))
    if b4 is not None:
        y = y + b4.reshape(-1)
    o4.copy_(y.to(o4.dtype).view(o4.shape))


@pytest.fixture
def emulated_unscale(monkeypatch):
    """The one-kernel last step of the fp32 tier, emulated (`_emulate`)."""
    _emulate(monkeypatch, "unscale", _unscale_step)


@pytest.mark.parametrize("m,n", [(1, 4), (5, 264), (33, 1000)])
@pytest.mark.parametrize("where", ["plain", "wider"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unscale_staging_meets_its_kernel(emulated_unscale, m, n, where, out_dtype):
    """`split.unscale_cuda` hands its kernel tensors the fakes accept (an accumulator inside
    a wider buffer, one row, a bias at an odd offset: copied), in the shapes and dtypes the
    kernel writes (the values are the emulation's: the kernel's own bits are
    test_gpu_fp32.py's); `unscale_applies` refuses what the kernel cannot read."""
    g = torch.Generator().manual_seed(m * 7 + n)
    acc = torch.randn(m, n, generator=g)
    if where == "wider":  # rows of a wider buffer, 16-byte aligned
        acc = torch.empty(m, n + 8)[:, 4:n + 4].copy_(acc)
    sa = torch.exp2(torch.randint(-20, 21, (m,), generator=g).float())
    sb = torch.exp2(torch.randint(-20, 21, (n,), generator=g).float())
    bias = torch.empty(n + 1)[1:].copy_(torch.randn(n, generator=g))  # an odd offset
    assert split.unscale_applies(acc, out_dtype)
    for b in (None, bias):
        want = split.unscale(acc, sa, sb) + (0 if b is None else b)
        got = split.unscale_cuda(acc, sa, sb, b, out_dtype)
        assert got.dtype == out_dtype and got.is_contiguous()
        assert torch.equal(got, want.to(out_dtype))
    assert not split.unscale_applies(torch.randn(m, n + 2), out_dtype)  # N not a multiple of 4
    assert not split.unscale_applies(torch.empty(m, n + 1)[:, 1:], out_dtype)  # misaligned
    assert not split.unscale_applies(acc, torch.float64)


def test_unscale_kernel_takes_no_more_outputs_than_its_int32_index_counts(monkeypatch):
    """The unscale kernel numbers its threads in int32 (a block of 256 past the last quad of
    4 outputs): `unscale_applies` takes at most 2^31 - 257 quads (views with a zero row
    stride stand for accumulators of that size)."""
    monkeypatch.setattr(split, "_kernels_on", lambda: True)
    row = torch.zeros(1, 16)
    top = 2 ** 31 - 1 - 256
    assert split.unscale_applies(row.expand(top // 4, 16), torch.float32)
    assert not split.unscale_applies(row.expand(top // 4 + 1, 16), torch.float32)
