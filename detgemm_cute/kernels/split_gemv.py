"""The fp32 tier's full precision at decode sizes: W's split fused into the GEMM (sm_80 up).

``Y[M, N] = unscale(chunks(parts(X), parts(W))) (+ bias)`` for M <= 64, with the bits of
the split path (`split.py`: `scaled_operand_cuda` on both operands, the chunked GEMM,
`split.unscale`), but W is read as fp32 and split in registers: its three fp16 parts are
never written to memory and read back. X's parts (M rows, small) come from the split kernel.

Pipeline (one CTA of 8 warps per block of BN = 8 * NB rows of W, persistent over blocks):

1. Row scales: the CTA streams its BN rows (16-byte loads, `_LOADS` in flight per thread),
   takes the integer maximum of |x|'s bits per row (a NaN dominates, as in
   `SplitFp16Parts`), and writes the row scale 2^(13 - floor(log2 max|x|)) (clamped to
   [2^-126, 2^127]) and its reciprocal to shared memory.
2. Chunks: in round r warp w takes the G consecutive chunks (32 values of K each) starting
   at (r * 8 + w) * G. The block's rows were just read in step 1, so these loads hit L2; the
   next round's are issued before this round computes. Per chunk and n8 block of rows each
   thread scales and splits its 8 values into the B fragments of the chunk's six
   ``m16n8k16`` steps (side "b": -hi j0, -hi j1, -lo j0, -lo j1, hi j0, hi j1), loads X's
   parts as the A fragments, and runs the six steps onto a fragment that starts at +0.0:
   the chunk, exactly as the chunked GEMM kernels compute it.
3. Ordered adds: each warp writes its chunks to shared memory; after a barrier, the thread
   that owns an output adds the round's chunks to its fp32 accumulator one IEEE add at a
   time, in ascending chunk order (the chunked chain: acc = ((+0.0 + c0) + c1) + ...).
4. Epilogue: ``(acc * (1/s_x[m])) * (1/s_w[n])`` (`split.unscale`), plus bias[n] in fp32,
   stored as fp32 (the caller rounds to another output dtype, as the split path does).

Inside a 16-wide K block the chain adds 16 exact products at once (the block sum does not
depend on their order: docs/reference.md), so a thread's four values of a block are the
consecutive K indices 4t..4t+3 (one 16-byte load of W, one 8-byte load of X's parts) placed
in the fragment slots 2t, 2t+1, 2t+8, 2t+9 of both A and B: the same 16 products per block.

Inputs: W fp32 [N, chunks, 2, 4, 4] and its int32 view [N, chunks * 8, 4] (rows 16-byte
aligned, K a multiple of 32); X's parts fp16 [M, chunks, 3, 2, 4, 4] (side "a": -lo, -hi,
hi per chunk); 1/s_x fp32 [M]; Y fp32 [M, N] (unit stride along N); bias fp32 [N].
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

THREADS = 256
WARPS = THREADS // 32
STEPS = 6  # 16-wide steps per chunk
_LOADS = 8  # pass 1: 16-byte loads per thread per iteration
_SIGN_OFF = 0x7FFFFFFF  # |x| as bits: an integer maximum orders them, Inf < NaN
_TOP_EXP = 13  # a row's largest scaled magnitude lies in [2^13, 2^14)


class SplitGemvFp32:
    """One CTA per block of ``8 * n_blocks`` rows of W (persistent: the launch's grid may be
    smaller than the block count), ``m_tiles`` m16 tiles of X's rows (M <= 16 * m_tiles),
    ``group`` chunks per warp and round, optional fp32 bias."""

    def __init__(self, m_tiles: int, n_blocks: int, group: int, has_bias: bool):
        if not 1 <= m_tiles <= 4 or n_blocks not in (1, 2, 4) or group not in (1, 2, 4):
            raise ValueError(f"SplitGemvFp32: m_tiles 1..4, n_blocks and group in (1, 2, 4); "
                             f"got {m_tiles}, {n_blocks}, {group}")
        self.m_tiles, self.n_blocks, self.group = m_tiles, n_blocks, group
        self.bn = 8 * n_blocks
        self.has_bias = has_bias
        self.slots = WARPS * group  # chunks per round
        self.outs = 16 * m_tiles * self.bn  # outputs of a block (rows past M included)
        self.per_thread = -(-self.outs // THREADS)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mWbits: cute.Tensor, mA: cute.Tensor,
                 mSxInv: cute.Tensor, mY: cute.Tensor, mBias: Optional[cute.Tensor],
                 ctas: cutlass.Int32, stream):
        op = cute.nvgpu.warp.MmaF16BF16Op(cutlass.Float16, cutlass.Float32, (16, 8, 16))
        tiled_mma = cute.make_tiled_mma(op)

        @cute.struct
        class SharedStorage:
            parts: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, 2 * self.slots * self.outs], 16]
            scale: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.bn], 16]
            inv: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.bn], 16]

        self.shared_storage = SharedStorage
        self.kernel(mW, mWbits, mA, mSxInv, mY, mBias, tiled_mma).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mWbits: cute.Tensor, mA: cute.Tensor,
               mSxInv: cute.Tensor, mY: cute.Tensor, mBias: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        warp, lane = tidx // 32, tidx % 32
        bn, mt_n, nb_n, grp = self.bn, self.m_tiles, self.n_blocks, self.group
        n_total = cute.size(mW, mode=[0])
        chunks = cute.size(mW, mode=[1])
        m_total = cute.size(mA, mode=[0])
        blocks = (n_total + bn - 1) // bn
        rounds = (chunks + self.slots - 1) // self.slots

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        s_parts = storage.parts.get_tensor(
            cute.make_layout((2, self.slots, 16 * mt_n, bn),
                             stride=(self.slots * self.outs, self.outs, bn, 1)))
        s_scale = storage.scale.get_tensor(cute.make_layout(bn))
        s_inv = storage.inv.get_tensor(cute.make_layout(bn))

        frag_a = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((16 * mt_n, 16 * STEPS)))
        frag_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((bn, 16 * STEPS)))
        chunk = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((16 * mt_n, bn)))
        # Vector mode first: each 16-byte load fills 4 consecutive registers.
        w_next = cute.make_rmem_tensor((4, 2, nb_n, grp), cutlass.Float32)
        w_cur = cute.make_rmem_tensor((4, 2, nb_n, grp), cutlass.Float32)
        acc = cute.make_rmem_tensor((self.per_thread,), cutlass.Float32)
        row_scale = cute.make_rmem_tensor((nb_n,), cutlass.Float32)

        for blk in cutlass.range(bidx, blocks, ctas, unroll=1):
            n0 = blk * bn
            self._row_scales(mWbits, s_scale, s_inv, n0, n_total, tidx)
            cute.arch.sync_threads()
            for nb in cutlass.range_constexpr(nb_n):
                row_scale[nb] = s_scale[nb * 8 + lane // 4]
            acc.fill(0.0)
            self._load_w(mW, w_next, n0, n_total, chunks, warp, lane, 0)
            for r in cutlass.range(rounds, unroll=1):
                w_cur.store(w_next.load())
                if r + 1 < rounds:
                    self._load_w(mW, w_next, n0, n_total, chunks, warp, lane, r + 1)
                buf = r % 2
                for gi in cutlass.range_constexpr(grp):
                    c = (r * WARPS + warp) * grp + gi
                    if c < chunks:
                        self._split_w(w_cur, row_scale, frag_b, gi)
                        self._load_a(mA, frag_a, c, m_total, lane)
                        chunk.fill(0.0)
                        for s in cutlass.range_constexpr(STEPS):
                            cute.gemm(tiled_mma, chunk, frag_a[(None, None, s)],
                                      frag_b[(None, None, s)], chunk)
                        self._store_chunk(chunk, s_parts, buf, warp * grp + gi, m_total, lane)
                cute.arch.sync_threads()
                in_round = cutlass.min(self.slots, chunks - r * self.slots)
                for i in cutlass.range_constexpr(self.per_thread):
                    o = tidx + i * THREADS
                    m = o // bn
                    if m < m_total:
                        total = acc[i]
                        for sl in cutlass.range(in_round, unroll=1):
                            total = total + s_parts[(buf, sl, m, o % bn)]
                        acc[i] = total
            for i in cutlass.range_constexpr(self.per_thread):
                o = tidx + i * THREADS
                m, n = o // bn, n0 + o % bn
                if m < m_total and n < n_total:
                    # Explicit rounding: no contraction into an FMA (split.unscale's bits).
                    y = mul_rn(mul_rn(acc[i], mSxInv[m]), s_inv[o % bn])
                    if cutlass.const_expr(self.has_bias):
                        y = add_rn(y, mBias[n])
                    mY[(m, n)] = y
            cute.arch.sync_threads()  # the next block rewrites the scales

    @cute.jit
    def _row_scales(self, mWbits: cute.Tensor, s_scale: cute.Tensor, s_inv: cute.Tensor,
                    n0, n_total, tidx):
        """Pass 1: the scale of each row of the block and its reciprocal, into smem."""
        per_row = THREADS // self.bn
        row, sub = tidx // per_row, tidx % per_row
        n = n0 + row
        quads = cute.size(mWbits, mode=[1])
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
                        top = cutlass.max(top, bits[(i, u)] & _SIGN_OFF)
        top = cute.arch.warp_reduction(top, lambda a, b: cutlass.max(a, b),
                                       threads_in_group=per_row)
        if sub == 0:
            e = cutlass.min(cutlass.max(_TOP_EXP + 254 - (top >> 23), 1), 254)
            inv_bits = cutlass.select_(e <= 253, (254 - e) << 23, cutlass.Int32(1 << 22))
            scale_i = cute.make_tensor(cute.recast_ptr(s_scale.iterator, dtype=cutlass.Int32),
                                       s_scale.layout)
            inv_i = cute.make_tensor(cute.recast_ptr(s_inv.iterator, dtype=cutlass.Int32),
                                     s_inv.layout)
            scale_i[row] = e << 23
            inv_i[row] = cutlass.Int32(inv_bits)

    @cute.jit
    def _load_w(self, mW: cute.Tensor, w: cute.Tensor, n0, n_total, chunks, warp, lane, r):
        """Round r's W values of this thread: per chunk, n8 block and 16-wide half, the 4
        consecutive values 4t..4t+3 of row 8*nb + lane/4 (zeros past N or the last chunk)."""
        g, t = lane // 4, lane % 4
        for gi in cutlass.range_constexpr(self.group):
            c = (r * WARPS + warp) * self.group + gi
            for nb in cutlass.range_constexpr(self.n_blocks):
                n = n0 + nb * 8 + g
                for j in cutlass.range_constexpr(2):
                    if n < n_total and c < chunks:
                        cute.autovec_copy(mW[(n, c, j, t, None)], w[(None, j, nb, gi)])
                    else:
                        w[(None, j, nb, gi)].fill(0.0)

    @cute.jit
    def _split_w(self, w: cute.Tensor, row_scale: cute.Tensor, frag_b: cute.Tensor, gi):
        """B fragments of chunk `gi`'s six steps: x = w * s (exact), hi = fp16(x),
        -lo = fp16(hi - x), -hi = fp16(-x); steps -hi j0, -hi j1, -lo j0, -lo j1, hi j0,
        hi j1 (split.py's side "b")."""
        for nb in cutlass.range_constexpr(self.n_blocks):
            for j in cutlass.range_constexpr(2):
                x = w[(None, j, nb, gi)].load() * row_scale[nb]
                hi = x.to(cutlass.Float16)
                parts = cute.make_rmem_tensor((3, 4), cutlass.Float16)
                parts[(0, None)].store((-x).to(cutlass.Float16))
                parts[(1, None)].store((hi.to(cutlass.Float32) - x).to(cutlass.Float16))
                parts[(2, None)].store(hi)
                for p in cutlass.range_constexpr(3):
                    for v in cutlass.range_constexpr(4):
                        frag_b[(v, nb, 2 * p + j)] = parts[(p, v)]

    @cute.jit
    def _load_a(self, mA: cute.Tensor, frag_a: cute.Tensor, c, m_total, lane):
        """A fragments of chunk c's six steps: rows g and g + 8 of each m16 tile, values
        4t..4t+3 of the step's 16-wide block into slots (2t, 2t+1, 2t+8, 2t+9); rows past M
        are zeros."""
        g, t = lane // 4, lane % 4
        for mt in cutlass.range_constexpr(self.m_tiles):
            for s in cutlass.range_constexpr(STEPS):
                for h in cutlass.range_constexpr(2):  # rows g, g + 8
                    m = mt * 16 + g + 8 * h
                    vals = cute.make_rmem_tensor((4,), cutlass.Float16)
                    if m < m_total:
                        cute.autovec_copy(mA[(m, c, s // 2, s % 2, t, None)], vals)
                    else:
                        vals.fill(0.0)
                    frag_a[(2 * h, mt, s)] = vals[0]
                    frag_a[(2 * h + 1, mt, s)] = vals[1]
                    frag_a[(2 * h + 4, mt, s)] = vals[2]
                    frag_a[(2 * h + 5, mt, s)] = vals[3]

    @cute.jit
    def _store_chunk(self, chunk: cute.Tensor, s_parts: cute.Tensor, buf, slot, m_total,
                     lane):
        """This warp's chunk values (rows below M) into its slot of buffer `buf`."""
        g, t = lane // 4, lane % 4
        for mt in cutlass.range_constexpr(self.m_tiles):
            for nb in cutlass.range_constexpr(self.n_blocks):
                for v in cutlass.range_constexpr(4):
                    m = mt * 16 + g + 8 * (v // 2)
                    if m < m_total:
                        s_parts[(buf, slot, m, nb * 8 + 2 * t + v % 2)] = chunk[(v, mt, nb)]


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


mul_rn = _rn("mul")
add_rn = _rn("add")
