"""SM80 GEMM kernel: cp.async multi-stage pipeline, ldmatrix, mma.sync, one rounding.

Computes ``C[M, N] = round(A[M, K] @ B[N, K]^T (+ bias[N]))`` with fp32 accumulators, with
the same interface and the same arithmetic contract as the SM90 kernels (`kernels.sm90`).
Runs on every GPU from sm_80 up (A100, A10/A40/L4, and H100 when built for ``sm_90``).

Mainloop order (the contract): one CTA per output tile; it walks K from 0 upward in BK-wide
tiles, and inside a tile issues one ``mma.sync.m16n8k16`` per accumulator fragment for each
16-wide K block, in ascending K order. So every output element is the same ascending chain
of 16-wide blocks ``acc = blk(acc, k0..k0+15)`` as on SM90, whatever the tile shape, stage
count or number of rows: no split-K, no reduction across CTAs or warps, no atomics. The
register double-buffering (block kb+1 is loaded while kb multiplies) and the grouped order
in which CTAs pick their tiles change only when data arrives, never the order of the adds.
On an H100 (this family built for ``sm_90``) the bits equal the SM90 WGMMA kernel's and the
CPU model of the chain (`reference`) for every tile, operand layout and epilogue tried
(tests/test_gpu_sm80.py); on an A100 that is still to be measured.

Tails: K tiles are loaded in ascending order from k = 0, and elements past the end of K (of
M, of N) are zero-filled in shared memory. The last K tile is therefore the only partial
one, and its zeros sit *after* the real data: blocks [0, 16), [16, 32), ... keep their
grouping, and zero products leave the chain unchanged. (CUTLASS's Ampere example loads the
partial "residue" tile first instead; that shifts the 16-wide grouping of every element and
changes bits, so it is not used here.) A tile fully inside the problem is copied with plain
16-byte ``cp.async.cg``; an edge tile goes vector by vector: whole vectors in bounds by
``cp.async``, vectors straddling the end element by element, vectors outside as zeros.

Every tile starts its accumulators at +0.0 -- or, with ``accumulate`` (dW += dY^T X), at the
fp32 values already in C, loaded by each thread for its own fragment -- so a call continues
the chain exactly where the previous one stopped (at a 16-wide block boundary).

Batches (bmm): rank-3 operands in torch order [L, rows, cols] run in one launch with the
batch on grid z; each CTA slices its entry and runs the 2-D tile above on it.

Epilogue (as on SM90): optional bias converted to fp32 and added once to the fp32
accumulator, then each value rounded once (round-to-nearest-even) to the output dtype and
stored from registers; stores past M or N are masked.

The fp32 tier, as on SM90 (detgemm_cute/split.py):
- Chunked chain (`chunked`, full precision: 16-bit parts of split fp32 operands, BK 96): each
  k tile is one chunk. Its six ``m16n8k16`` steps run onto a second fragment that starts at
  +0.0, and the chunk is then added to the fp32 accumulator with one IEEE add, chunks in
  ascending K.
- TF32 (fp32 operands, both K-major, precision "tf32"): shared memory holds the raw fp32
  values; each fragment is rounded to TF32 in registers (round to nearest, ties to even, the
  rounding SM90's TMA applies; a NaN stays a NaN) right before its ``mma.sync.m16n8k8``, so
  the chain is SM90's TF32 chain of 8-wide K blocks.
"""

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass.tensor_utils import LayoutEnum

from . import sm80_limits
from .operands import b_as_nk, with_batch_mode

_COPY_BITS = 128  # one cp.async moves 16 bytes: 8 16-bit or 4 fp32 elements
_MMA_SHAPE = (16, 8, 16)
_TF32_MMA_SHAPE = (16, 8, 8)
_TF32_DROP = 13  # fraction bits TF32 drops
_MAX_SWIZZLE_ROW_BITS = 1024  # a swizzle atom row is at most 128 bytes
_GROUP_M = 8  # M-tiles per rasterization group


class Sm80Gemm:
    """One CTA per output tile, cp.async stage ring, register double-buffered ldmatrix.

    ``tile`` (BM, BN, BK) and ``stages`` come from a registry bucket; ``cluster`` must be
    (1, 1). ``b_is_kn`` says whether B arrives as a [K, N] tensor (``mm``) or [N, K]
    (``linear``). A and B may each be contiguous along K or along M/N.
    """

    def __init__(self, tile, cluster, stages, b_is_kn: bool, has_bias: bool,
                 accumulate: bool = False, chunked: bool = False):
        if tuple(cluster) != (1, 1):
            raise ValueError(f"the sm80 kernel takes cluster (1, 1), got {tuple(cluster)}")
        self.tile_shape_mnk = tuple(tile)
        self.stages = stages
        self.b_is_kn = b_is_kn
        self.has_bias = has_bias
        self.accumulate = accumulate
        # Chunked chain (the fp32 tier's split operands): each k tile is summed from +0.0 on
        # its own fragment, then added to the accumulator.
        self.chunked = chunked
        self.acc_dtype = cutlass.Float32
        self.warp_layout = sm80_limits.warp_layout(tile[0], tile[1])
        self.num_threads = sm80_limits.threads(tile[0], tile[1])
        self.smem_align = sm80_limits.SMEM_ALIGN

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_in: cute.Tensor, mC: cute.Tensor,
                 mBias: Optional[cute.Tensor], max_clusters: cutlass.Int32, stream):
        # max_clusters only sizes SM90's persistent grid; one CTA per tile needs no cap.
        # Rank 2: one GEMM; rank 3: a batch in torch order [L, rows, cols], one launch.
        mA, mB, mC = with_batch_mode(mA), b_as_nk(with_batch_mode(mB_in), self.b_is_kn), \
            with_batch_mode(mC)
        # fp32 operands (K-major only) run on TF32 mma.sync (precision "tf32"): they stay
        # fp32 through shared memory and are rounded to TF32 in registers (`_round_tf32`).
        self.tf32 = mA.element_type == cutlass.Float32
        self.a_dtype = mA.element_type
        self.b_dtype = mB.element_type
        self.c_dtype = mC.element_type
        a_k_major = LayoutEnum.from_tensor(mA) == LayoutEnum.ROW_MAJOR
        b_k_major = LayoutEnum.from_tensor(mB) == LayoutEnum.ROW_MAJOR
        bm, bn, bk = self.tile_shape_mnk
        self.vec = _COPY_BITS // self.a_dtype.width

        sA_layout, sA_swizzle = self._smem_layout(self.a_dtype, a_k_major, bm, bk)
        sB_layout, sB_swizzle = self._smem_layout(self.b_dtype, b_k_major, bn, bk)
        copy_a = self._g2s_copy(self.a_dtype, a_k_major, bm, bk)
        copy_b = self._g2s_copy(self.b_dtype, b_k_major, bn, bk)
        s2r_a = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(not a_k_major, 4),
                                    self.a_dtype)
        s2r_b = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(not b_k_major, 4),
                                    self.b_dtype)

        wm, wn = self.warp_layout
        if cutlass.const_expr(self.tf32):
            # An 8x8 ldmatrix of 16-bit pairs is an 8-row x 4-column TF32 matrix: one x4
            # loads A of an m16n8k8 step, or B of two n8 steps, exactly as for 16-bit.
            shape = _TF32_MMA_SHAPE
            mma_op = cute.nvgpu.warp.MmaTF32Op(shape)
        else:
            shape = _MMA_SHAPE
            mma_op = cute.nvgpu.warp.MmaF16BF16Op(self.a_dtype, self.acc_dtype, shape)
        tiled_mma = cute.make_tiled_mma(
            mma_op, cute.make_layout((wm, wn, 1)),
            # 16 columns per warp and step, so one x4 ldmatrix feeds two n8 MMAs of B.
            permutation_mnk=(wm * shape[0], wn * shape[1] * 2, shape[2]),
        )

        @cute.struct
        class SharedStorage:
            a: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(sA_layout)], self.smem_align]
            b: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(sB_layout)], self.smem_align]

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(cute.size(mC, mode=[0]), bm),
                cute.ceil_div(cute.size(mC, mode=[1]), bn), cute.size(mC, mode=[2]))
        self.kernel(mA, mB, mC, mBias, sA_layout, sA_swizzle, sB_layout, sB_swizzle,
                    copy_a, copy_b, s2r_a, s2r_b, tiled_mma,
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    def _smem_layout(self, dtype, k_major: bool, rows: int, bk: int):
        """(rows, BK, stages) staged layout built from 8-row (K-major) or 8-column
        (M/N-major) atoms of at most 128 bytes per row (the largest power of two dividing
        the contiguous extent: BK 96 takes 32-wide atoms), with an XOR swizzle of 16-byte
        chunks so that both the 16-byte cp.async writes and the ldmatrix reads are free of
        bank conflicts."""
        extent = bk if k_major else rows
        major = min(extent & -extent, _MAX_SWIZZLE_ROW_BITS // dtype.width)
        bits = min(int(math.log2(major * dtype.width // 128)), 3)
        # The swizzle acts on byte addresses: 16-byte chunks (4 bits), 8 chunks per row.
        swizzle = cute.make_swizzle(bits, 4, 3)
        if k_major:
            atom = cute.make_layout((8, major), stride=(major, 1))
        else:
            atom = cute.make_layout((major, 8), stride=(1, major))
        return cute.tile_to_shape(atom, (rows, bk, self.stages), (0, 1, 2)), swizzle

    def _g2s_copy(self, dtype, k_major: bool, rows: int, bk: int):
        """A tiled 16-byte cp.async.cg copy of one (rows, BK) tile: threads walk the
        contiguous dim in 16-byte vectors (a power-of-two count of them per row: BK 96 is
        copied as three 32-wide column blocks). Small tiles use fewer threads than the CTA."""
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            dtype, num_bits_per_copy=_COPY_BITS)
        n_threads = self._copy_threads(rows, bk)
        vec = self.vec
        if k_major:
            cols = self._copy_cols(bk)
            thr = cute.make_layout((n_threads // cols, cols), stride=(cols, 1))
            val = cute.make_layout((1, vec))
        else:
            vrows = rows // vec
            thr = cute.make_layout((vrows, n_threads // vrows), stride=(1, vrows))
            val = cute.make_layout((vec, 1))
        return cute.make_tiled_copy_tv(atom, thr, val)

    def _copy_cols(self, bk: int) -> int:
        """Threads along K per row of a K-major copy: the power-of-two part of BK / vec."""
        vectors = bk // self.vec
        return vectors & -vectors

    def _copy_threads(self, rows: int, bk: int) -> int:
        return min(self.num_threads, rows * self._copy_cols(bk))

    # ------------------------------------------------------- device-side helpers
    @cute.jit
    def _load_tile(self, tiled_copy, tXgX, tXsX, tXcX, bound, kt, stage, interior):
        """Copy k tile `kt` of one operand into shared-memory stage `stage`.

        `interior`: the whole (rows, BK) tile lies inside the operand, so every vector is
        copied as is. Otherwise each 16-byte vector is checked against `bound` (the
        operand's (rows, K) extent): copied whole, element by element up to the end, or
        zero-filled -- never read past the end, and zeros past K (as TMA's fill on SM90)."""
        if interior:
            cute.copy(tiled_copy, tXgX[(None, None, None, kt)], tXsX[(None, None, None, stage)])
        else:
            for i in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                for j in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                    src = tXgX[(None, i, j, kt)]
                    dst = tXsX[(None, i, j, stage)]
                    crd = tXcX[(None, i, j, kt)]
                    if cute.elem_less(crd[self.vec - 1], bound):
                        cute.copy(tiled_copy, src, dst)
                    else:
                        dst.fill(0)
                        if cute.elem_less(crd[0], bound):  # straddles the end of K or M/N
                            for e in cutlass.range_constexpr(1, self.vec):
                                if cute.elem_less(crd[e], bound):
                                    dst[e] = src[e]
                            dst[0] = src[0]

    @cute.jit
    def _init_acc(self, acc, tCgC, tCcC, mC):
        """Start the chain: +0.0, or (dW +=) the fp32 values already in C, so this call
        continues exactly where the previous one stopped. Elements past M or N stay 0 and
        are never stored."""
        acc.fill(0.0)
        if cutlass.const_expr(self.accumulate):
            for i in cutlass.range_constexpr(cute.size(acc)):
                if cute.elem_less(tCcC[i], mC.shape):
                    acc[i] = tCgC[i]

    @cute.jit
    def _epilogue(self, acc, tCgC, tCcC, mC, mBias, interior):
        """acc += float32(bias[n]) (one fp32 add), round once to C's dtype, store; stores
        past M or N are masked."""
        if cutlass.const_expr(self.has_bias):
            n_last = cute.size(mC, mode=[1]) - 1
            for i in cutlass.range_constexpr(cute.size(acc)):
                n = cutlass.min(tCcC[i][1], n_last)  # clamp: columns past N are not stored
                acc[i] = acc[i] + mBias[n].to(cutlass.Float32)
        out = cute.make_rmem_tensor_like(acc, self.c_dtype)
        out.store(acc.load().to(self.c_dtype))  # the single rounding
        if interior:
            cute.autovec_copy(out, tCgC)
        else:
            for i in cutlass.range_constexpr(cute.size(out)):
                if cute.elem_less(tCcC[i], mC.shape):
                    tCgC[i] = out[i]

    @cute.kernel
    def kernel(self, mA_mkl: cute.Tensor, mB_nkl: cute.Tensor, mC_mnl: cute.Tensor,
               mBias: Optional[cute.Tensor],
               sA_layout: cute.Layout, sA_swizzle: cute.Swizzle,
               sB_layout: cute.Layout, sB_swizzle: cute.Swizzle,
               copy_a: cute.TiledCopy, copy_b: cute.TiledCopy,
               s2r_atom_a: cute.CopyAtom, s2r_atom_b: cute.CopyAtom,
               tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, tile_l = cute.arch.block_idx()
        # This CTA's batch entry; from here on the tile is that of a plain 2-D GEMM.
        mA, mB, mC = (mA_mkl[(None, None, tile_l)], mB_nkl[(None, None, tile_l)],
                      mC_mnl[(None, None, tile_l)])
        tiles_m, tiles_n, _ = cute.arch.grid_dim()
        tile_m, tile_n = self._raster(bidx, bidy, tiles_m, tiles_n)
        bm, bn, bk = self.tile_shape_mnk
        m_total = cute.size(mC, mode=[0])
        n_total = cute.size(mC, mode=[1])

        # Global tiles of this CTA and their coordinates (for predication).
        gA = cute.local_tile(mA, (bm, bk), (tile_m, None))  # (BM, BK, k_tiles)
        gB = cute.local_tile(mB, (bn, bk), (tile_n, None))  # (BN, BK, k_tiles of B)
        gC = cute.local_tile(mC, (bm, bn), (tile_m, tile_n))
        cA = cute.local_tile(cute.make_identity_tensor(mA.shape), (bm, bk), (tile_m, None))
        cB = cute.local_tile(cute.make_identity_tensor(mB.shape), (bn, bk), (tile_n, None))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape), (bm, bn), (tile_m, tile_n))
        # k tiles are counted from A; B (which may be longer or shorter in K when one operand
        # was staged with zero padding) is bounded by its own K.
        k_tiles = cute.size(gA, mode=[2])
        k_a = cute.size(mA, mode=[1])
        k_b = cute.size(mB, mode=[1])
        rows_a_full = (tile_m + 1) * bm <= m_total
        rows_b_full = (tile_n + 1) * bn <= cute.size(mB, mode=[0])

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sA = storage.a.get_tensor(sA_layout, swizzle=sA_swizzle)  # (BM, BK, stages)
        sB = storage.b.get_tensor(sB_layout, swizzle=sB_swizzle)  # (BN, BK, stages)

        thr_a = copy_a.get_slice(tidx)
        tAgA, tAsA, tAcA = thr_a.partition_S(gA), thr_a.partition_D(sA), thr_a.partition_S(cA)
        thr_b = copy_b.get_slice(tidx)
        tBgB, tBsB, tBcB = thr_b.partition_S(gB), thr_b.partition_D(sB), thr_b.partition_S(cB)
        a_threads = self._copy_threads(bm, bk)
        b_threads = self._copy_threads(bn, bk)

        # MMA partitions, fragments, accumulators.
        thr_mma = tiled_mma.get_slice(tidx)
        tCgC = thr_mma.partition_C(gC)
        tCcC = thr_mma.partition_C(cC)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA)[(None, None, None, 0)])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB)[(None, None, None, 0)])
        acc = tiled_mma.make_fragment_C(tCgC)
        self._init_acc(acc, tCgC, tCcC, mC)
        # The chunked chain's per-tile sum (unused otherwise: the compiler drops it).
        part = tiled_mma.make_fragment_C(tCgC)
        part.fill(0.0)

        s2r_a = cute.make_tiled_copy_A(s2r_atom_a, tiled_mma)
        s2r_b = cute.make_tiled_copy_B(s2r_atom_b, tiled_mma)
        thr_s2r_a = s2r_a.get_slice(tidx)
        thr_s2r_b = s2r_b.get_slice(tidx)
        tCsA_v = thr_s2r_a.partition_S(sA)  # (CPY, CPY_M, k_blocks, stages)
        tCrA_v = thr_s2r_a.retile(tCrA)
        tCsB_v = thr_s2r_b.partition_S(sB)
        tCrB_v = thr_s2r_b.retile(tCrB)
        k_blocks = cute.size(tCrA, mode=[2])  # BK / 16 (TF32: BK / 8)

        # Prologue: k tiles 0 .. stages-2 into stages 0 .. stages-2, one commit group each
        # (empty groups past the last tile keep the group count uniform).
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < k_tiles:
                self._load_operands(copy_a, tAgA, tAsA, tAcA, copy_b, tBgB, tBsB, tBcB,
                                    tidx, a_threads, b_threads, mA.shape, mB.shape,
                                    s, s, rows_a_full, rows_b_full, k_a, k_b)
            cute.arch.cp_async_commit_group()

        # Mainloop: k tiles in ascending order, k blocks in ascending order inside a tile.
        # Fragments are double-buffered in registers: block kb+1 is read from shared memory
        # while block kb multiplies, and the last block of a tile reads block 0 of the next
        # tile. Before that read, waiting until at most stages-2 copy groups are in flight
        # means the next tile has landed, and the barrier means every warp is done reading
        # the stage of the current tile's predecessor -- which is refilled (with tile
        # kt+stages-1) at block 0 of the next tile.
        cute.arch.cp_async_wait_group(self.stages - 2)
        cute.arch.sync_threads()
        self._load_fragments(s2r_a, tCsA_v, tCrA_v, s2r_b, tCsB_v, tCrB_v, 0, 0)
        for kt in cutlass.range(k_tiles, unroll=1):
            stage = kt % self.stages
            for kb in cutlass.range_constexpr(k_blocks):
                if cutlass.const_expr(kb == k_blocks - 1):
                    cute.arch.cp_async_wait_group(self.stages - 2)
                    cute.arch.sync_threads()
                    self._load_fragments(s2r_a, tCsA_v, tCrA_v, s2r_b, tCsB_v, tCrB_v,
                                         (kt + 1) % self.stages, 0)
                else:
                    self._load_fragments(s2r_a, tCsA_v, tCrA_v, s2r_b, tCsB_v, tCrB_v,
                                         stage, kb + 1)
                if cutlass.const_expr(kb == 0):
                    nxt = kt + self.stages - 1
                    if nxt < k_tiles:
                        self._load_operands(copy_a, tAgA, tAsA, tAcA, copy_b, tBgB, tBsB,
                                            tBcB, tidx, a_threads, b_threads, mA.shape,
                                            mB.shape, nxt, nxt % self.stages, rows_a_full,
                                            rows_b_full, k_a, k_b)
                    cute.arch.cp_async_commit_group()
                # One m16n8k16 per accumulator fragment: the 16-wide block kt*BK + 16*kb
                # (TF32: one m16n8k8 on the 8-wide block kt*BK + 8*kb, rounded first).
                if cutlass.const_expr(self.tf32):
                    self._round_tf32(tCrA[(None, None, kb)])
                    self._round_tf32(tCrB[(None, None, kb)])
                if cutlass.const_expr(self.chunked):
                    cute.gemm(tiled_mma, part, tCrA[(None, None, kb)], tCrB[(None, None, kb)],
                              part)
                    if cutlass.const_expr(kb == k_blocks - 1):  # the chunk is this k tile
                        acc.store(acc.load() + part.load())
                        part.fill(0.0)
                else:
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb)], tCrB[(None, None, kb)],
                              acc)
        cute.arch.cp_async_wait_group(0)

        interior = rows_a_full and (tile_n + 1) * bn <= n_total
        self._epilogue(acc, tCgC, tCcC, mC, mBias, interior)

    @cute.jit
    def _raster(self, bidx, bidy, tiles_m, tiles_n):
        """The output tile of this CTA: CTAs go in groups of `_GROUP_M` M-tiles, walking
        all N-tiles inside a group, so CTAs running together share A and B tiles in L2.
        Only which tile a CTA runs changes; no tile's arithmetic does."""
        linear = bidx + bidy * tiles_m
        per_group = _GROUP_M * tiles_n
        group = linear // per_group
        first_m = group * _GROUP_M
        rows = cutlass.min(tiles_m - first_m, _GROUP_M)
        r = linear - group * per_group
        return first_m + r % rows, r // rows

    @cute.jit
    def _round_tf32(self, frag):
        """Round an fp32 fragment to TF32 in place: round to nearest, ties to even, on the
        bits (`split.tf32_round`); a value past the largest TF32 becomes Inf, Inf stays Inf,
        and a NaN becomes the canonical NaN (its low payload bits would be dropped)."""
        bits = cute.recast_tensor(frag, cutlass.Int32)
        for i in cutlass.range_constexpr(cute.size(bits)):
            x = bits[i]
            odd = (x >> _TF32_DROP) & 1
            rounded = (x + ((1 << (_TF32_DROP - 1)) - 1) + odd) & -(1 << _TF32_DROP)
            is_nan = (x & 0x7FFFFFFF) > 0x7F800000
            bits[i] = cutlass.Int32(cutlass.select_(is_nan, cutlass.Int32(0x7FFFFFFF),
                                                    rounded))

    @cute.jit
    def _load_fragments(self, s2r_a, tCsA_v, tCrA_v, s2r_b, tCsB_v, tCrB_v, stage, kb):
        """ldmatrix k block `kb` of shared-memory stage `stage` into its fragment registers."""
        cute.copy(s2r_a, tCsA_v[(None, None, kb, stage)], tCrA_v[(None, None, kb)])
        cute.copy(s2r_b, tCsB_v[(None, None, kb, stage)], tCrB_v[(None, None, kb)])

    @cute.jit
    def _load_operands(self, copy_a, tAgA, tAsA, tAcA, copy_b, tBgB, tBsB, tBcB, tidx,
                       a_threads: cutlass.Constexpr, b_threads: cutlass.Constexpr,
                       a_bound, b_bound, kt, stage, rows_a_full, rows_b_full, k_a, k_b):
        """k tile `kt` of A and of B into `stage` (threads past an operand's copy width
        sit out; only B of a 16-wide N tile with BK 32 has fewer vectors than threads)."""
        _, _, bk = self.tile_shape_mnk
        k_full_a = (kt + 1) * bk <= k_a
        k_full_b = (kt + 1) * bk <= k_b
        if cutlass.const_expr(a_threads == self.num_threads):
            self._load_tile(copy_a, tAgA, tAsA, tAcA, a_bound, kt, stage,
                            rows_a_full and k_full_a)
        else:
            if tidx < a_threads:
                self._load_tile(copy_a, tAgA, tAsA, tAcA, a_bound, kt, stage,
                                rows_a_full and k_full_a)
        if cutlass.const_expr(b_threads == self.num_threads):
            self._load_tile(copy_b, tBgB, tBsB, tBcB, b_bound, kt, stage,
                            rows_b_full and k_full_b)
        else:
            if tidx < b_threads:
                self._load_tile(copy_b, tBgB, tBsB, tBcB, b_bound, kt, stage,
                                rows_b_full and k_full_b)


def kernel_class(persistent: bool, pingpong: bool = False, grouped: bool = False,
                 grouped_k: bool = False):
    """The SM80 family has one kernel: one CTA per output tile."""
    if grouped or grouped_k:
        raise ValueError("the sm80 kernel family has no grouped kernel")
    if persistent or pingpong:
        raise ValueError("the sm80 kernel family has no persistent kernel (and no ping-pong one)")
    return Sm80Gemm


def mainloop_order() -> str:
    """Human-readable statement of the accumulation order, used by `explain`."""
    return ("K ascending in 16-wide mma.sync (m16n8k16) steps onto fp32 accumulators that "
            "start at +0.0 (dW: at the buffer's fp32 values), K tail zero-filled at the end, "
            "one CTA per output tile, no split-K; bias added in fp32, then one rounding to "
            "the output dtype (fp32 tier: each 96-wide k tile of split parts summed from +0.0, "
            "then added; tf32: operands rounded to TF32, 8-wide m16n8k8 steps)")
