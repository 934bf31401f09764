"""A tiled transpose of a 32-bit matrix, for staging operands the TF32 kernels cannot read in
place (TF32 WGMMA takes both operands K-major): ``out[c, r] = x[r, c]`` for c < C, r < R, and
``out[c, r] = 0`` for R <= r < out's width (a zero-padded K tail adds exact zero products).

Work: a CTA of 32 x 8 threads moves one 32 x 32 tile: four coalesced 128-byte row reads into
a shared tile padded to 33 columns (no bank conflicts on the transposed read), one barrier,
four coalesced 128-byte row writes. A copy: the bits do not change. Inputs: x [R, C] with a
unit column stride, out [C, Rp] contiguous, Rp >= R.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

_TILE = 32
_ROWS = 8  # thread rows per CTA: each thread moves TILE / ROWS values each way


class Transpose32:
    """out[c, r] = x[r, c] (zero past R), one 32 x 32 tile per CTA."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mO: cute.Tensor, stream):
        rows_out = cute.size(mO, mode=[1])
        grid = [(cute.size(mX, mode=[1]) + _TILE - 1) // _TILE, (rows_out + _TILE - 1) // _TILE,
                1]
        self.kernel(mX, mO).launch(grid=grid, block=[_TILE, _ROWS, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mO: cute.Tensor):
        tile = cutlass.memory.SmemAllocator().allocate_tensor(
            mX.element_type, cute.make_layout((_TILE, _TILE), stride=(_TILE + 1, 1)), 4)
        tx, ty, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        n_rows, n_cols = cute.size(mX, mode=[0]), cute.size(mX, mode=[1])
        width = cute.size(mO, mode=[1])
        c = bx * _TILE + tx
        for j in cutlass.range_constexpr(_TILE // _ROWS):
            r = by * _TILE + ty + j * _ROWS
            v = mX.element_type(0)
            if r < n_rows and c < n_cols:
                v = mX[r, c]
            tile[ty + j * _ROWS, tx] = v
        cute.arch.sync_threads()
        r = by * _TILE + tx
        for j in cutlass.range_constexpr(_TILE // _ROWS):
            c_out = bx * _TILE + ty + j * _ROWS
            if c_out < n_cols and r < width:
                mO[c_out, r] = tile[tx, ty + j * _ROWS]
