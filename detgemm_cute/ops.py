"""`torch.library` custom ops and their autograd formulas.

Forward: detgemm::mm, detgemm::addmm, detgemm::linear. Backward: detgemm::input_grad
(dX = dY W), detgemm::weight_grad (dW = dY^T X, fp32), detgemm::bias_grad (fp32 column sum),
and in-place accumulating forms detgemm::weight_grad_acc_ / bias_grad_acc_ that continue
the fp32 chain in a persistent buffer (see `grads`).

The ops make the GEMMs visible to `torch.compile` (fake implementations give shapes and
dtypes, and raise the same input errors as eager calls) and to the dispatcher. The public
functions in `detgemm_cute` call the same implementation directly in eager mode, which
keeps per-call overhead low; under tracing, or when an input needs grad, they go through
these ops, whose backward runs only the GEMMs whose inputs need a gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import amp, grads, split
from .errors import check_gemm_args
from .gemm import gemm

_NAMES = ("a", "b", "bias")
_LINEAR_NAMES = ("input", "weight", "bias")


def _linear_args(x, weight, bias, out_dtype, op, check_device=True):
    """Validate linear's arguments (eager and fake alike); returns x as 2-D."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{op}: input must be a tensor of shape [..., K], got a 0-d tensor")
    x2 = grads._flat(x)
    check_gemm_args(x2, weight, "nk", bias, out_dtype, op, _LINEAR_NAMES, check_device)
    return x2


def _linear(x, weight, bias, out_dtype, op):
    x2 = _linear_args(x, weight, bias, out_dtype, op)
    if x.dim() == 2:
        return gemm(x2, weight, "nk", bias, out_dtype)
    # [..., N] allocated as such and written through its 2-D view: the op's output is not a
    # view of a temporary (wrappers such as FSDP2 warn about view outputs)
    n = weight.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=out_dtype or x.dtype, device=x.device)
    gemm(x2, weight, "nk", bias, out_dtype, out=y.view(-1, n))
    return y


@torch.library.custom_op("detgemm::mm", mutates_args=())
def mm(a: Tensor, b: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """a [M, K] @ b [K, N] -> [M, N]."""
    check_gemm_args(a, b, "kn", None, out_dtype, "detgemm::mm", _NAMES)
    return gemm(a, b, "kn", None, out_dtype)


@mm.register_fake
def _mm_fake(a, b, out_dtype=None):
    check_gemm_args(a, b, "kn", None, out_dtype, "detgemm::mm", _NAMES, check_device=False)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)


@torch.library.custom_op("detgemm::addmm", mutates_args=())
def addmm(bias: Tensor, a: Tensor, b: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """bias [N] + a [M, K] @ b [K, N], bias added in fp32 before the one rounding."""
    check_gemm_args(a, b, "kn", bias, out_dtype, "detgemm::addmm", _NAMES)
    return gemm(a, b, "kn", bias, out_dtype)


@addmm.register_fake
def _addmm_fake(bias, a, b, out_dtype=None):
    check_gemm_args(a, b, "kn", bias, out_dtype, "detgemm::addmm", _NAMES, check_device=False)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)


@torch.library.custom_op("detgemm::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
           out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N], like F.linear."""
    return _linear(x, weight, bias, out_dtype, "detgemm::linear")


@linear.register_fake
def _linear_fake(x, weight, bias=None, out_dtype=None):
    _linear_args(x, weight, bias, out_dtype, "detgemm::linear", check_device=False)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype or x.dtype)


# ------------------------------------------------------------------------------ backward
@torch.library.custom_op("detgemm::input_grad", mutates_args=())
def input_grad(dy: Tensor, weight: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """dX = dY [..., N] @ weight [N, K] -> [..., K] (the `dx` dispatch table)."""
    return grads.input_grad(dy, weight, out_dtype, "detgemm::input_grad")


@input_grad.register_fake
def _input_grad_fake(dy, weight, out_dtype=None):
    grads.check_input_grad(dy, weight, out_dtype, "detgemm::input_grad", check_device=False)
    return dy.new_empty((*dy.shape[:-1], weight.shape[1]), dtype=out_dtype or dy.dtype)


@torch.library.custom_op("detgemm::weight_grad", mutates_args=())
def weight_grad(dy: Tensor, x: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """dW = dY^T X over all tokens -> [N, K] (fp32 unless out_dtype), chain from +0.0."""
    return grads.weight_grad(dy, x, None, "detgemm::weight_grad", out_dtype)


@weight_grad.register_fake
def _weight_grad_fake(dy, x, out_dtype=None):
    _, _, dt = grads.check_weight_grad(dy, x, None, out_dtype, "detgemm::weight_grad", False)
    return dy.new_empty((dy.shape[-1], x.shape[-1]), dtype=dt)


@torch.library.custom_op("detgemm::weight_grad_acc_", mutates_args=("acc",))
def weight_grad_acc_(acc: Tensor, dy: Tensor, x: Tensor) -> None:
    """acc (fp32 [N, K]) += dY^T X as one continued chain, in place. acc must be a plain
    buffer (not requiring grad): autograd cannot see this mutation."""
    _plain_buffer(acc, "detgemm::weight_grad_acc_")
    grads.weight_grad(dy, x, acc, "detgemm::weight_grad_acc_")


@weight_grad_acc_.register_fake
def _weight_grad_acc_fake(acc, dy, x):
    grads.check_weight_grad(dy, x, acc, None, "detgemm::weight_grad_acc_", False)


@torch.library.custom_op("detgemm::bias_grad", mutates_args=())
def bias_grad(dy: Tensor) -> Tensor:
    """db = sum over tokens of dY [..., N] -> fp32 [N] (dW's chain against ones)."""
    return grads.bias_grad(dy, None, "detgemm::bias_grad")


@bias_grad.register_fake
def _bias_grad_fake(dy):
    grads.check_bias_grad(dy, None, "detgemm::bias_grad", check_device=False)
    return dy.new_empty((dy.shape[-1],), dtype=torch.float32)


@torch.library.custom_op("detgemm::bias_grad_acc_", mutates_args=("acc",))
def bias_grad_acc_(acc: Tensor, dy: Tensor) -> None:
    """acc (fp32 [N]) += sum over tokens of dY, continuing the chain, in place."""
    _plain_buffer(acc, "detgemm::bias_grad_acc_")
    grads.bias_grad(dy, acc, "detgemm::bias_grad_acc_")


@bias_grad_acc_.register_fake
def _bias_grad_acc_fake(acc, dy):
    grads.check_bias_grad(dy, acc, "detgemm::bias_grad_acc_", check_device=False)


def _plain_buffer(acc, op):
    if acc.requires_grad:
        raise RuntimeError(f"{op}: acc requires grad; pass a plain buffer (e.g. .detach())")


def _grad_in(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """The kernels take 16-bit operands: an fp32 upstream gradient (out_dtype=fp32) is
    rounded once to the input dtype before the backward GEMMs."""
    return grad if grad.dtype == dtype else grad.to(dtype)


def _needs(ctx, i: int) -> bool:
    return ctx.needs_input_grad[i]


def _save_pair(ctx, first, second, i_first: int):
    """Save each GEMM operand only if the other one's gradient is needed: dX needs only
    the weight, dW only the input."""
    ctx.in_dtype, ctx.second_dtype = first.dtype, second.dtype
    ctx.fp32_precision = split.forward_precision(first.dtype)  # backward runs at it too
    ctx.save_for_backward(first if _needs(ctx, i_first + 1) else None,
                          second if _needs(ctx, i_first) else None)


def _setup_linear(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    _save_pair(ctx, x, weight, 0)


def _backward_linear(ctx, grad):
    x, weight = ctx.saved_tensors
    g = _grad_in(grad, ctx.in_dtype)
    with split.at_precision(ctx.fp32_precision):
        gx = torch.ops.detgemm.input_grad(g, weight, ctx.in_dtype) if _needs(ctx, 0) else None
        gw = torch.ops.detgemm.weight_grad(g, x, ctx.second_dtype) if _needs(ctx, 1) else None
    gb = None
    if ctx.has_bias and _needs(ctx, 2):
        gb = torch.ops.detgemm.bias_grad(g).to(ctx.bias_dtype)
    return gx, gw, gb, None


def _setup_mm(ctx, inputs, output):
    _save_pair(ctx, inputs[-3], inputs[-2], len(inputs) - 3)


def _mm_grads(ctx, grad, first):
    """Gradients of a [M, K] @ b [K, N]: da = g b^T (a dx GEMM), db = a^T g (a dW GEMM)."""
    a, b = ctx.saved_tensors
    g = _grad_in(grad, ctx.in_dtype)
    with split.at_precision(ctx.fp32_precision):
        ga = (torch.ops.detgemm.input_grad(g, b.t(), ctx.in_dtype) if _needs(ctx, first)
              else None)
        gb = (torch.ops.detgemm.weight_grad(a, g, ctx.second_dtype) if _needs(ctx, first + 1)
              else None)
    return g, ga, gb


def _backward_mm(ctx, grad):
    _, ga, gb = _mm_grads(ctx, grad, 0)
    return ga, gb, None


def _setup_addmm(ctx, inputs, output):
    _setup_mm(ctx, inputs, output)
    ctx.bias_dtype = inputs[0].dtype


def _backward_addmm(ctx, grad):
    g, ga, gb = _mm_grads(ctx, grad, 1)
    gbias = torch.ops.detgemm.bias_grad(g).to(ctx.bias_dtype) if _needs(ctx, 0) else None
    return gbias, ga, gb, None


linear.register_autograd(_backward_linear, setup_context=_setup_linear)
mm.register_autograd(_backward_mm, setup_context=_setup_mm)
addmm.register_autograd(_backward_addmm, setup_context=_setup_addmm)

# Inside torch.autocast the forward ops cast their inputs like aten::mm/addmm/linear (`amp`).
amp.register(("mm", "addmm", "linear"))
