"""batch_invariant_mode on CPU: the same replacement kernels registered for the CPU key
(the tests' hook), so routing, fallback, strictness, nesting and restoration are all
exercised without a GPU; routed CPU calls run the bit-exact reference."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import detgemm_cute as dg
from detgemm_cute import mode, reference

CPU = ("CPU",)


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.fixture(autouse=True)
def _mode_off():
    dg.reset_report()
    yield
    while mode.is_enabled():
        dg.disable()


def _kernel_name(op="aten::mm"):
    return repr(torch.library.get_kernel(op, "CPU"))


def test_enable_disable_restores_the_original_kernels():
    before = {op: _kernel_name(op) for op in ("aten::mm", "aten::bmm", "aten::addmm.out")}
    dg.enable(_dispatch_keys=CPU)
    assert mode.is_enabled()
    assert all(_kernel_name(op) != k for op, k in before.items())
    assert dg.disable() is True
    assert {op: _kernel_name(op) for op in before} == before
    assert not mode.is_enabled() and dg.disable() is False
    a, b = rand(5, 16), rand(16, 8)
    torch.mm(a, b)
    assert dg.report().total_routed == 0  # nothing routed once disabled


def test_routed_ops_give_the_reference_bits():
    x, w, bias = rand(12, 48), rand(20, 48), rand(20)
    a3, b3 = rand(3, 9, 32), rand(3, 32, 10)
    with dg.batch_invariant_mode(_dispatch_keys=CPU):
        y = F.linear(x, w, bias)
        y_mm = x @ w.t()
        y_bmm = torch.bmm(a3, b3)
        y_4d = torch.matmul(a3.view(1, 3, 9, 32), b3.view(1, 3, 32, 10))
        y_mv = torch.mv(x, w[0])
        out = torch.empty(12, 20, dtype=torch.bfloat16)
        y_out = torch.mm(x, w.t(), out=out)
    assert same(y, reference.linear(x, w, bias))
    assert same(y_mm, reference.linear(x, w))
    for i in range(3):
        assert same(y_bmm[i], reference.mm(a3[i], b3[i]))
    assert same(y_4d.view(3, 9, 10), y_bmm)
    assert same(y_mv, reference.linear(x, w[:1])[:, 0])
    assert y_out is out and same(out, y_mm)
    r = dg.report()
    assert r.routed[("addmm", "bf16")] == 1 and r.routed[("mm.out", "bf16")] == 1
    assert r.total_fell_back == 0
    assert "aten::addmm" in str(r)


def test_scaled_forms_round_once_from_fp32():
    s, m1, m2 = rand(6, 10), rand(6, 16), rand(16, 10)
    y32 = reference.mm(m1, m2, out_dtype=torch.float32)
    with dg.batch_invariant_mode(_dispatch_keys=CPU):
        got = torch.addmm(s, m1, m2, beta=0.5, alpha=2.0)
        got_b = torch.baddbmm(s[None], m1[None], m2[None], beta=0.0, alpha=1.0)
        inplace = s.clone()
        inplace.addmm_(m1, m2)
    assert same(got, (2.0 * y32 + 0.5 * s.float()).to(torch.bfloat16))
    assert same(got_b[0], y32.to(torch.bfloat16))  # beta=0 ignores self
    assert same(inplace, (y32 + s.float()).to(torch.bfloat16))


def test_autograd_reaches_the_replaced_kernels():
    x = rand(16, 32).requires_grad_()
    w = rand(24, 32).requires_grad_()
    g = rand(16, 24)
    with dg.batch_invariant_mode(_dispatch_keys=CPU):
        F.linear(x, w).backward(g)
    assert same(x.grad, reference.mm(g, w.detach()))
    assert same(w.grad, reference.chain(g.t(), x.detach()).to(torch.bfloat16))
    assert dg.report().total_routed >= 3


def test_fallback_warns_once_and_counts():
    a, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    a3, b3 = torch.randn(2, 4, 8), torch.randn(2, 8, 3)
    with dg.batch_invariant_mode(_dispatch_keys=CPU):
        with pytest.warns(UserWarning, match="aten::mm with torch.float64 inputs"):
            first = torch.mm(a, b)
        with pytest.warns(UserWarning, match="aten::bmm with torch.float64 inputs"):
            torch.bmm(a3.double(), b3.double())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.mm(a, b)  # no second warning
            y32 = torch.mm(a3[0], b3[0])  # fp32 mm and bmm are routed: no warning
            z32 = torch.bmm(a3, b3)
    assert torch.equal(first, a @ b)
    assert same(y32, reference.mm(a3[0], b3[0])) and same(z32[0], y32)
    r = dg.report()
    assert r.fell_back[("mm", "float64", "torch.float64 inputs (detgemm takes "
                        "bfloat16/float16/float32 here)")] == 2
    assert r.fell_back[("bmm", "float64", "torch.float64 inputs (detgemm takes "
                        "bfloat16/float16/float32 here)")] == 1
    assert r.routed[("mm", "fp32")] == 1 and r.routed[("bmm", "fp32")] == 1
    dg.reset_report()
    assert dg.report().total_fell_back == 0


def test_strict_raises_naming_op_and_shapes():
    with dg.batch_invariant_mode(strict=True, _dispatch_keys=CPU):
        with pytest.raises(mode.BatchInvariantError, match=r"aten::bmm on \(2, 3, 4\)"):
            torch.bmm(torch.randn(2, 3, 4).double(), torch.randn(2, 4, 5).double())
        with pytest.raises(mode.BatchInvariantError, match="mixed dtypes"):
            torch.mm(rand(3, 4), rand(4, 5, dtype=torch.float16))


def test_nesting_restores_the_previous_state_also_on_exceptions():
    a, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    with dg.batch_invariant_mode(strict=True, _dispatch_keys=CPU):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with dg.batch_invariant_mode(strict=False, _dispatch_keys=CPU):
                torch.mm(a, b)  # inner: falls back
        with pytest.raises(mode.BatchInvariantError):
            torch.mm(a, b)  # outer strictness is back
        with pytest.raises(ZeroDivisionError):
            with dg.batch_invariant_mode(_dispatch_keys=CPU):
                1 / 0
        assert mode.is_enabled() and mode._stack == [True]
    assert not mode.is_enabled()
    assert torch.equal(torch.mm(a, b), a @ b)
    with dg.batch_invariant_mode(_dispatch_keys=CPU):
        with pytest.raises(RuntimeError, match="already enabled"):
            dg.enable()  # a different key set cannot nest


def test_malformed_calls_get_pytorchs_own_errors():
    with dg.batch_invariant_mode(_dispatch_keys=CPU):
        with pytest.raises(RuntimeError, match="cannot be multiplied|size mismatch|shapes"):
            torch.mm(rand(3, 4), rand(5, 6))
    assert dg.report().total_routed == 0


def test_empty_and_zero_k_shapes():
    with dg.batch_invariant_mode(_dispatch_keys=CPU):
        z = torch.mm(rand(3, 0), rand(0, 5))
        e = torch.mm(rand(0, 4), rand(4, 5))
        bias = rand(5)
        zb = torch.addmm(bias, rand(3, 0), rand(0, 5))
    assert same(z, torch.zeros(3, 5, dtype=torch.bfloat16)) and e.shape == (0, 5)
    assert same(zb, bias.expand(3, 5).contiguous())


# --- the public defaults on this machine: CUDA only, and a PyTorch without CUDA -----------

def _no_cuda_kernels(monkeypatch):
    """Make this PyTorch look like a build without CUDA kernels (it may be one already)."""
    real = mode._has_kernels
    monkeypatch.setattr(mode, "_has_kernels", lambda key: key != "CUDA" and real(key))
    monkeypatch.setattr(mode, "_warned_no_backend", False)


def test_default_mode_without_cuda_enables_and_routes_nothing(monkeypatch):
    _no_cuda_kernels(monkeypatch)
    before = {op: _kernel_name(op) for op in ("aten::mm", "aten::addmm", "aten::bmm")}
    a, b = rand(9, 32), rand(32, 12)
    want = torch.mm(a, b)
    with pytest.warns(UserWarning, match=r"no CUDA kernels, so the mode routes no matmul"
                                         r".*cpu=True"):
        dg.enable()
    try:
        assert mode.is_enabled() and mode.routed_devices() == ()
        assert {op: _kernel_name(op) for op in before} == before  # CPU keeps PyTorch's
        assert same(torch.mm(a, b), want)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the warning is shown once per process
            with dg.batch_invariant_mode(strict=True):  # nests; strict raises nothing here
                assert same(F.linear(a, b.t()), want)
    finally:
        assert dg.disable() is True
    assert not mode.is_enabled() and dg.disable() is False
    assert dg.report().total_routed == 0 and dg.report().total_fell_back == 0


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a PyTorch built without CUDA")
def test_this_pytorch_without_cuda():
    """The real thing, no monkeypatching: import, enable, matmul, disable."""
    a, b = rand(5, 16), rand(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with dg.batch_invariant_mode():
            y = a @ b
            assert mode.routed_devices() == ()
    assert same(y, a @ b)


def test_cpu_true_routes_cpu_matmuls_through_the_reference(monkeypatch):
    _no_cuda_kernels(monkeypatch)
    x, w = rand(6, 40), rand(10, 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU is routed: nothing to warn about
        with dg.batch_invariant_mode(cpu=True):
            assert mode.routed_devices() == ("cpu",)
            y = F.linear(x, w)
            with pytest.raises(RuntimeError, match="already enabled"):
                dg.enable()  # CUDA-only cannot nest inside CUDA + CPU
    assert same(y, reference.linear(x, w))
    assert dg.report().routed[("mm", "bf16")] == 1
