"""Backward GEMMs of ``Y = X W^T + b``: dX = dY W, dW (+)= dY^T X, db (+)= sum_tokens dY.

- dX runs the same kernels as the forward through the ``dx`` dispatch table (W is read as a
  [K, N] operand in place). Row i of dX depends only on row i of dY: batch-invariant.
- dW is a GEMM whose reduction runs over tokens, through the ``dw`` table, with dY^T read
  as a transposed view (no copy). Its fp32 accumulators start from the fp32 values already
  in the accumulation buffer (or +0.0) and continue the same ascending chain of 16-token
  blocks, then are stored as fp32. So micro-batches whose token counts are multiples of 16
  give the same bits as one call on the concatenated tokens; zero-padded tokens add exact
  zero products and change nothing. A micro-batch of T tokens that is not a multiple of 16
  ends with a block padded by zeros, so the next micro-batch's blocks start at a different
  offset: the result is still deterministic (same split, same bits), but not the bits of
  the unsplit batch.
- db is the same dW GEMM against a column of ones, so it carries exactly dW's contract
  (fixed ascending 16-token blocks, fp32, continuing from the buffer).

Casting to the parameter dtype (if wanted) is the caller's one rounding, done once.
"""

from __future__ import annotations

import math
import threading

import torch

from .errors import GEMM_DTYPES, MAX_DIM, check_devices, check_gemm_args
from .gemm import gemm

_FP32 = torch.float32
_ONES_COLS = 8  # an [8, T] ones operand: the narrowest B whose row stride TMA can take
_ones: dict = {}
_ones_lock = threading.Lock()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[..., F] -> [rows, F] (a view where possible); F = 0 is fine, unlike reshape(-1, 0)."""
    return t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def check_input_grad(dy, weight, out_dtype, op, check_device=True) -> torch.Tensor:
    """Validate dX's arguments; returns dY as 2-D."""
    _check_tensor_rank(dy, "grad_output", op)
    dy2 = _flat(dy)
    check_gemm_args(dy2, weight, "kn", None, out_dtype, op, ("grad_output", "weight", "bias"),
                    check_device=check_device)
    return dy2


def input_grad(dy: torch.Tensor, weight: torch.Tensor, out_dtype=None,
               op: str = "detgemm_cute.input_grad") -> torch.Tensor:
    """dX = dY [..., N] @ weight [N, K] -> [..., K] in out_dtype (default dY's dtype)."""
    dy2 = check_input_grad(dy, weight, out_dtype, op)
    dx = gemm(dy2, weight, "kn", None, out_dtype, op="dx")
    return dx.reshape(*dy.shape[:-1], weight.shape[1])


def check_weight_grad(dy, x, acc, out_dtype, op, check_device=True):
    """Validate dW's arguments; returns (dY 2-D, X 2-D, output dtype)."""
    dy2, x2 = _check_token_pair(dy, x, "grad_output", "input", op, check_device)
    _check_acc(acc, (dy2.shape[1], x2.shape[1]), dy2, op)
    if out_dtype not in (None, _FP32) and acc is not None:
        raise ValueError(f"{op}: an fp32 accumulation buffer takes fp32 results; got "
                         f"out_dtype={out_dtype}")
    if out_dtype not in (None, _FP32, torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: out_dtype must be torch.float32, torch.bfloat16 or "
                        f"torch.float16, got {out_dtype}")
    return dy2, x2, out_dtype or _FP32


def weight_grad(dy: torch.Tensor, x: torch.Tensor, acc: torch.Tensor | None = None,
                op: str = "detgemm_cute.weight_grad", out_dtype=None) -> torch.Tensor:
    """dW = dY^T X over all tokens: dY [..., N], X [..., K] -> [N, K], fp32 by default.

    `out_dtype` (bf16/fp16) rounds the fp32 chain once in the kernel's epilogue: the same
    bits as ``weight_grad(...).to(out_dtype)`` without the fp32 round trip through memory.
    With `acc` (fp32 [N, K]) the chain continues from acc's values and the result is written
    into acc in place (``acc += dY^T X`` as one chain), which is returned."""
    dy2, x2, out_dtype = check_weight_grad(dy, x, acc, out_dtype, op)
    n, k = dy2.shape[1], x2.shape[1]
    if dy2.shape[0] == 0:
        return acc if acc is not None else torch.zeros((n, k), dtype=out_dtype, device=dy.device)
    return gemm(dy2.t(), x2, "kn", None, out_dtype, op="dw", acc=acc)


def check_bias_grad(dy, acc, op, check_device=True) -> torch.Tensor:
    """Validate the bias gradient's arguments; returns dY as 2-D."""
    _check_tensor_rank(dy, "grad_output", op)
    if dy.dtype not in GEMM_DTYPES:
        raise TypeError(f"{op}: grad_output must be torch.bfloat16, torch.float16 or "
                        f"torch.float32, got {dy.dtype}")
    if check_device:
        check_devices(dy, dy, None, op, ("grad_output", "grad_output", "bias"))
    dy2 = _flat(dy)
    if dy2.shape[1] < 1:
        raise ValueError(f"{op}: grad_output must have a last dim >= 1, got {tuple(dy.shape)}")
    _check_tokens(dy2.shape[0], op)
    _check_acc(acc, (dy2.shape[1],), dy2, op)
    return dy2


def bias_grad(dy: torch.Tensor, acc: torch.Tensor | None = None,
              op: str = "detgemm_cute.bias_grad") -> torch.Tensor:
    """db = sum over tokens of dY [..., N] -> fp32 [N], as the dW GEMM against ones.

    With `acc` (fp32 [N]) the sum continues from acc's values, written into acc in place."""
    dy2 = check_bias_grad(dy, acc, op)
    n, t = dy2.shape[1], dy2.shape[0]
    if t == 0:
        return acc if acc is not None else torch.zeros((n,), dtype=_FP32, device=dy.device)
    ones = _ones_operand(dy2.device, dy2.dtype, t)
    cols = None
    if acc is not None:
        cols = acc.unsqueeze(1).expand(n, _ONES_COLS).contiguous()
    cols = gemm(dy2.t(), ones, "nk", None, _FP32, op="dw", acc=cols)
    if acc is not None:
        acc.copy_(cols[:, 0])
        return acc
    return cols[:, 0].contiguous()


def _ones_operand(device, dtype, tokens: int) -> torch.Tensor:
    """An [8, tokens] view of ones whose row stride is a multiple of 16 bytes, kept per
    (device, dtype) and grown by doubling, so warm calls allocate nothing. Kernels on
    several streams read it (the data-parallel wrapper runs db on a side stream): on a GPU
    its rare creation or growth waits for the device (not while a graph is captured), so
    the new buffer is filled and the old one unused before it is freed."""
    key = (device, dtype)
    buf = _ones.get(key)
    if buf is None or buf.shape[1] < tokens:
        with _ones_lock:
            buf = _ones.get(key)
            if buf is None or buf.shape[1] < tokens:
                cap = max(1024, 1 << (tokens - 1).bit_length())
                buf = torch.ones((_ONES_COLS, cap), dtype=dtype, device=device)
                if buf.is_cuda and not torch.cuda.is_current_stream_capturing():
                    torch.cuda.synchronize(buf.device)
                _ones[key] = buf
    return buf[:, :tokens]


def _check_tensor_rank(t, name, op):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 1:
        raise ValueError(f"{op}: {name} must have shape [..., features], got a 0-d tensor")


def _check_tokens(t, op):
    if t > MAX_DIM:
        raise ValueError(f"{op}: the token count {t} exceeds the supported maximum {MAX_DIM}")


def _check_token_pair(dy, x, dy_name, x_name, op, check_device=True):
    """dY [..., N] and X [..., K] with the same leading (token) shape -> 2-D views."""
    _check_tensor_rank(dy, dy_name, op)
    _check_tensor_rank(x, x_name, op)
    if dy.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{op}: {dy_name} {tuple(dy.shape)} and {x_name} {tuple(x.shape)} "
                         f"must have the same leading (token) dims")
    for t, name in ((dy, dy_name), (x, x_name)):
        if t.dtype not in GEMM_DTYPES:
            raise TypeError(f"{op}: {name} must be torch.bfloat16, torch.float16 or "
                            f"torch.float32, got {t.dtype}")
    if x.dtype != dy.dtype:
        raise TypeError(f"{op}: {x_name} must have the same dtype as {dy_name} ({dy.dtype}), "
                        f"got {x.dtype}")
    if check_device:
        check_devices(dy, x, None, op, (dy_name, x_name, "acc"))
    elif dy.device != x.device:
        raise ValueError(f"{op}: {x_name} is on {x.device} but {dy_name} is on {dy.device}")
    if dy.shape[-1] < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: feature dims must be >= 1, got {dy_name} {tuple(dy.shape)}, "
                         f"{x_name} {tuple(x.shape)}")
    dy2, x2 = _flat(dy), _flat(x)
    _check_tokens(dy2.shape[0], op)
    return dy2, x2


def _check_acc(acc, shape, like, op):
    if acc is None:
        return
    if not isinstance(acc, torch.Tensor):
        raise TypeError(f"{op}: acc must be a torch.Tensor or None, got {type(acc).__name__}")
    if acc.dtype != _FP32:
        raise TypeError(f"{op}: acc must be torch.float32 (the fp32 accumulation buffer), got "
                        f"{acc.dtype}")
    if tuple(acc.shape) != tuple(shape):
        raise ValueError(f"{op}: acc must have shape {list(shape)}, got {tuple(acc.shape)}")
    if acc.device != like.device:
        raise ValueError(f"{op}: acc is on {acc.device} but the gradients are on {like.device}")
    if acc.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{op}: acc requires grad; pass a plain buffer (e.g. .detach())")
    if any(st == 0 and sz > 1 for st, sz in zip(acc.stride(), acc.shape)):
        raise ValueError(f"{op}: acc has elements that share memory (an expanded view, strides "
                         f"{acc.stride()}); pass a buffer with one memory location per element")


__all__ = ["input_grad", "weight_grad", "bias_grad"]
