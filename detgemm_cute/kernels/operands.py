"""Operand views shared by the kernel families (called while their entry points trace)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def b_as_nk(mB_in: cute.Tensor, b_is_kn: bool) -> cute.Tensor:
    """B as an (N, K) tensor whatever its memory order: a [K, N] tensor (``mm``) is a mode
    swap of its layout, no copy; an [N, K] tensor (``linear``'s weight) is used as is."""
    if b_is_kn:  # (K, N[, L]) -> (N, K[, L])
        modes = [1, 0, 2] if cute.rank(mB_in.layout) == 3 else [1, 0]
        return cute.make_tensor(mB_in.iterator, cute.select(mB_in.layout, mode=modes))
    return mB_in


def with_batch_mode(t: cute.Tensor) -> cute.Tensor:
    """The kernels' (rows, cols, L) view of an operand: a rank-2 tensor gains a batch mode
    of size 1; a rank-3 one, given in torch order [L, rows, cols], has its batch mode moved
    last (a layout permutation, no copy)."""
    if cute.rank(t.layout) == 2:
        return cute.make_tensor(t.iterator, cute.append(t.layout, cute.make_layout(1)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 2, 0]))


def as_tf32(t: cute.Tensor) -> cute.Tensor:
    """An fp32 tensor's bits read as TF32 (the same layout, no copy): what TF32 TMA and
    WGMMA take."""
    return cute.make_tensor(cute.recast_ptr(t.iterator, dtype=cutlass.TFloat32), t.layout)
