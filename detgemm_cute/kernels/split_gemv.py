"""The fp32 tier's full precision at decode sizes: W's split fused into the GEMM (sm_80 up).

``Y[M, N] = unscale(chunks(parts(X), parts(W))) (+ bias)`` for M <= 64, with the bits of
the split path (`split.py`: `scaled_operand_cuda` on both operands, the chunked GEMM,
`split.unscale`), but W is read as fp32 and split in registers: its three fp16 parts are
never written to memory and read back. X's parts come from the split kernel, or (`x_fp32`)
X is staged as fp32 too and split in registers with its row scales (4 bytes a value staged
per block of W instead of 6: the form for many rows of X); with `x_inline` (up to 16 rows of
X) each CTA takes those scales itself before its first block, as the split kernel would.

Pipeline (one CTA of 8 warps per block of `rows` rows of W, persistent over blocks; a
round is the 8 * G chunks of 32 values of K that the CTA's warps take together):

1. The cp.async ring: stages - 1 rounds of the block's W rows and of X's rows are copied
   into shared memory (16-byte cp.async, threads in memory order) before anything else.
2. Row scales: the CTA streams its rows (16-byte loads, `_LOADS` in flight per thread),
   takes the integer maximum of |x|'s bits per row (a NaN dominates, as in
   `SplitFp16Parts`), and writes the row scale 2^(13 - floor(log2 max|x|)) (clamped to
   [2^-126, 2^127]) and its reciprocal to shared memory. The copies of step 1 and of the
   rounds below read the lines this pass brought into L2 (at K >= 8192 mostly from DRAM
   again). With `w_guess` there is no such pass: the scales are the rows' guesses
   (`mGuess`: the weight's scales from its last call), each thread keeps the maximum of the
   |w| bits it splits in step 3, and after the block `_check_guess` takes each row's scale
   from those maxima; a row whose guess was wrong takes that scale (shared memory and
   mGuess) and the block runs again from step 1. The bits are always those of the rows'
   own scales; W is read once where the guesses were right.
3. Rounds: wait for round r's stage and refill the oldest with round r + stages - 1; warp
   w takes the G chunks starting at (r * 8 + w) * G. Per chunk and n8 block of rows each
   thread scales and splits its 8 values of W into the B fragments of the chunk's six
   ``m16n8k16`` steps (side "b": -hi j0, -hi j1, -lo j0, -lo j1, hi j0, hi j1), reads X's
   parts as the A fragments, and runs the six steps onto a fragment that starts at +0.0:
   the chunk, exactly as the chunked GEMM kernels compute it. With `x_fp32` the A
   fragments are split from X's staged fp32 values the same way (side "a").
4. Ordered adds: each warp writes its chunks to shared memory; after a barrier, the thread
   that owns an output adds the round's chunks to its fp32 accumulator one IEEE add at a
   time, in ascending chunk order (the chunked chain: acc = ((+0.0 + c0) + c1) + ...).
5. Epilogue: ``(acc * (1/s_x[m])) * (1/s_w[n])`` (`split.unscale`; the reciprocals of
   powers of two are built from exponent bits, exact), plus bias[n] in fp32,
   stored as fp32 (the caller rounds to another output dtype, as the split path does).

Inside a 16-wide K block the chain adds 16 exact products at once (the block sum does not
depend on their order: docs/reference.md), so a thread's four values of a block are the
consecutive K indices 4t..4t+3 (one 16-byte read of W, one 8-byte read of X's parts) placed
in the fragment slots 2t, 2t+1, 2t+8, 2t+9 of both A and B: the same 16 products per block.

With `w_kn` W is given [K, N] with N contiguous (dX's weight: its reduction runs down the
columns), read in place: a round copies, per row of K, the block's `rows` columns (16-byte
vectors, so N a multiple of 4) into shared memory as [slot][row of K][column], 8 floats of
padding after every 4 rows of K, so that the four lanes t of a fragment read (rows 4t..4t+3
of one column) fall in distinct banks; step 3 then reads a thread's four values one by one
instead of as one vector. Only with `w_guess` (the scales come in: `mGuess`, checked as
above; the caller passes exact column scales where it has no guess).

Inputs: W fp32 [N, chunks, 2, 4, 4] and its int32 view [N, chunks * 8, 4] (rows 16-byte
aligned, K a multiple of 32; `w_kn`: W [K, N / 4, 4], the view unused); X's parts fp16
[M, chunks, 3, 2, 4, 4] (side "a": -lo, -hi, hi per chunk), or with `x_fp32` X fp32
[M, chunks, 8, 4] (rows 16-byte aligned); X's row scales s_x fp32 [M]; Y fp32 [M, N]
(unit stride along N); bias fp32 [N].
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .split_parts import SIGN_OFF

THREADS = 256
WARPS = THREADS // 32
STEPS = 6  # 16-wide steps per chunk
_LOADS = 8  # pass 1: 16-byte loads per thread per iteration
_TOP_EXP = 13  # a row's largest scaled magnitude lies in [2^13, 2^14)


class SplitGemvFp32:
    """One CTA per block of ``rows`` rows of W (2, 4, 8 or 16; persistent: the launch's grid
    may be smaller than the block count), ``m_rows`` rows of X at most (a power of two up to
    64: the m16 tiles and the shared-memory rows of X), ``group`` chunks per warp and round,
    ``stages`` rounds in the cp.async ring, optional fp32 bias, X staged as fp32 and split
    in registers (``x_fp32``) or as its parts. (`split_decode.launch_shape` says which.)"""

    def __init__(self, m_rows: int, rows: int, group: int, stages: int, has_bias: bool,
                 x_fp32: bool = False, x_inline: bool = False, w_guess: bool = False,
                 w_kn: bool = False):
        if (m_rows not in (1, 2, 4, 8, 16, 32, 64) or rows not in (2, 4, 8, 16)
                or group not in (1, 2, 4) or not 2 <= stages <= 6
                or (x_inline and (not x_fp32 or m_rows > 16))
                or (w_kn and (not w_guess or rows < 8))):
            raise ValueError(f"SplitGemvFp32: m_rows in (1, 2, 4, 8, 16, 32, 64), rows in "
                             f"(2, 4, 8, 16), group in (1, 2, 4), stages 2..6, x_inline only "
                             f"with x_fp32 and m_rows <= 16, w_kn only with w_guess and rows "
                             f">= 8; got {m_rows}, {rows}, {group}, {stages}, {x_fp32}, "
                             f"{x_inline}, {w_guess}, {w_kn}")
        self.w_kn = w_kn  # W given [K, N] (N contiguous), read in place
        self.x_inline = x_inline  # X's row scales taken in the kernel (mSx unused)
        self.w_guess = w_guess  # W's scales from mGuess, checked after the block (no pass 1)
        self.m_rows, self.m_tiles = m_rows, -(-m_rows // 16)
        self.rows, self.group, self.stages = rows, group, stages
        self.bn = max(8, rows)  # the MMA's N extent: n8 blocks, rows past `rows` unused
        self.n_blocks = self.bn // 8
        self.has_bias, self.x_fp32 = has_bias, x_fp32
        self.slots = WARPS * group  # chunks per round
        # Shared-memory row pitches, padded so that a warp's fragment reads hit distinct
        # banks: fp32 rows (W; X with x_fp32) by 16 values (lanes 4 rows apart alternate
        # bank halves), rows of X's parts by 16 fp16 (four rows' 8-byte reads fill 128 bytes).
        self.w_pitch = self.slots * 32 + 16
        self.a_pitch = self.w_pitch if x_fp32 else self.slots * 96 + 16
        # X's rows in shared memory: (values per 16-byte vector, vectors per chunk).
        self.a_vec = (4, 8) if x_fp32 else (8, 12)
        self.outs = m_rows * rows  # outputs of a block (rows of X below m_rows)
        self.per_thread = -(-self.outs // THREADS)
        # int32 scratch: the row maxima of X's rows (x_inline) or of W's rows (warps x rows;
        # w_guess: then the block's redo flag after them).
        self.tops_len = WARPS * (m_rows if x_inline else 1)
        if w_guess:
            self.tops_len = max(self.tops_len, WARPS * self.bn + 1)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mWbits: cute.Tensor, mA: cute.Tensor,
                 mSx: Optional[cute.Tensor], mY: cute.Tensor, mBias: Optional[cute.Tensor],
                 mGuess: Optional[cute.Tensor], ctas: cutlass.Int32, stream):
        op = cute.nvgpu.warp.MmaF16BF16Op(cutlass.Float16, cutlass.Float32, (16, 8, 16))
        tiled_mma = cute.make_tiled_mma(op)
        w_floats = self.stages * w_stage_floats(self.rows, self.slots, self.w_kn)
        a_values = self.stages * self.m_rows * self.a_pitch
        a_dtype = cutlass.Float32 if self.x_fp32 else cutlass.Float16
        # With x_inline, X's scales and reciprocals follow W's, and the tops take one row
        # of X per warp and row.
        scales = self.bn + (self.m_rows if self.x_inline else 0)
        top_rows = self.m_rows if self.x_inline else 1

        @cute.struct
        class SharedStorage:
            w: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, w_floats], 128]
            a: cute.struct.Align[cute.struct.MemRange[a_dtype, a_values], 128]
            parts: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self.slots * self.outs], 16]
            scale: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, scales], 16]
            inv: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, scales], 16]
            tops: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.tops_len], 16]

        self.shared_storage = SharedStorage
        self.kernel(mW, mWbits, mA, mSx, mY, mBias, mGuess, tiled_mma).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mWbits: cute.Tensor, mA: cute.Tensor,
               mSx: Optional[cute.Tensor], mY: cute.Tensor, mBias: Optional[cute.Tensor],
               mGuess: Optional[cute.Tensor], tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        warp, lane = tidx // 32, tidx % 32
        bn, nb_n, stages = self.bn, self.n_blocks, self.stages
        n_total, chunks = self._w_extents(mW)
        m_total = cute.size(mA, mode=[0])
        rows = self.rows
        blocks = (n_total + rows - 1) // rows
        rounds = (chunks + self.slots - 1) // self.slots

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        # W: [stage][row][chunk slot][32] (pitch w_pitch per row); X: [stage][row][chunk
        # slot][32 fp32 or 96 parts] (pitch a_pitch); chunk values: [slot][row][col].
        s_w = self._w_stages(storage)
        vec, vecs = self.a_vec
        s_a = storage.a.get_tensor(cute.make_layout(
            (vec, vecs, self.slots, self.m_rows, stages),
            stride=(1, vec, vec * vecs, self.a_pitch, self.m_rows * self.a_pitch)))
        s_parts = storage.parts.get_tensor(
            cute.make_layout((self.slots, self.m_rows, rows), stride=(self.outs, rows, 1)))
        s_scale = storage.scale.get_tensor(cute.make_layout(bn))
        s_inv = storage.inv.get_tensor(cute.make_layout(bn))
        s_tops = storage.tops.get_tensor(cute.make_layout(WARPS))
        g2s_w, g2s_a, mA8 = self._staging(mA, m_total, chunks)
        x_inv = mSx
        if cutlass.const_expr(self.x_inline):
            mSx = cute.make_tensor(s_scale.iterator + bn, cute.make_layout(self.m_rows))
            x_inv = cute.make_tensor(s_inv.iterator + bn, cute.make_layout(self.m_rows))
            self._x_row_scales(mA, mSx, x_inv, storage.tops.get_tensor(
                cute.make_layout((WARPS, self.m_rows))), m_total, chunks, tidx)
            cute.arch.sync_threads()

        frag_a = tiled_mma.make_fragment_A(
            tiled_mma.partition_shape_A((16 * self.m_tiles, 16 * STEPS)))
        frag_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((bn, 16 * STEPS)))
        chunk = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((16 * self.m_tiles, bn)))
        acc = cute.make_rmem_tensor((self.per_thread,), cutlass.Float32)
        row_scale = cute.make_rmem_tensor((nb_n,), cutlass.Float32)
        x_scale = self._x_scales(mSx, m_total, lane)
        for blk in cutlass.range(bidx, blocks, ctas, unroll=1):
            n0 = blk * rows
            copy = (g2s_w, g2s_a, mW, mA8, s_w, s_a, n0, n_total, chunks, m_total)
            block = (copy, rounds, s_scale, row_scale, acc, frag_a, frag_b, chunk, s_parts,
                     x_scale, tiled_mma, tidx, warp, lane)
            if cutlass.const_expr(self.w_guess):
                # The block's rows at their guessed scales; if a row's maximum says
                # otherwise, the block again at the scales it found (two attempts at most:
                # the second's scales are the block's own).
                s_wtops = storage.tops.get_tensor(cute.make_layout(WARPS * bn))
                s_flag = cute.make_tensor(s_wtops.iterator + WARPS * bn, cute.make_layout(1))
                self._open_guess(copy, rounds, mGuess, s_scale, s_inv, s_flag, tidx)
                tops = cute.make_rmem_tensor((nb_n,), cutlass.Int32)
                for _attempt in cutlass.range(2, unroll=1):
                    if s_flag[0] != 0:
                        tops.fill(0)
                        self._rounds(*block, tops)
                        self._check_guess(copy, rounds, tops, mGuess, s_scale, s_inv,
                                          s_wtops, s_flag, tidx)
            else:
                self._open_block(copy, rounds, mWbits, s_scale, s_inv, s_tops, tidx)
                self._rounds(*block, None)
            for i in cutlass.range_constexpr(self.per_thread):
                o = tidx + i * THREADS
                m, n = o // rows, n0 + o % rows
                if m < m_total and n < n_total:
                    inv_x = x_inv[m] if cutlass.const_expr(self.x_inline) else reciprocal(mSx[m])
                    self._store_unscaled(mY, mBias, m, n, acc[i], inv_x, s_inv, o % rows)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # the next block rewrites the scales and the stages

    def _w_stages(self, storage):
        """W's stages in shared memory: [row][chunk slot][32] (pitch w_pitch per row) or,
        with `w_kn`, [column][row of K][chunk slot] with 8 floats of padding after every 4
        rows of K (`w_stage_floats`), per stage."""
        rows, slots = self.rows, self.slots
        per_stage = w_stage_floats(rows, slots, self.w_kn)
        if self.w_kn:
            pitch = 4 * rows + 8  # 4 rows of K's columns, then the padding
            return storage.w.get_tensor(cute.make_layout(
                ((4, rows // 4), (4, 8), slots, self.stages),
                stride=((1, 4), (rows, pitch), 8 * pitch, per_stage)))
        return storage.w.get_tensor(cute.make_layout(
            (4, 8, slots, rows, self.stages),
            stride=(1, 4, 32, self.w_pitch, per_stage)))

    @cute.jit
    def _w_quad(self, s_w: cute.Tensor, w: cute.Tensor, row, j, t, slot, stage):
        """This thread's values 4t..4t+3 of W's row `row` in 16-wide half j of the chunk
        in `slot` (`w_kn`: rows 16j + 4t .. + 3 of K of column `row`, one by one)."""
        if cutlass.const_expr(self.w_kn):
            for v in cutlass.range_constexpr(4):
                w[v] = s_w[(row, 16 * j + 4 * t + v, slot, stage)]
        else:
            cute.autovec_copy(s_w[(None, 4 * j + t, slot, row, stage)], w)

    def _w_extents(self, mW: cute.Tensor):
        """(N, chunks of 32 values of K) of W as given: [N, chunks, ...] or, with `w_kn`,
        [K, N / 4, 4]."""
        if self.w_kn:
            return cute.size(mW, mode=[1]) * 4, cute.size(mW, mode=[0]) // 32
        return cute.size(mW, mode=[0]), cute.size(mW, mode=[1])

    @cute.jit
    def _rounds(self, copy, rounds, s_scale: cute.Tensor, row_scale: cute.Tensor,
                acc: cute.Tensor, frag_a: cute.Tensor, frag_b: cute.Tensor, chunk: cute.Tensor,
                s_parts: cute.Tensor, x_scale: cute.Tensor, tiled_mma: cute.TiledMma, tidx,
                warp, lane, tops: Optional[cute.Tensor]):
        """Steps 3 and 4 over one block: every round's chunks at the scales in `s_scale`,
        added into `acc` in ascending chunk order (`tops`: this thread's maxima of |w| bits
        per n8 block, for `_check_guess`)."""
        rows, grp, stages = self.rows, self.group, self.stages
        chunks, m_total = copy[8], copy[9]
        for nb in cutlass.range_constexpr(self.n_blocks):
            row_scale[nb] = cutlass.Float32(1.0)
            if nb * 8 + lane // 4 < rows:
                row_scale[nb] = s_scale[nb * 8 + lane // 4]
        acc.fill(0.0)
        for r in cutlass.range(rounds, unroll=1):
            self._open_round(copy, r, rounds, tidx)
            stage = r % stages
            for gi in cutlass.range_constexpr(grp):
                slot = warp * grp + gi
                if r * self.slots + slot < chunks:
                    self._split_w(copy[4], row_scale, frag_b, slot, stage, lane, tops)
                    if cutlass.const_expr(self.x_fp32):
                        self._split_a(copy[5], x_scale, frag_a, slot, stage, m_total, lane)
                    else:
                        self._load_a(copy[5], frag_a, slot, stage, m_total, lane)
                    chunk.fill(0.0)
                    for s in cutlass.range_constexpr(STEPS):
                        cute.gemm(tiled_mma, chunk, frag_a[(None, None, s)],
                                  frag_b[(None, None, s)], chunk)
                    self._store_chunk(chunk, s_parts, slot, m_total, lane)
            cute.arch.sync_threads()
            in_round = chunks - r * self.slots
            for i in cutlass.range_constexpr(self.per_thread):
                o = tidx + i * THREADS
                m = o // rows
                if m < m_total:
                    # Independent loads, then the adds in ascending chunk order.
                    vals = cute.make_rmem_tensor((self.slots,), cutlass.Float32)
                    for sl in cutlass.range_constexpr(self.slots):
                        if sl < in_round:
                            vals[sl] = s_parts[(sl, m, o % rows)]
                    total = acc[i]
                    for sl in cutlass.range_constexpr(self.slots):
                        if sl < in_round:
                            total = total + vals[sl]
                    acc[i] = total

    @cute.jit
    def _open_guess(self, copy, rounds, mGuess: cute.Tensor, s_scale: cute.Tensor,
                    s_inv: cute.Tensor, s_flag: cute.Tensor, tidx):
        """A block's start with `w_guess`: the first stages - 1 rounds' copies go out, and
        the rows' guessed scales (mGuess, as bits: any value; a wrong one costs a second
        attempt, never a bit) and their reciprocals go to shared memory; then a barrier."""
        self._prime_ring(copy, rounds, tidx)
        n0, n_total = copy[6], copy[7]
        if tidx == 0:
            s_flag[0] = 1
        if tidx < self.bn:
            guess = cutlass.Int32(_ONE_BITS)
            if tidx < self.rows and n0 + tidx < n_total:
                guess = mGuess[n0 + tidx]
            _scales_i(s_scale)[tidx] = guess
            _scales_i(s_inv)[tidx] = inverse_bits(guess)
        cute.arch.sync_threads()

    @cute.jit
    def _check_guess(self, copy, rounds, tops: cute.Tensor, mGuess: cute.Tensor,
                     s_scale: cute.Tensor, s_inv: cute.Tensor, s_tops: cute.Tensor,
                     s_flag: cute.Tensor, tidx):
        """After a block's rounds: each row's maximum of |w| bits over the CTA (the four
        lanes of a row's fragments, then the warps in shared memory) gives its scale as the
        row-maxima pass would (`scale_bits_of`). A row whose guess differs takes that scale
        (shared memory and mGuess) and raises the flag; then the block's first rounds are
        copied again for the next attempt. Barriers inside; every thread calls it."""
        self._warp_tops(tops, s_tops, tidx // 32, tidx % 32)
        if tidx == 0:
            s_flag[0] = 0
        cute.arch.sync_threads()
        n0, n_total = copy[6], copy[7]
        if tidx < self.rows and n0 + tidx < n_total:
            top = cutlass.Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                top = cutlass.max(top, s_tops[w * self.bn + tidx])
            scale_bits, inv_bits = scale_bits_of(top)
            if scale_bits != _scales_i(s_scale)[tidx]:
                _scales_i(s_scale)[tidx] = scale_bits
                _scales_i(s_inv)[tidx] = inv_bits
                mGuess[n0 + tidx] = scale_bits
                s_flag[0] = 1
        cute.arch.sync_threads()
        if s_flag[0] != 0:
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            self._prime_ring(copy, rounds, tidx)

    @cute.jit
    def _warp_tops(self, tops: cute.Tensor, s_tops: cute.Tensor, warp, lane):
        """This warp's row maxima (the four lanes of each row's fragments) into its entries
        of `s_tops` [warp][row]: every warp splits values of every row of the block."""
        for nb in cutlass.range_constexpr(self.n_blocks):
            top = cute.arch.warp_reduction(tops[nb], lambda a, b: cutlass.max(a, b),
                                           threads_in_group=4)
            if lane % 4 == 0:
                s_tops[warp * self.bn + nb * 8 + lane // 4] = top

    @cute.jit
    def _store_unscaled(self, mY: cute.Tensor, mBias, m, n, value, inv_x, s_inv: cute.Tensor,
                        row):
        """Output (m, n): the chunked sum times X's inverse scale and W's (`s_inv[row]`),
        each product rounded (no contraction into an FMA: split.unscale's bits), plus the
        bias."""
        y = mul_rn(mul_rn(value, inv_x), s_inv[row])
        if cutlass.const_expr(self.has_bias):
            y = add_rn(y, mBias[n])
        mY[(m, n)] = y

    @cute.jit
    def _open_block(self, copy, rounds, mWbits: cute.Tensor, s_scale: cute.Tensor,
                    s_inv: cute.Tensor, s_tops: cute.Tensor, tidx):
        """A block's start: the first stages - 1 rounds' copies (`copy`: `_copy_round`'s
        leading arguments) go out before the row maxima (THREADS / rows threads per row),
        which bring the same lines into L2; then the maxima, W's scales in shared memory,
        and a barrier."""
        self._prime_ring(copy, rounds, tidx)
        per_row = THREADS // self.rows
        top = self._row_max(mWbits, copy[6] + tidx // per_row, copy[7], tidx % per_row,
                            per_row, cute.size(mWbits, mode=[1]))
        self._write_scale(top, s_scale, s_inv, s_tops, tidx)
        cute.arch.sync_threads()

    @cute.jit
    def _prime_ring(self, copy, rounds, tidx):
        """Step 1: the first stages - 1 rounds' copies (`copy`: `_copy_round`'s leading
        arguments), one commit group each."""
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < rounds:
                self._copy_round(*copy, s, s, tidx)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _open_round(self, copy, r, rounds, tidx):
        """Round r has landed (at most stages - 2 newer groups in flight), and after the
        barrier every warp is done with round r - 1, whose stage takes round
        r + stages - 1."""
        cute.arch.cp_async_wait_group(self.stages - 2)
        cute.arch.sync_threads()
        nxt = r + self.stages - 1
        if nxt < rounds:
            self._copy_round(*copy, nxt, nxt % self.stages, tidx)
        cute.arch.cp_async_commit_group()

    def _staging(self, mA: cute.Tensor, m_total, chunks):
        """The cp.async atoms (16 bytes of W's fp32, of X: fp32 or fp16 parts) and X as
        [row, chunk, vectors, values]: 16-byte vectors (`a_vec`)."""
        a_dtype = cutlass.Float32 if self.x_fp32 else cutlass.Float16
        atoms = [cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), dtype,
            num_bits_per_copy=128) for dtype in (cutlass.Float32, a_dtype)]
        vec, vecs = self.a_vec
        mA8 = cute.make_tensor(mA.iterator, cute.make_layout(
            (m_total, chunks, vecs, vec), stride=(mA.stride[0], vec * vecs, vec, 1)))
        return atoms[0], atoms[1], mA8

    @cute.jit
    def _copy_round(self, g2s_w, g2s_a, mW: cute.Tensor, mA8: cute.Tensor, s_w: cute.Tensor,
                    s_a: cute.Tensor, n0, n_total, chunks, m_total, r, stage, tidx):
        """cp.async round r's W rows and X's rows (fp32 or parts; 16-byte vectors, threads
        in memory order) into `stage`; nothing past N, M or the last chunk (never read)."""
        c0 = r * self.slots
        if cutlass.const_expr(self.w_kn):  # per row of K, the block's columns in vectors
            per_row = self.rows // 4
            w_vecs = self.slots * 32 * per_row
            for i in cutlass.range_constexpr(-(-w_vecs // THREADS)):
                u = tidx + i * THREADS
                v, rest = u % per_row, u // per_row
                kr, sl = rest % 32, rest // 32
                if u < w_vecs and n0 + 4 * v < n_total and c0 + sl < chunks:
                    cute.copy(g2s_w, mW[((c0 + sl) * 32 + kr, n0 // 4 + v, None)],
                              s_w[((None, v), kr, sl, stage)])
        else:
            w_vecs = self.rows * self.slots * 8
            for i in cutlass.range_constexpr(-(-w_vecs // THREADS)):
                u = tidx + i * THREADS
                v, rest = u % 8, u // 8
                sl, row = rest % self.slots, rest // self.slots
                if u < w_vecs and n0 + row < n_total and c0 + sl < chunks:
                    cute.copy(g2s_w, mW[(n0 + row, c0 + sl, v // 4, v % 4, None)],
                              s_w[(None, v, sl, row, stage)])
        vecs = self.a_vec[1]
        a_vecs = self.m_rows * self.slots * vecs
        for i in cutlass.range_constexpr(-(-a_vecs // THREADS)):
            u = tidx + i * THREADS
            v, rest = u % vecs, u // vecs
            sl, row = rest % self.slots, rest // self.slots
            if u < a_vecs and row < m_total and c0 + sl < chunks:
                cute.copy(g2s_a, mA8[(row, c0 + sl, v, None)], s_a[(None, v, sl, row, stage)])

    @cute.jit
    def _row_max(self, mWbits: cute.Tensor, n, n_total, sub, per_row, quads):
        """This thread's part of row n's maximum of |x| bits: `_LOADS` 16-byte loads in
        flight per iteration (zero past N)."""
        top = cutlass.Int32(0)
        if n < n_total:
            for q0 in cutlass.range(sub, quads, per_row * _LOADS, unroll=1):
                bits = cute.make_rmem_tensor((4, _LOADS), cutlass.Int32)
                for u in cutlass.range_constexpr(_LOADS):
                    q = q0 + u * per_row
                    if q < quads:
                        cute.autovec_copy(mWbits[(n, q, None)], bits[(None, u)])
                    else:
                        bits[(None, u)].fill(0)
                for u in cutlass.range_constexpr(_LOADS):
                    for i in cutlass.range_constexpr(4):
                        top = cutlass.max(top, bits[(i, u)] & SIGN_OFF)
        return top

    @cute.jit
    def _x_row_scales(self, mA: cute.Tensor, s_xs: cute.Tensor, s_xinv: cute.Tensor,
                      s_tops: cute.Tensor, m_total, chunks, tidx):
        """X's row scales in the kernel (`x_inline`), as `SplitFp16Parts` takes them: the
        integer maximum of |x| bits per row (a NaN dominates) over the CTA's threads
        (`_LOADS` 16-byte loads in flight), then `scale_bits_of` into s_xs and s_xinv (the
        split kernel's launch saved; every CTA reads X, a few rows, from L2)."""
        quads = chunks * 8
        bits = cute.make_tensor(cute.recast_ptr(mA.iterator, dtype=cutlass.Int32),
                                cute.make_layout((m_total, quads, 4),
                                                 stride=(mA.stride[0], 4, 1)))
        for m in cutlass.range_constexpr(self.m_rows):
            top = cutlass.Int32(0)
            if m < m_total:
                top = self._row_max(bits, m, m_total, tidx, THREADS, quads)
            top = cute.arch.warp_reduction(top, lambda a, b: cutlass.max(a, b))
            if tidx % 32 == 0:
                s_tops[(tidx // 32, m)] = top
        cute.arch.sync_threads()
        if tidx < self.m_rows:
            top = cutlass.Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                top = cutlass.max(top, s_tops[(w, tidx)])
            scale_bits, inv_bits = scale_bits_of(top)
            cute.make_tensor(cute.recast_ptr(s_xs.iterator, dtype=cutlass.Int32),
                             s_xs.layout)[tidx] = scale_bits
            cute.make_tensor(cute.recast_ptr(s_xinv.iterator, dtype=cutlass.Int32),
                             s_xinv.layout)[tidx] = inv_bits

    @cute.jit
    def _write_scale(self, top, s_scale: cute.Tensor, s_inv: cute.Tensor, s_tops: cute.Tensor,
                     tidx):
        """Reduce the row maxima of the block's THREADS / rows threads per row (one warp or
        part of one, else several warps meeting in smem) and write each row's scale
        2^(13 - floor(log2 max|x|)), clamped to [2^-126, 2^127], and its reciprocal (exact)
        to smem. Every thread calls it (a barrier inside when rows < 8)."""
        per_row = THREADS // self.rows
        row, sub = tidx // per_row, tidx % per_row
        top = cute.arch.warp_reduction(top, lambda a, b: cutlass.max(a, b),
                                       threads_in_group=min(per_row, 32))
        if cutlass.const_expr(per_row > 32):
            if tidx % 32 == 0:
                s_tops[tidx // 32] = top
            cute.arch.sync_threads()
            if sub == 0:
                for w in cutlass.range_constexpr(1, per_row // 32):
                    top = cutlass.max(top, s_tops[tidx // 32 + w])
        if sub == 0:
            scale_bits, inv_bits = scale_bits_of(top)
            scale_i = cute.make_tensor(cute.recast_ptr(s_scale.iterator, dtype=cutlass.Int32),
                                       s_scale.layout)
            inv_i = cute.make_tensor(cute.recast_ptr(s_inv.iterator, dtype=cutlass.Int32),
                                     s_inv.layout)
            scale_i[row] = scale_bits
            inv_i[row] = inv_bits

    @cute.jit
    def _split_w(self, s_w: cute.Tensor, row_scale: cute.Tensor, frag_b: cute.Tensor, slot,
                 stage, lane, tops: Optional[cute.Tensor] = None):
        """B fragments of the chunk in `slot`'s six steps: per n8 block and 16-wide half,
        this thread's values 4t..4t+3 of row 8 * nb + lane / 4, x = w * s (exact),
        hi = fp16(x), -lo = fp16(hi - x), -hi = fp16(-x); steps -hi j0, -hi j1, -lo j0,
        -lo j1, hi j0, hi j1 (split.py's side "b")."""
        g, t = lane // 4, lane % 4
        for nb in cutlass.range_constexpr(self.n_blocks):
            for j in cutlass.range_constexpr(2):
                w = cute.make_rmem_tensor((4,), cutlass.Float32)
                if cutlass.const_expr(self.rows >= 8):  # w_kn: rows >= 8
                    self._w_quad(s_w, w, nb * 8 + g, j, t, slot, stage)
                else:  # rows past the block's are zeros (their outputs are not stored)
                    w.fill(0.0)
                    if g < self.rows:
                        cute.autovec_copy(s_w[(None, 4 * j + t, slot, g, stage)], w)
                if cutlass.const_expr(tops is not None):
                    bits = cute.recast_tensor(w, cutlass.Int32)
                    for v in cutlass.range_constexpr(4):
                        tops[nb] = cutlass.max(tops[nb], bits[v] & SIGN_OFF)
                parts = cute.make_rmem_tensor((4, 3), cutlass.Float16)
                split_quad(w.load() * row_scale[nb], parts, "b")
                for p in cutlass.range_constexpr(3):
                    for v in cutlass.range_constexpr(4):
                        frag_b[(v, nb, 2 * p + j)] = parts[(v, p)]

    @cute.jit
    def _load_a(self, s_a: cute.Tensor, frag_a: cute.Tensor, slot, stage, m_total, lane):
        """A fragments of the chunk in `slot`'s six steps: rows g and g + 8 of each m16
        tile, values 4t..4t+3 of the step's 16-wide block into slots (2t, 2t+1, 2t+8, 2t+9);
        rows past M are zeros."""
        g, t = lane // 4, lane % 4
        s_a4 = cute.make_tensor(s_a.iterator, cute.make_layout(
            (4, 24, self.slots, self.m_rows, self.stages),
            stride=(1, 4, 96, self.a_pitch, self.m_rows * self.a_pitch)))
        for mt in cutlass.range_constexpr(self.m_tiles):
            for s in cutlass.range_constexpr(STEPS):
                for h in cutlass.range_constexpr(2):  # rows g, g + 8
                    m = mt * 16 + g + 8 * h
                    vals = cute.make_rmem_tensor((4,), cutlass.Float16)
                    if cutlass.const_expr(mt * 16 + 8 * h < self.m_rows):
                        if m < m_total:
                            cute.autovec_copy(s_a4[(None, 4 * s + t, slot, m, stage)], vals)
                        else:
                            vals.fill(0.0)
                    else:
                        vals.fill(0.0)
                    frag_a[(2 * h, mt, s)] = vals[0]
                    frag_a[(2 * h + 1, mt, s)] = vals[1]
                    frag_a[(2 * h + 4, mt, s)] = vals[2]
                    frag_a[(2 * h + 5, mt, s)] = vals[3]

    @cute.jit
    def _x_scales(self, mSx: cute.Tensor, m_total, lane):
        """With `x_fp32`, the scales of the rows of X this thread's A fragments hold (rows
        g and g + 8 of each m16 tile; 1.0 past M); else an unused register."""
        x_scale = cute.make_rmem_tensor((2 * self.m_tiles,), cutlass.Float32)
        x_scale.fill(1.0)
        if cutlass.const_expr(self.x_fp32):
            for i in cutlass.range_constexpr(2 * self.m_tiles):
                m = (i // 2) * 16 + 8 * (i % 2) + lane // 4
                if m < m_total:
                    x_scale[i] = mSx[m]
        return x_scale

    @cute.jit
    def _split_a(self, s_a: cute.Tensor, x_scale: cute.Tensor, frag_a: cute.Tensor, slot,
                 stage, m_total, lane):
        """`_load_a` from X's fp32 rows (`x_fp32`): per m16 tile, row g or g + 8 and
        16-wide half j, this thread's values 4t..4t+3 of row m, x = X * s_x[m] (exact),
        hi = fp16(x), -lo = fp16(hi - x), -hi = fp16(-x), as `SplitFp16Parts` writes side
        "a" ([-lo, -hi, hi]); steps 2p + j take part p; rows past M are zeros."""
        g, t = lane // 4, lane % 4
        for mt in cutlass.range_constexpr(self.m_tiles):
            for h in cutlass.range_constexpr(2):  # rows g, g + 8
                m = mt * 16 + g + 8 * h
                for j in cutlass.range_constexpr(2):
                    parts = cute.make_rmem_tensor((4, 3), cutlass.Float16)
                    parts.fill(0.0)
                    if cutlass.const_expr(mt * 16 + 8 * h < self.m_rows):
                        if m < m_total:
                            xs = cute.make_rmem_tensor((4,), cutlass.Float32)
                            cute.autovec_copy(s_a[(None, 4 * j + t, slot, m, stage)], xs)
                            split_quad(xs.load() * x_scale[2 * mt + h], parts, "a")
                    for p in cutlass.range_constexpr(3):
                        frag_a[(2 * h, mt, 2 * p + j)] = parts[(0, p)]
                        frag_a[(2 * h + 1, mt, 2 * p + j)] = parts[(1, p)]
                        frag_a[(2 * h + 4, mt, 2 * p + j)] = parts[(2, p)]
                        frag_a[(2 * h + 5, mt, 2 * p + j)] = parts[(3, p)]

    @cute.jit
    def _store_chunk(self, chunk: cute.Tensor, s_parts: cute.Tensor, slot, m_total, lane):
        """This warp's chunk values (rows below M) into its slot. One buffer serves every
        round: a thread reaches the next round's barrier only after its adds of this one."""
        g, t = lane // 4, lane % 4
        for mt in cutlass.range_constexpr(self.m_tiles):
            for nb in cutlass.range_constexpr(self.n_blocks):
                for v in cutlass.range_constexpr(4):
                    if cutlass.const_expr(mt * 16 + 8 * (v // 2) < self.m_rows):
                        m = mt * 16 + g + 8 * (v // 2)
                        col = nb * 8 + 2 * t + v % 2
                        if m < m_total and col < self.rows:
                            s_parts[(slot, m, col)] = chunk[(v, mt, nb)]


@cute.jit
def split_quad(x, parts: cute.Tensor, side: cutlass.Constexpr):
    """Four scaled values x (exact products) into their fp16 parts [4, 3] in `side`'s order
    (`split_parts.SplitFp16Parts`): hi = fp16(x), -lo = fp16(hi - x), -hi = fp16(-x);
    side "a" [-lo, -hi, hi], side "b" [-hi, -lo, hi]."""
    hi = x.to(cutlass.Float16)
    if cutlass.const_expr(side == "a"):
        parts[(None, 0)].store((hi.to(cutlass.Float32) - x).to(cutlass.Float16))
        parts[(None, 1)].store((-x).to(cutlass.Float16))
    else:
        parts[(None, 0)].store((-x).to(cutlass.Float16))
        parts[(None, 1)].store((hi.to(cutlass.Float32) - x).to(cutlass.Float16))
    parts[(None, 2)].store(hi)


@cute.jit
def scale_bits_of(top):
    """The bits of a row's scale 2^(13 - floor(log2 max|x|)), clamped to [2^-126, 2^127],
    and of its reciprocal (exact; 2^-127 as the subnormal it is), from the row's largest
    |x| as bits (`top`)."""
    e = cutlass.min(cutlass.max(_TOP_EXP + 254 - (top >> 23), 1), 254)
    inv_bits = cutlass.select_(e <= 253, (254 - e) << 23, cutlass.Int32(1 << 22))
    return cutlass.Int32(e << 23), cutlass.Int32(inv_bits)


_ONE_BITS = 127 << 23  # 1.0f as bits: the scale of rows a block does not store


def _scales_i(scales: cute.Tensor) -> cute.Tensor:
    """A shared-memory fp32 tensor of scales seen as their int32 bits."""
    return cute.make_tensor(cute.recast_ptr(scales.iterator, dtype=cutlass.Int32), scales.layout)


@cute.jit
def inverse_bits(scale_bits):
    """The bits of 1 / scale for a scale's bits (`scale_bits_of`'s reciprocal rule: the
    exponent field mirrored, 2^-127 as the subnormal it is)."""
    e = scale_bits >> 23
    return cutlass.select_(e <= 253, (254 - e) << 23, cutlass.Int32(1 << 22))


@cute.jit
def reciprocal(scale):
    """1 / scale for a power of two in [2^-126, 2^127] (`split.row_scales`), exactly: the
    exponent field mirrored, and 2^-127 as the subnormal it is."""
    e = cute.make_rmem_tensor((1,), cutlass.Float32)
    e[0] = scale
    bits = cute.recast_tensor(e, cutlass.Int32)
    x = bits[0] >> 23
    bits[0] = cutlass.select_(x <= 253, (254 - x) << 23, cutlass.Int32(1 << 22))
    return e[0]


def _rn(op: str):
    """An fp32 `op` ("mul" or "add") with an explicit round-to-nearest-even modifier:
    PTX never contracts such an instruction with another into an FMA."""

    @dsl_user_op
    def fn(a, b, *, loc=None, ip=None):
        return cutlass.Float32(llvm.inline_asm(
            cutlass.Float32.mlir_type,
            [cutlass.Float32(a).ir_value(loc=loc, ip=ip),
             cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
            f"{op}.rn.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False,
            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

    return fn


def w_stage_floats(rows: int, slots: int, w_kn: bool) -> int:
    """Floats of one stage of W in shared memory (`_w_stages`): `rows` rows of `slots`
    chunks of 32, pitch padded by 16; with `w_kn` per chunk slot 32 rows of K of the
    block's `rows` columns, 8 floats of padding after every 4."""
    return slots * 8 * (4 * rows + 8) if w_kn else rows * (slots * 32 + 16)


mul_rn = _rn("mul")
add_rn = _rn("add")
