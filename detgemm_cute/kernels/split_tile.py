"""The fp32 tier's full precision at 16..64 rows of X: each warp keeps its outputs' chains.

``Y[M, N] = unscale(chunks(parts(X), parts(W))) (+ bias)``, the bits of `SplitGemvFp32`
and of the split path (`split.py`), with W read as fp32 and split in registers. Where
`SplitGemvFp32` gives each warp a chunk of K and meets the warps' chunk values in shared
memory for the ordered adds (a barrier and an exchange per round, and every warp holding
every row of X and W of the block), here each warp owns outputs: one n8 block of the CTA's
block of W and `wm` m16 tiles of X, over the whole K. A chunk's value never leaves the
registers: it is added to the output's fp32 accumulator right after its six steps, in
ascending chunk order (the chunked chain acc = ((+0.0 + c0) + c1) + ...).

Pipeline (one CTA of 8 warps per block of `rows` rows of W, 16, 32 or 64, and all
`m_rows` rows of X; persistent over blocks; a round is `group` consecutive chunks of 32
values of K, read by every warp):

1. The cp.async ring: stages - 1 rounds of the block's W rows (fp32) and of X's fp16 parts
   (side "a", from the split kernel) go out first (`SplitGemvFp32._copy_round`).
2. Row scales of W: the CTA streams its rows for their maxima (`_row_max`, `_write_scale`;
   the copies of step 1 read the lines this pass brings into L2). With `w_guess` the scales
   are guessed instead and checked after the block (`SplitGemvFp32._open_guess`,
   `_check_guess`): a block whose guess was wrong runs again at the scales it found.
3. Rounds: wait for round r, barrier, refill the oldest stage with round r + stages - 1.
   Warp (wm_i, nb) per chunk of the round: W's 8 rows of its n8 block scaled and split
   into the B fragments of the six ``m16n8k16`` steps (side "b"), then X's parts of its
   `wm` m16 tiles as the A fragments, the six steps each over the tiles in turn (`wm`
   independent chains from +0.0), and each tile's chunk added to its accumulators. A's
   rows past M are read as shared memory holds them, never zeroed: an output row takes
   only its own row of A, and rows past M are not stored. (The two together: 1.05-1.10x
   over tile after tile with zeroed rows on an H200, bench/results/tune/tile-forms_*.md:
   the forms' A/B, whose switches and probe are in git at abe0c1e.)
4. Epilogue: ``(acc * (1/s_x[m])) * (1/s_w[n])`` (explicit rounding: `split.unscale`),
   plus bias[n] in fp32, stored as fp32.

The warps split the block as warps_m x warps_n = 8 with warps_n = rows / 8 n8 blocks: a
block's W is split by warps_m warps and X's parts are read by warps_n. The layouts of the
stages, the fragment slots and the row scales are `SplitGemvFp32`'s with `group` chunk slots
per round, so the 16 products of each 16-wide K block are the same ones.

With `w_kn` (and `w_guess`) W is given [K, N] with N contiguous and read in place, as
`SplitGemvFp32`'s `w_kn` reads it: per round and row of K the block's columns, staged
[slot][row of K][column] with 8 floats of padding after every 4 rows of K.

Inputs: W fp32 [N, chunks, 2, 4, 4] and its int32 view [N, chunks * 8, 4] (rows 16-byte
aligned, K a multiple of 32; `w_kn`: W [K, N / 4, 4], the view unused); X's parts fp16
[M, chunks, 3, 2, 4, 4]; X's row scales s_x fp32 [M]; Y fp32 [M, N] (unit stride along N);
bias fp32 [N].
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute

from .split_gemv import (STEPS, THREADS, WARPS, SplitGemvFp32, reciprocal, split_quad,
                         w_stage_floats)
from .split_parts import SIGN_OFF

M_ROWS = (16, 32, 64)
ROWS = (16, 32, 64)


class SplitTileFp32(SplitGemvFp32):
    """One CTA per block of ``rows`` rows of W (16, 32 or 64; persistent), ``m_rows`` rows of
    X (16, 32 or 64, with m_rows / 16 * rows / 8 >= 8: one n8 block and at least one m16
    tile per warp), ``group`` chunks per round (1, 2, 4 or 8), ``stages`` rounds in the
    cp.async ring (2..8), optional fp32 bias. (`split_decode.tile_shape` says which.)"""

    def __init__(self, m_rows: int, rows: int, group: int, stages: int, has_bias: bool,
                 w_guess: bool = False, w_kn: bool = False):
        if (m_rows not in M_ROWS or rows not in ROWS or group not in (1, 2, 4, 8)
                or not 2 <= stages <= 8 or (m_rows // 16) * (rows // 8) < WARPS
                or (w_kn and not w_guess)):
            raise ValueError(f"SplitTileFp32: m_rows in {M_ROWS}, rows in {ROWS} with "
                             f"m_rows / 16 * rows / 8 >= {WARPS}, group in (1, 2, 4, 8), "
                             f"stages 2..8, w_kn only with w_guess; got {m_rows}, {rows}, "
                             f"{group}, {stages}, {w_guess}, {w_kn}")
        self.m_rows, self.m_tiles = m_rows, m_rows // 16
        self.rows, self.group, self.stages = rows, group, stages
        self.bn, self.n_blocks = rows, rows // 8
        self.has_bias, self.x_fp32 = has_bias, False
        self.slots = group  # chunk slots per round (every warp reads all of them)
        self.w_pitch = group * 32 + 16
        self.a_pitch = group * 96 + 16
        self.a_vec = (8, 12)
        self.warps_n = self.n_blocks
        self.wm = self.m_tiles // (WARPS // self.warps_n)  # m16 tiles per warp
        self.w_guess, self.w_kn = w_guess, w_kn
        self.tops_len = WARPS * self.bn + 1 if w_guess else WARPS

    @cute.jit
    def __call__(self, mW: cute.Tensor, mWbits: cute.Tensor, mA: cute.Tensor,
                 mSx: cute.Tensor, mY: cute.Tensor, mBias: Optional[cute.Tensor],
                 mGuess: Optional[cute.Tensor], ctas: cutlass.Int32, stream):
        op = cute.nvgpu.warp.MmaF16BF16Op(cutlass.Float16, cutlass.Float32, (16, 8, 16))
        tiled_mma = cute.make_tiled_mma(op)
        w_floats = self.stages * w_stage_floats(self.rows, self.slots, self.w_kn)
        a_values = self.stages * self.m_rows * self.a_pitch

        @cute.struct
        class SharedStorage:
            w: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, w_floats], 128]
            a: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, a_values], 128]
            scale: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.bn], 16]
            inv: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.bn], 16]
            tops: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.tops_len], 16]

        self.shared_storage = SharedStorage
        self.kernel(mW, mWbits, mA, mSx, mY, mBias, mGuess, tiled_mma).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mWbits: cute.Tensor, mA: cute.Tensor,
               mSx: cute.Tensor, mY: cute.Tensor, mBias: Optional[cute.Tensor],
               mGuess: Optional[cute.Tensor], tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        warp, lane = tidx // 32, tidx % 32
        g, t = lane // 4, lane % 4
        nb = warp % self.warps_n  # this warp's n8 block of the CTA's rows of W
        mt0 = (warp // self.warps_n) * self.wm  # its first m16 tile of X
        grp, stages, rows = self.group, self.stages, self.rows
        n_total, chunks = self._w_extents(mW)
        m_total = cute.size(mA, mode=[0])
        blocks = (n_total + rows - 1) // rows
        rounds = (chunks + grp - 1) // grp

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        # W: [stage][row][chunk slot][32] (pitch w_pitch); X's parts: [stage][row][chunk
        # slot][96] (pitch a_pitch): `SplitGemvFp32`'s layouts with `group` slots.
        s_w = self._w_stages(storage)
        s_a = storage.a.get_tensor(cute.make_layout(
            (8, 12, grp, self.m_rows, stages),
            stride=(1, 8, 96, self.a_pitch, self.m_rows * self.a_pitch)))
        s_a4 = cute.make_tensor(s_a.iterator, cute.make_layout(
            (4, 24, grp, self.m_rows, stages),
            stride=(1, 4, 96, self.a_pitch, self.m_rows * self.a_pitch)))
        s_scale = storage.scale.get_tensor(cute.make_layout(self.bn))
        s_inv = storage.inv.get_tensor(cute.make_layout(self.bn))
        s_tops = storage.tops.get_tensor(cute.make_layout(WARPS))
        g2s_w, g2s_a, mA8 = self._staging(mA, m_total, chunks)

        frag_a = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((16 * self.wm,
                                                                        16 * STEPS)))
        frag_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((8, 16 * STEPS)))
        chunk = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((16 * self.wm, 8)))
        acc = cute.make_rmem_tensor((4, self.wm), cutlass.Float32)
        for blk in cutlass.range(bidx, blocks, ctas, unroll=1):
            n0 = blk * rows
            copy = (g2s_w, g2s_a, mW, mA8, s_w, s_a, n0, n_total, chunks, m_total)
            block = (copy, rounds, s_scale, acc, frag_a, frag_b, chunk, s_w, s_a4, tiled_mma,
                     nb, mt0, g, t)
            if cutlass.const_expr(self.w_guess):
                s_wtops = storage.tops.get_tensor(cute.make_layout(WARPS * self.bn))
                s_flag = cute.make_tensor(s_wtops.iterator + WARPS * self.bn,
                                          cute.make_layout(1))
                self._open_guess(copy, rounds, mGuess, s_scale, s_inv, s_flag, tidx)
                tops = cute.make_rmem_tensor((1,), cutlass.Int32)
                for _attempt in cutlass.range(2, unroll=1):
                    if s_flag[0] != 0:
                        tops.fill(0)
                        self._tile_rounds(*block, tidx, tops)
                        self._check_guess(copy, rounds, tops, mGuess, s_scale, s_inv,
                                          s_wtops, s_flag, tidx)
            else:
                self._open_block(copy, rounds, mWbits, s_scale, s_inv, s_tops, tidx)
                self._tile_rounds(*block, tidx, None)
            for i in cutlass.range_constexpr(self.wm):
                for v in cutlass.range_constexpr(4):
                    m = (mt0 + i) * 16 + g + 8 * (v // 2)
                    col = nb * 8 + 2 * t + v % 2
                    n = n0 + col
                    if m < m_total and n < n_total:
                        self._store_unscaled(mY, mBias, m, n, acc[(v, i)],
                                             reciprocal(mSx[m]), s_inv, col)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # the next block rewrites the scales and the stages

    @cute.jit
    def _tile_rounds(self, copy, rounds, s_scale: cute.Tensor, acc: cute.Tensor,
                     frag_a: cute.Tensor, frag_b: cute.Tensor, chunk: cute.Tensor,
                     s_w: cute.Tensor, s_a4: cute.Tensor, tiled_mma: cute.TiledMma, nb, mt0,
                     g, t, tidx, tops: Optional[cute.Tensor]):
        """Step 3 over one block at the scales in `s_scale`: this warp's chunks added into
        `acc` (`tops`: this thread's maximum of |w| bits, for `_check_guess`)."""
        grp, stages, chunks = self.group, self.stages, copy[8]
        w_scale = s_scale[nb * 8 + g]
        acc.fill(0.0)
        for r in cutlass.range(rounds, unroll=1):
            self._open_round(copy, r, rounds, tidx)
            stage = r % stages
            for gi in cutlass.range_constexpr(grp):
                if r * grp + gi < chunks:
                    self._split_w_block(s_w, w_scale, frag_b, nb, gi, stage, g, t, tops)
                    # Every tile's A fragments, then each step over the tiles: wm
                    # independent chains in flight.
                    for i in cutlass.range_constexpr(self.wm):
                        self._load_a_tile(s_a4, frag_a, mt0 + i, i, gi, stage, g, t)
                    chunk.fill(0.0)
                    for s in cutlass.range_constexpr(STEPS):
                        cute.gemm(tiled_mma, chunk, frag_a[(None, None, s)],
                                  frag_b[(None, None, s)], chunk)
                    for i in cutlass.range_constexpr(self.wm):
                        for v in cutlass.range_constexpr(4):
                            acc[(v, i)] = acc[(v, i)] + chunk[(v, i, 0)]

    @cute.jit
    def _warp_tops(self, tops: cute.Tensor, s_tops: cute.Tensor, warp, lane):
        """This warp's row maximum into `s_tops` [warp][row]: its n8 block's rows hold it
        (the four lanes of each row reduced), the block's other rows +0 (other warps split
        them)."""
        top = cute.arch.warp_reduction(tops[0], lambda a, b: cutlass.max(a, b),
                                       threads_in_group=4)
        if lane % 4 == 0:
            for nb in cutlass.range_constexpr(self.n_blocks):
                s_tops[warp * self.bn + nb * 8 + lane // 4] = cutlass.select_(
                    warp % self.warps_n == nb, top, cutlass.Int32(0))

    @cute.jit
    def _split_w_block(self, s_w: cute.Tensor, w_scale, frag_b: cute.Tensor, nb, slot,
                       stage, g, t, tops: Optional[cute.Tensor] = None):
        """B fragments of one n8 block (`SplitGemvFp32._split_w` for one block): per 16-wide
        half j, this thread's values 4t..4t+3 of row 8 * nb + g, scaled and split into
        steps -hi j, -lo j, hi j (steps 2p + j take part p)."""
        for j in cutlass.range_constexpr(2):
            w = cute.make_rmem_tensor((4,), cutlass.Float32)
            self._w_quad(s_w, w, nb * 8 + g, j, t, slot, stage)
            if cutlass.const_expr(tops is not None):
                bits = cute.recast_tensor(w, cutlass.Int32)
                for v in cutlass.range_constexpr(4):
                    tops[0] = cutlass.max(tops[0], bits[v] & SIGN_OFF)
            parts = cute.make_rmem_tensor((4, 3), cutlass.Float16)
            split_quad(w.load() * w_scale, parts, "b")
            for p in cutlass.range_constexpr(3):
                for v in cutlass.range_constexpr(4):
                    frag_b[(v, 0, 2 * p + j)] = parts[(v, p)]

    @cute.jit
    def _load_a_tile(self, s_a4: cute.Tensor, frag_a: cute.Tensor, mt, fi, slot, stage, g, t):
        """A fragments of m16 tile `mt` into tile `fi` of `frag_a` (`SplitGemvFp32._load_a`
        for one tile): rows g and g + 8, values 4t..4t+3 of each step's 16-wide block into
        slots (2t, 2t+1, 2t+8, 2t+9). Rows past M are read as shared memory holds them
        (never copied there): an MMA's output row takes only its own row of A, and rows
        past M are not stored."""
        for s in cutlass.range_constexpr(STEPS):
            for h in cutlass.range_constexpr(2):  # rows g, g + 8
                m = mt * 16 + g + 8 * h
                vals = cute.make_rmem_tensor((4,), cutlass.Float16)
                cute.autovec_copy(s_a4[(None, 4 * s + t, slot, m, stage)], vals)
                frag_a[(2 * h, fi, s)] = vals[0]
                frag_a[(2 * h + 1, fi, s)] = vals[1]
                frag_a[(2 * h + 4, fi, s)] = vals[2]
                frag_a[(2 * h + 5, fi, s)] = vals[3]
