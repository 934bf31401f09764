"""The training triad on CPU: backward ops, autograd formulas, nn.Linear / convert, the
fp32 accumulation buffer, and input errors. CPU tensors run the bit-exact reference, so the
dW micro-batch contract is asserted here bit-for-bit as well (the GPU suite re-proves it on
the kernels)."""

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import grads, reference


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def rand(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def test_backward_ops_are_registered_with_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name in ("input_grad", "weight_grad", "weight_grad_acc_", "bias_grad", "bias_grad_acc_"):
        assert hasattr(torch.ops.detgemm, name)
    with FakeTensorMode():
        dy, x, w = rand(4, 5, 24), rand(4, 5, 40), rand(24, 40)
        assert torch.ops.detgemm.input_grad(dy, w, None).shape == (4, 5, 40)
        gw = torch.ops.detgemm.weight_grad(dy, x)
        assert gw.shape == (24, 40) and gw.dtype == torch.float32
        gb = torch.ops.detgemm.bias_grad(dy)
        assert gb.shape == (24,) and gb.dtype == torch.float32


def test_opcheck_backward_ops():
    dy, x, w = rand(32, 16), rand(32, 24), rand(16, 24)
    torch.library.opcheck(torch.ops.detgemm.input_grad.default, (dy, w, None))
    torch.library.opcheck(torch.ops.detgemm.weight_grad.default, (dy, x))
    torch.library.opcheck(torch.ops.detgemm.weight_grad.default, (dy, x, torch.bfloat16))
    torch.library.opcheck(torch.ops.detgemm.bias_grad.default, (dy,))
    acc = torch.randn(16, 24)
    torch.library.opcheck(torch.ops.detgemm.weight_grad_acc_.default, (acc, dy, x))
    torch.library.opcheck(torch.ops.detgemm.bias_grad_acc_.default, (torch.randn(16), dy))
    x, w, b = rand(8, 32, grad=True), rand(16, 32, grad=True), rand(16, grad=True)
    torch.library.opcheck(torch.ops.detgemm.linear.default, (x, w, b, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_grads_are_the_reference_chains(dtype):
    """dX, dW, db of `linear` are exactly: dY @ W rounded once, fp32 chain of dY^T X rounded
    once to the weight dtype, and the dW chain against ones rounded once."""
    x, w, b = rand(37, 40, dtype=dtype, grad=True), rand(24, 40, dtype=dtype, grad=True), \
        rand(24, dtype=dtype, grad=True)
    y = dg.linear(x, w, b)
    assert y.grad_fn is not None and "detgemm" in type(y.grad_fn).__name__.lower() or y.grad_fn
    g = rand(37, 24, dtype=dtype)
    y.backward(g)
    xd, wd = x.detach(), w.detach()
    assert same(x.grad, reference.mm(g, wd))
    assert same(w.grad, reference.chain(g.t(), xd).to(dtype))
    ones = torch.ones(37, 1, dtype=dtype)
    assert same(b.grad, reference.chain(g.t(), ones)[:, 0].to(dtype))
    # Accuracy against fp64, per element, relative to the size of the terms.
    g64 = g.double()
    for got, want, scale in ((x.grad, g64 @ wd.double(), g64.abs() @ wd.double().abs()),
                             (w.grad, g64.t() @ xd.double(), g64.abs().t() @ xd.double().abs()),
                             (b.grad, g64.sum(0), g64.abs().sum(0))):
        assert ((got.double() - want).abs() <= scale * 2**-7 + 1e-30).all()


def test_mm_and_addmm_grads():
    a, bm, bias = rand(21, 30, grad=True), rand(30, 18, grad=True), rand(18, grad=True)
    out = dg.addmm(bias, a, bm)
    g = rand(21, 18)
    out.backward(g)
    assert same(a.grad, reference.linear(g, bm.detach()))
    assert same(bm.grad, reference.chain(a.detach().t(), g).to(torch.bfloat16))
    assert same(bias.grad, grads.bias_grad(g).to(torch.bfloat16))
    a2, b2 = a.detach().clone().requires_grad_(), bm.detach().clone().requires_grad_()
    dg.mm(a2, b2).backward(g)
    assert same(a2.grad, a.grad) and same(b2.grad, bm.grad)


def test_fp32_output_gradient_is_rounded_once_to_the_input_dtype():
    x, w = rand(9, 16, grad=True), rand(8, 16)
    y = dg.linear(x, w, out_dtype=torch.float32)
    g = torch.randn(9, 8)
    y.backward(g)
    assert same(x.grad, reference.mm(g.to(torch.bfloat16), w))


def test_only_needed_gradients_run(monkeypatch):
    calls = []
    for name in ("input_grad", "weight_grad", "bias_grad"):
        real = getattr(grads, name)
        monkeypatch.setattr(grads, name,
                            lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    x, w, b = rand(16, 8), rand(4, 8, grad=True), rand(4)
    dg.linear(x, w, b).sum().backward()
    assert calls == ["weight_grad"]
    calls.clear()
    x.requires_grad_()
    w.requires_grad_(False)
    dg.linear(x, w, b).sum().backward()
    assert calls == ["input_grad"]


def test_weight_grad_microbatches_of_16_equal_one_call():
    dy, x = rand(96, 24), rand(96, 40)
    whole = dg.weight_grad(dy, x)
    acc = torch.zeros(24, 40)
    for lo, hi in ((0, 16), (16, 64), (64, 96)):
        assert dg.weight_grad(dy[lo:hi], x[lo:hi], acc=acc) is acc
    assert same(acc, whole)
    db = torch.zeros(24)
    for lo, hi in ((0, 48), (48, 96)):
        dg.bias_grad(dy[lo:hi], acc=db)
    assert same(db, dg.bias_grad(dy))


def test_weight_grad_out_dtype_is_one_rounding_of_the_fp32_chain():
    dy, x = rand(50, 24), rand(50, 40)
    for dt in (torch.bfloat16, torch.float16):
        assert same(dg.weight_grad(dy, x, out_dtype=dt), dg.weight_grad(dy, x).to(dt))
    with pytest.raises(ValueError, match="fp32 accumulation buffer"):
        dg.weight_grad(dy, x, acc=torch.zeros(24, 40), out_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        dg.weight_grad(dy, x, out_dtype=torch.int8)


def test_zero_padded_tokens_change_nothing():
    dy, x = rand(40, 24), rand(40, 40)
    pad_dy = torch.cat([dy, torch.zeros(13, 24, dtype=dy.dtype)])
    pad_x = torch.cat([x, rand(13, 40)])  # any X: a zero dY row makes zero products
    assert same(dg.weight_grad(pad_dy, pad_x), dg.weight_grad(dy, x))
    assert same(dg.bias_grad(pad_dy), dg.bias_grad(dy))


def test_zero_tokens_leave_the_buffer_alone():
    acc = torch.randn(4, 6)
    before = acc.clone()
    assert dg.weight_grad(rand(0, 4), rand(0, 6), acc=acc) is acc and same(acc, before)
    assert same(dg.weight_grad(rand(0, 4), rand(0, 6)), torch.zeros(4, 6))


@pytest.mark.parametrize("call, exc, words", [
    (lambda: dg.weight_grad(rand(8, 4), rand(7, 6)), ValueError, "same leading"),
    (lambda: dg.weight_grad(rand(8, 4), rand(8, 6, dtype=torch.float16)), TypeError,
     "same dtype"),
    (lambda: dg.weight_grad(rand(8, 4).float(), rand(8, 6)), TypeError, "grad_output"),
    (lambda: dg.weight_grad(rand(8, 4), rand(8, 6), acc=torch.zeros(4, 6,
                                                                      dtype=torch.bfloat16)),
     TypeError, "acc must be torch.float32"),
    (lambda: dg.weight_grad(rand(8, 4), rand(8, 6), acc=torch.zeros(6, 4)), ValueError,
     "acc must have shape"),
    (lambda: dg.bias_grad(rand(8, 4), acc=torch.zeros(5)), ValueError, "acc must have shape"),
    (lambda: dg.bias_grad(torch.ones(3, dtype=torch.int32)), TypeError, "grad_output"),
    (lambda: dg.input_grad(rand(8, 4), rand(5, 6)), ValueError, "K mismatch"),
    (lambda: dg.input_grad(rand(8, 4), "w"), TypeError, "weight must be a torch.Tensor"),
    (lambda: dg.weight_grad(3, rand(8, 6)), TypeError, "grad_output must be a torch.Tensor"),
])
def test_backward_input_errors(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_bad_upstream_gradient_shape_is_rejected():
    x, w = rand(6, 8, grad=True), rand(4, 8, grad=True)
    y = dg.linear(x, w)
    with pytest.raises(RuntimeError, match="shape"):
        y.backward(rand(6, 5))


# ------------------------------------------------------------------------------ modules
def test_linear_module_is_a_drop_in():
    torch.manual_seed(0)
    ref = torch.nn.Linear(40, 24, dtype=torch.bfloat16)
    mod = dg.nn.Linear.from_linear(ref)
    assert isinstance(mod, torch.nn.Linear)
    assert mod.weight is ref.weight and mod.bias is ref.bias
    assert mod.state_dict().keys() == ref.state_dict().keys()
    fresh = dg.nn.Linear(40, 24, dtype=torch.bfloat16)
    fresh.load_state_dict(ref.state_dict())
    x = rand(10, 40)
    assert same(fresh(x), reference.linear(x, ref.weight.detach(), ref.bias.detach()))
    assert same(mod(x), fresh(x))
    assert "fp32_grad_accum" not in repr(mod)


def test_convert_swaps_nested_linears_in_place():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 4)),
        torch.nn.MultiheadAttention(16, 2),
    ).to(torch.bfloat16)
    params = [id(p) for p in model.parameters()]
    keys = model.state_dict().keys()
    out = dg.nn.convert(model, filter=lambda name, m: name != "2.1")
    assert out is model
    assert isinstance(model[0], dg.nn.Linear) and isinstance(model[2][0], dg.nn.Linear)
    assert type(model[2][1]) is torch.nn.Linear  # filtered out
    assert not isinstance(model[3].out_proj, dg.nn.Linear)  # nn.Linear subclass: left alone
    assert [id(p) for p in model.parameters()] == params and model.state_dict().keys() == keys
    single = dg.nn.convert(torch.nn.Linear(4, 4))
    assert isinstance(single, dg.nn.Linear)
    with pytest.raises(TypeError, match="torch.nn.Linear"):
        dg.nn.Linear.from_linear(torch.nn.ReLU())


def test_fp32_grad_accum_continues_the_chain_across_microbatches():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8)).to(torch.bfloat16)
    dg.nn.convert(model, fp32_grad_accum=True)
    assert "fp32_grad_accum=True" in repr(model[0])
    x = rand(64, 24)

    def main_grads():
        return [p.main_grad.clone() for p in model.parameters()]

    for chunk in (x[:16], x[16:48], x[48:]):
        model(chunk).float().square().sum().backward()
    split = main_grads()
    assert all(p.grad is None for p in model.parameters())
    dg.nn.zero_main_grads(model)
    assert all(not p.main_grad.any() for p in model.parameters())
    model(x).float().square().sum().backward()
    whole = main_grads()
    assert all(same(a, b) for a, b in zip(split, whole))
    dg.nn.finalize_grads(model)
    for p, buf in zip(model.parameters(), whole):
        assert same(p.grad, buf.to(torch.bfloat16))


def test_fp32_grad_accum_input_grad_matches_default_mode():
    torch.manual_seed(2)
    lin = torch.nn.Linear(24, 16, dtype=torch.bfloat16)
    a = dg.nn.Linear.from_linear(lin)
    b = dg.nn.Linear.from_linear(lin, fp32_grad_accum=True)
    x1, x2 = rand(20, 24, grad=True), None
    x2 = x1.detach().clone().requires_grad_()
    g = rand(20, 16)
    a(x1).backward(g)
    w_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    lin.bias.grad = None
    b(x2).backward(g)
    assert same(x1.grad, x2.grad)
    assert same(lin.weight.main_grad.to(torch.bfloat16), w_grad)
    with torch.no_grad():  # no grad: plain forward, no buffers touched
        assert same(b(x2), a(x2))


def test_torch_compile_traces_forward_and_backward():
    def step(x, w, b):
        y = dg.linear(x, w, b)
        return torch.nn.functional.gelu(y).float().sum()

    x, w, b = rand(16, 32, grad=True), rand(8, 32, grad=True), rand(8, grad=True)
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, b)
    loss.backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    step(x2, w2, b2).backward()
    assert same(x.grad, x2.grad) and same(w.grad, w2.grad) and same(b.grad, b2.grad)
