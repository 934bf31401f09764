"""The fp32 tier's full precision at decode sizes on sm_90: a cluster holds a block of W.

``Y[M, N] = unscale(chunks(parts(X), parts(W))) (+ bias)``, the bits of `SplitGemvFp32`
(and of the split path), with W read from memory once at any K. A row's scale needs the
whole row's maximum before any of its chunks can be split; `SplitGemvFp32` reads a block
twice for that (the second read misses L2 at long K). Here the `cluster` CTAs of a cluster
split the block's K range and keep their slices in shared memory, and the row maxima meet
in distributed shared memory.

Pipeline (one cluster per block of 8 rows of W; CTA r of the cluster owns the chunks
[r * cap, (r + 1) * cap) of 32 values of K; 8 warps):

1. cp.async: the CTA's slice of the 8 rows of W and of X's parts into shared memory, in
   `groups` commit groups along K (16-byte copies, threads in memory order).
2. Row maxima: as each group lands, warp w takes row w's integer maximum of |x| bits over
   it (a NaN dominates, as in `SplitFp16Parts`). Lane r sends the row's partial maximum to
   CTA r of the cluster; a cluster barrier makes the cluster's maxima visible everywhere.
3. Chunks: warp w takes the CTA's chunks w, w + 8, ...: the row's scale from the cluster's
   maxima, W scaled and split in registers into the B fragments, X's parts as the A
   fragments, six ``m16n8k16`` steps from +0.0 (`SplitGemvFp32._split_w` / `_load_a`, the
   same fragment slots). Each chunk value goes to the CTA that owns its output (output
   o = m * 8 + row belongs to CTA o % cluster), into its slot for the chunk's global index.
4. After a second cluster barrier, each owner thread adds its output's chunks to an fp32
   accumulator from +0.0, one IEEE add at a time in ascending chunk order (the chunked
   chain), unscales ``(acc * (1/s_x[m])) * (1/s_w[n])`` with explicit rounding, adds the
   bias and stores fp32.

No CTA stores to another before the start-up cluster barrier (`cluster_arrive_relaxed` at
entry, waited before the first remote store) or after the second barrier. (A persistent
form, each cluster looping over blocks with a ring of W slices and X's parts kept, took 1.6x
the time on the H100, geomean over 46 problems at M 1..8 (0.97-3.13x): two cluster barriers
per block, and too little in flight between them;
`bench/results/tune/fp32-decode-cluster-persistent_*`.)

Inputs as `SplitGemvFp32`'s: W fp32 [N, chunks, 2, 4, 4] (rows 16-byte aligned), X's parts
fp16 [M, chunks, 3, 2, 4, 4], s_x fp32 [M], Y fp32 [M, N], bias fp32 [N]; chunks must not
exceed cluster * cap (`split_decode.cluster_shape`).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .split_gemv import (SIGN_OFF, STEPS, THREADS, WARPS, SplitGemvFp32, add_rn, mul_rn,
                         reciprocal, scale_bits_of)

ROWS = 8  # rows of W per cluster: the MMA's n8


class ClusterGemvFp32(SplitGemvFp32):
    """One cluster of ``cluster`` CTAs (1..8) per block of 8 rows of W; each CTA holds
    ``cap`` chunks (a multiple of 8) of the block's rows and of X's ``m_rows`` rows (a power of
    two up to 64) in shared memory, loaded in ``groups`` (1, 2 or 4) commit groups."""

    def __init__(self, m_rows: int, cluster: int, cap: int, groups: int, has_bias: bool):
        if not 1 <= cluster <= 8 or cap < 8 or cap % 8 or groups not in (1, 2, 4):
            raise ValueError(f"ClusterGemvFp32: cluster 1..8, cap a positive multiple of 8, "
                             f"groups in (1, 2, 4); got {cluster}, {cap}, {groups}")
        super().__init__(m_rows, ROWS, 1, 2, has_bias)  # checks m_rows
        self.cluster, self.cap, self.groups = cluster, cap, groups
        # The fragment helpers read "slots" chunks of one "stage".
        self.slots, self.stages = cap, 1
        self.w_pitch = cap * 32 + 16
        self.a_pitch = cap * 96 + 16
        self.owned = -(-m_rows * ROWS // cluster)  # outputs per CTA
        self.sub = -(-cap // groups)  # chunks per commit group

    @cute.jit
    def __call__(self, mW: cute.Tensor, mA: cute.Tensor, mSx: cute.Tensor, mY: cute.Tensor,
                 mBias: Optional[cute.Tensor], stream):
        op = cute.nvgpu.warp.MmaF16BF16Op(cutlass.Float16, cutlass.Float32, (16, 8, 16))
        tiled_mma = cute.make_tiled_mma(op)

        @cute.struct
        class SharedStorage:
            w: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, ROWS * self.w_pitch],
                                 128]
            a: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float16, self.m_rows * self.a_pitch], 128]
            parts: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self.cluster * self.cap * self.owned], 16]
            tops: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, ROWS * self.cluster],
                                    16]

        self.shared_storage = SharedStorage
        blocks = (cute.size(mW, mode=[0]) + ROWS - 1) // ROWS
        self.kernel(mW, mA, mSx, mY, mBias, tiled_mma).launch(
            grid=[self.cluster, blocks, 1], block=[THREADS, 1, 1],
            cluster=[self.cluster, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mA: cute.Tensor, mSx: cute.Tensor, mY: cute.Tensor,
               mBias: Optional[cute.Tensor], tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        rank, blk, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        cap, nc = self.cap, self.cluster
        n_total = cute.size(mW, mode=[0])
        chunks = cute.size(mW, mode=[1])
        m_total = cute.size(mA, mode=[0])
        n0, c0 = blk * ROWS, rank * cap
        mine = cutlass.max(cutlass.min(chunks - c0, cap), 0)
        cute.arch.cluster_arrive_relaxed()  # waited before the first remote store

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        s_w = storage.w.get_tensor(cute.make_layout(
            (4, 8, cap, ROWS, 1), stride=(1, 4, 32, self.w_pitch, ROWS * self.w_pitch)))
        s_a = storage.a.get_tensor(cute.make_layout(
            (8, 12, cap, self.m_rows, 1),
            stride=(1, 8, 96, self.a_pitch, self.m_rows * self.a_pitch)))
        s_parts = storage.parts.get_tensor(cute.make_layout((nc * cap, self.owned),
                                                            stride=(self.owned, 1)))
        s_tops = storage.tops.get_tensor(cute.make_layout((ROWS, nc), stride=(1, ROWS)))
        w_bits = cute.make_tensor(cute.recast_ptr(s_w.iterator, dtype=cutlass.Int32),
                                  cute.make_layout((4, cap * 8, ROWS),
                                                   stride=(1, 4, self.w_pitch)))
        g2s_w, g2s_a, mA8 = self._staging(mA, m_total, chunks)

        # 1. The slice, in commit groups along K.
        for gq in cutlass.range_constexpr(self.groups):
            lo, hi = gq * self.sub, min((gq + 1) * self.sub, cap)
            self._copy_slice(g2s_w, g2s_a, mW, mA8, s_w, s_a, n0, n_total, c0, mine,
                             m_total, lo, hi, tidx)
            cute.arch.cp_async_commit_group()
        # 2. Row maxima over the slice as its groups land; warp w takes row w.
        top = cutlass.Int32(0)
        for gq in cutlass.range_constexpr(self.groups):
            cute.arch.cp_async_wait_group(self.groups - 1 - gq)
            cute.arch.sync_threads()
            lo = gq * self.sub * 8
            hi = cutlass.min(min((gq + 1) * self.sub, cap), mine) * 8
            for v in cutlass.range(lo + lane, hi, 32, unroll=2):
                bits = cute.make_rmem_tensor((4,), cutlass.Int32)
                cute.autovec_copy(w_bits[(None, v, warp)], bits)
                for i in cutlass.range_constexpr(4):
                    top = cutlass.max(top, bits[i] & SIGN_OFF)
        top = cute.arch.warp_reduction(top, lambda a, b: cutlass.max(a, b))
        cute.arch.cluster_wait()  # every CTA of the cluster runs: remote stores may start
        if lane < nc:
            _store_remote(s_tops.iterator + (rank * ROWS + warp), lane, top)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

        # 3. The CTA's chunks; each value to its output's owner.
        g = lane // 4
        row_scale = cute.make_rmem_tensor((1,), cutlass.Float32)
        scale_bits, _ = scale_bits_of(self._cluster_max(s_tops, g))
        row_scale[0] = _from_bits(scale_bits)
        frag_a = tiled_mma.make_fragment_A(
            tiled_mma.partition_shape_A((16 * self.m_tiles, 16 * STEPS)))
        frag_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((ROWS, 16 * STEPS)))
        chunk = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((16 * self.m_tiles,
                                                                       ROWS)))
        for slot in cutlass.range(warp, mine, WARPS, unroll=1):
            self._split_w(s_w, row_scale, frag_b, slot, 0, lane)
            self._load_a(s_a, frag_a, slot, 0, m_total, lane)
            chunk.fill(0.0)
            for s in cutlass.range_constexpr(STEPS):
                cute.gemm(tiled_mma, chunk, frag_a[(None, None, s)], frag_b[(None, None, s)],
                          chunk)
            self._send_chunk(chunk, s_parts, c0 + slot, m_total, lane)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

        # 4. Owners: the ordered adds, unscale, bias, store.
        if tidx < self.owned:
            o = tidx * nc + rank
            m, col = o // ROWS, o % ROWS
            n = n0 + col
            if m < m_total and n < n_total:
                acc = cutlass.Float32(0.0)
                for ch in cutlass.range(chunks, unroll=8):
                    acc = acc + s_parts[(ch, tidx)]
                _, inv_bits = scale_bits_of(self._cluster_max(s_tops, col))
                # Explicit rounding: no contraction into an FMA (split.unscale's bits).
                y = mul_rn(mul_rn(acc, reciprocal(mSx[m])), _from_bits(inv_bits))
                if cutlass.const_expr(self.has_bias):
                    y = add_rn(y, mBias[n])
                mY[(m, n)] = y

    @cute.jit
    def _cluster_max(self, s_tops: cute.Tensor, row):
        """Row `row`'s largest |x| bits over the cluster's partial maxima."""
        top = s_tops[(row, 0)]
        for r in cutlass.range_constexpr(1, self.cluster):
            top = cutlass.max(top, s_tops[(row, r)])
        return top

    @cute.jit
    def _copy_slice(self, g2s_w, g2s_a, mW: cute.Tensor, mA8: cute.Tensor, s_w: cute.Tensor,
                    s_a: cute.Tensor, n0, n_total, c0, mine, m_total, lo, hi, tidx):
        """cp.async the slice's chunks [lo, hi) (below `mine`) of the block's W rows and of
        X's parts (16-byte vectors, threads in memory order); nothing past N or M. Loops,
        not unrolled: every copy's address kept live would cost registers."""
        width = hi - lo
        w_vecs = ROWS * width * 8
        for i in cutlass.range(-(-w_vecs // THREADS), unroll=1):
            u = tidx + i * THREADS
            v, rest = u % 8, u // 8
            sl, row = lo + rest % width, rest // width
            if u < w_vecs and n0 + row < n_total and sl < mine:
                cute.copy(g2s_w, mW[(n0 + row, c0 + sl, v // 4, v % 4, None)],
                          s_w[(None, v, sl, row, 0)])
        a_vecs = self.m_rows * width * 12
        for i in cutlass.range(-(-a_vecs // THREADS), unroll=1):
            u = tidx + i * THREADS
            v, rest = u % 12, u // 12
            sl, row = lo + rest % width, rest // width
            if u < a_vecs and row < m_total and sl < mine:
                cute.copy(g2s_a, mA8[(row, c0 + sl, v, None)], s_a[(None, v, sl, row, 0)])

    @cute.jit
    def _send_chunk(self, chunk: cute.Tensor, s_parts: cute.Tensor, index, m_total, lane):
        """This warp's chunk values (rows below M) into chunk `index`'s slot of the CTA that
        owns each output (distributed shared memory; the local store when the cluster is one
        CTA)."""
        g, t = lane // 4, lane % 4
        for mt in cutlass.range_constexpr(self.m_tiles):
            for v in cutlass.range_constexpr(4):
                if cutlass.const_expr(mt * 16 + 8 * (v // 2) < self.m_rows):
                    m = mt * 16 + g + 8 * (v // 2)
                    if m < m_total:
                        o = m * ROWS + 2 * t + v % 2
                        if cutlass.const_expr(self.cluster == 1):
                            s_parts[(index, o)] = chunk[(v, mt, 0)]
                        else:
                            _store_remote(
                                s_parts.iterator + (index * self.owned + o // self.cluster),
                                o % self.cluster, chunk[(v, mt, 0)])


@cute.jit
def _from_bits(bits):
    """The fp32 value whose bits are `bits`."""
    f = cute.make_rmem_tensor((1,), cutlass.Float32)
    cute.recast_tensor(f, cutlass.Int32)[0] = bits
    return f[0]


@dsl_user_op
def _store_remote(ptr, rank, value, *, loc=None, ip=None):
    """Store a 32-bit `value` (Int32 or Float32) at shared-memory `ptr` of the cluster's CTA
    `rank` (``st.shared::cluster.b32``)."""
    addr = cutlass.Int32(cute.arch.map_dsmem_ptr(ptr, rank, loc=loc, ip=ip).toint(loc=loc,
                                                                                 ip=ip))
    kind = "f" if isinstance(value, cutlass.Float32) else "r"
    llvm.inline_asm(None, [addr.ir_value(loc=loc, ip=ip), value.ir_value(loc=loc, ip=ip)],
                    "st.shared::cluster.b32 [$0], $1;", f"r,{kind}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
