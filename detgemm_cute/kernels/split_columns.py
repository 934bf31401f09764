"""The fp32 tier's split of an operand whose reduction runs down its columns (sm_80 up).

dX = dY @ W reduces over the weight's rows: W [R, C] (row-major, R the reduction) is the
GEMM's B in "kn" form. Its scales belong to the rows of W^T, one per column of W, and its
parts can be written in the same orientation, [R' = 3 R, C] with C contiguous, which the
chunked kernel reads as an N-major B: no transposed copy of W. For column c and a 32-row
block b of R (x = W[32b + i, c] * S[c], exact: S[c] is a power of two; hi = fp16(x)), the
block's 96 rows of the parts are, as split.py's side "b" orders them,

    rows 96b + i: -hi        rows 96b + 32 + i: fp16(hi - x) (= -lo)       rows 96b + 64 + i: hi

(i = 0..31; the 16-wide steps -hi j0, -hi j1, -lo j0, -lo j1, hi j0, hi j1). Every value is
one IEEE round-to-nearest-even conversion of an exact fp32 value, so the bits are those of
`split.operand(W.t(), S, "b")` laid out as its transpose.

Two kernels (`split.scaled_columns_cuda` runs them):
1. `ColumnMaxima`: the integer maximum of |x|'s bits per column (a NaN dominates, as in
   `SplitFp16Parts`) into `top` [C] int32 (zeros before): a CTA takes `_ROWS` rows of 128
   columns, 8 lanes of a warp share a quad of columns, and one lane per quad folds the CTA's
   maximum in with an atomic max (the maximum does not depend on the order of the folds).
2. `SplitFp16Columns`: a CTA takes one 32-row block of 128 columns; each thread a quad of
   columns (its four scales, 2^(13 - floor(log2 top)) clamped to [2^-126, 2^127], by the
   streaming kernel's `scale_bits_of`) and four of the block's rows (one 16-byte load, the
   parts by `split_quad`, three 8-byte stores; rows past R written as zeros); the first
   block's threads also write the scales S [C].
Inputs: W [R, C / 4, 4] fp32 (its rows 16-byte aligned); top [C] int32; parts
[R' / 96, 3, 32, C / 4, 4] fp16 (R' = 96 ceil(R / 32)), contiguous; S [C] fp32.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .split_gemv import SIGN_OFF, scale_bits_of, split_quad

_THREADS = 256
_QUADS = 32  # column quads (128 columns) per CTA
_ROWS = 256  # rows per CTA of the maxima
_BLOCK = 32  # rows of W per chunk


class ColumnMaxima:
    """Step 1 of the module docstring: `top[c]` = max(top[c], max over rows |W[r, c]| bits)."""

    @cute.jit
    def __call__(self, mW: cute.Tensor, mTop: cute.Tensor, stream):
        rows, quads = cute.size(mW, mode=[0]), cute.size(mW, mode=[1])
        self.kernel(mW, mTop).launch(
            grid=[(rows + _ROWS - 1) // _ROWS, (quads + _QUADS - 1) // _QUADS, 1],
            block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mTop: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, quads = cute.size(mW, mode=[0]), cute.size(mW, mode=[1])
        q = by * _QUADS + tidx // 8  # 8 consecutive lanes share a quad
        mWi = cute.make_tensor(cute.recast_ptr(mW.iterator, dtype=cutlass.Int32), mW.layout)
        tops = cute.make_rmem_tensor((4,), cutlass.Int32)
        tops.fill(0)
        if q < quads:
            r_end = cutlass.min(rows, (bx + 1) * _ROWS)
            for r in cutlass.range(bx * _ROWS + tidx % 8, r_end, 8, unroll=8):
                bits = cute.make_rmem_tensor((4,), cutlass.Int32)
                cute.autovec_copy(mWi[(r, q, None)], bits)
                for i in cutlass.range_constexpr(4):
                    tops[i] = cutlass.max(tops[i], bits[i] & SIGN_OFF)
        for i in cutlass.range_constexpr(4):
            tops[i] = cute.arch.warp_reduction(tops[i], lambda a, b: cutlass.max(a, b),
                                               threads_in_group=8)
        if q < quads and tidx % 8 == 0:
            for i in cutlass.range_constexpr(4):
                cute.arch.atomic_max((mTop.iterator + (4 * q + i)).llvm_ptr, tops[i])


class SplitFp16Columns:
    """Step 2 of the module docstring: the parts of W [R, C] with per-column scales, in the
    [R' / 96, 3, 32, C] layout an N-major B of the chunked kernel reads."""

    @cute.jit
    def __call__(self, mW: cute.Tensor, mTop: cute.Tensor, mO: cute.Tensor, mS: cute.Tensor,
                 stream):
        quads = cute.size(mW, mode=[1])
        self.kernel(mW, mTop, mO, mS).launch(
            grid=[cute.size(mO, mode=[0]), (quads + _QUADS - 1) // _QUADS, 1],
            block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mTop: cute.Tensor, mO: cute.Tensor, mS: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, quads = cute.size(mW, mode=[0]), cute.size(mW, mode=[1])
        q = by * _QUADS + tidx % _QUADS
        if q < quads:
            tops = cute.make_rmem_tensor((4,), cutlass.Int32)
            cute.autovec_copy(mTop[(q, None)], tops)
            scales = cute.make_rmem_tensor((4,), cutlass.Float32)
            scale_bits = cute.recast_tensor(scales, cutlass.Int32)
            for i in cutlass.range_constexpr(4):
                scale_bits[i] = scale_bits_of(tops[i])[0]
            if bx == 0 and tidx < _QUADS:
                cute.autovec_copy(scales, mS[(q, None)])
            for i in cutlass.range_constexpr(_BLOCK // (_THREADS // _QUADS)):
                row = i * (_THREADS // _QUADS) + tidx // _QUADS
                r = bx * _BLOCK + row
                w = cute.make_rmem_tensor((4,), cutlass.Float32)
                w.fill(0.0)
                if r < rows:
                    cute.autovec_copy(mW[(r, q, None)], w)
                parts = cute.make_rmem_tensor((4, 3), cutlass.Float16)
                split_quad(w.load() * scales.load(), parts, "b")
                for p in cutlass.range_constexpr(3):
                    cute.autovec_copy(parts[(None, p)], mO[(bx, p, row, q, None)])
