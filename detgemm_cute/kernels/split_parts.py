"""The fp32 tier's operand split in one pass (any GPU from sm_80 up).

`SplitFp16Parts` writes what `detgemm_cute.split.operand` computes with several PyTorch
kernels, reading each fp32 value once and writing its three fp16 slots once: for a row r and
a 32-wide block j of K, x = X[r, 32j:32j+32] * S[r] (exact: S[r] is a power of two),
hi = fp16(x), and the block's 96 output values are, per operand side,

    A: [fp16(hi - x), -hi, hi]        B: [-hi, fp16(hi - x), hi]

(fp16(hi - x) = -lo; see split.py for why the signs sit there). Every value is one IEEE
round-to-nearest-even conversion of an exact fp32 value, so the bits equal the reference's.

Work: one thread per 4 consecutive values (one 16-byte load, three 8-byte stores), threads
in memory order, so a warp reads 512 contiguous bytes and writes three 64-byte runs per
block. Inputs: X [rows, blocks, 8, 4] fp32 (unit stride inside a row), S [rows] fp32, out
[rows, blocks, 3, 8, 4] fp16, contiguous.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

_THREADS = 256
_BLOCK = 32  # K per block
_VEC = 4  # fp32 values per thread: one 16-byte load
_QUADS = _BLOCK // _VEC


class SplitFp16Parts:
    """One pass of the scaled fp16 split for operand side "a" or "b"."""

    def __init__(self, side: str):
        if side not in ("a", "b"):
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        self.neg_lo_group = 0 if side == "a" else 1  # where fp16(hi - x) goes
        self.neg_hi_group = 1 - self.neg_lo_group

    @cute.jit
    def __call__(self, mX: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, stream):
        units = cute.size(mX, mode=[0]) * cute.size(mX, mode=[1]) * _QUADS
        grid = (units + _THREADS - 1) // _THREADS
        self.kernel(mX, mS, mO).launch(grid=[grid, 1, 1], block=[_THREADS, 1, 1],
                                       stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        blocks = cute.size(mX, mode=[1])
        unit = bidx * _THREADS + tidx
        if unit < cute.size(mX, mode=[0]) * blocks * _QUADS:
            q = unit % _QUADS
            rest = unit // _QUADS
            r = rest // blocks
            j = rest - r * blocks
            xs = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
            cute.autovec_copy(mX[(r, j, q, None)], xs)
            x = xs.load() * mS[r]
            hi = x.to(cutlass.Float16)
            for group, value in ((self.neg_lo_group, (hi.to(cutlass.Float32) - x)),
                                 (self.neg_hi_group, -x), (2, x)):
                part = cute.make_rmem_tensor((_VEC,), cutlass.Float16)
                part.store(value.to(cutlass.Float16))
                cute.autovec_copy(part, mO[(r, j, group, q, None)])


_EXACT_BLOCK = 16  # K per block of dW's scheme
_EXACT_QUADS = _EXACT_BLOCK // _VEC


class SplitBf16Exact:
    """One pass of dW's exact bf16 split (split.py): per 16-wide block of K, six 16-wide
    steps of hi / mid / lo = bf16(x), bf16(x - hi), bf16(x - hi - mid), in side "a"'s order
    [lo, hi, mid, mid, hi, hi] or side "b"'s [hi, lo, mid, hi, mid, hi]. Inputs: X
    [rows, blocks, 4, 4] fp32 (unit stride inside a row), out [rows, blocks, 6, 4, 4] bf16,
    contiguous; one thread per 4 consecutive values."""

    _STEPS = {"a": (2, 0, 1, 1, 0, 0), "b": (0, 2, 1, 0, 1, 0)}  # 0 hi, 1 mid, 2 lo

    def __init__(self, side: str):
        if side not in self._STEPS:
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        self.steps = self._STEPS[side]

    @cute.jit
    def __call__(self, mX: cute.Tensor, mO: cute.Tensor, stream):
        units = cute.size(mX, mode=[0]) * cute.size(mX, mode=[1]) * _EXACT_QUADS
        grid = (units + _THREADS - 1) // _THREADS
        self.kernel(mX, mO).launch(grid=[grid, 1, 1], block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        blocks = cute.size(mX, mode=[1])
        unit = bidx * _THREADS + tidx
        if unit < cute.size(mX, mode=[0]) * blocks * _EXACT_QUADS:
            q = unit % _EXACT_QUADS
            rest = unit // _EXACT_QUADS
            r = rest // blocks
            j = rest - r * blocks
            xs = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
            cute.autovec_copy(mX[(r, j, q, None)], xs)
            x = xs.load()
            hi = x.to(cutlass.BFloat16)
            rest_v = x - hi.to(cutlass.Float32)
            mid = rest_v.to(cutlass.BFloat16)
            lo = (rest_v - mid.to(cutlass.Float32)).to(cutlass.BFloat16)
            for step, which in enumerate(self.steps):
                part = cute.make_rmem_tensor((_VEC,), cutlass.BFloat16)
                part.store((hi, mid, lo)[which])
                cute.autovec_copy(part, mO[(r, j, step, q, None)])
