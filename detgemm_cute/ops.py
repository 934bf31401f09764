"""`torch.library` custom ops: detgemm::mm, detgemm::addmm, detgemm::linear.

The ops make the GEMMs visible to `torch.compile` (fake implementations give shapes and
dtypes, and raise the same input errors as eager calls) and to the dispatcher. The public
functions in `detgemm_cute` call the same implementation directly in eager mode, which
keeps per-call overhead low; under tracing they go through these ops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .errors import check_gemm_args
from .gemm import gemm

_NAMES = ("a", "b", "bias")
_LINEAR_NAMES = ("input", "weight", "bias")


def _linear(x, weight, bias, out_dtype, op):
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: input must be a tensor of shape [..., K], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    check_gemm_args(x2, weight, "nk", bias, out_dtype, op, _LINEAR_NAMES)
    y = gemm(x2, weight, "nk", bias, out_dtype)
    return y.reshape(*lead, weight.shape[0])


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
    x2 = x.reshape(-1, x.shape[-1])
    check_gemm_args(x2, weight, "nk", bias, out_dtype, "detgemm::linear", _LINEAR_NAMES,
                    check_device=False)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype or x.dtype)
