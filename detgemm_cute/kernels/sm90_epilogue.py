"""The SM90 kernels' epilogue: one rounding of the fp32 accumulators to the output dtype,
staged through shared memory, then stored by TMA or, where TMA cannot store C's rows well,
by the tile's threads (a mixin of `Sm90Base`: it reads the kernel's tile, layouts and
dtypes from `self`).

The threads' stores (`c_direct`) walk C's contiguous dimension together. One element at a
time serves any row pitch; where the pitch is a multiple of 8 bytes (`c_vector` elements,
`KernelKey.c_align`), each thread stores 8 bytes at once from sub-tiles 32 x `c_vector`
columns wide, so each warp's store covers one 256-byte run of one row: on an H100 that beat
element stores by 1.09-1.58x on 23 q @ k^T rows of half-sector and 8-mod-16-byte pitches,
and 2-, 4- and 16-byte stores and narrower sub-tiles (bench/results/vector-store-ab_*).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

EPILOGUE_BARRIER = 1  # named barrier of one tile's epilogue threads (0 is __syncthreads)


class EpilogueStores:
    """Epilogue helpers of the SM90 kernels (see the module docstring)."""

    @cute.jit
    def _epilogue(self, acc, tiled_mma, mma_tidx, is_store_warp, sC, gC, tma_atom_c,
                  c_pipeline, buf_base, barrier, direct: cutlass.Constexpr = False):
        """Round once to the output dtype, stage through shared memory, TMA-store; with
        `c_direct` or `direct` (gC: the tile and C's extent from its start), the tile's
        threads store the staged sub-tiles instead (`_store_staged`). `direct` in a kernel
        that TMA-stores its other tiles (a grouped tile that ends inside the tile): the TMA
        stores of earlier tiles finish reading the staging buffers first."""
        by_threads = self.c_direct or direct
        r2s, tRS_sD, tRS_rAcc, tRS_rD, out = self._staging(acc, tiled_mma, mma_tidx, sC)
        n_rd = cute.size(tRS_rD)
        if cutlass.const_expr(by_threads):
            gC, rows, cols = gC
        if cutlass.const_expr(direct and not self.c_direct):
            if is_store_warp:
                c_pipeline.producer_tail()
            barrier.arrive_and_wait()
        gC_epi = cute.zipped_divide(gC, self.store_tile)
        epi_shape = gC_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        sC_store = sC
        if cutlass.const_expr(self.row_tile):
            sC_store = cute.flat_divide(sC, self.store_tile)[(None, None, 0, 0, None)]
        bSG_sD, bSG_gD = None, None
        if cutlass.const_expr(not by_threads):
            bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC_store, 0, 2), gC_epi)
        for epi_idx in cutlass.range_constexpr(cute.size(gC_epi, mode=[1])):
            for v in cutlass.range_constexpr(n_rd):
                tRS_rD[v] = tRS_rAcc[epi_idx * n_rd + v]
            out.store(tRS_rD.load().to(self.c_dtype))  # the single rounding
            buf = (buf_base + epi_idx) % self.epi_stage
            cute.copy(r2s, out, tRS_sD[(None, None, None, buf)])
            coord = epi_layout.get_hier_coord(epi_idx)
            if cutlass.const_expr(by_threads):
                barrier.arrive_and_wait()
                self._store_staged(sC_store[(None, None, buf)],
                                   cute.local_tile(gC, self.store_tile, coord),
                                   rows - coord[0] * self.store_tile[0],
                                   cols - coord[1] * self.store_tile[1], mma_tidx)
            else:
                cute.arch.fence_proxy("async.shared", space="cta")
                barrier.arrive_and_wait()
                if is_store_warp:
                    cute.copy(tma_atom_c, bSG_sD[(None, buf)], bSG_gD[(None, coord)])
                    c_pipeline.producer_commit()
                    c_pipeline.producer_acquire()
            barrier.arrive_and_wait()

    @cute.jit
    def _staging(self, acc, tiled_mma, mma_tidx, sC):
        """The register-to-shared copy of the epilogue: (tiled copy, this thread's share of
        sC's buffers, its accumulators retiled, fp32 and output-dtype sub-tile fragments)."""
        # stmatrix .x4 covers 16 columns of a warp's rows, .x2 eight: an 8-column sub-tile
        # (BN an odd multiple of 8) takes .x2, or its copy would span two sub-tiles.
        matrices = 2 if self.epi_tile[1] == 8 else 4
        stmatrix = cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), matrices)
        copy_atom_r2s = cute.make_copy_atom(
            stmatrix if self.c_dtype.width == 16 else cute.nvgpu.CopyUniversalOp(), self.c_dtype)
        copy_atom_c = cute.make_copy_atom(stmatrix, self.c_dtype)
        tiled_copy_r2s = cute.make_tiled_copy_S(
            copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
        rD_shape = cute.make_layout(cute.shape(thr_copy_r2s.partition_S(sC))[:3]).shape
        return (tiled_copy_r2s, thr_copy_r2s.partition_D(sC), tiled_copy_r2s.retile(acc),
                cute.make_rmem_tensor(rD_shape, self.acc_dtype),
                cute.make_rmem_tensor(rD_shape, self.c_dtype))

    @cute.jit
    def _store_staged(self, sD, gD, rows, cols, tidx):
        """Store one staged sub-tile sD to gD, its first `rows` x `cols` elements: the tile's
        threads walk C's contiguous dimension together, so each warp's stores land on one
        run of consecutive elements (a row of C that TMA cannot address); with `c_vector`,
        that many elements a thread at a time (`_store_staged_vectors`)."""
        em, en = self.store_tile
        n_major = self.c_layout.is_n_major_c()
        run = en if cutlass.const_expr(n_major) else em  # elements along the contiguous dim
        vec = self._store_vector(em * en, run)
        if cutlass.const_expr(vec > 1):
            self._store_staged_vectors(sD, gD, rows, cols, tidx, run, vec)
        else:
            step = self.tile_threads // run  # lines (rows of C, or columns when M-major) a pass
            lane, line0 = tidx % run, tidx // run
            # This thread's element of every line: one line of sD/gD, walked by `step`.
            s_lane, g_lane, lines, lanes = sD[(None, lane)], gD[(None, lane)], rows, cols
            if cutlass.const_expr(not n_major):
                s_lane, g_lane, lines, lanes = sD[(lane, None)], gD[(lane, None)], cols, rows
            if lane < lanes:
                for i in cutlass.range_constexpr(em * en // self.tile_threads):
                    if line0 + i * step < lines:
                        g_lane[line0 + i * step] = s_lane[line0 + i * step]

    @cute.jit
    def _store_staged_vectors(self, sD, gD, rows, cols, tidx, run: cutlass.Constexpr,
                              vec: cutlass.Constexpr):
        """`_store_staged`, `vec` elements a thread at a time: `run // vec` threads share
        each line (a row of C, or a column when M-major), so a warp's store covers whole
        runs of its lines."""
        em, en = self.store_tile
        n_major = self.c_layout.is_n_major_c()
        per_line = run // vec
        step = self.tile_threads // per_line  # lines a pass
        lane, line0 = tidx % per_line, tidx // per_line
        lines, lanes = rows, cols
        if cutlass.const_expr(not n_major):
            lines, lanes = cols, rows
        first = lane * vec
        if first < lanes:
            for i in cutlass.range_constexpr(em * en // (self.tile_threads * vec)):
                line = line0 + i * step
                if line < lines:
                    s_run, g_run = sD[(line, None)], gD[(line, None)]
                    if cutlass.const_expr(not n_major):
                        s_run, g_run = sD[(None, line)], gD[(None, line)]
                    self._store_run(s_run, g_run, first, lanes - first, vec)

    def _store_vector(self, elements: int, run: int) -> int:
        """Elements one thread stores at once: `c_vector`, halved until the tile's threads
        cover a sub-tile of `elements` in whole passes of lines `run` long."""
        vec = self.c_vector
        while vec > 1 and (run % vec or elements % (self.tile_threads * vec)
                           or self.tile_threads % (run // vec)):
            vec //= 2
        return vec

    @cute.jit
    def _store_run(self, s_run, g_run, first, left, vec: cutlass.Constexpr):
        """Elements first..first + vec - 1 of one staged line to C: one store of `vec`
        elements (C's start and pitch are multiples of its bytes) when all lie inside C,
        else those that do, one by one."""
        vals = cute.make_rmem_tensor((vec,), self.c_dtype)
        cute.autovec_copy(cute.local_tile(s_run, (vec,), (first // vec,)), vals)
        if left >= vec:
            dst = cute.local_tile(g_run, (vec,), (first // vec,))
            ptr = cute.make_ptr(self.c_dtype, dst.iterator.toint(), cute.AddressSpace.gmem,
                                assumed_align=vec * (self.c_dtype.width // 8))
            cute.autovec_copy(vals, cute.make_tensor(ptr, cute.make_layout(vec)))
        else:
            for e in cutlass.range_constexpr(vec):
                if e < left:
                    g_run[first + e] = vals[e]

    @cute.jit
    def _store_rows(self, acc, thr_mma_thread, gC, rows, cols):
        """Round once to the output dtype and store this thread's elements of the first
        `rows` rows and `cols` columns of tile gC straight from the accumulators (a grouped
        tile of a group shorter than BM: a TMA box cannot stop at the group's end)."""
        tCgC = thr_mma_thread.partition_C(gC)
        tCcC = thr_mma_thread.partition_C(
            cute.make_identity_tensor((self.mma_m, self.tile_shape_mnk[1])))
        for i in cutlass.range_constexpr(cute.size(acc)):
            if tCcC[i][0] < rows:
                if tCcC[i][1] < cols:
                    tCgC[i] = acc[i].to(self.c_dtype)  # the single rounding

    def _epilogue_sync(self):
        """The TMA-store pipeline and named barrier of one tile's epilogue threads."""
        c_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_threads))
        barrier = pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER,
                                        num_threads=self.tile_threads)
        return c_pipeline, barrier

    def _epi_tiles(self):
        return (self.mma_m // self.epi_tile[0]) * (self.tile_shape_mnk[1] // self.epi_tile[1])
