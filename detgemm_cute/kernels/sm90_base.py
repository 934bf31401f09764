"""Host-side setup and device helpers shared by the SM90 GEMM kernels (`sm90.py`).

Nothing here decides the order of the arithmetic beyond one output tile: the mainloop
helpers issue a tile's k tiles in ascending order onto its accumulators, and the kernel
classes in `sm90.py` decide which tile a CTA (or a consumer warpgroup) runs when.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.pipeline import pipeline_init_arrive
from cutlass.tensor_utils import LayoutEnum

from . import sm90_limits
from .operands import as_tf32, b_as_nk, with_batch_mode
from .sm90_chunked import ChunkedChain
from .sm90_epilogue import EpilogueStores
from .tf32_mma import make_tf32_tiled_mma
from .wgmma_registers import fence_operands, zero_pinned

WG = 128  # threads per warpgroup
GROUP_TABLE = sm90_limits.GROUPED_MAX_GROUPS + 2  # grouped: first tile of each group, + 2


class TmaSources(NamedTuple):
    """What the TMA partitions of A and B are built from (`Sm90Base._partition_loads`)."""

    atom_a: Any
    mA_mk: Any  # TMA coordinate tensor of A (M, K, L)
    sA_load: Any  # the stages TMA writes A into
    atom_b: Any
    mB_nk: Any  # TMA coordinate tensor of B (N, K, L)
    sB: Any
    cta_layout_mnk: Any
    cluster_coord: Any


class ARegs(NamedTuple):
    """A read through registers (`Sm90Base.a_regs`): this thread's elements of A's stages in
    shared memory, and the register fragment each k tile is copied into."""

    smem: Any  # (V, MMA_M, MMA_K, stages)
    regs: Any  # (V, MMA_M, MMA_K)


class TilePlace(NamedTuple):
    """Where one output tile lies (device values, `Sm90Base._place`): its indices into the
    tile grids of A/C and B after they were moved by (off_m, off_n) elements, the batch
    entries it reads, and how many of its rows it stores."""

    m: Any  # tile index along M (of the grid moved by off_m)
    n: Any  # tile index along N (of the grid moved by off_n)
    l_c: Any  # batch entry of A and C
    l_b: Any  # batch entry of B (grouped: the group's weight)
    off_m: Any
    off_n: Any
    rows: Any  # rows stored: BM; grouped: fewer for a small group (predicated), 0 for none
    loads: Any  # whether the tile reads A and B (grouped: not for the zero rows past the groups)
    # Groups along K (`Sm90GemmGroupedK`): where the tile's group starts along K, its k
    # tiles (0 for an empty group) and the elements of K its last k tile holds (1..BK).
    k0: Any = 0
    k_tiles: Any = None
    k_last: Any = None


def _stage(staged):
    """One stage of a staged smem layout. A swizzled (composed) layout is rebuilt from its
    outer layout's slice: the DSL (4.8.1) aborts slicing the composed layout itself when its
    swizzle atoms along a mode are odd in number (BN = 104 = 13 atoms of 8 rows)."""
    if isinstance(staged, cute.ComposedLayout):
        return cute.make_composed_layout(staged.inner, 0,
                                         cute.slice_(staged.outer, (None, None, 0)))
    return cute.slice_(staged, (None, None, 0))


class Sm90Base(ChunkedChain, EpilogueStores):
    """Host-side setup and device helpers shared by both SM90 kernels.

    ``tile`` (BM, BN, BK), ``cluster`` (CM, CN) and ``stages`` come from a registry bucket;
    ``b_is_kn`` says whether B arrives as a [K, N] tensor (``mm``) or [N, K] (``linear``).
    """

    producer_warpgroups = 0
    pingpong = False  # two consumer warpgroups on alternate tiles (Sm90GemmPingpong)
    grouped = False  # row groups with their own B (Sm90GemmGrouped)
    grouped_k = False  # groups along K, each its own C entry (Sm90GemmGroupedK)

    def __init__(self, tile, cluster, stages, b_is_kn: bool, has_bias: bool,
                 accumulate: bool = False, chunked: bool = False, bias_on_rows: bool = False,
                 raster_n: bool = False, c_direct: bool = False, a_loads: bool = False,
                 pdl: bool = False, c_vector: int = 1, offs_report: bool = False):
        self.tile_shape_mnk = tuple(tile)
        # Grouped: print a bad offs entry before the trap (`_check_offs`; debugging only).
        self.offs_report = offs_report
        # Programmatic dependent launch: the kernel may start while the previous kernel in the
        # stream drains, and waits for it (griddepcontrol.wait) before its first global access.
        self.pdl = pdl
        # The producer warpgroup reads A itself instead of TMA (any row pitch, 2-byte
        # aligned: rows TMA cannot address): 16-byte chunks into a raw ring, shifted into the
        # swizzled stage (sm90_a_rows.py); B still arrives by TMA (persistent kernels).
        self.a_loads = a_loads
        # The tile's threads store each staged sub-tile, bounds-checked, instead of a TMA
        # box: C's rows are not 16-byte aligned, or TMA would write them as half sectors.
        self.c_direct = c_direct
        # Elements each of those stores writes at once (C's start and pitch are multiples of
        # them: `KernelKey.c_align`); 1: element by element, any pitch.
        self.c_vector = c_vector
        self.mma_m = sm90_limits.mma_rows(tile[0])  # rows WGMMA computes (64 for row tiles)
        self.row_tile = tile[0] < self.mma_m
        self.accumulate = accumulate
        # Chunked chain (the fp32 tier): each k tile is summed from +0.0 on its own
        # registers, then added to the accumulator with one fp32 add (see the module doc).
        self.chunked = chunked
        self.cluster_shape_mn = tuple(cluster)
        self.ab_stage = stages
        self.b_is_kn = b_is_kn
        self.has_bias = has_bias
        # The bias runs along M (one value per row of C): a call that computes C^T = B A^T
        # into a transposed view of the caller's output ("swap_ab") has its bias there.
        self.bias_on_rows = bias_on_rows
        # Persistent schedule: walk the N tiles fastest (else M's). Concurrent CTAs share the
        # operand tile of the slower index, which should be the larger operand: for a swapped
        # kernel with few token tiles along N, each weight tile is then read from DRAM once.
        self.raster_n = raster_n
        self.acc_dtype = cutlass.Float32
        # Warpgroups that compute one tile together (the tiled MMA), and consumer warpgroups
        # in the CTA: the same, except in ping-pong, where each of two runs a tile alone.
        self.tile_warp_groups = sm90_limits.warpgroups(tile[0], tile[1], chunked, self.pingpong)
        # Grouped, cooperative, a 128-row tile on two warpgroups (rows 0-63 and 64-127; a
        # 256-row tile interleaves their 64-row blocks): a warpgroup whose rows all lie past
        # its group's end skips its MMAs (`_grouped_tile`).
        self.halves_idle = (self.grouped and not self.pingpong and self.tile_warp_groups == 2
                            and tile[0] == 128)
        self.mma_warp_groups = 2 if self.pingpong else self.tile_warp_groups
        self.atom_layout_mnk = (self.tile_warp_groups, 1, 1)
        # Threads that consume each stage and share one epilogue.
        self.tile_threads = WG * self.tile_warp_groups
        self.threads_per_cta = WG * (self.mma_warp_groups + self.producer_warpgroups)
        self.epi_tile = sm90_limits.epilogue_tile(tile[0], tile[1], chunked, self.pingpong,
                                                  c_vector if c_direct else 1)
        # Stored per epilogue sub-tile: a row tile stores only its BM rows.
        self.store_tile = (min(tile[0], self.epi_tile[0]), self.epi_tile[1])
        self.buffer_align_bytes = 1024
        self.is_a_mcast = cluster[1] > 1
        self.is_b_mcast = cluster[0] > 1

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_in: cute.Tensor, mC: cute.Tensor,
                 mBias: Optional[cute.Tensor], max_clusters: cutlass.Int32, stream):
        self._launch(mA, mB_in, mC, mBias, None, max_clusters, stream)

    @cute.jit
    def _launch(self, mA: cute.Tensor, mB_in: cute.Tensor, mC: cute.Tensor,
                mBias: Optional[cute.Tensor], mOffs: Optional[cute.Tensor],
                max_clusters: cutlass.Int32, stream):
        """Set up layouts, TMA atoms and shared storage for these tensors, then launch.
        `mOffs` (grouped kernels only): the int32 cumulative row ends of the groups."""
        # Rank 2: one GEMM; rank 3: a batch in torch order [L, rows, cols], one launch.
        mA, mB, mC = with_batch_mode(mA), b_as_nk(with_batch_mode(mB_in), self.b_is_kn), \
            with_batch_mode(mC)
        # fp32 operands run on TF32 tensor cores (the "tf32" precision): TMA reads them
        # through TF32 tensor maps, which round each value to TF32 (nearest, ties to even),
        # and WGMMA multiplies in 8-wide K steps.
        self.tf32 = mA.element_type == cutlass.Float32
        if cutlass.const_expr(self.tf32):
            mA, mB = as_tf32(mA), as_tf32(mB)

        self.a_dtype = mA.element_type
        self.b_dtype = mB.element_type
        self.c_dtype = mC.element_type
        self.a_layout = LayoutEnum.from_tensor(mA)
        self.b_layout = LayoutEnum.from_tensor(mB)
        self.c_layout = LayoutEnum.from_tensor(mC)
        self.epi_stage = sm90_limits.epi_stages(self.c_dtype.width // 8, self.epi_tile[1])
        # A moved last tile starts at a multiple of 16 bytes along any tensor's contiguous
        # dimension: a TMA store from an unaligned start traps (illegal instruction).
        self.tail_align = (
            max(self._align16(self.a_dtype, self.a_layout.is_m_major_a()),
                self._align16(self.c_dtype, self.c_layout.is_m_major_c())),
            max(self._align16(self.b_dtype, self.b_layout.is_n_major_b()),
                self._align16(self.c_dtype, self.c_layout.is_n_major_c())))
        # TF32 WGMMA reads shared-memory operands K-major only: an M-major A (dX's weight
        # seen as C^T = W^T dY^T, or a transposed view) is copied from each stage into
        # registers, each thread its own elements, and multiplied from there (`ARegs`).
        self.a_regs = self.tf32 and self.a_layout.is_m_major_a()
        if cutlass.const_expr(self.tf32):
            self.tiled_mma = make_tf32_tiled_mma(self.atom_layout_mnk,
                                                 (64, self.tile_shape_mnk[1]), self.a_regs)
        else:
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.a_dtype, self.b_dtype,
                self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
                self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_shape_mnk[1]))
        self.cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))

        bm, bn, bk = self.tile_shape_mnk
        mma_tile = (self.mma_m, bn, bk)
        if cutlass.const_expr(self.row_tile):
            # Rows outermost, so the BM rows TMA loads are a prefix of each stage.
            a_smem = self._row_tile_a_smem()
            a_load = self._row_major_a_smem(bm)
        else:
            a_smem = sm90_utils.make_smem_layout_a(
                self.a_layout, mma_tile, self.a_dtype, self.ab_stage)
            a_load = a_smem
        b_smem = sm90_utils.make_smem_layout_b(
            self.b_layout, mma_tile, self.b_dtype, self.ab_stage)
        epi_smem = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage)
        epi_store = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.store_tile, self.epi_stage)
        # Bytes TMA writes into one stage (the full barrier's transaction count).
        self.tma_bytes = cute.size_in_bytes(self.b_dtype, _stage(b_smem))
        tma_atom_a, tma_a = None, mA  # a_loads: the threads read A itself
        if cutlass.const_expr(not self.a_loads):
            self.tma_bytes += cute.size_in_bytes(self.a_dtype, _stage(a_load))
            tma_atom_a, tma_a = self._tma_load(mA, a_load, (bm, bk), self.cluster_shape_mn[1])
        tma_atom_b, tma_b = self._tma_load(mB, b_smem, (bn, bk), self.cluster_shape_mn[0])
        tma_atom_c, tma_c = None, mC
        if cutlass.const_expr(not self.c_direct):
            tma_atom_c, tma_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC,
                cute.slice_(epi_store, (None, None, 0)), self.store_tile)

        self.shared_storage = self._shared_storage(a_smem, b_smem, epi_smem)
        grid, extra_args, extra_launch = self._schedule(mC, mOffs, max_clusters)
        # C's values (dW +=), or where a grouped kernel stores a partial tile row by row.
        mC_in = mC if cutlass.const_expr(self.accumulate or self.grouped) else None
        self.kernel(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, mBias, mC_in,
                    mOffs,
                    self.tiled_mma, self.cta_layout_mnk, a_smem, b_smem, epi_smem, *extra_args,
                    ).launch(grid=grid, block=[self.threads_per_cta, 1, 1],
                             cluster=(*self.cluster_shape_mn, 1), stream=stream,
                             use_pdl=self.pdl, **extra_launch)

    def _shared_storage(self, a_smem, b_smem, epi_smem):
        """The CTA's shared memory: stage barriers (grouped: and the groups' first-tile
        table, in the same first KiB), then the A and B stages and the epilogue buffer
        (`a_loads`: and the raw ring of A's rows)."""
        fields = {"barriers": cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]}
        if self.grouped:
            fields["group_first"] = cute.struct.MemRange[cutlass.Int32, GROUP_TABLE]
        for name, dtype, layout in (("sA", self.a_dtype, a_smem), ("sB", self.b_dtype, b_smem),
                                    ("sC", self.c_dtype, epi_smem)):
            fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)],
                                             self.buffer_align_bytes]
        if self.a_loads:  # the raw ring of A's chunks (sm90_a_rows)
            fields["sRaw"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int32,
                                                                    self._raw_words()], 128]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _a_atom(self):
        bk = self.tile_shape_mnk[2]
        return cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.a_layout, self.a_dtype, bk), self.a_dtype)

    def _row_major_a_smem(self, rows):
        """K-major A stages of `rows` rows with the 8-row swizzle atoms ordered K first,
        rows outermost: a stage is one contiguous block (what TMA loads for a row tile)."""
        bk = self.tile_shape_mnk[2]
        return cute.tile_to_shape(self._a_atom(), (rows, bk, self.ab_stage), order=(1, 0, 2))

    def _row_tile_a_smem(self):
        """A row tile's A stages as WGMMA reads them: 64 rows each (`_row_major_a_smem`'s
        order), but stage s starts at s x BM rows, right after the BM rows of stage s - 1.
        WGMMA's rows BM..63 of a stage are then the next stages' rows (and, for the last
        ones, the buffer's 64 - BM rows of slack): whatever they hold only reaches
        accumulator rows that are never stored, since a row of the product depends on its
        own row of A alone. A stage costs BM rows of shared memory instead of 64."""
        bm, _, bk = self.tile_shape_mnk
        one = cute.tile_to_shape(self._a_atom(), (self.mma_m, bk), order=(1, 0))
        stages = cute.append(one.outer, cute.make_layout(self.ab_stage, stride=bm * bk))
        return cute.make_composed_layout(one.inner, 0, stages)

    @staticmethod
    def _align16(dtype, contiguous: bool) -> int:
        """Elements in 16 bytes of `dtype` along a contiguous dimension, else 1."""
        return 128 // dtype.width if contiguous else 1

    @staticmethod
    def _tma_load(tensor, smem_layout_staged, smem_tile, mcast):
        op = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if mcast == 1
              else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, tensor, _stage(smem_layout_staged), smem_tile,
            num_multicast=mcast)

    # ------------------------------------------------------- device-side helpers
    @cute.jit
    def _prefetch_descriptors(self, tma_atom_a, tma_atom_b):
        """Warp 0 prefetches the TMA descriptors; returns (uniform warp index, thread index)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            if cutlass.const_expr(not self.a_loads):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
        tidx, _, _ = cute.arch.thread_idx()
        return warp_idx, tidx

    @cute.jit
    def _wait_for_previous_grid(self):
        """With `pdl`: wait until the previous kernel in the stream has completed and its
        memory is visible (the barriers and descriptors were set up under its tail), then let
        the next kernel start its own set-up. Called before the CTA's first global access."""
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _setup(self, storage, cta_layout_mnk, a_smem_layout_staged, b_smem_layout_staged,
               epi_smem_layout_staged, mA_mk, mB_nk, tma_atom_a, tma_atom_b):
        """Pipeline barriers, smem tensors and TMA partitions over all (m|n, k) tiles."""
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        a_mask = a_mask if self.is_a_mcast else 0
        b_mask = b_mask if self.is_b_mcast else 0
        mcast_size = self.cluster_shape_mn[0] + self.cluster_shape_mn[1] - 1
        # A stage is full once TMA's bytes have landed and the producers have arrived: one
        # arrival with the transaction count, plus (a_loads) one per producer thread after
        # its stores of A.
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 1 + (WG if self.a_loads else 0)),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, mcast_size * (self.tile_threads // 32)),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sC = storage.sC.get_tensor(epi_smem_layout_staged.outer,
                                   swizzle=epi_smem_layout_staged.inner)
        bm, _, bk = self.tile_shape_mnk
        sA_load = sA
        if cutlass.const_expr(self.row_tile):
            sA_load = cute.flat_divide(sA, (bm, bk))[(None, None, 0, 0, None)]  # BM-row prefix
        src = TmaSources(tma_atom_a, mA_mk, sA_load, tma_atom_b, mB_nk, sB, cta_layout_mnk,
                         cluster_coord)
        tAsA, tAgA, tBsB, tBgB = self._partition_loads(src, 0, 0)
        if cutlass.const_expr(self.a_loads):
            k_tiles = (cute.size(mA_mk, mode=[1]) + bk - 1) // bk
        else:
            k_tiles = cute.size(tAgA, mode=[2])
        return ab_pipeline, sA, sB, sC, tAsA, tBsB, src, a_mask, b_mask, k_tiles

    @cute.jit
    def _partition_loads(self, src, off_m, off_n, off_k=0):
        """TMA partitions of A and B over all (m|n, k, l) tiles, with the tile grid moved by
        (off_m, off_n) elements (see `_tail_offsets`) and by off_k along K (a group's start,
        `Sm90GemmGroupedK`); A's are None with `a_loads`."""
        bm, bn, bk = self.tile_shape_mnk
        gB = cute.local_tile(cute.domain_offset((off_n, off_k, 0), src.mB_nk), (bn, bk),
                             (None, None, None))  # (BN, BK, tn, tk, L)
        tAsA, tAgA = None, None
        if cutlass.const_expr(not self.a_loads):
            gA = cute.local_tile(cute.domain_offset((off_m, off_k, 0), src.mA_mk), (bm, bk),
                                 (None, None, None))  # (BM, BK, tm, tk, L)
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                src.atom_a, src.cluster_coord[1],
                cute.make_layout(cute.slice_(src.cta_layout_mnk, (0, None, 0)).shape),
                cute.group_modes(src.sA_load, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            src.atom_b, src.cluster_coord[0],
            cute.make_layout(cute.slice_(src.cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(src.sB, 0, 2), cute.group_modes(gB, 0, 2))
        return tAsA, tAgA, tBsB, tBgB

    @cute.jit
    def _tail_offset(self, tile, extent, size: cutlass.Constexpr, align: cutlass.Constexpr):
        """Elements (<= 0) by which tile `tile` of `size` moves back so that it ends inside
        `extent` (to within align - 1 elements: the move is a multiple of `align`): the last
        tile of a ragged extent then covers its last elements, in bounds, instead of a box
        that runs mostly past the end (such boxes measured up to 3.6x slower than full
        ones). Its first rows are also computed by the tile before it: the same chain per
        element, so both store the same bits. A tile wholly past the end (a cluster's CTA
        beyond the last tile, e.g. the fourth of two 1x2 clusters over three tiles) moves
        back the same way onto the last tile's box: it repeats that tile's chains and stores
        its bits. Left past the end, such a box slowed its cluster down: on the H100, the
        forward's cluster kernels whose tile count along a cluster dimension is not a
        multiple of the cluster ran 1.14x faster (geomean, up to 2.3x) after this change
        (tune_fwd_small_* of 2026-11-27, bench/results/README.md). 0 when the extent is
        shorter than a tile, and with `accumulate` (dW +=), where a row computed twice would
        read C after the other tile had stored it."""
        off = cutlass.Int32(0)
        if cutlass.const_expr(not self.accumulate):
            if extent >= size:
                pad = cutlass.max((tile + 1) * size - extent, 0)
                off = pad % align - pad
        return off

    @cute.jit
    def _tail_offsets(self, mC_mn, tile):
        """(off_m, off_n) of output tile `tile` (m, n, l): see `_tail_offset`."""
        bm, bn, _ = self.tile_shape_mnk
        return (self._tail_offset(tile[0], cute.size(mC_mn, mode=[0]), bm, self.tail_align[0]),
                self._tail_offset(tile[1], cute.size(mC_mn, mode=[1]), bn, self.tail_align[1]))

    @cute.jit
    def _place(self, mC_mn, groups, tile):
        """The `TilePlace` of scheduled tile `tile` (m, n, l): moved as `_tail_offsets`
        says, or, in a grouped kernel (`groups`: the offs tensor and the table that
        `_group_table` filled), found among the groups (`_group_place`)."""
        if cutlass.const_expr(self.grouped):
            return self._group_place(mC_mn, groups, tile)
        off_m, off_n = self._tail_offsets(mC_mn, tile)
        return TilePlace(tile[0], tile[1], tile[2], tile[2], off_m, off_n,
                         self.tile_shape_mnk[0], True)

    @cute.jit
    def _group_rows(self, mOffs, total, g):
        """(start, end) rows of group g; g == len(offs) is the rows past the last group.
        Each bound is clamped into [0, total], so no offs moves a tile out of C."""
        groups = cute.size(mOffs)
        start = cutlass.Int32(0)
        end = total
        if g > 0:
            start = cutlass.min(cutlass.max(mOffs[g - 1], 0), total)
        if g < groups:
            end = cutlass.min(cutlass.max(mOffs[g], 0), total)
        return start, cutlass.max(end, start)

    @cute.jit
    def _check_offs(self, mOffs, total, g, extent: cutlass.Constexpr = "the rows of a"):
        """A device-side assert (the host never reads offs): offs[g] must lie in
        [offs[g - 1] (0 for g = 0), total]. Otherwise the thread traps and the launch fails:
        two groups would share rows, or a group would run past the rows of A. With
        `offs_report` it first prints which entry is wrong. Only then: printf is a function
        call, and any call in the kernel makes ptxas serialize every WGMMA (C7510)."""
        prev = cutlass.Int32(0)
        if g > 0:
            prev = mOffs[g - 1]
        end = mOffs[g]
        if end < prev or end > total:
            if cutlass.const_expr(self.offs_report):
                cute.printf("detgemm_cute grouped_mm: offs must be non-decreasing, >= 0 and "
                            "<= %d (" + extent + "); offs[%d] = %d after %d", total, g, end,
                            prev)
            llvm.intr_trap()

    @cute.jit
    def _group_table(self, table, mOffs, total):
        """Fill the shared table of the groups' first tiles (all threads, once per CTA):
        group g (g == len(offs): the rows past the last group) has ceil(rows / BM) tiles,
        rounded up to a multiple of the cluster's M size CM, and table[g] is the number of
        tiles of the groups before it."""
        bm = self.tile_shape_mnk[0]
        cm = self.cluster_shape_mn[0]
        groups = cute.size(mOffs)
        tidx, _, _ = cute.arch.thread_idx()
        for g in cutlass.range(tidx, groups + 1, self.threads_per_cta, unroll=1):
            start, end = self._group_rows(mOffs, total, g)
            table[g + 1] = ((end - start + bm - 1) // bm + cm - 1) // cm * cm
            if g < groups:
                self._check_offs(mOffs, total, g)
        cute.arch.sync_threads()
        if tidx == 0:
            table[0] = 0
            for g in cutlass.range(groups + 1, unroll=4):
                table[g + 1] = table[g + 1] + table[g]
        cute.arch.sync_threads()

    def _group_grid_m(self, rows, groups):
        """M tiles of a grouped kernel's grid: an upper bound on the groups' row tiles
        (rows // BM, CM more per group and for the zero rows past the last group: each
        group's count is rounded up to a multiple of CM), a multiple of CM."""
        cm = self.cluster_shape_mn[0]
        return (rows // self.tile_shape_mnk[0] + (groups + 1) * cm + cm - 1) // cm * cm

    @cute.jit
    def _group_place(self, mC_mn, groups, tile):
        """Grouped kernels: where scheduled tile `tile` (m, n, l) lies among the groups.

        Group g owns ceil(rows / BM) row tiles, rounded up to a multiple of the cluster's M
        size CM (`_group_table`), and the schedule runs the groups one after the other: tile
        (m, n) is number m + M * (n // CN) of the grid in the scheduler's M-major order (M:
        the grid's M tiles, a multiple of CM; CN the cluster's N size), and the groups take
        that order in turn, each as its row tiles x the cluster columns of N with its row
        tiles fastest. So a group's rows of A stay in L2 while its weight streams past them
        once. The CTAs of a cluster row keep one row tile (A multicast); the CM CTAs of a
        cluster column always hold row tiles of one group in one column (B multicast: the
        group's weight tile). A padding tile (past a group's row tiles, CM > 1) reads and
        multicasts like the group's last tile, runs no MMAs and stores nothing (rows 0,
        loads True). A row tile starts at its group's start + i * BM; the last one of a
        group of at least BM rows moves back to end at the group's end (its first rows are
        also computed by the tile before it, with the same chain and weight: the same bits);
        a group shorter than BM has one tile whose rows past the group are computed but not
        stored. With `halves_idle`, a last tile that holds at most BM/2 of the group's rows
        stays in place instead (stored by the threads, `Sm90GemmPersistent._grouped_tile`):
        the warpgroup of its second half has none of the group's rows and skips its MMAs.
        The rows past the last group form one more group that reads nothing and stores
        zeros. Tiles past the last one store nothing."""
        mOffs, table = groups
        bm, bn, _ = self.tile_shape_mnk
        cn = self.cluster_shape_mn[1]
        total = cute.size(mC_mn, mode=[0])
        count = cute.size(mOffs)
        grid_m = self._group_grid_m(total, count)
        columns = (cute.size(mC_mn, mode=[1]) + bn * cn - 1) // (bn * cn)
        order = tile[0] + grid_m * (tile[1] // cn)
        lo = cutlass.Int32(0)  # the last group whose first tile's order is <= `order`
        hi = count + 1
        for _ in cutlass.range_constexpr(GROUP_TABLE.bit_length()):
            mid = (lo + hi) // 2
            if hi - lo > 1:
                if table[mid] * columns <= order:
                    lo = mid
                else:
                    hi = mid
        row_tiles = cutlass.max(table[lo + 1] - table[lo], 1)
        local = order - table[lo] * columns
        start, end = self._group_rows(mOffs, total, lo)
        rows = end - start
        tile_m = local % row_tiles
        padding = False  # a cluster's padding tile (CM > 1 only)
        if cutlass.const_expr(self.cluster_shape_mn[0] > 1):
            padding = tile_m * bm >= rows
            if padding:
                tile_m = cutlass.max((rows + bm - 1) // bm - 1, 0)
        row0 = start + tile_m * bm
        if rows >= bm:
            if cutlass.const_expr(self.halves_idle):
                if end - row0 > bm // 2:  # else: the first half alone, in place
                    row0 = cutlass.min(row0, end - bm)
            else:
                row0 = cutlass.min(row0, end - bm)
        stored = cutlass.min(end - row0, bm)
        if order >= table[count + 1] * columns:
            stored = 0
        if cutlass.const_expr(self.cluster_shape_mn[0] > 1):
            if padding:
                stored = 0
        n = (local // row_tiles) * cn + tile[1] % cn
        off_n = self._tail_offset(n, cute.size(mC_mn, mode=[1]), bn, self.tail_align[1])
        return TilePlace(0, n, 0, cutlass.min(lo, count - 1), row0, off_n, stored, lo < count)

    @cute.jit
    def _tile_loads(self, src, place):
        """The TMA sources of one output tile (a `TilePlace`): A's and B's k tiles, in order
        (A's None with `a_loads`)."""
        _, tAgA, _, tBgB = self._partition_loads(src, place.off_m, place.off_n)
        tAgA_k = None
        if cutlass.const_expr(not self.a_loads):
            tAgA_k = tAgA[(None, place.m, None, place.l_c)]
        return tAgA_k, tBgB[(None, place.n, None, place.l_b)]

    @cute.jit
    def _tile_c(self, mC_mn, place):
        """The output tile of C at `place`, moved like its loads; with `c_direct`, (tile, rows
        and columns of C from the tile's start) for the bounds-checked stores."""
        bm, bn, _ = self.tile_shape_mnk
        gC = cute.local_tile(cute.domain_offset((place.off_m, place.off_n, 0), mC_mn),
                             (bm, bn), (None, None, None))  # (BM, BN, tm, tn, L)
        gC = gC[(None, None, place.m, place.n, place.l_c)]
        if cutlass.const_expr(self.c_direct):
            gC = (gC, cute.size(mC_mn, mode=[0]) - (place.m * bm + place.off_m),
                  cute.size(mC_mn, mode=[1]) - (place.n * bn + place.off_n))
        return gC

    @cute.jit
    def _load_k_tile(self, ab_pipeline, state, tma_atom_a, tAgA_k, tAsA, a_mask,
                     tma_atom_b, tBgB_k, tBsB, b_mask):
        """TMA k tile `state.count` of this output tile into stage `state.index`."""
        ab_pipeline.producer_acquire(state)
        bar = ab_pipeline.producer_get_barrier(state)
        cute.copy(tma_atom_a, tAgA_k[(None, state.count)], tAsA[(None, state.index)],
                  tma_bar_ptr=bar, mcast_mask=a_mask)
        cute.copy(tma_atom_b, tBgB_k[(None, state.count)], tBsB[(None, state.index)],
                  tma_bar_ptr=bar, mcast_mask=b_mask)
        ab_pipeline.producer_commit(state)

    @cute.jit
    def _a_fragment(self, tiled_mma, thr_mma, sA, tidx):
        """A as `_mma_k_tile` reads it: descriptors of the stages (the warpgroup's slice
        `thr_mma`), or with `a_regs` this thread's `ARegs` (`tidx`: its index in the CTA)."""
        if cutlass.const_expr(self.a_regs):
            thr = tiled_mma.get_slice((tidx - self.producer_warpgroups * WG) % self.tile_threads)
            bm, _, bk = self.tile_shape_mnk
            return ARegs(thr.partition_A(sA),
                         tiled_mma.make_fragment_A(thr.partition_shape_A((bm, bk))))
        return tiled_mma.make_fragment_A(thr_mma.partition_A(sA))

    @cute.jit
    def _mma_k_tile(self, tiled_mma, acc, tCrA, tCrB, stage):
        """One k tile: its 16-wide (TF32: 8-wide) WGMMA steps in ascending K onto the
        accumulators. With `a_regs` the k tile's A is first copied into the registers, once
        the WGMMAs that read them for the previous k tile have retired. (Issuing each step
        as its own group, its registers refilled while the previous tile's later steps run,
        measured no faster on an H100: tf32 dX 1.4-3.8% slower over 181 problems.)"""
        if cutlass.const_expr(self.a_regs):
            cute.nvgpu.warpgroup.wait_group(0)
            cute.autovec_copy(tCrA.smem[(None, None, None, stage)], tCrA.regs)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA.regs if self.a_regs else tCrA,
                                                    mode=[2])):
            a = tCrA.regs[(None, None, kb)] if self.a_regs else tCrA[(None, None, kb, stage)]
            cute.gemm(tiled_mma, acc, a, tCrB[(None, None, kb, stage)], acc)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _mainloop(self, ab_pipeline, read, release, tiled_mma, acc, tCrA, tCrB, k_tiles,
                  refill, drain: cutlass.Constexpr = True, tail=None):
        """All k tiles of one output tile, in order: k tile 0 (K >= 1, so it exists), then
        1, 2, ... with one WGMMA batch in flight; the stage the previous batch read is
        released once it retires. `refill` (non-persistent kernel only) is (is_producer,
        producer state, TMA operands...): that warp then reloads the freed stage at once.
        `tail` (groups along K): what `_zero_k_tail` needs to clear the last k tile's
        elements past the group's end before its WGMMAs read the stage.
        Returns the advanced (read, release, producer) states. With `drain` all WGMMAs have
        retired; without, the last batch may still run (the caller waits for it)."""
        prod = None
        if cutlass.const_expr(refill is not None):
            prod = refill[1]
        ab_pipeline.consumer_wait(read)
        if cutlass.const_expr(tail is not None):
            self._zero_k_tail(tail, read.index, k_tiles == 1)
        self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read.index)
        read.advance()
        for _k in cutlass.range(1, k_tiles, 1, unroll=1):
            ab_pipeline.consumer_wait(read)
            if cutlass.const_expr(tail is not None):
                self._zero_k_tail(tail, read.index, _k == k_tiles - 1)
            self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read.index)
            cute.nvgpu.warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release)
            release.advance()
            read.advance()
            if cutlass.const_expr(refill is not None):
                if refill[0] and prod.count < k_tiles:
                    self._load_k_tile(ab_pipeline, prod, *refill[2:])
                    prod.advance()
        if cutlass.const_expr(drain):
            cute.nvgpu.warpgroup.wait_group(0)
        return read, release, prod

    @cute.jit
    def _zero_k_tail(self, tail, stage, is_last):
        """Groups along K: in the last k tile of a group (`is_last`) that holds fewer than BK
        elements of K, zero A's and B's elements past the group's end in the stage. TMA
        brought the next group's values there; zeros on both sides make exact zero products
        (whatever those values were, Inf and NaN included), so the chain is the group's own,
        as TMA's zero fill past the end of K makes it for one GEMM.

        `tail`: (k_last, the stages of A and B as 16-byte chunks with their element layouts
        and widths (`_k_tail_views`), the thread's index among the tile's threads, their
        barrier). Both operands are MN-major with 128-byte swizzle atoms (64 elements along
        M or N, 8 along K): each k row of an atom is one 128-byte line whose 16-byte chunks
        the swizzle only permutes, so zeroing every chunk of the lines of k >= k_last (one
        16-byte store each) zeroes exactly those elements. The tile's threads then fence
        their stores for the async proxy (WGMMA) and meet at the barrier."""
        k_last, views, tidx, barrier = tail
        bk = self.tile_shape_mnk[2]
        if is_last:
            if k_last < bk:
                zero = cute.make_rmem_tensor((4,), cutlass.Int32)
                zero.fill(0)
                for chunks, outer, width in views:
                    per_k = width // 8  # 16-byte chunks of one k row of the stage
                    for c in cutlass.range(tidx, (bk - k_last) * per_k, self.tile_threads,
                                           unroll=1):
                        j = c % per_k
                        line = cute.crd2idx(((j // 8) * 64, k_last + c // per_k, stage), outer)
                        cute.autovec_copy(zero, chunks[(None, line // 8 + j % 8)])
                cute.arch.fence_proxy("async.shared", space="cta")
                barrier.arrive_and_wait()

    def _k_tail_views(self, storage, a_smem_layout_staged, b_smem_layout_staged):
        """A's and B's stages as 16-byte chunks (4 x Int32 each), with their element layouts
        (unswizzled) and widths (BM, BN): what `_zero_k_tail` writes through."""
        views = []
        bm, bn, _ = self.tile_shape_mnk
        for buf, layout, dtype, width in (
                (storage.sA, a_smem_layout_staged, self.a_dtype, bm),
                (storage.sB, b_smem_layout_staged, self.b_dtype, bn)):
            words = cute.recast_ptr(buf.data_ptr(), dtype=cutlass.Int32)
            chunks = cute.make_tensor(words, cute.make_layout(
                (4, cute.cosize(layout.outer) * dtype.width // 128), stride=(1, 4)))
            views.append((chunks, layout.outer, width))
        return tuple(views)

    @cute.jit
    def _init_acc(self, acc, thr_mma_thread, mC_in_mnl, tile_m, tile_n, tile_l):
        """Start the chain: +0.0, or (dW +=) the fp32 values already in C, so this call
        continues exactly where the previous one stopped. Elements past C's edge are never
        stored (the TMA store clips them), so their start value does not matter.

        A tile inside C loads it with no guard. An edge tile guards its loads. In a
        ping-pong kernel a consumer's accumulators hold the whole tile (192 of its 232
        registers at 128x192). There a guard per element made ptxas spill and issue every
        WGMMA alone (C7511), so only the rows are guarded and the columns are clamped to C's
        last one. A cooperative consumer holds half the tile and guards both (the clamp
        spilled there). `detgemm-cute compile --ptxas` shows such warnings.

        The start values are pinned (`wgmma_registers`): from +0.0, each zero is its own volatile
        `mov`; for `dW +=`, C's values (over a plain fill) are fenced once loaded. Where the
        compiler instead sank the zero fill past the WGMMA fence, ptxas drained the pipe after each
        tile's first WGMMA (C7517, 164 of 631 table kernels on 2026-11-29). The chunked chain's sum
        is no WGMMA operand (its chunks are, `sm90_chunked`); pinned, its zeros made ptxas spill."""
        if cutlass.const_expr(not self.accumulate):
            if cutlass.const_expr(self.chunked):
                acc.fill(0.0)
            else:
                zero_pinned(acc)
        else:
            acc.fill(0.0)
            mC_in = mC_in_mnl[(None, None, tile_l)]
            bm, bn, _ = self.tile_shape_mnk
            if cutlass.const_expr(self.row_tile):
                # Accumulator rows BM..63 start at 0, take the products of other stages'
                # rows (`_row_tile_a_smem`) and are never stored.
                cC = cute.make_identity_tensor((self.mma_m, bn))
                tCcC = thr_mma_thread.partition_C(cC)
                m0, n0 = tile_m * bm, tile_n * bn
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r, c = tCcC[i]
                    if r < bm and cute.elem_less((m0 + r, n0 + c), mC_in.shape):
                        acc[i] = mC_in[(m0 + r, n0 + c)]
            else:
                gC = cute.local_tile(mC_in, (bm, bn), (tile_m, tile_n))
                cC = cute.local_tile(cute.make_identity_tensor(mC_in.shape), (bm, bn),
                                     (tile_m, tile_n))
                tCgC = thr_mma_thread.partition_C(gC)
                tCcC = thr_mma_thread.partition_C(cC)
                inside = ((tile_m + 1) * bm <= mC_in.shape[0]
                          and (tile_n + 1) * bn <= mC_in.shape[1])
                if inside:
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = tCgC[i]
                elif cutlass.const_expr(self.pingpong):
                    m_last, n_last = mC_in.shape[0] - 1, mC_in.shape[1] - 1
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        r, c = tCcC[i]
                        if r <= m_last:
                            acc[i] = mC_in[(r, cutlass.min(c, n_last))]
                else:
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        if cute.elem_less(tCcC[i], mC_in.shape):
                            acc[i] = tCgC[i]
            if cutlass.const_expr(not self.chunked):
                fence_operands(acc)

    @cute.jit
    def _add_bias(self, acc, thr_mma_thread, mBias, mC_mn, place):
        """acc += float32(bias[n]) (or bias[m], `bias_on_rows`), one IEEE fp32 add per
        element, before the rounding; `place` is the tile's `TilePlace`."""
        mode = 0 if cutlass.const_expr(self.bias_on_rows) else 1
        total = cute.size(mC_mn, mode=[mode])
        bm, bn, _ = self.tile_shape_mnk
        start = (place.m * bm + place.off_m) if cutlass.const_expr(self.bias_on_rows) \
            else (place.n * bn + place.off_n)
        # Coordinates of this thread's fragment in the tile.
        tCcC = thr_mma_thread.partition_C(cute.make_identity_tensor((self.mma_m, bn)))
        for i in cutlass.range_constexpr(cute.size(acc)):
            # Elements past M or N are clipped by the TMA store; clamp so the load stays in
            # bounds.
            j = cutlass.min(start + tCcC[i][mode], total - 1)
            acc[i] = acc[i] + mBias[j].to(cutlass.Float32)

    def _acc_shape(self, thr_mma):
        """This thread's accumulator fragment of one (mma rows, BN) tile."""
        return thr_mma.partition_C(
            cute.make_identity_tensor((self.mma_m, self.tile_shape_mnk[1]))).shape
