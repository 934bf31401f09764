"""Arguments that cannot apply are refused (or, where refusing would break a common path,
warned about once), never ignored: an explicit fp32 precision on 16-bit inputs,
finalize_grads without fp32 accumulation, convert on a non-module or a float64 model,
int64 offs, a bad DETGEMM_CUTE_CONFIG seen by CPU calls and by the mode."""

import warnings

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import registry as R
from detgemm_cute import split

g = torch.Generator().manual_seed(3)
X16 = torch.randn(8, 32, generator=g).bfloat16()
W16 = torch.randn(4, 32, generator=g).bfloat16()
X32, W32 = X16.float(), W16.float()

SIXTEEN_BIT_CALLS = {
    "linear": lambda p: dg.linear(X16, W16, precision=p),
    "mm": lambda p: dg.mm(X16, W16.t(), precision=p),
    "addmm": lambda p: dg.addmm(W16[:, 0], X16, W16.t(), precision=p),
    "input_grad": lambda p: dg.input_grad(X16[:, :4], W16, precision=p),
    "bmm": lambda p: dg.bmm(X16[None], W16.t()[None], precision=p),
    "grouped_mm": lambda p: dg.grouped_mm(X16, W16.t().reshape(1, 32, 4).contiguous(),
                                          torch.tensor([8], dtype=torch.int32), precision=p),
}


@pytest.mark.parametrize("op", list(SIXTEEN_BIT_CALLS))
@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_precision_on_16_bit_inputs_is_refused(op, precision):
    with pytest.raises(ValueError, match=rf"detgemm_cute\.{op}: precision='{precision}' "
                                         r"chooses how fp32 inputs .* torch\.bfloat16"):
        SIXTEEN_BIT_CALLS[op](precision)


def test_precision_on_fp32_inside_autocast_warns_once(monkeypatch):
    monkeypatch.setattr(split, "_warned_autocast", False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match=r"precision='tf32' has no effect inside "
                                             r"torch\.autocast.*torch\.bfloat16"):
            y = dg.linear(X32, W32, precision="tf32")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            dg.linear(X32, W32, precision="tf32")
    assert y.dtype == torch.bfloat16 and torch.equal(y, dg.linear(X16, W16))


def test_precision_on_fp32_outside_autocast_is_silent_and_applies():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tf32, ieee = dg.linear(X32, W32, precision="tf32"), dg.linear(X32, W32, precision="ieee")
    with dg.fp32_precision("tf32"):
        assert torch.equal(tf32, dg.linear(X32, W32))
    assert torch.equal(ieee, dg.linear(X32, W32))


def _model(**kw):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).to(**kw)


@pytest.mark.parametrize("converted", [False, True])
def test_finalize_grads_without_fp32_accumulation_raises(converted):
    model = _model(dtype=torch.bfloat16)
    if converted:
        dg.nn.convert(model)
    model(X16).sum().backward()
    with pytest.raises(RuntimeError, match="fp32_grad_accum=True"):
        dg.nn.finalize_grads(model)


def test_finalize_grads_with_fp32_accumulation_sets_grad():
    model = dg.nn.convert(_model(dtype=torch.bfloat16), fp32_grad_accum=True)
    model(X16).sum().backward()
    dg.nn.finalize_grads(model)
    assert torch.equal(model[0].weight.grad, model[0].weight.main_grad.bfloat16())


@pytest.mark.parametrize("arg", [torch.ones(3), "model", None])
def test_convert_names_a_non_module(arg):
    with pytest.raises(TypeError, match=r"convert: model must be a torch\.nn\.Module, got "
                                        + type(arg).__name__):
        dg.nn.convert(arg)


@pytest.mark.parametrize("kw", [dict(dtype=torch.float64), dict(dtype=torch.float16)])
def test_convert_refuses_float64_at_convert_time(kw):
    model = _model(**kw)
    if kw["dtype"] == torch.float64:
        with pytest.raises(ValueError, match=r"0\.weight is torch\.float64"):
            dg.nn.convert(model)
        assert type(model[0]) is torch.nn.Linear  # nothing swapped
    else:
        assert isinstance(dg.nn.convert(model)[0], dg.nn.Linear)


def test_convert_filter_leaves_a_float64_layer_out():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).double(), torch.nn.Linear(8, 8))
    dg.nn.convert(model, filter=lambda name, m: m.weight.dtype != torch.float64)
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], dg.nn.Linear)


def test_converted_linear_repr_is_not_torchs():
    model = dg.nn.convert(_model(), fp32_grad_accum=True)
    assert repr(model[0]) == ("detgemm_cute.nn.Linear(in_features=32, out_features=16, "
                              "bias=True, fp32_grad_accum=True)")
    assert repr(torch.nn.Linear(2, 3)).startswith("Linear(")


@pytest.mark.parametrize("offs, got", [
    (torch.tensor([8], dtype=torch.int64), "got a 1-D torch.int64 tensor; use offs.to"),
    (torch.tensor([[8]], dtype=torch.int32), "got a 2-D torch.int32 tensor"),
    ([8], "got list"),
])
def test_grouped_mm_says_what_offs_it_got(offs, got):
    w = W16.t().reshape(1, 32, 4).contiguous()
    with pytest.raises(TypeError, match="offs must be a 1-D torch.int32 tensor") as e:
        dg.grouped_mm(X16, w, offs)
    assert got in str(e.value)


BAD_CONFIG = "arch: sm90\nbuckets:\n  - name: half_a_bucket\n    op: fwd\n"


@pytest.fixture
def bad_env_config(tmp_path, monkeypatch):
    path = tmp_path / "bad_layer.yaml"
    path.write_text(BAD_CONFIG)
    monkeypatch.setenv(R.ENV_VAR, str(path))
    R.reset_user_configs()
    return path


@pytest.mark.parametrize("call", [
    lambda: dg.linear(X16, W16),
    lambda: dg.mm(X32, W32.t()),
    lambda: dg.weight_grad(X16, X16),
    lambda: dg.bmm(X16[None], W16.t()[None]),
])
def test_a_bad_user_table_is_reported_by_cpu_calls(bad_env_config, call):
    with pytest.raises(R.ConfigError, match=r"bad_layer\.yaml:3: bucket 'half_a_bucket'"):
        call()


def test_a_bad_user_table_is_reported_when_the_mode_is_enabled(bad_env_config):
    with pytest.raises(R.ConfigError, match=r"bad_layer\.yaml"):
        dg.enable()
    assert dg.disable() is False  # the failed enable left the mode off
