"""Operand views shared by the kernel families (called while their entry points trace)."""

from __future__ import annotations

import cutlass.cute as cute


def b_as_nk(mB_in: cute.Tensor, b_is_kn: bool) -> cute.Tensor:
    """B as an (N, K) tensor whatever its memory order: a [K, N] tensor (``mm``) is a mode
    swap of its layout, no copy; an [N, K] tensor (``linear``'s weight) is used as is."""
    if b_is_kn:
        return cute.make_tensor(mB_in.iterator, cute.select(mB_in.layout, mode=[1, 0]))
    return mB_in
