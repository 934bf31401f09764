"""SM90 GEMM kernel: TMA loads into a multi-stage mbarrier pipeline, WGMMA, one rounding.

Computes ``C[M, N] = round(A[M, K] @ B[N, K]^T (+ bias[N]))`` with fp32 accumulators.

Mainloop order (the contract): every CTA owns whole output tiles and walks K from 0 upward
in BK-wide TMA tiles; inside a tile the WGMMA instructions are issued in ascending 16-wide
K steps onto the same accumulator registers, and WGMMAs on one accumulator retire in issue
order. So every output element is the same ascending chain of 16-wide blocks
``acc = blk(acc, k0..k0+15)``, whatever the tile shape, cluster shape, stage count or the
number of rows in the problem: no split-K, no reduction across CTAs, no atomics. A ragged
last tile along M or N (the extent at least one tile) is moved back to end at the edge, so
every TMA box lies inside the tensors; its first rows (columns) are also computed by the
tile before it, with the same chain, and both store the same bits (not with ``accumulate``,
whose tiles read C: there the last tile is clipped). Boxes that ran mostly past M measured
up to 3.6x slower than full ones. A cluster's CTA past the last tile moves back the same
way and repeats the last tile (same chains, same bits). Extents shorter than a tile and the
tail of K use TMA's out-of-bounds zero fill (loads) and clipping (stores); zeros past the
end of K contribute exact zero products, which leave the chain unchanged.

Every tile starts its accumulators at +0.0 -- or, with ``accumulate`` (dW += dY^T X), at the
fp32 values already in C, loaded by each thread for its own fragment -- and accumulates
every 16-wide block onto them. The fp32 value a previous call stored is exactly the
accumulator it held, so continuing from it is the same chain as never having stopped (at a
16-wide block boundary). This holds in the three kernels below:
`Sm90Gemm` (one CTA per tile, TMA issued by warp 0 between WGMMA batches),
`Sm90GemmPersistent` (warp-specialized: a producer warpgroup streams TMA loads while one or
two consumer warpgroups run WGMMA and the epilogue of each tile together, over a static
persistent tile schedule) and `Sm90GemmPingpong` (the same producer; two consumer
warpgroups take alternate tiles, so one's epilogue runs under the other's mainloop). They
differ only in which tile a CTA or warpgroup runs when, never in the arithmetic of a tile.

Row tiles (BM = 8, 16 or 32, for decode): WGMMA always computes 64 rows; TMA loads only the
BM rows that belong to the tile (K-major A), and only those BM rows are stored. A stage then
carries BM rows of X next to the weight tile instead of a 64-row box that is mostly zero
fill. The A stages are BM rows apart in shared memory, so WGMMA's rows BM..63 of a stage are
the following stages' rows (`Sm90Base._row_tile_a_smem`): they feed products into
accumulator rows that are never stored, and a row of the product depends on its own row of
A alone, so each stored row is the same chain as with a 64-row tile. A stage costs BM rows
of A instead of 64, which leaves room for more stages of the weight in flight.

Rows TMA cannot address (`a_loads`, `Sm90GemmPersistent` only): a K-major A whose row pitch
is not a multiple of 16 bytes (p @ v's softmax rows at an odd sequence length) is read by the
producer warpgroup itself, 16-byte chunks into a raw ring and shifted into the swizzled stage
(`sm90_a_rows.py`); B still comes by TMA, and the consumers run the same chain on the stage.

Batches (bmm): operands of rank 3 arrive in torch order [L, rows, cols] and run in one launch;
the batch is the L mode of every tensor (grid z for `Sm90Gemm`, the third coordinate of the
persistent tile index for `Sm90GemmPersistent`). A tile never spans two entries, so each
entry is the chain above, as if it ran alone. Rank-2 operands get an L mode of size 1.

Groups (`Sm90GemmGrouped`, grouped_mm's mixture-of-experts form): the rows of A and C fall
into groups given by their int32 cumulative ends, read on the device, and group g multiplies
by B's entry g. The persistent schedule walks the groups' own row tiles (see
`Sm90Base._group_place`), so a tile never spans two groups and each row is the chain above
with its group's weight, as if its group ran alone.

Chunked chain (`chunked`, the fp32 tier's split operands, see detgemm_cute/split.py): each
k tile is one chunk. Its WGMMA steps run onto a chunk fragment that starts at +0.0; once they
retire, the fragment is added to the accumulator with one fp32 add (round to nearest even)
and the stage is released. Two chunk fragments alternate, so a chunk runs while the one
before it is added (`sm90_chunked`). The chunks are added in ascending K, so every output
element is again one fixed chain, whatever the tile.

TF32 operands (the fp32 tier's "tf32" precision): fp32 tensors, both K-major, are read through
TF32 TMA tensor maps (each value rounded to TF32 on the way into shared memory) and
multiplied by TF32 WGMMA, whose steps are 8 wide: the chain is the same with 8-wide blocks.

Epilogue: optional bias is converted to fp32 and added to the fp32 accumulator, then each
value is rounded once (round-to-nearest-even) to the output dtype and stored through shared
memory with TMA.
"""


from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.pipeline import pipeline_init_wait

from .sm90_a_rows import ARowLoads
from .sm90_base import GROUP_TABLE, WG, Sm90Base, TilePlace

# Named barriers of the ping-pong turns, one per consumer at each stage (id + consumer);
# 0 is __syncthreads and 1 the epilogue's (sm90_base).
_MMA_TURN = 2
_EPI_TURN = 4


class Sm90Gemm(Sm90Base):
    """One CTA per output tile; warp 0 issues TMA loads between WGMMA batches.

    Mainloop order: k tiles 0, 1, 2, ... of the CTA's tile, each as ascending 16-wide WGMMA
    steps onto fp32 accumulators that start at +0.0 (or at C's fp32 values, `accumulate`).
    Best for small grids (thin tiles, small M), where there is no second tile per CTA to
    overlap with.
    """

    def _schedule(self, mC, mOffs, max_clusters):
        """One CTA per output tile, the grid rounded up to whole clusters."""
        gc = cute.zipped_divide(mC, tiler=self.tile_shape_mnk[:2])
        cluster_mnl = (*self.cluster_shape_mn, 1)
        tiles = cute.get(gc.layout, mode=[1]).shape  # (tiles_m, tiles_n, L)
        grid = tuple(x * y for x, y in zip(cute.ceil_div(tiles, cluster_mnl), cluster_mnl))
        return grid, (), {}

    @cute.kernel
    def kernel(self, tma_atom_a: Optional[cute.CopyAtom], mA_mk: cute.Tensor,
               tma_atom_b: cute.CopyAtom, mB_nk: cute.Tensor,
               tma_atom_c: Optional[cute.CopyAtom], mC_mn: cute.Tensor,
               mBias: Optional[cute.Tensor],
               mC_in: Optional[cute.Tensor], mOffs: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, cta_layout_mnk: cute.Layout,
               a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout):
        warp_idx, tidx = self._prefetch_descriptors(tma_atom_a, tma_atom_b)

        # Raster clusters in groups of 8 along M so neighbouring CTAs share B tiles in L2.
        # Only the order in which tiles run changes; each tile's arithmetic does not.
        cidx, cidy, _ = cute.arch.cluster_idx()
        cdimx, cdimy, _ = cute.arch.cluster_dim()
        cluster_id = cidx + cdimx * cidy
        group_m = 8
        s_shape = ((group_m, cdimx // group_m), cdimy)
        s_layout = cute.make_layout(s_shape, stride=((1, cdimy * group_m), group_m))
        num_reg = cute.size(s_shape)
        cid_m, cid_n = s_layout.get_flat_coord(cluster_id % num_reg)
        if cluster_id >= num_reg:
            tail_m = cdimx % group_m
            tail_layout = cute.make_layout((tail_m, cdimy), stride=(1, tail_m))
            t_m, t_n = tail_layout.get_flat_coord(cluster_id - num_reg)
            cid_m = cute.size(s_shape, mode=[0]) + t_m
            cid_n = t_n
        in_cluster = cute.arch.block_in_cluster_idx()
        tile_m = cid_m * self.cluster_shape_mn[0] + in_cluster[0]
        tile_n = cid_n * self.cluster_shape_mn[1] + in_cluster[1]
        _, _, tile_l = cute.arch.block_idx()  # batch entry (0 for a plain GEMM)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        (ab_pipeline, sA, sB, sC, tAsA, tBsB, src, a_mask, b_mask, k_tiles) = self._setup(
            storage, cta_layout_mnk, a_smem_layout_staged, b_smem_layout_staged,
            epi_smem_layout_staged, mA_mk, mB_nk, tma_atom_a, tma_atom_b)
        self._wait_for_previous_grid()
        place = self._place(mC_mn, None, (tile_m, tile_n, tile_l))
        tAgA_k, tBgB_k = self._tile_loads(src, place)
        gC = self._tile_c(mC_mn, place)

        wg_idx = cute.arch.make_warp_uniform(tidx // WG)
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.tile_warp_groups, stride=WG)(wg_idx))
        tCrA = self._a_fragment(tiled_mma, thr_mma, sA, tidx)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(self._acc_shape(thr_mma), self.acc_dtype)
        self._init_acc(acc, tiled_mma.get_slice(tidx), mC_in, tile_m, tile_n, tile_l)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        if warp_idx == 0:  # prologue: k tiles 0 .. stages-1
            for _ in cutlass.range(cutlass.min(self.ab_stage, k_tiles), unroll=1):
                self._load_k_tile(ab_pipeline, prod, tma_atom_a, tAgA_k, tAsA, a_mask,
                                  tma_atom_b, tBgB_k, tBsB, b_mask)
                prod.advance()

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        # Warp 0 refills each freed stage with the next k tile from inside the mainloop.
        refill = (warp_idx == 0, prod, tma_atom_a, tAgA_k, tAsA, a_mask, tma_atom_b, tBgB_k,
                  tBsB, b_mask)
        if cutlass.const_expr(self.chunked):
            parts = self._chunk_parts(thr_mma)
            read, prod = self._mainloop_chunked(ab_pipeline, read, tiled_mma, acc, parts,
                                                tCrA, tCrB, k_tiles, refill)
        else:
            read, release, prod = self._mainloop(
                ab_pipeline, read, release, tiled_mma, acc, tCrA, tCrB, k_tiles, refill)
        if cutlass.const_expr(self.is_a_mcast or self.is_b_mcast):
            # Peers multicast into our shared memory until all are done with the mainloop.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

        if cutlass.const_expr(self.has_bias):
            # Coordinates need the per-thread slice (thr_mma above is per warpgroup).
            self._add_bias(acc, tiled_mma.get_slice(tidx), mBias, mC_mn, place)
        c_pipeline, barrier = self._epilogue_sync()
        self._epilogue(acc, tiled_mma, tidx, warp_idx == 0, sC, gC, tma_atom_c, c_pipeline,
                       0, barrier)
        if warp_idx == 0:
            c_pipeline.producer_tail()


class Sm90GemmPersistent(ARowLoads, Sm90Base):
    """Warp-specialized, persistent: one producer warpgroup, one or two consumer warpgroups.

    The producer's warp 0 walks the CTA's tiles (static schedule: tile t, t + grid, ...) and
    for each streams k tiles 0, 1, 2, ... into the stage ring. Consumers take the stages in
    the same order, so each tile's chain is again ascending 16-wide WGMMA steps onto fp32
    accumulators reset to +0.0 (or loaded from C, `accumulate`) at the start of the tile; then
    bias, one rounding, TMA store.
    """

    producer_warpgroups = 1
    swizzle = 1
    load_registers = 40
    mma_registers = 232

    def _schedule(self, mC, mOffs, max_clusters):
        """At most max_clusters clusters (the GPU's SMs), each walking its tiles."""
        gc = cute.zipped_divide(mC, tiler=self.tile_shape_mnk[:2])
        tiles_mnl = gc[(0, (None, None, None))].shape
        if cutlass.const_expr(self.grouped):
            tiles_mnl = (self._group_grid_m(cute.size(mC, mode=[0]), cute.size(mOffs)),
                         tiles_mnl[1], tiles_mnl[2])
        # Plain M-major tile order (N-major with `raster_n`): the DSL's swizzled order rounds
        # the M tiles up to a multiple of the swizzle and runs the padding tiles, which
        # measured 2x slower at M=512. Order only; no tile's arithmetic changes.
        sched = utils.PersistentTileSchedulerParams(
            tiles_mnl, (*self.cluster_shape_mn, 1), self.swizzle, not self.raster_n)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_clusters)
        return grid, (sched,), {"min_blocks_per_mp": 1}

    @cute.jit
    def _produce(self, sched_params, ab_pipeline, k_tiles, src, mC_mn, groups, tAsA, a_mask,
                 tBsB, b_mask, raw):
        """The producer warp (`a_loads`: warpgroup): walk the CTA's tiles (static schedule:
        tile t, t + grid, ...) and stream each tile's k tiles 0, 1, 2, ... into the stage
        ring (grouped: only tiles that read, see `_group_place`)."""
        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        while work.is_valid_tile:
            place = self._place(mC_mn, groups, work.tile_idx)
            if cutlass.const_expr(self.grouped):
                if place.loads:
                    prod = self._produce_tile(ab_pipeline, prod, k_tiles, src, place, tAsA,
                                              a_mask, tBsB, b_mask, raw)
            else:  # groups along K: the tile's group has its own k tiles (maybe none)
                prod = self._produce_tile(ab_pipeline, prod,
                                          place.k_tiles if self.grouped_k else k_tiles, src,
                                          place, tAsA, a_mask, tBsB, b_mask, raw)
            sched.advance_to_next_work()
            work = sched.get_current_work()
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            ab_pipeline.producer_tail(prod)

    @cute.jit
    def _produce_tile(self, ab_pipeline, prod, k_tiles, src, place, tAsA, a_mask, tBsB,
                      b_mask, raw):
        """Stream the k tiles 0, 1, 2, ... of the tile at `place` into the stage ring
        (`a_loads`: A through the raw ring `raw`, `ARowLoads`)."""
        tAgA_k, tBgB_k = self._tile_loads(src, place)
        if cutlass.const_expr(self.a_loads):
            prod = self._produce_tile_rows(ab_pipeline, prod, k_tiles, src, place, tBgB_k,
                                           tBsB, b_mask, *raw)
        else:
            prod.reset_count()
            for _k in cutlass.range(k_tiles, unroll=1):
                self._load_k_tile(ab_pipeline, prod, src.atom_a, tAgA_k, tAsA, a_mask,
                                  src.atom_b, tBgB_k, tBsB, b_mask)
                prod.advance()
        return prod

    @cute.jit
    def _grouped_tile(self, place, consumer, ab_pipeline, read, release, tiled_mma, acc, tCrA,
                      tCrB, k_tiles, thr_mma_thread, mma_tidx, store_warp, sC, mC_mn, mC,
                      tma_atom_c, c_pipeline, buf_base, barrier):
        """One scheduled tile of a grouped kernel (`_group_place`): nothing past the last
        tile; zeros for rows past the last group; else the group's chain. A full tile is
        stored by TMA, the one tile of a group shorter than BM row by row. Ping-pong: the
        mainloop runs in this consumer's MMA turn and the stores in its epilogue turn (from
        buffer 0, drained before the turn passes), as in `Sm90GemmPingpong`; a tile that
        stores or reads nothing still takes both turns, so the consumers keep alternating.
        Cooperative tiles (`halves_idle`): a warpgroup with none of the group's rows passes
        the stages without MMAs; its accumulators stay +0.0 and are never stored. A
        cluster's padding tile (rows 0, CM > 1) passes them the same way. A tile
        that ends inside it is stored by the threads: from registers up to BM/4 rows (and in
        ping-pong), else staged through shared memory like a full tile, each warp storing a
        run of consecutive elements (1.06-1.15x the layer's speed at 64-96 rows per expert,
        bench/results/grouped-partial-store-ab_*; 0.98-1.00x at 8-16, hence registers)."""
        if cutlass.const_expr(self.pingpong):
            self._turn_wait(consumer, _MMA_TURN)
        # This warpgroup stores none of the tile's rows: a cluster's padding tile (rows 0,
        # CM > 1), or (`halves_idle`) its 64 rows all lie past the group's end.
        idle_below = 0
        if cutlass.const_expr(self.halves_idle):
            idle_below = consumer * (self.tile_shape_mnk[0] // 2)
        if place.rows > 0:
            # A plain fill: zeros pinned by volatile movs (`wgmma_registers`, as `_init_acc`
            # writes them) made ptxas serialize this kernel's WGMMAs (C7515).
            acc.fill(0.0)
        if place.loads:
            read.reset_count()
            release.reset_count()
            if place.rows <= idle_below:
                read, release = self._pass_stages(ab_pipeline, read, release, k_tiles)
            else:
                read, release, _ = self._mainloop(ab_pipeline, read, release, tiled_mma,
                                                  acc, tCrA, tCrB, k_tiles, None,
                                                  drain=not self.pingpong)
        if cutlass.const_expr(self.pingpong):
            self._turn_pass(1 - consumer, _MMA_TURN)  # all issued: the other's turn
            # Unconditional (a no-op after a tile that issued nothing): a wait on a
            # data-dependent path makes ptxas add its own and serialize every WGMMA (C7518).
            cute.nvgpu.warpgroup.wait_group(0)
        if place.loads:
            ab_pipeline.consumer_release(release)
            release.advance()
        if cutlass.const_expr(self.pingpong):
            self._turn_wait(consumer, _EPI_TURN)
        if place.rows > 0:
            if place.rows == self.tile_shape_mnk[0]:
                self._epilogue(acc, tiled_mma, mma_tidx, store_warp, sC,
                               self._tile_c(mC_mn, place), tma_atom_c, c_pipeline, buf_base,
                               barrier)
                if cutlass.const_expr(self.pingpong):
                    if store_warp:
                        c_pipeline.producer_tail()
            else:  # mC: the output itself (mC_mn holds TMA coordinates)
                bn = self.tile_shape_mnk[1]
                cols = cute.size(mC, mode=[1]) - place.n * bn - place.off_n
                staged = False
                if cutlass.const_expr(not self.pingpong):
                    staged = place.rows > self.tile_shape_mnk[0] // 4
                if staged:  # staged like a full tile, stored by the threads to the group's end
                    self._epilogue(acc, tiled_mma, mma_tidx, store_warp, sC,
                                   (self._tile_c(mC, place), place.rows, cols), tma_atom_c,
                                   c_pipeline, buf_base, barrier, direct=True)
                else:
                    self._store_rows(acc, thr_mma_thread, self._tile_c(mC, place), place.rows,
                                     cols)
        if cutlass.const_expr(self.pingpong):
            self._turn_pass(1 - consumer, _EPI_TURN)
        return read, release

    @cute.jit
    def _pass_stages(self, ab_pipeline, read, release, k_tiles):
        """Take the tile's k tiles in turn as `_mainloop` does (wait for each stage, release
        the one before), with no MMA; the caller releases the last one, as after it."""
        ab_pipeline.consumer_wait(read)
        read.advance()
        for _k in cutlass.range(1, k_tiles, 1, unroll=1):
            ab_pipeline.consumer_wait(read)
            ab_pipeline.consumer_release(release)
            release.advance()
            read.advance()
        return read, release

    @cute.jit
    def _tile_stages(self, mC_mn, groups, work, k_tiles):
        """Stages the producer streams for scheduled tile `work` (ping-pong: what the other
        consumer's tile takes from the ring): its k tiles, none for a grouped tile that
        reads nothing (rows past the last group, a tile past the last one)."""
        stages = k_tiles
        if cutlass.const_expr(self.grouped):
            stages = cutlass.Int32(0)
            if work.is_valid_tile:
                if self._place(mC_mn, groups, work.tile_idx).loads:
                    stages = k_tiles
        return stages

    @cute.jit
    def _turn_wait(self, consumer, stage: cutlass.Constexpr):
        """Ping-pong: wait until it is consumer `consumer`'s turn at `stage` (_MMA_TURN or
        _EPI_TURN)."""
        cute.arch.barrier(barrier_id=stage + consumer, number_of_threads=2 * WG)

    @cute.jit
    def _turn_pass(self, consumer, stage: cutlass.Constexpr):
        """Ping-pong: give consumer `consumer` its turn at `stage`."""
        cute.arch.barrier_arrive(barrier_id=stage + consumer, number_of_threads=2 * WG)

    @cute.kernel
    def kernel(self, tma_atom_a: Optional[cute.CopyAtom], mA_mk: cute.Tensor,
               tma_atom_b: cute.CopyAtom, mB_nk: cute.Tensor,
               tma_atom_c: Optional[cute.CopyAtom], mC_mn: cute.Tensor,
               mBias: Optional[cute.Tensor],
               mC_in: Optional[cute.Tensor], mOffs: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, cta_layout_mnk: cute.Layout,
               a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout,
               sched_params: utils.PersistentTileSchedulerParams):
        warp_idx, tidx = self._prefetch_descriptors(tma_atom_a, tma_atom_b)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        (ab_pipeline, sA, sB, sC, tAsA, tBsB, src, a_mask, b_mask, k_tiles) = self._setup(
            storage, cta_layout_mnk, a_smem_layout_staged, b_smem_layout_staged,
            epi_smem_layout_staged, mA_mk, mB_nk, tma_atom_a, tma_atom_b)
        self._wait_for_previous_grid()
        groups = None
        if cutlass.const_expr(self.grouped):
            table = storage.group_first.get_tensor(cute.make_layout(GROUP_TABLE))
            self._group_table(table, mOffs, cute.size(mC_mn, mode=[0]))
            groups = (mOffs, table)
        if cutlass.const_expr(self.grouped_k):
            groups = self._k_groups(mOffs, mA_mk)

        wg_idx = cute.arch.make_warp_uniform(tidx // WG)
        consumer = wg_idx - self.producer_warpgroups
        # Cooperative: the consumers split each tile along M; ping-pong: each runs a whole one.
        tile_wg = 0 if cutlass.const_expr(self.pingpong) else consumer
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.tile_warp_groups, stride=WG)(tile_wg))
        tCrA = self._a_fragment(tiled_mma, thr_mma, sA, tidx)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(self._acc_shape(thr_mma), self.acc_dtype)
        parts = None
        if cutlass.const_expr(self.chunked):
            parts = self._chunk_parts(thr_mma)
        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if wg_idx < self.producer_warpgroups:
            cute.arch.setmaxregister_decrease(self.load_registers)
        # The producer: warp 0 (TMA), or with `a_loads` the whole warpgroup (A's loads).
        if warp_idx < (4 if self.a_loads else 1):
            raw = self._raw_views(storage) if cutlass.const_expr(self.a_loads) else None
            self._produce(sched_params, ab_pipeline, k_tiles, src, mC_mn, groups, tAsA, a_mask,
                          tBsB, b_mask, raw)

        if wg_idx >= self.producer_warpgroups:
            cute.arch.setmaxregister_increase(self.mma_registers)
            # Thread index among the threads that share a tile, and the warp that stores it.
            first_wg = wg_idx if cutlass.const_expr(self.pingpong) else self.producer_warpgroups
            mma_tidx = tidx - first_wg * WG
            store_warp = warp_idx == first_wg * 4
            thr_mma_thread = tiled_mma.get_slice(mma_tidx)
            sched = utils.StaticPersistentTileScheduler.create(
                sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                   self.ab_stage)
            c_pipeline, barrier = self._epilogue_sync()
            tail_views = None
            if cutlass.const_expr(self.grouped_k):
                tail_views = self._k_tail_views(storage, a_smem_layout_staged,
                                                b_smem_layout_staged)
            if cutlass.const_expr(self.pingpong):
                if consumer == 0:  # consumer 0 has the first turn at both stages
                    self._turn_pass(0, _MMA_TURN)
                    self._turn_pass(0, _EPI_TURN)
                else:  # consumer 1 starts at the CTA's second tile, past the first's stages
                    skip = self._tile_stages(mC_mn, groups, work, k_tiles)
                    read.advance(skip)
                    release.advance(skip)
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
            if cutlass.const_expr(self.grouped):
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            while work.is_valid_tile:
                tile = work.tile_idx
                if cutlass.const_expr(self.grouped):
                    buf_base = 0 if cutlass.const_expr(self.pingpong) else \
                        sched.num_tiles_executed * self._epi_tiles()
                    read, release = self._grouped_tile(
                        self._place(mC_mn, groups, tile), consumer, ab_pipeline, read, release,
                        tiled_mma, acc, tCrA, tCrB, k_tiles,
                        thr_mma_thread, mma_tidx, store_warp, sC, mC_mn, mC_in, tma_atom_c,
                        c_pipeline, buf_base, barrier)
                    if cutlass.const_expr(self.pingpong):  # skip the other consumer's tile
                        sched.advance_to_next_work()
                        skip = self._tile_stages(mC_mn, groups, sched.get_current_work(),
                                                 k_tiles)
                        read.advance(skip)
                        release.advance(skip)
                    sched.advance_to_next_work()
                else:
                    read.reset_count()
                    release.reset_count()
                    self._init_acc(acc, thr_mma_thread, mC_in, *tile)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    if cutlass.const_expr(self.chunked):
                        read, _ = self._mainloop_chunked(ab_pipeline, read, tiled_mma, acc, parts,
                                                         tCrA, tCrB, k_tiles, None)
                    elif cutlass.const_expr(self.grouped_k):
                        read, release = self._k_group_chain(
                            self._place(mC_mn, groups, tile), ab_pipeline, read, release,
                            tiled_mma, acc, tCrA, tCrB, (tail_views, mma_tidx, barrier))
                    else:
                        if cutlass.const_expr(self.pingpong):
                            self._turn_wait(consumer, _MMA_TURN)
                        read, release, _ = self._mainloop(ab_pipeline, read, release, tiled_mma,
                                                          acc, tCrA, tCrB, k_tiles, None,
                                                          drain=not self.pingpong)
                        if cutlass.const_expr(self.pingpong):
                            self._turn_pass(1 - consumer, _MMA_TURN)  # all issued: the other's turn
                            cute.nvgpu.warpgroup.wait_group(0)
                        ab_pipeline.consumer_release(release)
                        release.advance()

                    place = self._place(mC_mn, groups, tile)
                    if cutlass.const_expr(self.has_bias):
                        self._add_bias(acc, thr_mma_thread, mBias, mC_mn, place)
                    gC = self._tile_c(mC_mn, place)
                    if cutlass.const_expr(self.pingpong):
                        # The consumers share the epilogue buffer: each stores in its turn, from
                        # buffer 0, and hands over once its stores have left shared memory.
                        self._turn_wait(consumer, _EPI_TURN)
                        self._epilogue(acc, tiled_mma, mma_tidx, store_warp, sC, gC, tma_atom_c,
                                       c_pipeline, 0, barrier)
                        if store_warp:
                            c_pipeline.producer_tail()
                        self._turn_pass(1 - consumer, _EPI_TURN)
                        # Skip the other consumer's next tile and its stages.
                        read.advance(k_tiles)
                        release.advance(k_tiles)
                        sched.advance_to_next_work(advance_count=2)
                    else:
                        self._epilogue(acc, tiled_mma, mma_tidx, store_warp, sC, gC, tma_atom_c,
                                       c_pipeline, sched.num_tiles_executed * self._epi_tiles(),
                                       barrier)
                        sched.advance_to_next_work()
                work = sched.get_current_work()
            if cutlass.const_expr(not self.pingpong):
                if store_warp:
                    c_pipeline.producer_tail()


class Sm90GemmPingpong(Sm90GemmPersistent):
    """Warp-specialized, persistent, ping-pong: one producer warpgroup and two consumer
    warpgroups that take the CTA's tiles in turn, each running a whole tile on its own.

    The producer streams the CTA's tiles t0, t1, t2, ... (static schedule) into the stage
    ring exactly as in `Sm90GemmPersistent`. Consumer 0 runs t0, t2, t4, ...; consumer 1
    runs t1, t3, ... and skips the other's stages in the ring. Two named-barrier turns order
    them: a consumer starts issuing a tile's WGMMAs once the other has issued its last ones,
    and starts its epilogue once the other's stores have left shared memory (both share the
    epilogue buffer). So one consumer's epilogue (bias, rounding, stores) runs under the
    other's mainloop. Each tile is still ascending 16-wide WGMMA steps onto its own fp32
    accumulators from +0.0 (or C's values, `accumulate`), one rounding: the same chain.
    The kernel body is `Sm90GemmPersistent.kernel`, with its ping-pong branches.
    """

    pingpong = True


class _OffsCall:
    """The launch of a kernel that takes the groups' int32 cumulative ends in the bias's
    place."""

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB_in: cute.Tensor, mC: cute.Tensor,
                 mOffs: cute.Tensor, max_clusters: cutlass.Int32, stream):
        self._launch(mA, mB_in, mC, None, mOffs, max_clusters, stream)


class Sm90GemmGrouped(_OffsCall, Sm90GemmPersistent):
    """Grouped GEMM (mixture of experts) in one launch: ``C[rows of group g] = A[rows of
    group g] @ B[g]^T`` for row groups given by their int32 cumulative ends ``offs`` (a
    device tensor, never read on the host, so a call can be captured in a CUDA graph).

    The persistent kernel of `Sm90GemmPersistent` (cooperative: no ping-pong) over a tile
    grid whose M tiles are the groups' own row tiles (`Sm90Base._group_place`): a tile never
    spans two groups, and each of its rows is the chain of that row alone (ascending 16-wide
    WGMMA steps onto fp32 accumulators from +0.0, one rounding) with its group's weight: a
    token's bits do not depend on how many tokens its group received, nor on the others.
    Rows past the last group are stored as zeros. The grid has rows // BM + (groups + 1) x CM
    M tiles, rounded up to a multiple of CM (an upper bound); scheduled tiles past the last
    one store nothing. A has its rows K-major, C is row-major, B is [G, N, K] or [G, K, N]
    (L mode = group). Clusters multicast A along N (a cluster row shares a row tile) and B
    along M: each group's row tiles are padded to a multiple of CM, so a cluster column
    always holds one group's tiles; a padding tile streams its share of the weight and
    stores nothing."""

    grouped = True


class Sm90GemmGroupedPingpong(Sm90GemmGrouped):
    """The grouped kernel with ping-pong consumers: the persistent grouped schedule of
    `Sm90GemmGrouped`, its tiles taken in turn by two consumer warpgroups that each run a
    whole tile, as in `Sm90GemmPingpong` (one's epilogue under the other's mainloop). A tile
    that reads nothing (rows past the last group) takes no stages from the ring, so the
    consumer that skips it skips none. Every row is the same chain as in `Sm90GemmGrouped`."""

    pingpong = True


class Sm90GemmGroupedK(_OffsCall, Sm90GemmPersistent):
    """Grouped GEMM with the groups along K (grouped_mm's 2-D x 2-D form, the weight
    gradient of a mixture-of-experts layer) in one launch: ``C[g] = A[:, group g] @
    B[group g, :]`` for A [M, T], B [T, N] and column groups of A (rows of B) given by their
    int32 cumulative ends ``offs`` along T, read on the device only (no sync; a CUDA graph
    captures the call). C is [G, M, N].

    The persistent cooperative kernel of `Sm90GemmPersistent` over the tile grid of C
    (M tiles, N tiles, G entries). The tile of entry g reads its group's k tiles only: A's
    and B's TMA tiles start at the group's start (`TilePlace.k0`) and step by BK; in the last
    one, the elements past the group's end are zeroed in the stage before its WGMMAs
    (`Sm90Base._zero_k_tail`). So each element of C[g] is the chain of its group alone --
    ascending 16-wide WGMMA steps from +0.0 over the group's K, zeros past its end, one
    rounding -- the bits of one GEMM over A[:, group g] and B[group g, :], whatever the other
    groups hold. An empty group's entry is stored as zeros; columns of A past the last
    group are read by no tile."""

    grouped_k = True

    @cute.jit
    def _k_groups(self, mOffs, mA_mk):
        """Check offs on the device (every CTA, its threads each a few entries: a bad entry
        traps, `_check_offs`) and return what `_place` needs: (offs, T)."""
        total = cute.size(mA_mk, mode=[1])
        tidx, _, _ = cute.arch.thread_idx()
        for g in cutlass.range(tidx, cute.size(mOffs), self.threads_per_cta, unroll=1):
            self._check_offs(mOffs, total, g, "the columns of a")
        return mOffs, total

    @cute.jit
    def _place(self, mC_mn, groups, tile):
        """Tile (m, n, g): moved along M and N as `_tail_offsets` says, reading A's and B's
        only entry, and its group's K range (`TilePlace.k0`, `k_tiles`, `k_last`)."""
        mOffs, total = groups
        bk = self.tile_shape_mnk[2]
        off_m, off_n = self._tail_offsets(mC_mn, tile)
        start, end = self._group_rows(mOffs, total, tile[2])
        k_tiles = (end - start + bk - 1) // bk
        return TilePlace(tile[0], tile[1], tile[2], 0, off_m, off_n, self.tile_shape_mnk[0],
                         True, start, k_tiles, end - start - (k_tiles - 1) * bk)

    @cute.jit
    def _tile_loads(self, src, place):
        """A's and B's k tiles of the tile's group: the grids start at the group's start."""
        _, tAgA, _, tBgB = self._partition_loads(src, place.off_m, place.off_n, place.k0)
        return tAgA[(None, place.m, None, 0)], tBgB[(None, place.n, None, 0)]

    @cute.jit
    def _k_group_chain(self, place, ab_pipeline, read, release, tiled_mma, acc, tCrA, tCrB,
                       zero_args):
        """The chain of one tile over its group's k tiles (none for an empty group: the
        accumulators stay +0.0), the last one's elements past the group cleared first."""
        if place.k_tiles > 0:
            read, release, _ = self._mainloop(ab_pipeline, read, release, tiled_mma, acc,
                                              tCrA, tCrB, place.k_tiles, None,
                                              tail=(place.k_last, *zero_args))
            ab_pipeline.consumer_release(release)
            release.advance()
        return read, release


def kernel_class(persistent: bool, pingpong: bool = False, grouped: bool = False,
                 grouped_k: bool = False):
    if grouped_k:
        if not persistent or pingpong or grouped:
            raise ValueError("the grouped-K kernel is persistent and cooperative: grouped_k "
                             "needs persistent and no pingpong")
        return Sm90GemmGroupedK
    if grouped:
        if not persistent:
            raise ValueError("the grouped kernel is persistent: grouped needs persistent")
        return Sm90GemmGroupedPingpong if pingpong else Sm90GemmGrouped
    if pingpong:
        if not persistent:
            raise ValueError("the ping-pong kernel is persistent: pingpong needs persistent")
        return Sm90GemmPingpong
    return Sm90GemmPersistent if persistent else Sm90Gemm


def mainloop_order() -> str:
    """Human-readable statement of the accumulation order, used by `explain`."""
    return ("K ascending in 16-wide WGMMA steps onto fp32 accumulators that start at +0.0 "
            "(dW: at the buffer's fp32 values), one CTA per output tile at a time, no split-K; "
            "bias added in fp32, then one rounding to the output dtype")
