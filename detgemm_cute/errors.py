"""Input checks that run before any launch, with messages that name the argument.

Kept apart from the launch path so `torch.compile`'s fake implementations raise the very
same errors at trace time as eager calls do at run time."""

from __future__ import annotations

import torch

IN_DTYPES = (torch.bfloat16, torch.float16)
# Every op also takes fp32 inputs (the fp32 tier).
GEMM_DTYPES = IN_DTYPES + (torch.float32,)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_DIM = 2**31 - 1


def _need_tensor(x, name, op):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")


def check_gemm_args(a, b, b_form, bias, out_dtype, op, names=("a", "b", "bias"),
                    check_device=True):
    """Validate C = a @ op(b) (+ bias). `b_form` is 'nk' (b is [N, K]) or 'kn' ([K, N])."""
    an, bn, biasn = names
    check_operand_dtypes(a, b, an, bn, op, GEMM_DTYPES)
    if a.dim() != 2:
        raise ValueError(f"{op}: {an} must be 2-D [M, K], got shape {tuple(a.shape)}")
    if b.dim() != 2:
        want = "[N, K]" if b_form == "nk" else "[K, N]"
        raise ValueError(f"{op}: {bn} must be 2-D {want}, got shape {tuple(b.shape)}")
    m, k = a.shape
    n, kb = (b.shape[0], b.shape[1]) if b_form == "nk" else (b.shape[1], b.shape[0])
    if kb != k:
        raise ValueError(f"{op}: K mismatch: {an} has K={k} (shape {tuple(a.shape)}) but {bn} "
                         f"has K={kb} (shape {tuple(b.shape)})")
    if k < 1 or n < 1:
        raise ValueError(f"{op}: N and K must be >= 1, got N={n}, K={k} "
                         f"({an} {tuple(a.shape)}, {bn} {tuple(b.shape)})")
    for dim_name, v in (("M", m), ("N", n), ("K", k)):
        if v > MAX_DIM:
            raise ValueError(f"{op}: {dim_name}={v} exceeds the supported maximum {MAX_DIM}")
    check_out_and_bias(out_dtype, bias, n, a.dtype, an, biasn, op)
    if check_device:
        check_devices(a, b, bias, op, names)
    else:  # fake tensors (tracing) carry real devices; they must still agree
        _same_device(a, b, bias, op, names)


_DTYPE_TEXT = {IN_DTYPES: "torch.bfloat16 or torch.float16",
               GEMM_DTYPES: "torch.bfloat16, torch.float16 or torch.float32"}


def check_operand_dtypes(a, b, an, bn, op, allowed=IN_DTYPES):
    """a and b are tensors of one input dtype drawn from `allowed`."""
    _need_tensor(a, an, op)
    _need_tensor(b, bn, op)
    if a.dtype not in allowed:
        raise TypeError(f"{op}: {an} must be {_DTYPE_TEXT[allowed]}, got {a.dtype}")
    if b.dtype != a.dtype:
        raise TypeError(f"{op}: {bn} must have the same dtype as {an} ({a.dtype}), got {b.dtype}")


def check_out_and_bias(out_dtype, bias, n, dtype, an, biasn, op):
    """out_dtype is a supported output dtype; bias (if any) is [n] of the input dtype."""
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be one of torch.bfloat16, torch.float16, "
                        f"torch.float32 or None, got {out_dtype}")
    if bias is not None:
        _need_tensor(bias, biasn, op)
        if bias.dim() != 1 or bias.shape[0] != n:
            raise ValueError(f"{op}: {biasn} must be 1-D of length N={n}, got shape "
                             f"{tuple(bias.shape)}")
        if bias.dtype != dtype:
            raise TypeError(f"{op}: {biasn} must have dtype {dtype} like {an}, got {bias.dtype}")


def check_bmm_args(a, b, bias, out_dtype, op, names=("a", "b", "bias"), check_device=True):
    """Validate C[l] = a[l] @ b[l] (+ bias): a [L, M, K], b [L, K, N], bias [N]; bf16, fp16
    or fp32 (the fp32 tier, entry by entry at "ieee", one launch at "tf32")."""
    an, bn, biasn = names
    check_operand_dtypes(a, b, an, bn, op, GEMM_DTYPES)
    if a.dim() != 3:
        raise ValueError(f"{op}: {an} must be 3-D [L, M, K], got shape {tuple(a.shape)}")
    if b.dim() != 3:
        raise ValueError(f"{op}: {bn} must be 3-D [L, K, N], got shape {tuple(b.shape)}")
    if b.shape[0] != a.shape[0]:
        raise ValueError(f"{op}: batch mismatch: {an} has L={a.shape[0]}, {bn} has "
                         f"L={b.shape[0]} (shapes {tuple(a.shape)}, {tuple(b.shape)})")
    if b.shape[1] != a.shape[2]:
        raise ValueError(f"{op}: K mismatch: {an} has K={a.shape[2]} (shape {tuple(a.shape)}) "
                         f"but {bn} has K={b.shape[1]} (shape {tuple(b.shape)})")
    for dim_name, v in zip("LMKN", (*a.shape, b.shape[2])):
        if v > MAX_DIM:
            raise ValueError(f"{op}: {dim_name}={v} exceeds the supported maximum {MAX_DIM}")
    check_out_and_bias(out_dtype, bias, b.shape[2], a.dtype, an, biasn, op)
    if check_device:
        check_devices(a, b, bias, op, names)
    else:
        _same_device(a, b, bias, op, names)


def check_devices(a, b, bias, op, names=("a", "b", "bias")):
    an = names[0]
    if a.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{op}: {an} is on {a.device}; detgemm runs on CUDA tensors (SM90 "
                         f"kernels) and on CPU tensors (the bit-exact reference)")
    _same_device(a, b, bias, op, names)


def _same_device(a, b, bias, op, names):
    an, bn, biasn = names
    if b.device != a.device:
        raise ValueError(f"{op}: {bn} is on {b.device} but {an} is on {a.device}; "
                         f"both must be on the same device")
    if bias is not None and bias.device != a.device:
        raise ValueError(f"{op}: {biasn} is on {bias.device} but {an} is on {a.device}")
