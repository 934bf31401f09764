"""fp32 operands as 16-bit parts: the arithmetic of the fp32 tier (GPU and reference).

Two schemes: scaled fp16 parts (fwd and dX, below) and exact bf16 parts (dW, further down).

Each row r of an fp32 operand (a row of X, of W, of dY^T, ...: always a row along K) gets a
power-of-two scale s_r that brings its largest finite magnitude into [2^13, 2^14); every
scaled value x = s_r * v (exact) is split into two fp16 values, hi = fp16(x) (round to
nearest even) and lo = fp16(x - hi) (x - hi is exact in fp32). hi + lo carries 22 of v's 24
significant bits (the last two are rounded away in lo); values 2^-27 below the row's largest
lose more as hi and lo become fp16 subnormals.

A product then takes the three part products whose size is at least 2^-12 of hi*hi: lo*hi,
hi*lo, hi*hi (lo*lo, below 2^-22 of it, is left out). For every 32-wide block of K (two
16-wide blocks j0, j1) the operand written here holds six 16-wide steps, smallest products
first, so one K-major fp16 GEMM over 3x the K (rounded up to a multiple of 32) computes
them:

    A row, per block: [-lo j0, -lo j1, -hi j0, -hi j1, hi j0, hi j1]
    B row, per block: [-hi j0, -hi j1, -lo j0, -lo j1, hi j0, hi j1]

The kernel sums each block's six steps from +0.0 (a "chunk": the WGMMA chain of DESIGN fact
7 over 96 values) and adds the chunk to an fp32 accumulator with one IEEE add. Then the
result is unscaled, ``(acc * (1 / s_a)[:, None]) * (1 / s_b)[None, :]`` -- exact unless the
value lands below fp32's normal range -- the bias is added in fp32 and the sum rounded once
to the output dtype. dW += continues from ``(acc * s_a) * s_b``. Scaling by powers of two
commutes with every rounding of the chain in fp32's normal range, so a row's result does
not depend on the other rows of its batch, and micro-batched dW equals one call.

Non-finite inputs: hi carries the Inf or NaN and lo is NaN, so every output an Inf or NaN
input touches is NaN (IEEE would give Inf for an Inf that is not cancelled).
"""

from __future__ import annotations

import torch

BLOCK_K = 32  # original K per chunk
STEPS = 6  # 16-wide steps per chunk
CHUNK_K = 96  # split-operand K per chunk = the kernel's k tile
PART_DTYPE = torch.float16
TOP_EXP = 13  # a row's largest scaled magnitude lies in [2^13, 2^14)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: the power of two 2^(13 - floor(log2 max|row|)) per row (a row of zeros
    gets 1; a row holding an Inf or NaN gets some scale: its outputs are NaN or Inf anyway).
    Built from exponent bits, exact on every device."""
    if x.shape[-1] == 0:
        return torch.ones(x.shape[:-1], dtype=torch.float32, device=x.device)
    top = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1)  # max |x|, one pass
    exp = ((top.view(torch.int32) >> 23) & 0xFF).clamp(min=1)  # biased; subnormal -> emin
    scale_exp = (TOP_EXP + 127 - (exp - 127)).clamp(1, 254)
    scale_exp = torch.where(top == 0, torch.full_like(scale_exp, 127), scale_exp)
    return (scale_exp << 23).view(torch.float32)


def split_k(k: int) -> int:
    """K of the split operand for an original K."""
    return -(-k // BLOCK_K) * CHUNK_K


def operand(x: torch.Tensor, scale: torch.Tensor, side: str) -> torch.Tensor:
    """x fp32 [rows, K] (any strides), scale fp32 [rows] -> fp16 [rows, split_k(K)],
    contiguous, K-major: the parts of (x * scale) in `side`'s ("a" or "b") step order; the K
    tail is zero-padded to a whole 32-wide block.

    Signs: the two smaller products are written as (-lo)(-hi) and (-hi)(-lo) -- the same
    exact products -- because -lo = fp16(hi - x * s) is one fused kernel (x * s is exact)."""
    rows, k = x.shape
    blocks = -(-k // BLOCK_K)
    if blocks * BLOCK_K != k:
        x = torch.nn.functional.pad(x, (0, blocks * BLOCK_K - k))
    xv = x.reshape(rows, blocks, 1, BLOCK_K)
    sv = scale.view(rows, 1, 1, 1)
    out = torch.empty((rows, blocks, 3, BLOCK_K), dtype=PART_DTYPE, device=x.device)
    hi, neg_hi, neg_lo = out[:, :, 2:3], out[:, :, _NEG_HI[side]:_NEG_HI[side] + 1], \
        out[:, :, _NEG_LO[side]:_NEG_LO[side] + 1]
    torch.mul(xv, sv, out=hi)  # fp16(x * s): x * s is exact, one rounding
    torch.neg(hi, out=neg_hi)
    torch.addcmul(hi, xv, sv, value=-1, out=neg_lo)  # fp16(hi - x * s) = -lo
    return out.view(rows, blocks * CHUNK_K)


# Per chunk the three 32-wide groups are: A [-lo, -hi, hi], B [-hi, -lo, hi]
# (steps lo*hi j0, j1; hi*lo j0, j1; hi*hi j0, j1).
_NEG_LO = {"a": 0, "b": 1}
_NEG_HI = {"a": 1, "b": 0}


def parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) fp16 of already-scaled fp32 values (|x| < 2^14): hi + lo ~ x."""
    hi = x.to(PART_DTYPE)
    return hi, (x - hi.to(torch.float32)).to(PART_DTYPE)


# ---------------------------------------------------------------------------------------
# dW's scheme: exact bf16 parts, no scales.
#
# dW += dY^T X reduces over tokens, so per-row scales would depend on which tokens a call
# received, and micro-batches would not continue one chain. dW therefore splits each fp32
# value without scaling into three bf16 values (bf16 has fp32's exponent range):
# hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid), hi + mid + lo = x exactly (down
# to bf16's smallest subnormal, 2^-133). A product takes the six part products within 2^-16
# of hi*hi; per 16-wide block of K (a chunk of 96, the same k tile), smallest first:
#     A row: [lo, hi, mid, mid, hi, hi]      B row: [hi, lo, mid, hi, mid, hi]
# Twice the tensor-core work of the fp16 scheme; a micro-batch whose token count is a
# multiple of 16 continues the chain exactly, as in the bf16 tier.

EXACT_BLOCK_K = 16
_EXACT_PARTS = {"a": (2, 0, 1, 1, 0, 0), "b": (0, 2, 1, 0, 1, 0)}
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def exact_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, mid, lo) bf16 with hi + mid + lo == x (finite x; a finite value whose bf16
    rounding would overflow takes hi = the largest finite bf16 of its sign)."""
    hi = torch.where(torch.isfinite(x), x.clamp(-_BF16_MAX, _BF16_MAX), x).to(torch.bfloat16)
    rest = x - hi.to(torch.float32)  # NaN for a non-finite x: its outputs are NaN
    mid = rest.to(torch.bfloat16)
    return hi, mid, (rest - mid.to(torch.float32)).to(torch.bfloat16)


def exact_operand(x: torch.Tensor, side: str) -> torch.Tensor:
    """x fp32 [rows, K] (any strides) -> bf16 [rows, 6 * ceil(K / 16) * 16], contiguous,
    K-major, dW's six steps per 16-wide block of K in `side`'s order."""
    rows, k = x.shape
    blocks = -(-k // EXACT_BLOCK_K)
    if blocks * EXACT_BLOCK_K != k:
        x = torch.nn.functional.pad(x, (0, blocks * EXACT_BLOCK_K - k))
    src = [p.reshape(rows, blocks, 1, EXACT_BLOCK_K) for p in exact_parts(x)]
    out = torch.empty((rows, blocks, STEPS, EXACT_BLOCK_K), dtype=torch.bfloat16,
                      device=x.device)
    for step, p in enumerate(_EXACT_PARTS[side]):
        out[:, :, step:step + 1].copy_(src[p])
    return out.view(rows, blocks * CHUNK_K)


def scale_acc(acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """An fp32 [M, N] accumulator into the scaled domain (dW +=): (acc * s_a) * s_b."""
    return (acc * sa.unsqueeze(1)) * sb.unsqueeze(0)


def unscale(acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """The scaled fp32 accumulator back: (acc * (1 / s_a)) * (1 / s_b), reciprocals exact."""
    return (acc * sa.reciprocal().unsqueeze(1)) * sb.reciprocal().unsqueeze(0)


__all__ = ["row_scales", "parts", "operand", "exact_parts", "exact_operand", "EXACT_BLOCK_K", "split_k", "scale_acc", "unscale", "BLOCK_K",
           "STEPS", "CHUNK_K", "PART_DTYPE"]
