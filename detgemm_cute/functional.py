"""The public GEMM functions: `mm`, `addmm`, `linear` and the gradient GEMMs `input_grad`,
`weight_grad`, `bias_grad` (re-exported by the package).

Eager calls on plain CPU/CUDA tensors take the direct path (`gemm.checked_gemm`: on a warm
shape, one allocation and the launch). Everything else goes through the `torch.ops.detgemm`
custom ops, whose dispatcher entries handle it: autograd (an input needs grad), autocast (an
autocast region is active: the forward ops cast their inputs, see `amp`), tracing
(`torch.compile`), tensor subclasses such as fake tensors (their fake implementations give
shapes and dtypes without touching data or the device), and meta tensors (found on the
error path of the direct call, so they cost the warm path nothing). DTensor arguments are
refused with a message naming the argument.
"""

from __future__ import annotations

import sys

import torch

from . import grads as _grads
from . import ops as _ops
from . import split as _split
from .gemm import checked_gemm as _checked_gemm

_Tensor, _Parameter, _NoneType = torch.Tensor, torch.nn.Parameter, type(None)
_grad_enabled = torch.is_grad_enabled
_autocast_on = torch._C._is_any_autocast_enabled
_compiling = torch.compiler.is_compiling
_MM_NAMES = ("a", "b", "bias")
_ADDMM_NAMES = ("bias", "a", "b")
_LINEAR_NAMES = ("input", "weight", "bias")


def _via_op(ts) -> bool:
    """A forward call goes through the custom op (not the direct eager path): an input needs
    grad, an input is a tensor subclass (fake tensor, DTensor, ...), autocast is on, or the
    call is being traced. Non-tensors take the direct path, whose checks name them."""
    if _grad_enabled():
        for t in ts:
            tp = type(t)
            if tp is _Tensor or tp is _Parameter:
                if t.requires_grad:
                    return True
            elif tp is not _NoneType and isinstance(t, _Tensor):
                return True
    else:
        for t in ts:
            tp = type(t)
            if (tp is not _Tensor and tp is not _Parameter and tp is not _NoneType
                    and isinstance(t, _Tensor)):
                return True
    return _autocast_on() or _compiling()


def _grads_via_op(ts) -> bool:
    """The gradient functions go through their ops for tensor subclasses and tracing (they
    are not autocast and have no autograd formula of their own)."""
    for t in ts:
        tp = type(t)
        if tp is not _Tensor and tp is not _Parameter and isinstance(t, _Tensor):
            return True
    return _compiling()


def _op_args(ts, names, op) -> None:
    """Refuse DTensor arguments, naming them (the ops compute on whole local tensors)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    for t, name in zip(ts, names):
        if isinstance(t, dtensor):
            raise TypeError(
                f"{op}: {name} is a DTensor (placements {tuple(t.placements)}); detgemm takes "
                f"plain tensors: pass {name}.full_tensor() (or .to_local() when replicated). "
                f"Modules wrapped by fully_shard (FSDP2) already receive unsharded plain "
                f"parameters in their forward")


def _dtensor_type():
    mod = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before this
    return getattr(mod, "DTensor", None)


def _meta(t) -> bool:
    return isinstance(t, _Tensor) and t.is_meta


def mm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None,
       precision: str | None = None):
    """``a [M, K] @ b [K, N]`` -> ``[M, N]`` in ``out_dtype`` (default: a's dtype).
    `precision` ("ieee" | "tf32", fp32 inputs): this call's fp32 precision, as
    `fp32_precision` would set it (None: the thread's / torch's)."""
    if precision is not None:
        with _split.call_precision(precision, a, "detgemm_cute.mm"):
            return mm(a, b, out_dtype=out_dtype)
    if _via_op((a, b)):
        _op_args((a, b), _MM_NAMES, "detgemm_cute.mm")
        return torch.ops.detgemm.mm(a, b, out_dtype)
    try:
        return _checked_gemm(a, b, "kn", None, out_dtype, "detgemm_cute.mm", _MM_NAMES)
    except (TypeError, ValueError):
        if _meta(a):
            return torch.ops.detgemm.mm(a, b, out_dtype)
        raise


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
          out_dtype: torch.dtype | None = None, precision: str | None = None):
    """``bias [N] + a [M, K] @ b [K, N]``; the bias is added in fp32 before the rounding.
    `precision` as for `mm`."""
    if precision is not None:
        with _split.call_precision(precision, a, "detgemm_cute.addmm"):
            return addmm(bias, a, b, out_dtype=out_dtype)
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"detgemm_cute.addmm: bias must be a torch.Tensor, got "
                        f"{type(bias).__name__} (use detgemm_cute.mm for no bias)")
    if _via_op((bias, a, b)):
        _op_args((bias, a, b), _ADDMM_NAMES, "detgemm_cute.addmm")
        return torch.ops.detgemm.addmm(bias, a, b, out_dtype)
    try:
        return _checked_gemm(a, b, "kn", bias, out_dtype, "detgemm_cute.addmm", _MM_NAMES)
    except (TypeError, ValueError):
        if _meta(a):
            return torch.ops.detgemm.addmm(bias, a, b, out_dtype)
        raise


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, precision: str | None = None):
    """Like ``F.linear``: ``x [..., K] @ weight[N, K]^T (+ bias)`` -> ``[..., N]``.
    `precision` as for `mm` (eager autograd runs the backward at it too)."""
    if precision is not None:
        with _split.call_precision(precision, x, "detgemm_cute.linear"):
            return linear(x, weight, bias, out_dtype=out_dtype)
    if _via_op((x, weight, bias)):
        _op_args((x, weight, bias), _LINEAR_NAMES, "detgemm_cute.linear")
        return torch.ops.detgemm.linear(x, weight, bias, out_dtype)
    try:
        return _linear_direct(x, weight, bias, out_dtype)
    except (TypeError, ValueError):
        if _meta(x):
            return torch.ops.detgemm.linear(x, weight, bias, out_dtype)
        raise


def _linear_direct(x, weight, bias, out_dtype):
    if isinstance(x, torch.Tensor) and x.dim() > 2 and isinstance(weight, torch.Tensor):
        # [..., K] as [rows, K] (a view where the strides allow), through the same fast path
        y = _checked_gemm(_grads._flat(x), weight, "nk", bias, out_dtype,
                          "detgemm_cute.linear", _LINEAR_NAMES)
        return y.view(*x.shape[:-1], y.shape[-1])
    if not (isinstance(x, torch.Tensor) and x.dim() == 2):
        return _ops._linear(x, weight, bias, out_dtype, "detgemm_cute.linear")
    return _checked_gemm(x, weight, "nk", bias, out_dtype, "detgemm_cute.linear",
                         _LINEAR_NAMES)


def _no_grad_buffer(acc, op):
    """The in-place ops mutate `acc`; autograd cannot track that for a tensor needing grad."""
    if getattr(acc, "requires_grad", False) and torch.is_grad_enabled():
        raise RuntimeError(f"{op}: acc requires grad; pass a plain buffer (e.g. .detach())")


def input_grad(grad_output: torch.Tensor, weight: torch.Tensor, *,
               out_dtype: torch.dtype | None = None, precision: str | None = None):
    """dX of ``linear``: ``grad_output [..., N] @ weight [N, K]`` -> ``[..., K]``.
    `precision` as for `mm`."""
    if precision is not None:
        with _split.call_precision(precision, grad_output, "detgemm_cute.input_grad"):
            return input_grad(grad_output, weight, out_dtype=out_dtype)
    ts = (grad_output, weight)
    if _grads_via_op(ts):
        _op_args(ts, ("grad_output", "weight"), "detgemm_cute.input_grad")
        return torch.ops.detgemm.input_grad(grad_output, weight, out_dtype)
    try:
        return _grads.input_grad(grad_output, weight, out_dtype)
    except (TypeError, ValueError):
        if _meta(grad_output):
            return torch.ops.detgemm.input_grad(grad_output, weight, out_dtype)
        raise


def weight_grad(grad_output: torch.Tensor, input: torch.Tensor, *,
                acc: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """dW of ``linear``: ``grad_output^T @ input`` over all tokens, ``[N, K]`` in fp32 (or
    ``out_dtype``, rounded once from the fp32 chain).

    With ``acc`` (fp32 [N, K]) the fp32 chain continues from acc's values and the result is
    written into ``acc`` in place: micro-batches whose token counts are multiples of 16
    accumulate to the bits of one call on all their tokens."""
    ts = (grad_output, input, acc)
    if _grads_via_op(ts):
        _op_args(ts, ("grad_output", "input", "acc"), "detgemm_cute.weight_grad")
        return _weight_grad_op(grad_output, input, acc, out_dtype)
    try:
        return _grads.weight_grad(grad_output, input, acc, out_dtype=out_dtype)
    except (TypeError, ValueError):
        if _meta(grad_output):
            return _weight_grad_op(grad_output, input, acc, out_dtype)
        raise


def _weight_grad_op(dy, x, acc, out_dtype):
    if acc is None:
        return torch.ops.detgemm.weight_grad(dy, x, out_dtype)
    _no_grad_buffer(acc, "detgemm_cute.weight_grad")
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"detgemm_cute.weight_grad: an fp32 accumulation buffer takes fp32 "
                         f"results; got out_dtype={out_dtype}")
    torch.ops.detgemm.weight_grad_acc_(acc, dy, x)
    return acc


def bias_grad(grad_output: torch.Tensor, *, acc: torch.Tensor | None = None):
    """Bias gradient: the sum over tokens of ``grad_output [..., N]``, fp32 ``[N]``, with
    dW's contract (it is the dW GEMM against ones); ``acc`` continues a buffer in place."""
    ts = (grad_output, acc)
    if _grads_via_op(ts):
        _op_args(ts, ("grad_output", "acc"), "detgemm_cute.bias_grad")
        return _bias_grad_op(grad_output, acc)
    try:
        return _grads.bias_grad(grad_output, acc)
    except (TypeError, ValueError):
        if _meta(grad_output):
            return _bias_grad_op(grad_output, acc)
        raise


def _bias_grad_op(dy, acc):
    if acc is None:
        return torch.ops.detgemm.bias_grad(dy)
    _no_grad_buffer(acc, "detgemm_cute.bias_grad")
    torch.ops.detgemm.bias_grad_acc_(acc, dy)
    return acc


__all__ = ["mm", "addmm", "linear", "input_grad", "weight_grad", "bias_grad"]
