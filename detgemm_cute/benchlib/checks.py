"""Correctness helpers: relative error, finiteness, bitwise row equality (CPU or GPU)."""

from __future__ import annotations

import math

import torch


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """norm(a - ref) / norm(ref) in fp32 (nan when either is not finite)."""
    a32, r32 = a.float(), ref.float()
    den = torch.linalg.vector_norm(r32).item()
    num = torch.linalg.vector_norm(a32 - r32).item()
    if not math.isfinite(num) or not math.isfinite(den):
        return float("nan")
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all().item())


def rows_equal_bitwise(full: torch.Tensor, part: torch.Tensor) -> bool:
    """True when `part` equals the first part.shape[0] rows of `full` bit for bit."""
    m = part.shape[0]
    a = full[:m]
    if a.shape != part.shape or a.dtype != part.dtype:
        return False
    if a.element_size() == 2:
        return torch.equal(a.contiguous().view(torch.int16), part.contiguous().view(torch.int16))
    if a.element_size() == 4:
        return torch.equal(a.contiguous().view(torch.int32), part.contiguous().view(torch.int32))
    return torch.equal(a, part)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whole tensors bit-identical (same shape and dtype)."""
    return a.shape == b.shape and rows_equal_bitwise(a, b)
