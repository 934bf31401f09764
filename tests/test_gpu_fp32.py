"""The fp32 tier on the GPU, on each kernel family the GPU runs: the split, chunked chain
of `detgemm_cute.split`.

Bits against the CPU reference (which runs the same split and the same chunked chain), the
invariances of the bf16 tier (every M, every fp32 bucket, chunked rows, run to run, dW
micro-batches), autograd and the mode, and accuracy against cuBLAS SGEMM with TF32 off."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU (each family the GPU can run is tested)",
                allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import reference  # noqa: E402
from detgemm_cute.reference import same_bits as same_bits_nan  # noqa: E402
from gpu_helpers import (SWEEP_M, assert_linear_matches_reference,  # noqa: E402,F401
                         bucket_names, family, family_bucket, graph_replayed,
                         poison, same_bits, torch_tf32)

DEV = "cuda"
F32 = torch.float32


def rand(*shape, g=None, spread=False):
    x = torch.randn(*shape, device=DEV, dtype=F32, generator=g)
    if spread:  # exponents over a wide range: every part of the split carries bits
        e = torch.randint(-20, 21, shape, device=DEV, generator=g).to(F32)
        x = x * torch.exp2(e)
    return x


def ref_linear(x, w, bias=None, out_dtype=None):
    return reference.linear(x.cpu(), w.cpu(), None if bias is None else bias.cpu(), out_dtype)


@pytest.mark.parametrize("m,n,k", [(1, 256, 64), (7, 130, 40), (100, 264, 200), (300, 520, 777),
                                   (1000, 384, 512)])
@pytest.mark.parametrize("spread", [False, True])
def test_linear_matches_reference_bits(m, n, k, spread):
    g = torch.Generator(device=DEV).manual_seed(m * 7 + n + k)
    x, w, bias = rand(m, k, g=g, spread=spread), rand(n, k, g=g, spread=spread), rand(n, g=g)
    assert_linear_matches_reference(x, w, bias)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_16bit_output_is_one_rounding(out_dtype):
    x, w = rand(200, 300), rand(136, 300)
    y32 = dg.linear(x, w)
    y = dg.linear(x, w, out_dtype=out_dtype)
    assert same_bits(y, y32.to(out_dtype))


@pytest.mark.parametrize("bucket", bucket_names("fp32"))
def test_every_fp32_bucket_same_bits(bucket):
    x, w, bias = rand(333, 1000), rand(264, 1000), rand(264)
    want = ref_linear(x, w, bias)
    b = family_bucket(bucket, "fp32")
    poison()
    with dg.force_bucket(bucket):
        if b.op == "fwd":
            y = dg.linear(x, w, bias)
        elif b.op == "dx":
            y = dg.input_grad(x, w.t().contiguous()) + bias
        else:
            y = dg.weight_grad(x.t().contiguous(), w.t().contiguous()) + bias
    # dx runs fwd's scheme on the same operands; dW its own exact-parts scheme (bias after)
    if b.op == "dx":
        want = ref_linear(x, w) + bias.cpu()
    elif b.op == "dw":
        want = reference.chain(x.cpu(), w.t().cpu(), op="dw") + bias.cpu()
    assert same_bits(y.cpu(), want)


def test_batch_invariance_every_m():
    g = torch.Generator(device=DEV).manual_seed(3)
    x, w = rand(4096, 1024, g=g), rand(1536, 1024, g=g)
    full = dg.linear(x, w)
    for m in [m for m in SWEEP_M if m <= 4096]:
        poison()
        assert same_bits(dg.linear(x[:m], w), full[:m]), f"rows differ at M={m}"
    chunks = torch.cat([dg.linear(c, w) for c in x.split(777)])
    assert same_bits(chunks, full)


def test_run_to_run_and_graphs():
    x, w = rand(1000, 2048), rand(2048, 2048)
    first = dg.linear(x, w)
    for _ in range(2):
        poison()
        assert same_bits(dg.linear(x, w), first)
    assert same_bits(graph_replayed(lambda: dg.linear(x, w)), first)


def test_volume_one_million_outputs_match_reference():
    g = torch.Generator(device=DEV).manual_seed(11)
    x, w, bias = rand(1024, 64, g=g, spread=True), rand(1040, 64, g=g), rand(1040, g=g)
    y = dg.linear(x, w, bias)
    assert y.numel() >= 1_000_000
    assert same_bits(y.cpu(), ref_linear(x, w, bias))


def test_special_values_match_reference():
    x, w = rand(64, 96), rand(72, 96)
    x[3, 5], x[10, 0], w[7, 2] = float("inf"), float("nan"), float("-inf")
    x[20, 7] = 3.0e38  # bf16 would round it to Inf: hi saturates instead
    y = dg.linear(x, w)
    assert torch.isnan(y[3]).all() and torch.isnan(y[:, 7]).all()
    assert same_bits_nan(y, ref_linear(x, w))  # NaN payloads are not part of the contract


def test_dw_micro_batches_continue_one_chain():
    g = torch.Generator(device=DEV).manual_seed(5)
    dy, x = rand(128, 384, g=g), rand(128, 256, g=g)
    whole = dg.weight_grad(dy, x)
    acc = torch.zeros(384, 256, device=DEV)
    for s in (slice(0, 16), slice(16, 64), slice(64, 128)):
        dg.weight_grad(dy[s], x[s], acc=acc)
    assert same_bits(acc, whole)
    want = reference.chain(dy.t().cpu(), x.cpu())
    assert same_bits(whole.cpu(), want)


def test_dx_matches_reference_and_rows_invariant():
    dy, w = rand(500, 768), rand(768, 320)
    dx = dg.input_grad(dy, w)
    assert same_bits(dx.cpu(), reference.mm(dy.cpu(), w.cpu()))
    assert same_bits(dg.input_grad(dy[:37], w), dx[:37])


def test_nn_linear_fp32_trains_and_matches_functional():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 192).cuda()
    mod = dg.nn.Linear.from_linear(lin)
    x = torch.randn(40, 256, device=DEV, requires_grad=True)
    y = mod(x)
    assert same_bits(y, dg.linear(x.detach(), lin.weight.detach(), lin.bias.detach()))
    g = torch.randn_like(y)
    y.backward(g)
    assert same_bits(x.grad, dg.input_grad(g, lin.weight.detach()))
    assert same_bits(mod.weight.grad, dg.weight_grad(g, x.detach()))


def test_mode_routes_fp32_matmuls():
    a, b = rand(300, 512), rand(512, 200)
    with dg.batch_invariant_mode(strict=True):
        y = a @ b
        z = torch.nn.functional.linear(a, b.t().contiguous())
    assert same_bits(y, dg.mm(a, b))
    assert same_bits(z, dg.linear(a, b.t().contiguous()))


@pytest.mark.parametrize("k", [256, 4096, 16384])
def test_error_not_above_sgemm(k):
    """Relative error vs fp64 at most cuBLAS SGEMM's (TF32 off) on the same inputs, on the
    bench's 512 x K x 512. (At 256 x 16384 x 256 cuBLAS splits K and is more accurate:
    bench/README.md.)"""
    g = torch.Generator(device=DEV).manual_seed(k)
    a, b = rand(512, k, g=g), rand(k, 512, g=g)
    ref = a.double() @ b.double()
    with torch_tf32(False):
        sgemm = a @ b
    ours = dg.mm(a, b)

    def err(y):
        return ((y.double() - ref).norm() / ref.norm()).item()

    assert err(ours) <= err(sgemm), (err(ours), err(sgemm))



@pytest.mark.parametrize("shape", [(300, 777), (64, 4096), (1, 32), (5, 3)])
def test_one_pass_split_kernel_same_bits_as_pytorch(shape):
    from detgemm_cute import split

    x = rand(*shape, spread=True)
    x[0, 0] = float("inf")
    if shape[0] > 3:  # rows the row scales clamp: zeros, subnormals; a NaN
        x[1] = 0.0
        x[2] = torch.randn(shape[1], device=DEV) * 2.0 ** -135
        x[3, -1] = float("nan")
    s = split.row_scales(x)
    for side in ("a", "b"):
        want = split.operand(x, s, side)
        for xv in (x, x.t().contiguous().t()):
            parts, scales = split.scaled_operand_cuda(xv, side)
            assert same_bits_nan(parts, want) and same_bits_nan(scales, s)
        want = split.exact_operand(x, side)
        assert same_bits_nan(split.exact_operand_cuda(x, side), want)
        assert same_bits_nan(split.exact_operand_cuda(x.t().contiguous().t(), side), want)


@pytest.mark.parametrize("shape", [(300, 776), (64, 4096), (1, 32), (33, 8), (1000, 264)])
def test_column_split_kernel_same_bits_as_pytorch(shape):
    """W [R, C] split in place with per-column scales: the transpose of the PyTorch split
    of W^T (R not a multiple of 32 pads zero rows)."""
    from detgemm_cute import split

    w = rand(*shape, spread=True)
    w[0, 0] = float("inf")
    if shape[1] > 3:  # columns the scales clamp: zeros, subnormals; a NaN
        w[:, 1] = 0.0
        w[:, 2] = torch.randn(shape[0], device=DEV) * 2.0 ** -135
        w[-1, 3] = float("nan")
    s = split.row_scales(w.t())
    want = split.operand(w.t(), s, "b")
    poison()
    parts, scales = split.scaled_columns_cuda(w)
    assert parts.shape == (want.shape[1], shape[1])
    assert same_bits_nan(parts.t(), want) and same_bits_nan(scales, s)


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.mark.parametrize("m,n", [(1, 4), (7, 264), (300, 1000)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_unscale_kernel_same_bits_as_pytorch(m, n, out_dtype, with_bias):
    """The fp32 tier's last step in one kernel (`split.unscale_cuda`): the bits of the
    PyTorch ops it replaces (unscale, + bias, .to(out_dtype)), NaN payloads included, on
    values that overflow, underflow to subnormals, round at the output dtype's edges, and
    scales at both ends of their range (2^-126, 2^127: a subnormal reciprocal)."""
    from detgemm_cute import split

    g = torch.Generator(device=DEV).manual_seed(m * 131 + n)
    acc = rand(m, n, g=g, spread=True) * 2.0 ** 60
    acc[0, 0], acc[-1, -1] = float("nan"), float("-inf")
    acc[0, 1:3] = torch.tensor([-0.0, 2.0 ** -100], device=DEV)
    sa = torch.exp2(torch.randint(-126, 128, (m,), device=DEV, generator=g).float())
    sb = torch.exp2(torch.randint(-126, 128, (n,), device=DEV, generator=g).float())
    sa[0], sb[-1] = 2.0 ** 127, 2.0 ** -126
    bias = rand(n, g=g, spread=True) if with_bias else None
    want = split.unscale(acc, sa, sb)
    if bias is not None:
        want = want + bias
    want = want.to(out_dtype)
    assert split.unscale_applies(acc, out_dtype)
    poison()
    got = split.unscale_cuda(acc, sa, sb, bias, out_dtype)
    iv = _INT_VIEW[out_dtype]
    assert got.dtype == out_dtype and torch.equal(got.view(iv), want.view(iv))
    assert bool(torch.isnan(got).any()) and bool(torch.isinf(got).any())


@pytest.mark.parametrize("m,r,c,wider", [(1, 64, 256, False), (65, 777, 264, False),
                                         (300, 1000, 1024, False), (7, 40, 8, False),
                                         (129, 4096, 520, False), (33, 100, 64, True),
                                         (1, 1, 32, False)])
def test_weight_read_in_place_same_bits(monkeypatch, m, r, c, wider):
    """dX = dY @ W and mm(X, W [K, N]) split W in place (its reduction down the columns; on
    sm90 the split runs, counted): the reference's bits, and those of the same product with
    W copied K-major. `wider`: W is a column window of a wider buffer (row pitch != C). The
    fused path of few rows (`split_decode.applies_kn`) is off: it takes a K-major copy."""
    from detgemm_cute import gemm, split, split_decode

    monkeypatch.setattr(split_decode, "_KN_ON", False)
    calls = []
    real = split.scaled_columns_cuda
    monkeypatch.setattr(split, "scaled_columns_cuda", lambda w: calls.append(1) or real(w))
    g = torch.Generator(device=DEV).manual_seed(m + r + c)
    dy, w = rand(m, r, g=g, spread=True), rand(r, c, g=g)
    if wider:
        w = torch.empty(r, c + 24, device=DEV)[:, 8:c + 8].copy_(w)
    assert split.columns_apply(w)
    poison()
    dx = dg.input_grad(dy, w)
    assert len(calls) == (gemm.arch_of(w.device) == "sm90")
    want = reference.mm(dy.cpu(), w.cpu())
    assert same_bits(dx.cpu(), want)
    assert same_bits(dx, dg.linear(dy, w.t().contiguous()))
    assert same_bits(dg.mm(dy, w).cpu(), want)


def _misplaced(m, k, where, g):
    """fp32 [m, k] random values at an odd storage offset ("offset") or inside a wider
    buffer ("wider": a column window of a [m, k + 3] buffer starting one element in)."""
    x = rand(m, k, g=g)
    if where == "offset":
        out = torch.empty(1 + m * k, device=DEV)[1:].view(m, k)
    else:
        out = torch.empty(m, k + 3, device=DEV)[:, 1:k + 1]
    return out.copy_(x)


# (M, K, N) where an fp32 linear at "ieee" with a misaligned input raised the DSL's
# "Misaligned Tensor data on argument #0" (the split kernel) instead of staging it.
MISALIGNED_CRASHES = [(101, 160, 5), (19, 640, 1), (19, 128, 1), (37, 64, 39), (29, 1344, 8)]


@pytest.mark.parametrize("m,k,n", MISALIGNED_CRASHES)
@pytest.mark.parametrize("where", ["offset", "wider"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_misaligned_operands_are_staged(m, k, n, where, precision):
    g = torch.Generator(device=DEV).manual_seed(m * 13 + k + n)
    x, w, bias = _misplaced(m, k, where, g), _misplaced(n, k, where, g), rand(n, g=g)
    assert x.data_ptr() % 16 and w.data_ptr() % 16
    with dg.fp32_precision(precision):
        poison()
        y = dg.linear(x, w, bias)
        want = reference.linear(x.cpu(), w.cpu(), bias.cpu())
        assert same_bits(y.cpu(), want)
        # dX and dW of the same operands: dY at an odd offset, X a slice
        dy = _misplaced(m, n, where, g)
        assert same_bits(dg.input_grad(dy, w).cpu(), reference.mm(dy.cpu(), w.cpu()))
        acc = torch.randn(n, k, device=DEV)
        want_dw = reference.chain(dy.t().cpu(), x.cpu(), acc.cpu(), op="dw")
        assert same_bits(dg.weight_grad(dy, x, acc=acc).cpu(), want_dw)
