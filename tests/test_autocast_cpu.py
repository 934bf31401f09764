"""torch.autocast with detgemm on CPU (CPU tensors run the bit-exact reference, so every
comparison is of the kernels' bits): the forward ops cast like aten::linear / mm / addmm,
fp32 parameters stay fp32 and get fp32 gradients, `fp32_grad_accum` keeps its fp32
main_grad chain, and every result has the bits of the same computation with the casts
written out. The CUDA autocast key is exercised with fake CUDA tensors (shapes and dtypes);
its bits are checked on the GPU (tests/test_gpu_amp.py)."""

import pytest
import torch
import torch.nn.functional as F

import detgemm_cute as dg
from detgemm_cute import reference

BF, FP, F32 = torch.bfloat16, torch.float16, torch.float32
AMP = [BF, FP]


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def autocast(dtype):
    return torch.autocast("cpu", dtype=dtype)


@pytest.mark.parametrize("dtype", AMP)
@pytest.mark.parametrize("out_dtype", [None, F32])
def test_forward_functions_cast_like_aten(dtype, out_dtype):
    """fp32 inputs inside autocast: the result is the op on inputs cast to the autocast
    dtype, in that dtype (or out_dtype), bit for bit; aten gives the same dtype."""
    x, w, b = torch.randn(2, 7, 40), torch.randn(24, 40), torch.randn(24)
    xc, wc, bc = x.to(dtype), w.to(dtype), b.to(dtype)
    with autocast(dtype):
        y = dg.linear(x, w, b, out_dtype=out_dtype)
        y2 = dg.linear(x[0], w, out_dtype=out_dtype)
        z = dg.mm(x[0], w.t(), out_dtype=out_dtype)
        za = dg.addmm(b, x[0], w.t(), out_dtype=out_dtype)
        op = torch.ops.detgemm.linear(x, w, b, out_dtype)
        aten = F.linear(x, w, b)
    assert y.dtype == (out_dtype or dtype) and aten.dtype == dtype
    assert same(y, reference.linear(xc.reshape(14, 40), wc, bc, out_dtype).view(2, 7, 24))
    assert same(op, y)
    assert same(y2, reference.linear(xc[0], wc, None, out_dtype))
    assert same(z, y2)
    assert same(za, reference.linear(xc[0], wc, bc, out_dtype))


def test_other_16_bit_inputs_are_cast_to_the_autocast_dtype():
    """aten casts every floating input to the autocast dtype, bf16 included."""
    x, w = torch.randn(5, 32).to(BF), torch.randn(8, 32).to(BF)
    with autocast(FP):
        y = dg.linear(x, w)
        assert F.linear(x, w).dtype == FP
    assert same(y, reference.linear(x.to(FP), w.to(FP)))


def test_outside_autocast_fp32_runs_the_fp32_tier():
    """Inside autocast fp32 inputs are cast (bf16 bits); outside they run the fp32 tier:
    an fp32 result with the reference's bits and fp32 accuracy. fp64 is still refused."""
    x, w = torch.randn(5, 32), torch.randn(8, 32)
    with autocast(BF):
        yc = dg.linear(x, w)
    assert same(yc, reference.linear(x.to(BF), w.to(BF)))
    y = dg.linear(x, w)
    assert same(y, reference.linear(x, w))
    exact = x.double() @ w.double().t()
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-6
    with pytest.raises(TypeError, match=r"input must be torch\.bfloat16, torch\.float16 or "
                                        r"torch\.float32, got torch\.float64"):
        dg.linear(x.double(), w.double())


@pytest.mark.parametrize("dtype", AMP)
def test_gradients_of_fp32_leaves_are_fp32_and_match_explicit_casts(dtype):
    x = torch.randn(3, 16, 48, requires_grad=True)
    w = torch.randn(32, 48, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    g = torch.randn(3, 16, 32).to(dtype)
    with autocast(dtype):
        y = dg.linear(x, w, b)
    y.backward(g)
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y_ref = dg.linear(*(t.to(dtype) for t in ref))
    y_ref.backward(g)
    assert same(y, y_ref)
    for t, r in zip((x, w, b), ref):
        assert t.grad.dtype == F32 and same(t.grad, r.grad)


@pytest.mark.parametrize("dtype", AMP)
def test_module_with_fp32_parameters(dtype):
    """A converted fp32 model inside autocast: output in the autocast dtype, parameters and
    their gradients fp32, all equal to the same model run with explicit casts."""
    torch.manual_seed(1)
    model = dg.nn.convert(torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(),
                                              torch.nn.Linear(48, 16)))
    x = torch.randn(4, 8, 32)
    with autocast(dtype):
        y = model(x)
    y.float().square().mean().backward()
    l1, l2 = model[0], model[2]

    ps = [p.detach().clone().requires_grad_() for p in model.parameters()]
    h = torch.relu(dg.linear(x.to(dtype), ps[0].to(dtype), ps[1].to(dtype)))
    y_ref = dg.linear(h, ps[2].to(dtype), ps[3].to(dtype))
    y_ref.float().square().mean().backward()
    assert y.dtype == dtype and same(y, y_ref)
    for p, r in zip(model.parameters(), ps):
        assert p.dtype == F32 and p.grad.dtype == F32 and same(p.grad, r.grad)
    assert isinstance(l1, dg.nn.Linear) and isinstance(l2, dg.nn.Linear)


@pytest.mark.parametrize("dtype", AMP)
def test_fp32_grad_accum_keeps_the_fp32_chain(dtype):
    """fp32_grad_accum under autocast: main_grad is the fp32 chain of the autocast-dtype
    operands (the bits of a 16-bit model fed 16-bit inputs), micro-batches of multiples of
    16 tokens give the bits of one batch, and finalize_grads hands fp32 gradients over."""
    torch.manual_seed(2)
    base = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    fp32 = dg.nn.convert(base, fp32_grad_accum=True)
    half = dg.nn.convert(torch.nn.Sequential(*(
        torch.nn.Linear(m.in_features, m.out_features).to(dtype) if isinstance(m, torch.nn.Linear)
        else m for m in base)), fp32_grad_accum=True)
    with torch.no_grad():
        for p, q in zip(fp32.parameters(), half.parameters()):
            q.copy_(p.to(dtype))
    x = torch.randn(48, 32, requires_grad=True)
    for part in (x[:16], x[16:]):  # 16 + 32 tokens, accumulated
        with autocast(dtype):
            y = fp32(part)
        y.float().sum().backward()
    whole = half(x.detach().to(dtype))
    whole.float().sum().backward()
    dg.nn.finalize_grads(fp32)
    for p, q in zip(fp32.parameters(), half.parameters()):
        assert p.dtype == F32 and p.main_grad.dtype == F32
        assert same(p.main_grad, q.main_grad)
        assert same(p.grad, p.main_grad)
    assert x.grad.dtype == F32


def test_module_training_is_reproducible_and_keeps_fp32_weights():
    def run():
        torch.manual_seed(3)
        model = dg.nn.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(),
                                                  torch.nn.Linear(32, 8)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            x, t = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            with autocast(BF):
                loss = (model(x).float() - t).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    a, b = run(), run()
    assert all(p.dtype == F32 and same(p, q) for p, q in zip(a, b))


def test_gradient_functions_are_not_autocast():
    """Like aten's backward ops they run in their operands' dtype (which the forward chose)."""
    dy, x = torch.randn(16, 8).to(BF), torch.randn(16, 24).to(BF)
    with autocast(FP):
        dw = dg.weight_grad(dy, x)
        dx = dg.input_grad(dy, torch.randn(8, 24).to(BF))
    assert same(dw, reference.chain(dy.t(), x)) and dx.dtype == BF


def test_compiled_function_under_autocast_gives_eager_bits():
    torch._dynamo.reset()

    def f(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.relu(dg.linear(x, w, b))

    x, w, b = torch.randn(12, 32), torch.randn(16, 32), torch.randn(16)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b)
    assert same(got, f(x, w, b))
    assert same(got, torch.relu(reference.linear(x.to(BF), w.to(BF), b.to(BF))))


def test_cuda_autocast_key_casts_fake_cuda_tensors():
    """The CUDA autocast kernels, reached with fake CUDA tensors (no GPU needed): the dtype
    of the region is followed, like aten::linear."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    prev, prev_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode():
        x, x2 = torch.randn(3, 5, 32, device="cuda"), torch.randn(5, 32, device="cuda")
        w, b = torch.randn(16, 32, device="cuda"), torch.randn(16, device="cuda")
        wt = torch.randn(32, 16, device="cuda")
        try:
            for dtype in AMP:
                torch.set_autocast_enabled("cuda", True)
                torch.set_autocast_dtype("cuda", dtype)
                y = dg.linear(x, w, b)
                assert y.dtype == F.linear(x, w, b).dtype == dtype
                assert y.shape == (3, 5, 16) and y.device.type == "cuda"
                assert dg.mm(x2, wt).dtype == dtype
                assert dg.addmm(b, x2, wt, out_dtype=F32).dtype == F32
        finally:
            torch.set_autocast_enabled("cuda", prev)
            torch.set_autocast_dtype("cuda", prev_dtype)
