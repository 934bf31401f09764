"""Bad-input matrix on CPU tensors, through every public entry point: mm, addmm, linear,
input_grad, weight_grad, bias_grad, the torch.ops.detgemm ops (eagerly, under autograd,
under their fake implementations and under torch.compile), inside torch.autocast, on meta
and fake tensors, with DTensor arguments, and the mode on a PyTorch without CUDA. Each case
either raises a clear error (type + a message naming the argument and what was expected) or
gives the bits of `detgemm_cute.reference` on contiguous copies of the inputs.

Tiny shapes only: CPU tensors run the bit-exact reference."""

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode

import detgemm_cute as dg
from detgemm_cute import grads, reference

BF, FP, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
OPS = torch.ops.detgemm
BIG = 2**31  # one past the supported maximum dimension
M, K, N = 4, 8, 3


def rand(*shape, dtype=BF, grad=False):
    return torch.randn(shape).to(dtype).requires_grad_(grad)


def ints(*shape, dtype=torch.int32):
    return torch.ones(*shape, dtype=dtype)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


def huge(rows, cols, dtype=BF):
    """A [rows, cols] CPU tensor of stride 0: any size, no memory."""
    return torch.zeros(1, 1, dtype=dtype).expand(rows, cols)


def flat(t):
    return t.reshape(-1, t.shape[-1])


def same(got, want):
    """Same dtype, shape, NaN positions and bits elsewhere."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape,
                                                                  want.dtype, want.shape)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(reference.bits(got), reference.bits(want))


# The reference of each entry point, applied to contiguous copies.
REF = {
    "mm": lambda a, b, out_dtype=None: reference.mm(a, b, out_dtype),
    "addmm": lambda bias, a, b: reference.addmm(bias, a, b),
    "linear": lambda x, w, bias=None, out_dtype=None: reference.linear(x, w, bias, out_dtype),
    "input_grad": lambda dy, w: reference.mm(flat(dy), w).reshape(*dy.shape[:-1], w.shape[1]),
    "weight_grad": lambda dy, x: reference.chain(flat(dy).t(), flat(x)),
    "bias_grad": lambda dy: reference.chain(flat(dy).t(), torch.ones(flat(dy).shape[0], 1,
                                                                     dtype=dy.dtype))[:, 0],
}
FN = {"mm": dg.mm, "addmm": dg.addmm, "linear": dg.linear, "input_grad": dg.input_grad,
      "weight_grad": dg.weight_grad, "bias_grad": dg.bias_grad}


def E(call, exc, regex, id, marks=()):
    return pytest.param(call, exc, regex, id=id, marks=marks)


BAD = [
    # --- dtypes -------------------------------------------------------------------------
    *[E(lambda dt=dt: dg.mm(torch.ones(M, K, dtype=dt), rand(K, N)), TypeError,
        rf"detgemm_cute\.mm: a must be torch\.bfloat16, torch\.float16 or torch\.float32, "
        rf"got {dt}", f"mm-a-{dt}")
      for dt in (F64, torch.int32, torch.int64, torch.bool)],
    E(lambda: dg.mm(torch.ones(M, K, dtype=F32), rand(K, N)), TypeError,
      r"b must have the same dtype as a \(torch\.float32\), got torch\.bfloat16", "mm-fp32-bf16"),
    E(lambda: dg.mm(rand(M, K), rand(K, N, dtype=FP)), TypeError,
      r"b must have the same dtype as a \(torch\.bfloat16\), got torch\.float16", "mm-mixed"),
    E(lambda: dg.addmm(rand(N), rand(M, K), rand(K, N, dtype=F32)), TypeError,
      r"detgemm_cute\.addmm: b must have the same dtype as a", "addmm-b-fp32"),
    E(lambda: dg.linear(rand(2, M, K, dtype=F64), rand(N, K, dtype=F64)), TypeError,
      r"linear: input must be torch\.bfloat16, torch\.float16 or torch\.float32, got "
      r"torch\.float64", "linear-fp64"),
    E(lambda: dg.linear(rand(M, K, dtype=FP), rand(N, K)), TypeError,
      r"weight must have the same dtype as input \(torch\.float16\), got torch\.bfloat16",
      "linear-mixed"),
    E(lambda: dg.input_grad(rand(M, N, dtype=F64), rand(N, K, dtype=F64)), TypeError,
      r"input_grad: grad_output must be torch\.bfloat16, torch\.float16 or torch\.float32",
      "input_grad-fp64"),
    E(lambda: dg.input_grad(rand(M, N), ints(N, K, dtype=torch.bool)), TypeError,
      r"weight must have the same dtype as grad_output", "input_grad-bool-weight"),
    E(lambda: dg.weight_grad(rand(M, N), ints(M, K, dtype=torch.int8)), TypeError,
      r"weight_grad: input must be torch\.bfloat16, torch\.float16 or torch\.float32, got "
      r"torch\.int8",
      "weight_grad-int8"),
    E(lambda: dg.weight_grad(rand(M, N, dtype=FP), rand(M, K)), TypeError,
      r"input must have the same dtype as grad_output \(torch\.float16\)", "weight_grad-mixed"),
    E(lambda: dg.bias_grad(ints(M, N, dtype=torch.bool)), TypeError,
      r"bias_grad: grad_output must be torch\.bfloat16, torch\.float16 or torch\.float32, "
      r"got torch\.bool",
      "bias_grad-bool"),
    E(lambda: dg.bias_grad(rand(M, N, dtype=F64)), TypeError, r"grad_output must be torch\.bf",
      "bias_grad-fp64"),
    # --- bias ---------------------------------------------------------------------------
    E(lambda: dg.addmm(rand(N, dtype=F32), rand(M, K), rand(K, N)), TypeError,
      r"bias must have dtype torch\.bfloat16 like a, got torch\.float32", "addmm-bias-fp32"),
    E(lambda: dg.linear(rand(M, K), rand(N, K), rand(N, dtype=FP)), TypeError,
      r"bias must have dtype torch\.bfloat16 like input, got torch\.float16", "linear-bias-fp16"),
    E(lambda: dg.addmm(rand(M), rand(M, K), rand(K, N)), ValueError,
      r"bias must be 1-D of length N=3, got shape \(4,\)", "addmm-bias-length"),
    E(lambda: dg.linear(rand(M, K), rand(N, K), rand(1, N)), ValueError,
      r"bias must be 1-D of length N=3, got shape \(1, 3\)", "linear-bias-2d"),
    E(lambda: dg.linear(rand(M, K), rand(N, K), rand()), ValueError,
      r"bias must be 1-D of length N=3, got shape \(\)", "linear-bias-0d"),
    # --- out_dtype ----------------------------------------------------------------------
    *[E(lambda od=od: dg.mm(rand(M, K), rand(K, N), out_dtype=od), TypeError,
        rf"mm: out_dtype must be one of torch\.bfloat16, torch\.float16, torch\.float32 or "
        rf"None, got {od}", f"mm-out-{od}") for od in (torch.int8, F64, "bf16")],
    E(lambda: dg.addmm(rand(N), rand(M, K), rand(K, N), out_dtype=torch.bool), TypeError,
      r"addmm: out_dtype must be one of", "addmm-out-bool"),
    E(lambda: dg.linear(rand(M, K), rand(N, K), out_dtype="float32"), TypeError,
      r"linear: out_dtype must be one of .* got float32", "linear-out-str"),
    E(lambda: dg.input_grad(rand(M, N), rand(N, K), out_dtype=torch.int8), TypeError,
      r"input_grad: out_dtype must be one of", "input_grad-out-int8"),
    E(lambda: dg.weight_grad(rand(M, N), rand(M, K), out_dtype="fp32"), TypeError,
      r"weight_grad: out_dtype must be torch\.float32, torch\.bfloat16 or torch\.float16, "
      r"got fp32", "weight_grad-out-str"),
    # --- ranks --------------------------------------------------------------------------
    E(lambda: dg.mm(rand(), rand(K, N)), ValueError, r"a must be 2-D \[M, K\], got shape \(\)",
      "mm-a-0d"),
    E(lambda: dg.mm(rand(K), rand(K, N)), ValueError, r"a must be 2-D \[M, K\], got shape \(8,\)",
      "mm-a-1d"),
    E(lambda: dg.mm(rand(2, M, K), rand(K, N)), ValueError, r"a must be 2-D \[M, K\]", "mm-a-3d"),
    E(lambda: dg.addmm(rand(N), rand(M, K), rand(1, K, N)), ValueError,
      r"b must be 2-D \[K, N\], got shape \(1, 8, 3\)", "addmm-b-3d"),
    E(lambda: dg.linear(rand(), rand(N, K)), ValueError,
      r"linear: input must be a tensor of shape \[\.\.\., K\]", "linear-x-0d"),
    E(lambda: dg.linear(rand(M, K), rand(K)), ValueError, r"weight must be 2-D \[N, K\]",
      "linear-w-1d"),
    E(lambda: dg.linear(rand(2, M, K), rand(1, N, K)), ValueError, r"weight must be 2-D \[N, K\]",
      "linear-w-3d"),
    E(lambda: dg.input_grad(rand(), rand(N, K)), ValueError,
      r"grad_output must have shape \[\.\.\., features\], got a 0-d tensor", "input_grad-0d"),
    E(lambda: dg.input_grad(rand(M, N), rand(N)), ValueError, r"weight must be 2-D",
      "input_grad-w-1d"),
    E(lambda: dg.weight_grad(rand(M, N), rand()), ValueError,
      r"weight_grad: input must have shape \[\.\.\., features\]", "weight_grad-0d"),
    E(lambda: dg.bias_grad(rand()), ValueError, r"bias_grad: grad_output must have shape",
      "bias_grad-0d"),
    # --- K / token mismatch -------------------------------------------------------------
    E(lambda: dg.mm(rand(M, K), rand(K + 1, N)), ValueError,
      r"K mismatch: a has K=8 \(shape \(4, 8\)\) but b has K=9 \(shape \(9, 3\)\)", "mm-K"),
    E(lambda: dg.linear(rand(2, M, K), rand(N, K + 1), rand(N)), ValueError,
      r"K mismatch: input has K=8 .* weight has K=9", "linear-K"),
    E(lambda: dg.input_grad(rand(M, N), rand(N + 1, K)), ValueError,
      r"input_grad: K mismatch: grad_output .* weight", "input_grad-N"),
    E(lambda: dg.weight_grad(rand(2, 3, N), rand(3, 2, K)), ValueError,
      r"grad_output \(2, 3, 3\) and input \(3, 2, 8\) must have the same leading \(token\) dims",
      "weight_grad-leading"),
    # --- zero-size dims (M = 0 is fine, see test_m_zero) ----------------------------------
    E(lambda: dg.mm(rand(M, 0), rand(0, N)), ValueError,
      r"N and K must be >= 1, got N=3, K=0 \(a \(4, 0\), b \(0, 3\)\)", "mm-K0"),
    E(lambda: dg.mm(rand(M, K), rand(K, 0)), ValueError, r"N and K must be >= 1, got N=0",
      "mm-N0"),
    E(lambda: dg.mm(rand(0, 0), rand(0, N)), ValueError, r"N and K must be >= 1", "mm-M0-K0"),
    E(lambda: dg.addmm(rand(0), rand(M, K), rand(K, 0)), ValueError, r"N and K must be >= 1",
      "addmm-N0"),
    E(lambda: dg.linear(rand(M, 0), rand(N, 0)), ValueError,
      r"N and K must be >= 1, got N=3, K=0 \(input \(4, 0\), weight \(3, 0\)\)", "linear-K0"),
    *[E(call, ValueError, regex, name)
      for call, regex, name in (
          (lambda: dg.linear(rand(2, M, 0), rand(N, 0)), r"N and K must be >= 1", "linear-K0-3d"),
          (lambda: dg.linear(rand(0), rand(N, 0)), r"N and K must be >= 1", "linear-K0-1d"),
          (lambda: dg.input_grad(rand(2, M, 0), rand(0, K)), r"N and K must be >= 1",
           "input_grad-N0-3d"),
          (lambda: dg.bias_grad(rand(2, M, 0)), r"grad_output must have a last dim >= 1",
           "bias_grad-N0-3d"))],
    E(lambda: dg.input_grad(rand(M, N), rand(N, 0)), ValueError, r"N and K must be >= 1",
      "input_grad-K0"),
    E(lambda: dg.weight_grad(rand(M, 0), rand(M, K)), ValueError,
      r"feature dims must be >= 1, got grad_output \(4, 0\), input \(4, 8\)", "weight_grad-N0"),
    E(lambda: dg.weight_grad(rand(M, N), rand(M, 0)), ValueError, r"feature dims must be >= 1",
      "weight_grad-K0"),
    E(lambda: dg.bias_grad(rand(M, 0)), ValueError,
      r"grad_output must have a last dim >= 1, got \(4, 0\)", "bias_grad-N0"),
    # --- not tensors --------------------------------------------------------------------
    E(lambda: dg.mm([[1.0]], rand(1, N)), TypeError, r"mm: a must be a torch\.Tensor, got list",
      "mm-list"),
    E(lambda: dg.mm(rand(M, K), np.ones((K, N))), TypeError,
      r"b must be a torch\.Tensor, got ndarray", "mm-ndarray"),
    E(lambda: dg.mm(rand(M, K), None), TypeError, r"b must be a torch\.Tensor, got NoneType",
      "mm-None"),
    E(lambda: dg.addmm([0.0] * N, rand(M, K), rand(K, N)), TypeError,
      r"bias must be a torch\.Tensor, got list", "addmm-bias-list"),
    E(lambda: dg.linear(rand(M, K), None), TypeError,
      r"weight must be a torch\.Tensor, got NoneType", "linear-w-None"),
    E(lambda: dg.linear(rand(M, K), rand(N, K), np.zeros(N)), TypeError,
      r"bias must be a torch\.Tensor, got ndarray", "linear-bias-ndarray"),
    E(lambda: dg.input_grad([[1.0]], rand(1, K)), TypeError,
      r"grad_output must be a torch\.Tensor, got list", "input_grad-list"),
    E(lambda: dg.weight_grad(None, rand(M, K)), TypeError,
      r"grad_output must be a torch\.Tensor, got NoneType", "weight_grad-None"),
    E(lambda: dg.weight_grad(rand(M, N), np.ones((M, K))), TypeError,
      r"input must be a torch\.Tensor, got ndarray", "weight_grad-ndarray"),
    E(lambda: dg.bias_grad((1.0, 2.0)), TypeError, r"grad_output must be a torch\.Tensor",
      "bias_grad-tuple"),
    E(lambda: dg.weight_grad(rand(M, N), rand(M, K), acc=[[0.0] * K] * N), TypeError,
      r"acc must be a torch\.Tensor or None, got list", "weight_grad-acc-list"),
    E(lambda: dg.bias_grad(rand(M, N), acc=np.zeros(N, np.float32)), TypeError,
      r"acc must be a torch\.Tensor or None, got ndarray", "bias_grad-acc-ndarray"),
    *[E(call, TypeError, r"linear: input must be a torch\.Tensor, got " + name,
        f"linear-x-{name}")
      for call, name in ((lambda: dg.linear([[1.0] * K], rand(N, K)), "list"),
                         (lambda: dg.linear(None, rand(N, K)), "NoneType"))],
    *[E(call, TypeError, r"addmm: bias must be a torch\.Tensor, got NoneType", f"addmm-None-{g}")
      for call, g, why in (
          (lambda: dg.addmm(None, rand(M, K), rand(K, N)), "eager",
           "silently computes mm (reference.addmm raises TypeError)"),
          (lambda: dg.addmm(None, rand(M, K, grad=True), rand(K, N)), "autograd",
           "crashes with AttributeError: 'NoneType' object has no attribute 'dtype'"))],
    # --- two devices (meta tensors alone are fine: tests/test_meta_fake_cpu.py) -----------
    E(lambda: dg.mm(rand(M, K), meta(K, N)), ValueError, r"b is on meta but a is on cpu",
      "mm-cpu-meta"),
    E(lambda: dg.addmm(meta(N), rand(M, K), rand(K, N)), ValueError,
      r"bias is on meta but a is on cpu", "addmm-bias-meta"),
    E(lambda: dg.linear(rand(M, K), meta(N, K)), ValueError,
      r"weight is on meta but input is on cpu", "linear-cpu-meta"),
    E(lambda: dg.linear(rand(M, K), rand(N, K), meta(N)), ValueError,
      r"bias is on meta but input is on cpu", "linear-bias-meta"),
    E(lambda: dg.input_grad(rand(M, N), meta(N, K)), ValueError,
      r"weight is on meta but grad_output is on cpu", "input_grad-cpu-meta"),
    E(lambda: dg.weight_grad(rand(M, N), meta(M, K)), ValueError,
      r"input is on meta but grad_output is on cpu", "weight_grad-cpu-meta"),
    E(lambda: dg.weight_grad(rand(M, N), rand(M, K), acc=meta(N, K, dtype=F32)), ValueError,
      r"acc is on meta but the gradients are on cpu", "weight_grad-acc-meta"),
    E(lambda: dg.bias_grad(rand(M, N), acc=meta(N, dtype=F32)), ValueError,
      r"acc is on meta but the gradients are on cpu", "bias_grad-acc-meta"),
    *[E(call, ValueError, regex, f"{name}-cpu-meta") for call, regex, name in (
        (lambda: dg.linear(rand(M, K, grad=True), meta(N, K)),
         r"weight is on meta but input is on cpu", "linear-autograd"),
        (lambda: dg.addmm(meta(N), rand(M, K, grad=True), rand(K, N)),
         r"bias is on meta but a is on cpu", "addmm-autograd"),
        (lambda: OPS.mm(rand(M, K), meta(K, N)), r"b is on meta but a is on cpu", "op-mm"),
        (lambda: OPS.linear(rand(M, K), rand(N, K), meta(N)), r"bias is on meta", "op-linear"),
        (lambda: OPS.input_grad(rand(M, N), meta(N, K)), r"weight is on meta", "op-input_grad"))],
    # --- dims beyond 2**31 - 1: checked before the device -------------------------------
    E(lambda: dg.mm(huge(BIG, K), rand(K, N)), ValueError,
      r"mm: M=2147483648 exceeds the supported maximum 2147483647", "mm-M-huge"),
    E(lambda: dg.mm(huge(M, BIG), huge(BIG, N)), ValueError, r"K=2147483648 exceeds",
      "mm-K-huge"),
    E(lambda: dg.addmm(huge(1, BIG)[0], rand(M, K), huge(K, BIG)), ValueError,
      r"N=2147483648 exceeds", "addmm-N-huge"),
    E(lambda: dg.linear(rand(M, K), huge(BIG, K)), ValueError, r"N=2147483648 exceeds",
      "linear-N-huge"),
    E(lambda: dg.input_grad(huge(BIG, N), rand(N, K)), ValueError, r"M=2147483648 exceeds",
      "input_grad-M-huge"),
    E(lambda: dg.mm(meta(BIG, K), meta(K, N)), ValueError, r"M=2147483648 exceeds", "mm-meta-huge"),
    E(lambda: dg.linear(meta(BIG, K), rand(N, K)), ValueError, r"M=2147483648 exceeds",
      "linear-meta-huge-cpu"),
    # --- the fp32 accumulation buffer ---------------------------------------------------
    *[E(lambda dt=dt: dg.weight_grad(rand(M, N), rand(M, K), acc=torch.zeros(N, K, dtype=dt)),
        TypeError, rf"acc must be torch\.float32 \(the fp32 accumulation buffer\), got {dt}",
        f"weight_grad-acc-{dt}") for dt in (F64, BF, torch.int32)],
    *[E(lambda s=s: dg.weight_grad(rand(M, N), rand(M, K), acc=torch.zeros(s)), ValueError,
        r"acc must have shape \[3, 8\], got " + rf"\({', '.join(map(str, s))},?\)",
        f"weight_grad-acc-shape{s}") for s in ((N * K,), (1, N, K), (K, N))],
    E(lambda: dg.bias_grad(rand(M, N), acc=torch.zeros(N, dtype=FP)), TypeError,
      r"bias_grad: acc must be torch\.float32", "bias_grad-acc-fp16"),
    E(lambda: dg.bias_grad(rand(M, N), acc=torch.zeros(N, 1)), ValueError,
      r"acc must have shape \[3\], got \(3, 1\)", "bias_grad-acc-2d"),
    E(lambda: dg.weight_grad(rand(M, N), rand(M, K), acc=torch.zeros(N, K, requires_grad=True)),
      RuntimeError, r"weight_grad: acc requires grad; pass a plain buffer", "weight_grad-acc-rg"),
    E(lambda: dg.bias_grad(rand(M, N), acc=torch.zeros(N, requires_grad=True)), RuntimeError,
      r"bias_grad: acc requires grad", "bias_grad-acc-rg"),
    *[E(call, (ValueError, RuntimeError), r"\bacc\b", name)
      for call, name in ((lambda: dg.weight_grad(rand(M, N), rand(M, K),
                                                 acc=torch.zeros(1, K).expand(N, K)),
                          "weight_grad-acc-expanded"),
                         (lambda: dg.bias_grad(rand(M, N), acc=torch.zeros(1).expand(N)),
                          "bias_grad-acc-expanded"))],
    # --- the custom ops called directly, and the autograd path through them -------------
    E(lambda: OPS.mm(rand(M, K, dtype=F64), rand(K, N, dtype=F64)), TypeError,
      r"detgemm::mm: a must be torch\.bfloat16", "op-mm-fp64"),
    E(lambda: OPS.addmm(rand(M), rand(M, K), rand(K, N)), ValueError,
      r"detgemm::addmm: bias must be 1-D of length N=3", "op-addmm-bias"),
    E(lambda: OPS.linear(rand(M, K), rand(N, K + 1)), ValueError, r"detgemm::linear: K mismatch",
      "op-linear-K"),
    E(lambda: OPS.input_grad(rand(), rand(N, K)), ValueError,
      r"detgemm::input_grad: grad_output must have shape", "op-input_grad-0d"),
    E(lambda: OPS.weight_grad(rand(M, N), rand(M, K), torch.int8), TypeError,
      r"detgemm::weight_grad: out_dtype must be", "op-weight_grad-out"),
    E(lambda: OPS.weight_grad_acc_(torch.zeros(N, K, dtype=FP), rand(M, N), rand(M, K)), TypeError,
      r"detgemm::weight_grad_acc_: acc must be torch\.float32", "op-weight_grad_acc_-fp16"),
    E(lambda: OPS.bias_grad_acc_(torch.zeros(N + 1), rand(M, N)), ValueError,
      r"detgemm::bias_grad_acc_: acc must have shape \[3\]", "op-bias_grad_acc_-shape"),
    E(lambda: OPS.bias_grad(ints(M, N)), TypeError, r"detgemm::bias_grad: grad_output must be",
      "op-bias_grad-int"),
    E(lambda: OPS.mm([[1.0]], rand(1, N)), RuntimeError,
      r"Expected a value of type 'Tensor' for argument 'a'", "op-mm-list"),
    E(lambda: OPS.mm(rand(M, K), rand(K, N), "bf16"), RuntimeError, r"argument 'out_dtype'",
      "op-mm-out-str"),
    E(lambda: OPS.weight_grad_acc_(torch.zeros(N, K, requires_grad=True), rand(M, N), rand(M, K)),
      RuntimeError, r"acc requires grad", "op-weight_grad_acc_-rg"),
    E(lambda: OPS.bias_grad_acc_(torch.zeros(N, requires_grad=True), rand(M, N)),
      RuntimeError, r"acc requires grad", "op-bias_grad_acc_-rg"),
    E(lambda: dg.linear(rand(2, M, K, dtype=F64, grad=True), rand(N, K, dtype=F64)), TypeError,
      r"detgemm::linear: input must be torch\.bfloat16", "autograd-linear-fp64"),
    E(lambda: dg.mm(rand(M, K, grad=True), rand(K + 1, N)), ValueError,
      r"detgemm::mm: K mismatch", "autograd-mm-K"),
    E(lambda: dg.addmm(rand(M, grad=True), rand(M, K), rand(K, N)), ValueError,
      r"detgemm::addmm: bias must be 1-D of length N=3", "autograd-addmm-bias"),
]


@pytest.mark.parametrize("call, exc, regex", BAD)
def test_bad_input_is_refused(call, exc, regex):
    with pytest.raises(exc, match=regex):
        call()


@pytest.mark.parametrize("call", [lambda: dg.weight_grad(huge(BIG, N), huge(BIG, K)),
                                  lambda: dg.bias_grad(huge(BIG, N))], ids=["dw", "db"])
def test_token_count_beyond_int32_is_refused(monkeypatch, call):
    def reached(*args, **kwargs):
        raise AssertionError("the GEMM was reached with 2**31 tokens")

    monkeypatch.setattr(grads, "gemm", reached)
    monkeypatch.setattr(grads, "_ones_operand", reached)  # would allocate 32 GiB of ones
    with pytest.raises(ValueError, match=r"exceeds the supported maximum 2147483647"):
        call()


FAKE = [
    E(lambda: OPS.mm(rand(M, K, dtype=F64), rand(K, N, dtype=F64)), TypeError, r"a must be",
      "mm-fp64"),
    E(lambda: OPS.linear(rand(M, K), rand(N, K + 1)), ValueError, r"K mismatch", "linear-K"),
    E(lambda: OPS.addmm(rand(N, dtype=FP), rand(M, K), rand(K, N)), TypeError, r"bias must have",
      "addmm-bias"),
    E(lambda: OPS.input_grad(rand(M, N), rand(N + 1, K)), ValueError, r"K mismatch", "dx-N"),
    E(lambda: OPS.weight_grad(rand(M, N), rand(M + 1, K)), ValueError, r"same leading", "dw-T"),
    E(lambda: OPS.linear(rand(), rand(N, K)), ValueError, r"input must be a tensor of shape",
      "linear-0d"),
    E(lambda: OPS.input_grad(rand(), rand(N, K)), ValueError, r"grad_output must have shape",
      "dx-0d"),
    E(lambda: OPS.weight_grad(rand(M, N), rand(M, K), torch.int8), TypeError, r"out_dtype",
      "dw-out-int8"),
    E(lambda: OPS.bias_grad(rand(M, N, dtype=F64)), TypeError, r"grad_output must be",
      "db-fp64"),
    E(lambda: OPS.bias_grad(rand(M, 0)), ValueError, r"last dim >= 1", "db-N0"),
    E(lambda: OPS.weight_grad_acc_(torch.zeros(N, K, dtype=FP), rand(M, N), rand(M, K)),
      TypeError, r"acc must be torch\.float32", "dw-acc-fp16"),
    E(lambda: OPS.bias_grad_acc_(torch.zeros(N + 1), rand(M, N)), ValueError,
      r"acc must have shape", "db-acc-shape"),
]


@pytest.mark.parametrize("call, exc, regex", FAKE)
def test_fake_impls_raise_the_eager_errors(call, exc, regex):
    """Under FakeTensorMode every op runs its fake implementation only."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(exc, match=regex):
            call()


@pytest.mark.parametrize("fn, args, exc, regex", [
    pytest.param(lambda a, b: dg.mm(a, b), (rand(M, K, dtype=F64), rand(K, N, dtype=F64)),
                 TypeError, r"detgemm::mm: a must be torch\.bfloat16", id="mm-fp64"),
    pytest.param(lambda x, w, b: dg.linear(x, w, b), (rand(2, M, K), rand(N, K + 1), rand(N)),
                 ValueError, r"detgemm::linear: K mismatch", id="linear-K"),
    pytest.param(lambda b, x, w: dg.addmm(b, x, w), (rand(M), rand(M, K), rand(K, N)),
                 ValueError, r"bias must be 1-D of length N=3", id="addmm-bias"),
    pytest.param(lambda dy, x, acc: dg.weight_grad(dy, x, acc=acc),
                 (rand(M, N), rand(M, K), torch.zeros(N, K, dtype=FP)), TypeError,
                 r"weight_grad(_acc_)?: acc must be torch\.float32", id="dw-acc-fp16"),
    pytest.param(lambda x, w: dg.linear(x, w), (rand(), rand(N, K)), ValueError,
                 r"input must be a tensor of shape", id="linear-0d"),
])
def test_compiled_calls_raise_the_eager_errors(fn, args, exc, regex):
    """Dynamo wraps errors raised by fake implementations in a RuntimeError that carries
    the original message."""
    torch._dynamo.reset()
    with pytest.raises((exc, RuntimeError), match=regex):
        torch.compile(fn, fullgraph=True, backend="eager")(*args)


# --- inputs that are fine: the contract holds --------------------------------------------

@pytest.mark.parametrize("call, shape, dtype", [
    (lambda: dg.mm(rand(0, K), rand(K, N)), (0, N), BF),
    (lambda: dg.mm(rand(0, K, dtype=FP), rand(K, N, dtype=FP), out_dtype=F32), (0, N), F32),
    (lambda: dg.addmm(rand(N), rand(0, K), rand(K, N)), (0, N), BF),
    (lambda: dg.linear(rand(2, 0, K), rand(N, K), rand(N)), (2, 0, N), BF),
    (lambda: OPS.linear(rand(0, K), rand(N, K), None, F32), (0, N), F32),
    (lambda: dg.input_grad(rand(0, N), rand(N, K)), (0, K), BF),
    (lambda: dg.weight_grad(rand(0, 5, N), rand(0, 5, K)), (N, K), F32),
    (lambda: dg.weight_grad(rand(0, N), rand(0, K), out_dtype=BF), (N, K), BF),
    (lambda: dg.bias_grad(rand(0, N)), (N,), F32),
], ids=["mm", "mm-fp32", "addmm", "linear-3d", "op-linear", "input_grad", "weight_grad",
        "weight_grad-bf16", "bias_grad"])
def test_m_zero(call, shape, dtype):
    got = call()
    assert got.shape == shape and got.dtype == dtype
    assert not got.any()  # dW and db of no tokens are zeros


def _nc_cases():
    t = 20
    return [
        ("mm", rand(K, M).t(), rand(N, K).t()),                          # transposed views
        ("mm", rand(M, 2 * K)[:, ::2], rand(2 * K, N)[::2]),              # step slices
        ("mm", rand(1, K).expand(M, K), rand(K, 1).expand(K, N)),         # stride 0
        ("addmm", rand(2 * N)[::2], rand(K, M).t(), rand(K, 2 * N)[:, ::2]),
        ("addmm", rand(1).expand(N), rand(M, K), rand(N, K).t()),
        ("linear", rand(M, 2, K).transpose(0, 1), rand(N, 2 * K)[:, ::2], rand(2 * N)[::2]),
        ("linear", rand(K, M).t(), rand(K, N).t()),
        ("linear", rand(1, K).expand(M, K), rand(N, 1).expand(N, K), rand(1).expand(N)),
        ("input_grad", rand(N, M).t(), rand(N, 2 * K)[:, ::2]),
        ("input_grad", rand(1, 1, N).expand(2, M, N), rand(K, N).t()),
        ("weight_grad", rand(t, 2 * N)[:, ::2], rand(K, t).t()),
        ("weight_grad", rand(1, 1, N).expand(5, 4, N), rand(4, 5, K).transpose(0, 1)),
        ("bias_grad", rand(N, t).t()),
        ("bias_grad", rand(1, 1, N).expand(2, t, N)),
    ]


@pytest.mark.parametrize("case", _nc_cases(), ids=lambda c: c[0] if isinstance(c, str) else "")
def test_non_contiguous_inputs_give_the_reference_bits(case):
    name, *args = case
    assert not all(a.is_contiguous() for a in args)
    got = FN[name](*args)
    same(got, REF[name](*[a.contiguous() for a in args]))
    same(got, FN[name](*[a.contiguous() for a in args]))


def test_non_contiguous_acc_is_updated_in_place():
    dy, x = rand(20, N), rand(20, K)
    acc = torch.randn(K, N).t()
    want = reference.chain(dy.t(), x, acc.contiguous())
    assert dg.weight_grad(dy, x, acc=acc) is acc
    same(acc, want)
    base = torch.randn(2 * N)
    acc, odd = base[::2], base[1::2].clone()
    want = reference.chain(dy.t(), torch.ones(20, 1, dtype=BF), acc.reshape(N, 1).clone())[:, 0]
    assert dg.bias_grad(dy, acc=acc) is acc
    same(acc, want)
    same(base[1::2], odd)  # the elements between the strided view's are untouched


def test_requires_grad_acc_is_fine_without_grad_mode():
    dy, x = rand(16, N), rand(16, K)
    acc = torch.randn(N, K, requires_grad=True)
    want = reference.chain(dy.t(), x, acc.detach().clone())
    with torch.no_grad():
        assert dg.weight_grad(dy, x, acc=acc) is acc
    same(acc.detach(), want)


def _specials():
    x, w, b = rand(M, 32), rand(N, 32), rand(N)
    w[0, 3] = 0.0
    x[1, 5] = float("nan")
    x[2, 3] = float("inf")  # row 2: inf * w[n, 3]; w[0, 3] = 0 gives NaN
    return x, w, b


@pytest.mark.parametrize("out_dtype", [None, FP, F32])
def test_nan_inf_forward(out_dtype):
    x, w, b = _specials()
    for got, want in ((dg.linear(x, w, out_dtype=out_dtype), REF["linear"](x, w, None, out_dtype)),
                      (dg.mm(x, w.t(), out_dtype=out_dtype), REF["mm"](x, w.t(), out_dtype)),
                      (dg.linear(x.to(FP), w.to(FP), out_dtype=out_dtype),
                       REF["linear"](x.to(FP), w.to(FP), None, out_dtype))):
        same(got, want)
        assert torch.isnan(got[1]).all() and torch.isnan(got[2, 0])
        assert torch.isinf(got[2, 1:]).all() and torch.isfinite(got[[0, 3]]).all()
    b[1], b[2] = float("nan"), float("-inf")
    y = dg.addmm(b, x, w.t(), out_dtype=out_dtype)
    same(y, REF["linear"](x, w, b, out_dtype))
    same(dg.linear(x, w, b, out_dtype=out_dtype), y)
    assert torch.isnan(y[:, 1]).all() and torch.isnan(y[1]).all()
    assert (y[[0, 3], 2] == float("-inf")).all() and torch.isfinite(y[[0, 3], 0]).all()
    big = torch.full((2, 32), 2.0**100, dtype=BF)
    assert torch.isinf(dg.linear(big, big, out_dtype=out_dtype)).all()  # fp32 overflow -> inf


def test_nan_inf_backward():
    dy, x, w = rand(20, N), rand(20, K), rand(N, K)
    dy[3, 1] = float("nan")
    x[7, 2] = float("inf")
    dx = dg.input_grad(dy, w)
    same(dx, REF["input_grad"](dy, w))
    assert torch.isnan(dx[3]).all() and torch.isfinite(dx[torch.arange(20) != 3]).all()
    dw = dg.weight_grad(dy, x)
    same(dw, REF["weight_grad"](dy, x))
    assert torch.isnan(dw[1]).all() and torch.isinf(dw[[0, 2], 2]).all()
    db = dg.bias_grad(dy)
    same(db, REF["bias_grad"](dy))
    assert torch.isnan(db[1]) and torch.isfinite(db[[0, 2]]).all()
    acc = torch.randn(N, K)
    acc[0, 0], acc[2, 5] = float("nan"), float("inf")
    want = reference.chain(dy.t(), x, acc.clone())
    dg.weight_grad(dy, x, acc=acc)
    same(acc, want)
    assert torch.isnan(acc[0, 0]) and acc[2, 5] == float("inf")


@pytest.mark.parametrize("has_bias", [True, False])
def test_requires_grad_subsets_of_linear(has_bias):
    names = ("x", "weight", "bias") if has_bias else ("x", "weight")
    base = {"x": rand(2, 6, 24), "weight": rand(16, 24), "bias": rand(16)}
    g = rand(2, 6, 16)

    def run(subset):
        ts = {k: base[k].clone().requires_grad_(k in subset) for k in names}
        y = dg.linear(ts["x"], ts["weight"], ts.get("bias"))
        if subset:
            y.backward(g)
        return y, ts

    y_all, full = run(names)
    plain = dg.linear(base["x"], base["weight"], base["bias"] if has_bias else None)
    same(y_all.detach(), plain)
    for r in range(len(names) + 1):
        for subset in itertools.combinations(names, r):
            y, ts = run(subset)
            assert y.requires_grad == bool(subset)
            same(y.detach(), plain)
            for k in names:
                if k in subset:
                    same(ts[k].grad, full[k].grad)
                else:
                    assert ts[k].grad is None, (subset, k)
    with torch.no_grad():
        assert not dg.linear(*(full[k] for k in names)).requires_grad



# --- autocast, meta and fake tensors, the mode without CUDA, DTensor arguments ------------

def _amp(call, dtype=BF):
    def run():
        with torch.autocast("cpu", dtype=dtype):
            return call()
    return run


def _amp_fp32_dtype(call):
    """An autocast region whose dtype was set to fp32 (torch allows it inside a region)."""
    def run():
        with torch.autocast("cpu", dtype=BF):
            torch.set_autocast_dtype("cpu", F32)
            try:
                return call()
            finally:
                torch.set_autocast_dtype("cpu", BF)
    return run


def _fake(call):
    def run():
        with FakeTensorMode():
            return call()
    return run


def _fake_t(*shape, dtype=BF, device="cuda"):
    return torch.empty(*shape, dtype=dtype, device=device)


AMP_MODE_BAD = [
    E(_amp(lambda: dg.linear(rand(M, K, dtype=F64), rand(N, K, dtype=F64))), TypeError,
      r"detgemm::linear: input must be torch\.bfloat16, torch\.float16 or torch\.float32, got "
      r"torch\.float64", "amp-fp64-not-cast"),
    E(_amp(lambda: dg.mm(ints(M, K), ints(K, N))), TypeError,
      r"detgemm::mm: a must be torch\.bfloat16.* got torch\.int32", "amp-int"),
    E(_amp(lambda: dg.linear(rand(M, K, dtype=F32), rand(N, K, dtype=F64))), TypeError,
      r"weight must have the same dtype as input \(torch\.bfloat16\), got torch\.float64",
      "amp-fp32-fp64"),
    E(_amp(lambda: dg.linear(rand(M, K, dtype=F32), rand(N, K + 1, dtype=F32)), FP), ValueError,
      r"detgemm::linear: K mismatch", "amp-fp16-K"),
    E(_amp(lambda: dg.addmm(rand(M, dtype=F32), rand(M, K, dtype=F32), rand(K, N, dtype=F32))),
      ValueError, r"detgemm::addmm: bias must be 1-D of length N=3", "amp-addmm-bias"),
    E(_amp(lambda: dg.mm(rand(M, K, dtype=F32), rand(K, N, dtype=F32), out_dtype=torch.int8)),
      TypeError, r"out_dtype must be one of", "amp-out-int8"),
    E(_amp(lambda: dg.weight_grad(rand(M, N, dtype=F64), rand(M, K, dtype=F64))), TypeError,
      r"detgemm_cute\.weight_grad: grad_output must be torch\.bfloat16", "amp-grads-not-cast"),
    E(_amp(lambda: dg.input_grad(rand(M, N, dtype=F64), rand(N, K, dtype=F64))), TypeError,
      r"input_grad: grad_output must be torch\.bfloat16", "amp-input_grad-not-cast"),
    E(_amp_fp32_dtype(lambda: dg.linear(rand(M, K, dtype=F32), rand(N, K, dtype=F32))),
      TypeError, r"detgemm::linear: the cpu autocast dtype is torch\.float32; detgemm computes "
      r"in torch\.bfloat16 or torch\.float16", "amp-dtype-fp32"),
    E(_amp_fp32_dtype(lambda: dg.nn.Linear(K, N, fp32_grad_accum=True)(rand(M, K, dtype=F32))),
      TypeError, r"detgemm_cute\.nn\.Linear: the cpu autocast dtype is torch\.float32",
      "amp-dtype-fp32-module"),
    E(_amp(lambda: dg.nn.Linear(K, N, fp32_grad_accum=True)(rand(M, K, dtype=F64))), TypeError,
      r"input must be torch\.bfloat16, torch\.float16 or torch\.float32, got torch\.float64",
      "amp-module-main-grad-fp64"),
    E(lambda: dg.nn.Linear(K, N, dtype=F64)(rand(M, K, dtype=F64)), TypeError,
      r"detgemm::linear: input must be torch\.bfloat16.* got torch\.float64",
      "module-fp64-without-autocast"),
    # meta and fake tensors: alone they are fine (test_meta_fake_cpu.py); mixed or malformed
    E(lambda: dg.linear(meta(M, K), rand(N, K)), ValueError,
      r"weight is on cpu but input is on meta", "meta-x-cpu-w"),
    E(lambda: dg.mm(meta(M, K), meta(K + 1, N)), ValueError, r"mm: K mismatch", "meta-K"),
    E(lambda: dg.addmm(meta(N, dtype=FP), meta(M, K), meta(K, N)), TypeError,
      r"bias must have dtype torch\.bfloat16 like a", "meta-bias-dtype"),
    E(lambda: dg.weight_grad(meta(M, N), meta(M, K), acc=meta(N, K, dtype=F32), out_dtype=BF),
      ValueError, r"weight_grad: an fp32 accumulation buffer takes fp32 results", "meta-acc-out"),
    E(lambda: dg.bias_grad(meta(M, N), acc=meta(N + 1, dtype=F32)), ValueError,
      r"acc must have shape \[3\]", "meta-bias_grad-acc"),
    E(lambda: dg.input_grad(meta(M, N, dtype=F64), meta(N, K, dtype=F64)), TypeError,
      r"grad_output must be torch\.bfloat16", "meta-input_grad-fp64"),
    E(_fake(lambda: dg.linear(_fake_t(M, K), _fake_t(N, K, dtype=FP))), TypeError,
      r"weight must have the same dtype as input", "fake-mixed-dtype"),
    E(_fake(lambda: dg.mm(_fake_t(2, M, K), _fake_t(K, N))), ValueError, r"a must be 2-D",
      "fake-mm-3d"),
    E(_fake(lambda: dg.weight_grad(_fake_t(M, N), _fake_t(M + 1, K))), ValueError,
      r"same leading \(token\) dims", "fake-weight_grad-T"),
    E(_fake(lambda: dg.bias_grad(_fake_t(M, N), acc=_fake_t(N, dtype=FP))), TypeError,
      r"acc must be torch\.float32", "fake-bias_grad-acc"),
    E(_fake(lambda: dg.linear(_fake_t(M, K), _fake_t(N, K), _fake_t(N, device="cpu"))),
      ValueError, r"bias is on cpu but input is on cuda", "fake-bias-device"),
]


@pytest.mark.parametrize("call, exc, regex", AMP_MODE_BAD)
def test_autocast_meta_and_fake_bad_input_is_refused(call, exc, regex):
    with pytest.raises(exc, match=regex):
        call()


def test_fp32_grads_and_modules_run_the_fp32_tier_uncast():
    """Autocast casts the forward ops only: fp32 gradients inside a region, like an fp32
    module outside one, run the fp32 tier and give fp32 results with the reference's bits."""
    dy, x, w = rand(M, N, dtype=F32), rand(M, K, dtype=F32), rand(N, K, dtype=F32)
    gw, gx, gb = _amp(lambda: (dg.weight_grad(dy, x), dg.input_grad(dy, w), dg.bias_grad(dy)))()
    same(gw, REF["weight_grad"](dy, x))
    same(gx, REF["input_grad"](dy, w))
    same(gb, REF["bias_grad"](dy))
    lin = dg.nn.Linear(K, N)
    assert lin.weight.dtype == F32
    same(lin(x), REF["linear"](x, lin.weight.detach(), lin.bias.detach()))


def test_mode_cannot_nest_a_different_device_set():
    from detgemm_cute import mode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a PyTorch without CUDA warns that nothing is routed
        with dg.batch_invariant_mode():
            with pytest.raises(RuntimeError, match=r"already enabled for \('CUDA',\); cannot "
                                                   r"nest a different set \('CUDA', 'CPU'\)"):
                dg.enable(cpu=True)
            assert mode._stack == [False]
    assert not mode.is_enabled()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank gloo process group and CPU device mesh, for DTensor arguments."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh

    from dist_helpers import one_rank_gloo

    with one_rank_gloo(tmp_path_factory.mktemp("pg")):
        yield init_device_mesh("cpu", (1,))


def _dt(mesh, t, shard=True):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return distribute_tensor(t, mesh, [Shard(0) if shard else Replicate()])


DTENSOR_BAD = [
    ("linear-weight", lambda m: dg.linear(rand(M, K), _dt(m, rand(N, K))),
     r"detgemm_cute\.linear: weight is a DTensor \(placements \(Shard\(dim=0\),\)\)"),
    ("linear-input-grad", lambda m: dg.linear(_dt(m, rand(M, K, grad=True), False), rand(N, K)),
     r"linear: input is a DTensor \(placements \(Replicate\(\),\)\)"),
    ("linear-bias-amp", lambda m: _amp(lambda: dg.linear(rand(M, K, dtype=F32),
                                                         rand(N, K, dtype=F32),
                                                         _dt(m, rand(N, dtype=F32))))(),
     r"linear: bias is a DTensor"),
    ("mm-b", lambda m: dg.mm(rand(M, K), _dt(m, rand(K, N), False)), r"mm: b is a DTensor"),
    ("addmm-bias", lambda m: dg.addmm(_dt(m, rand(N)), rand(M, K), rand(K, N)),
     r"addmm: bias is a DTensor"),
    ("input_grad-weight", lambda m: dg.input_grad(rand(M, N), _dt(m, rand(N, K))),
     r"input_grad: weight is a DTensor"),
    ("weight_grad-acc", lambda m: dg.weight_grad(rand(M, N), rand(M, K),
                                                 acc=_dt(m, torch.zeros(N, K))),
     r"weight_grad: acc is a DTensor"),
    ("bias_grad-dy", lambda m: dg.bias_grad(_dt(m, rand(M, N))), r"bias_grad: grad_output is a "
                                                                 r"DTensor"),
    ("module", lambda m: _dtensor_module(m)(rand(M, K)),
     r"detgemm_cute\.linear: weight is a DTensor .* pass weight\.full_tensor\(\)"),
]


def _dtensor_module(mesh, fp32_grad_accum=False):
    lin = dg.nn.Linear(K, N, dtype=BF, fp32_grad_accum=fp32_grad_accum)
    lin.weight = torch.nn.Parameter(_dt(mesh, lin.weight.detach()))
    lin.bias = torch.nn.Parameter(_dt(mesh, lin.bias.detach(), False))
    return lin


@pytest.mark.parametrize("case", DTENSOR_BAD, ids=[c[0] for c in DTENSOR_BAD])
def test_dtensor_arguments_are_refused_by_name(mesh, case):
    _, call, regex = case
    with pytest.raises(TypeError, match=regex):
        call(mesh)


def test_fp32_grad_accum_refuses_dtensor_parameters(mesh):
    lin = _dtensor_module(mesh, fp32_grad_accum=True)
    for fn in (dg.nn.finalize_grads, dg.nn.zero_main_grads):
        with pytest.raises(RuntimeError, match=r"fp32_grad_accum=True does not work with "
                                               r"DTensor parameters \(fully_shard"):
            fn(lin)


def test_full_tensors_of_dtensor_parameters_work(mesh):
    """What FSDP2 does before forward (all-gather to a plain tensor) gives the usual bits."""
    w, x = rand(N, K), rand(M, K)
    same(dg.linear(x, _dt(mesh, w).full_tensor()), reference.linear(x, w))
