"""The public GEMM functions: `mm`, `addmm`, `linear` and the gradient GEMMs `input_grad`,
`weight_grad`, `bias_grad` (re-exported by the package).

Eager calls that need nothing from the dispatcher take the direct path (`gemm.checked_gemm`);
calls that do (autograd, tracing) go through the `torch.ops.detgemm` custom ops.
"""

from __future__ import annotations

import torch

from . import grads as _grads
from . import ops as _ops
from .gemm import checked_gemm as _checked_gemm

_compiling = torch.compiler.is_compiling


def _needs_graph(*ts) -> bool:
    """Go through the custom op (autograd, tracing) rather than the direct eager path."""
    if torch.is_grad_enabled():
        for t in ts:
            if getattr(t, "requires_grad", False):
                return True
    return _compiling()


def mm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None):
    """``a [M, K] @ b [K, N]`` -> ``[M, N]`` in ``out_dtype`` (default: a's dtype)."""
    if _needs_graph(a, b):
        return torch.ops.detgemm.mm(a, b, out_dtype)
    return _checked_gemm(a, b, "kn", None, out_dtype, "detgemm_cute.mm", ("a", "b", "bias"))


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
          out_dtype: torch.dtype | None = None):
    """``bias [N] + a [M, K] @ b [K, N]``; the bias is added in fp32 before the rounding."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"detgemm_cute.addmm: bias must be a torch.Tensor, got "
                        f"{type(bias).__name__} (use detgemm_cute.mm for no bias)")
    if _needs_graph(bias, a, b):
        return torch.ops.detgemm.addmm(bias, a, b, out_dtype)
    return _checked_gemm(a, b, "kn", bias, out_dtype, "detgemm_cute.addmm", ("a", "b", "bias"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None):
    """Like ``F.linear``: ``x [..., K] @ weight[N, K]^T (+ bias)`` -> ``[..., N]``."""
    if _needs_graph(x, weight, bias):
        return torch.ops.detgemm.linear(x, weight, bias, out_dtype)
    if isinstance(x, torch.Tensor) and x.dim() > 2 and isinstance(weight, torch.Tensor):
        # [..., K] as [rows, K] (a view where the strides allow), through the same fast path
        y = _checked_gemm(_grads._flat(x), weight, "nk", bias, out_dtype,
                          "detgemm_cute.linear", ("input", "weight", "bias"))
        return y.view(*x.shape[:-1], y.shape[-1])
    if not (isinstance(x, torch.Tensor) and x.dim() == 2):
        return _ops._linear(x, weight, bias, out_dtype, "detgemm_cute.linear")
    return _checked_gemm(x, weight, "nk", bias, out_dtype, "detgemm_cute.linear",
                         ("input", "weight", "bias"))


def _no_grad_buffer(acc, op):
    """The in-place ops mutate `acc`; autograd cannot track that for a tensor needing grad."""
    if getattr(acc, "requires_grad", False) and torch.is_grad_enabled():
        raise RuntimeError(f"{op}: acc requires grad; pass a plain buffer (e.g. .detach())")


def input_grad(grad_output: torch.Tensor, weight: torch.Tensor, *,
               out_dtype: torch.dtype | None = None):
    """dX of ``linear``: ``grad_output [..., N] @ weight [N, K]`` -> ``[..., K]``."""
    if _compiling():
        return torch.ops.detgemm.input_grad(grad_output, weight, out_dtype)
    return _grads.input_grad(grad_output, weight, out_dtype)


def weight_grad(grad_output: torch.Tensor, input: torch.Tensor, *,
                acc: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """dW of ``linear``: ``grad_output^T @ input`` over all tokens, ``[N, K]`` in fp32 (or
    ``out_dtype``, rounded once from the fp32 chain).

    With ``acc`` (fp32 [N, K]) the fp32 chain continues from acc's values and the result is
    written into ``acc`` in place: micro-batches whose token counts are multiples of 16
    accumulate to the bits of one call on all their tokens."""
    if _compiling():
        if acc is None:
            return torch.ops.detgemm.weight_grad(grad_output, input, out_dtype)
        _no_grad_buffer(acc, "detgemm_cute.weight_grad")
        torch.ops.detgemm.weight_grad_acc_(acc, grad_output, input)
        return acc
    return _grads.weight_grad(grad_output, input, acc, out_dtype=out_dtype)


def bias_grad(grad_output: torch.Tensor, *, acc: torch.Tensor | None = None):
    """Bias gradient: the sum over tokens of ``grad_output [..., N]``, fp32 ``[N]``, with
    dW's contract (it is the dW GEMM against ones); ``acc`` continues a buffer in place."""
    if _compiling():
        if acc is None:
            return torch.ops.detgemm.bias_grad(grad_output)
        _no_grad_buffer(acc, "detgemm_cute.bias_grad")
        torch.ops.detgemm.bias_grad_acc_(acc, grad_output)
        return acc
    return _grads.bias_grad(grad_output, acc)


__all__ = ["mm", "addmm", "linear", "input_grad", "weight_grad", "bias_grad"]
