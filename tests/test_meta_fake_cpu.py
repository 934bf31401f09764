"""Meta and fake tensors through every public function: shapes, dtypes and devices come from
the custom ops' fake implementations, without reading data or touching the device. Fake CUDA
tensors work on a PyTorch built without CUDA (as shape propagation, export and memory
estimation use them), and no call reads a fake tensor's data pointer."""

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import detgemm_cute as dg

BF, FP, F32 = torch.bfloat16, torch.float16, torch.float32


def t(*shape, dtype=BF, device="meta", grad=False):
    return torch.empty(*shape, dtype=dtype, device=device).requires_grad_(grad)


def calls(device, dtype=BF):
    """(name, thunk, expected shape, expected dtype) for every public function."""
    def mk(*shape, d=dtype):
        return t(*shape, dtype=d, device=device)

    return [
        ("mm", lambda: dg.mm(mk(7, 64), mk(64, 16)), (7, 16), dtype),
        ("mm-fp32-out", lambda: dg.mm(mk(7, 64), mk(64, 16), out_dtype=F32), (7, 16), F32),
        ("addmm", lambda: dg.addmm(mk(16), mk(7, 64), mk(64, 16)), (7, 16), dtype),
        ("linear", lambda: dg.linear(mk(7, 64), mk(16, 64), mk(16)), (7, 16), dtype),
        ("linear-3d", lambda: dg.linear(mk(2, 7, 64), mk(16, 64), out_dtype=F32), (2, 7, 16), F32),
        ("linear-1d", lambda: dg.linear(mk(64), mk(16, 64)), (16,), dtype),
        ("linear-m0", lambda: dg.linear(mk(0, 64), mk(16, 64)), (0, 16), dtype),
        ("input_grad", lambda: dg.input_grad(mk(2, 7, 16), mk(16, 64)), (2, 7, 64), dtype),
        ("weight_grad", lambda: dg.weight_grad(mk(2, 7, 16), mk(2, 7, 64)), (16, 64), F32),
        ("weight_grad-bf16", lambda: dg.weight_grad(mk(7, 16), mk(7, 64), out_dtype=BF),
         (16, 64), BF),
        ("weight_grad-acc", lambda: dg.weight_grad(mk(7, 16), mk(7, 64), acc=mk(16, 64, d=F32)),
         (16, 64), F32),
        ("bias_grad", lambda: dg.bias_grad(mk(2, 7, 16)), (16,), F32),
        ("bias_grad-acc", lambda: dg.bias_grad(mk(7, 16), acc=mk(16, d=F32)), (16,), F32),
    ]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("dtype", [BF, FP])
@pytest.mark.parametrize("case", calls("meta"), ids=_ids(calls("meta")))
def test_meta_tensors(case, dtype):
    _, fn, shape, want = next(c for c in calls("meta", dtype) if c[0] == case[0])
    y = fn()
    assert y.device.type == "meta" and tuple(y.shape) == shape and y.dtype == want


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_fake_tensors_under_a_bare_fake_mode(device):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Accessing the data pointer of FakeTensor"
        with FakeTensorMode():
            for name, fn, shape, dtype in calls(device):
                y = fn()
                assert isinstance(y, FakeTensor), name
                assert y.device.type == device, name
                assert tuple(y.shape) == shape and y.dtype == dtype, name


def test_fake_tensors_made_from_real_ones():
    """`FakeTensorMode.from_tensor` (what export and estimators do) then calls outside the
    mode: the fake tensors bring their mode along."""
    mode = FakeTensorMode()
    x, w = mode.from_tensor(torch.randn(5, 32).to(BF)), mode.from_tensor(torch.randn(8, 32).to(BF))
    y = dg.linear(x, w)
    assert isinstance(y, FakeTensor) and y.shape == (5, 8) and y.dtype == BF


def test_autograd_on_meta_tensors():
    x, w, b = t(4, 6, 32, grad=True), t(16, 32, grad=True), t(16, grad=True)
    y = dg.linear(x, w, b)
    y.sum().backward()
    for p in (x, w, b):
        assert p.grad.device.type == "meta" and p.grad.shape == p.shape and p.grad.dtype == BF
    a, m = t(4, 32, grad=True), t(32, 16, grad=True)
    dg.addmm(b.detach(), a, m).sum().backward()
    assert a.grad.shape == (4, 32) and m.grad.shape == (32, 16)


@pytest.mark.parametrize("fp32_grad_accum", [False, True])
def test_module_built_on_meta(fp32_grad_accum):
    """A model created under torch.device('meta') (as large models are, before loading a
    checkpoint), converted and run: shapes and dtypes only."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                    torch.nn.Linear(128, 32)).to(BF)
    model = dg.nn.convert(model, fp32_grad_accum=fp32_grad_accum)
    y = model(t(2, 9, 64))
    assert y.device.type == "meta" and y.shape == (2, 9, 32) and y.dtype == BF
    y.sum().backward()
    if fp32_grad_accum:
        assert model[0].weight.main_grad.device.type == "meta"
        assert model[0].weight.main_grad.dtype == F32
    else:
        assert model[0].weight.grad.shape == (128, 64)


def test_module_under_fake_mode_with_fp32_parameters_and_autocast():
    """Memory-estimation style: the whole converted fp32 model under FakeTensorMode and CPU
    autocast (fp32 parameters, bf16 compute)."""
    with FakeTensorMode():
        model = dg.nn.convert(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                                  torch.nn.Linear(128, 32)))
        x = torch.randn(4, 64)
        with torch.autocast("cpu", dtype=BF):
            y = model(x)
        assert isinstance(y, FakeTensor) and y.dtype == BF and y.shape == (4, 32)
        y.float().sum().backward()
        assert model[0].weight.grad.dtype == F32 and model[0].weight.grad.shape == (128, 64)


def test_bad_arguments_on_meta_and_fake_name_them():
    with pytest.raises(ValueError, match=r"K mismatch: input has K=32 .* weight has K=33"):
        dg.linear(t(4, 32), t(8, 33))
    with pytest.raises(TypeError, match=r"input must be torch\.bfloat16, torch\.float16 or "
                                        r"torch\.float32, got torch\.float64"):
        dg.linear(t(4, 32, dtype=torch.float64), t(8, 32, dtype=torch.float64))
    with FakeTensorMode():
        with pytest.raises(ValueError, match=r"bias must be 1-D of length N=8"):
            dg.linear(torch.empty(4, 32, dtype=BF, device="cuda"),
                      torch.empty(8, 32, dtype=BF, device="cuda"),
                      torch.empty(9, dtype=BF, device="cuda"))
        with pytest.raises(ValueError, match=r"weight is on cpu but input is on cuda"):
            dg.linear(torch.empty(4, 32, dtype=BF, device="cuda"), torch.empty(8, 32, dtype=BF))
