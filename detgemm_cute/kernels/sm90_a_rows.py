"""The producer of A rows TMA cannot address (`a_loads`, persistent SM90 kernels).

A K-major A whose row pitch is not a multiple of 16 bytes (p @ v's softmax rows at an odd
sequence length) has no TMA tensor map. Copying it into padded rows first costs two more
passes over A; instead the producer warpgroup (128 threads) reads A itself:

1. **Raw copy** (cp.async, 16 bytes a copy, no registers held): for each of the tile's BM
   rows, the 16-byte-aligned chunks that cover the row's BK elements of this k tile (9
   chunks for BK = 64 at 16 bits, since the row starts anywhere inside its first chunk)
   land in a raw ring in shared memory, as many k tiles ahead of the one being stored as the
   shared memory left by the stages holds (`raw_stages`). A chunk is copied only where it
   holds an element of the row inside A, so no read leaves the 16-byte granules that A's
   own elements lie in.
2. **Realign**: once a k tile's chunks have landed (cp.async.wait_group, then a barrier of
   the 128 threads), each thread builds 16-byte chunks of the stage: two raw chunks read
   (16 bytes each), shifted by where the row starts inside its first chunk, stored in
   WGMMA's 128-byte-swizzled K-major layout. The k tile that reaches past K (and a tile
   with rows past M) is moved element by element instead, with zeros past M or K (exact
   zero products: the chain does not change).
3. The stage is handed to the consumers like a TMA stage: warp 0 has started B's TMA load
   with the stage's transaction count, and every producer thread fences its stores for the
   async proxy (WGMMA) and arrives on the stage's full barrier (1 + 128 arrivals).

The consumers are unchanged: the same WGMMA steps in ascending K onto the same accumulators,
so every output element is the chain it is with TMA loads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from . import sm90_limits
from .sm90_base import WG

RAW_BARRIER = 6  # named barrier of the producer warpgroup (0: CTA, 1: epilogue, 2-5: turns)
CHUNK = 16  # bytes per cp.async, and per chunk of the swizzled stage


def raw_row_chunks(bk: int, elem_bytes: int) -> int:
    """16-byte chunks that cover BK elements starting anywhere inside the first chunk."""
    return bk * elem_bytes // CHUNK + 1


def raw_stages(tile, stages: int) -> int:
    """Raw k tiles in the ring (those in flight, plus the one being realigned): what the
    shared memory left by the kernel's stages and epilogue holds, 2 to 8. The ring, not the
    stages, carries the latency of A's reads (each slot is one k tile in flight)."""
    bm, _, bk = tile
    free = sm90_limits.SMEM_BYTES - sm90_limits.smem_bytes(tile, stages) - 2048  # alignment
    return max(2, min(8, free // (bm * raw_row_chunks(bk, 2) * CHUNK)))


class ARowLoads:
    """Mixin of `Sm90GemmPersistent`: the producer path of `a_loads` (see the module doc).
    It takes BK = 64 at 16 bits: one 128-byte swizzle atom per stage row."""

    def _raw_words(self) -> int:
        """32-bit words of the raw ring in shared memory."""
        bm, _, bk = self.tile_shape_mnk
        slots = raw_stages(self.tile_shape_mnk, self.ab_stage)
        return slots * bm * raw_row_chunks(bk, 2) * CHUNK // 4

    @cute.jit
    def _row_start(self, mA, row, k0):
        """Byte address of element (row, k0) of A's entry `mA` (row clamped into A)."""
        last_row = cute.size(mA, mode=[0]) - 1
        off = cute.crd2idx((cutlass.min(row, last_row), k0), mA.layout)
        return mA.iterator.toint() + cutlass.Int64(off) * (self.a_dtype.width // 8)

    @cute.jit
    def _issue_raw(self, mA, raw, place, kt, slot, tidx):
        """cp.async the chunks of A's k tile `kt` (tile at `place`) into raw slot `slot`:
        chunk j of tile row r at raw[(word, j, r, slot)]; one commit group per call."""
        bm, _, bk = self.tile_shape_mnk
        chunks = raw_row_chunks(bk, self.a_dtype.width // 8)
        rows = cute.size(mA, mode=[0])
        cols = cute.size(mA, mode=[1])
        m0 = place.m * bm + place.off_m
        k0 = kt * bk
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            cutlass.Int32, num_bits_per_copy=128)
        valid_bytes = cutlass.Int64(cutlass.min(bk, cols - k0) * (self.a_dtype.width // 8))
        for q in cutlass.range_constexpr(-(-bm * chunks // WG)):
            idx = tidx + q * WG
            r = idx // chunks
            j = idx - r * chunks
            if idx < bm * chunks and m0 + r < rows:
                start = self._row_start(mA, m0 + r, k0)
                chunk = (start & ~cutlass.Int64(CHUNK - 1)) + j * CHUNK
                if chunk < start + valid_bytes:
                    src = cute.make_tensor(
                        cute.make_ptr(cutlass.Int32, chunk, cute.AddressSpace.gmem,
                                      assumed_align=CHUNK), cute.make_layout(4))
                    cute.copy(atom, src, raw[(None, j, r, slot)])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _realign(self, mA, raw_base, stage_base, place, kt, slot, stage, tidx):
        """Move A's k tile `kt` from raw slot `slot` into stage `stage`, 16 bytes at a time:
        thread t builds chunk t % 8 of rows t // 8, t // 8 + 16, ... (`raw_base`,
        `stage_base`: shared addresses of the raw ring and of the A stages)."""
        bm, _, bk = self.tile_shape_mnk
        raw_row = raw_row_chunks(bk, 2) * CHUNK
        m0 = place.m * bm + place.off_m
        k0 = kt * bk
        c = tidx % 8
        words = cute.make_rmem_tensor((8,), cutlass.Uint32)
        out = cute.make_rmem_tensor((4,), cutlass.Uint32)
        for i in cutlass.range_constexpr(bm // 16):
            r = tidx // 8 + 16 * i
            shift = cutlass.Int32(self._row_start(mA, m0 + r, k0) & (CHUNK - 1))
            src = raw_base + (slot * bm + r) * raw_row + c * CHUNK
            for h in cutlass.range_constexpr(2):  # raw chunks c and c + 1
                cute.autovec_copy(self._smem_words(src + h * CHUNK),
                                  cute.make_tensor(words.iterator + h * 4, cute.make_layout(4)))
            q = shift // 4
            bits = (shift % 4) * 8
            for w in cutlass.range_constexpr(4):
                lo = cutlass.select_(q == 0, words[w], cutlass.select_(
                    q == 1, words[w + 1], cutlass.select_(q == 2, words[w + 2], words[w + 3])))
                hi = cutlass.select_(q == 0, words[w + 1], cutlass.select_(
                    q == 1, words[w + 2], cutlass.select_(q == 2, words[w + 3], words[w + 4])))
                pair = (cutlass.Uint64(hi) << 32) | cutlass.Uint64(lo)
                out[w] = cutlass.Uint32(pair >> cutlass.Uint64(bits))
            # 128-byte swizzle: row r's chunk c sits at chunk c ^ (r % 8) of its 128 bytes.
            dst = stage_base + (stage * bm + r) * 128 + ((c ^ (r % 8)) * CHUNK)
            cute.autovec_copy(out, self._smem_words(dst))

    @cute.jit
    def _smem_words(self, addr):
        """Four 32-bit words of shared memory at byte address `addr` (16-byte aligned)."""
        return cute.make_tensor(cute.make_ptr(cutlass.Uint32, addr, cute.AddressSpace.smem,
                                              assumed_align=CHUNK), cute.make_layout(4))

    @cute.jit
    def _realign_edge(self, mA, raw_elems, sA, place, kt, slot, stage, tidx):
        """`_realign` for the k tile that reaches past K or rows past M: element by
        element, each warp BM/4 rows, zeros past M or K."""
        bm, _, bk = self.tile_shape_mnk
        elem_bytes = self.a_dtype.width // 8
        row_elems = raw_row_chunks(bk, elem_bytes) * CHUNK // elem_bytes
        last_row = cute.size(mA, mode=[0]) - 1
        last_col = cute.size(mA, mode=[1]) - 1
        m0 = place.m * bm + place.off_m
        k0 = kt * bk
        lane, warp = tidx % 32, tidx // 32
        per_warp = bm // 4
        zero = self.a_dtype(0.0)
        for i in cutlass.range_constexpr(per_warp):
            r = warp * per_warp + i
            row = m0 + r
            shift = cutlass.Int32((self._row_start(mA, row, k0) & (CHUNK - 1)) // elem_bytes)
            base = (slot * bm + r) * row_elems + shift
            for j in cutlass.range_constexpr(bk // 32):
                col = lane + 32 * j
                v = raw_elems[base + col]
                # Both differences are >= 0 (their OR's sign bit clear) inside A.
                inside = ((last_row - row) | (last_col - (k0 + col))) >= 0
                sA[(r, col, stage)] = self.a_dtype(cutlass.select_(inside, v, zero))

    @cute.jit
    def _produce_tile_rows(self, ab_pipeline, prod, k_tiles, src, place, tBgB_k, tBsB,
                           b_mask, raw, raw_elems, raw_base, stage_base):
        """Stream the k tiles 0, 1, 2, ... of the tile at `place` into the stage ring, A by
        the producer warpgroup's raw copies and realignment, B by warp 0's TMA.

        Per k tile: refill the slot the previous k tile was realigned from with the k tile `ahead`
        further on, wait for this k tile's raw copies, pass a barrier of the 128 threads,
        realign, and pass another (every thread is done with the slot before its refill)."""
        bm, _, bk = self.tile_shape_mnk
        tidx, _, _ = cute.arch.thread_idx()
        mA = src.mA_mk[(None, None, place.l_c)]
        m0 = place.m * bm + place.off_m
        rows_inside = m0 + bm <= cute.size(mA, mode=[0])
        n_raw = raw_stages(self.tile_shape_mnk, self.ab_stage)
        ahead = n_raw - 1
        for kt in cutlass.range_constexpr(ahead):
            if kt < k_tiles:
                self._issue_raw(mA, raw, place, kt, kt, tidx)
            else:
                cute.arch.cp_async_commit_group()
        prod.reset_count()
        for kt in cutlass.range(k_tiles, unroll=1):
            if kt + ahead < k_tiles:
                self._issue_raw(mA, raw, place, kt + ahead, (kt + ahead) % n_raw, tidx)
            else:
                cute.arch.cp_async_commit_group()  # keep one group per k tile
            cute.arch.cp_async_wait_group(ahead)
            cute.arch.barrier(barrier_id=RAW_BARRIER, number_of_threads=WG)
            if tidx < 32:
                ab_pipeline.producer_acquire(prod)
                cute.copy(src.atom_b, tBgB_k[(None, prod.count)], tBsB[(None, prod.index)],
                          tma_bar_ptr=ab_pipeline.producer_get_barrier(prod),
                          mcast_mask=b_mask)
            else:
                ab_pipeline.sync_object_empty.wait(prod.index, prod.phase)
            if rows_inside and (kt + 1) * bk <= cute.size(mA, mode=[1]):
                self._realign(mA, raw_base, stage_base, place, kt, kt % n_raw, prod.index,
                              tidx)
            else:
                self._realign_edge(mA, raw_elems, src.sA_load, place, kt, kt % n_raw,
                                   prod.index, tidx)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(ab_pipeline.producer_get_barrier(prod))
            # Every thread is done reading this raw slot before it is refilled.
            cute.arch.barrier(barrier_id=RAW_BARRIER, number_of_threads=WG)
            prod.advance()
        return prod

    def _raw_views(self, storage):
        """The raw ring as (4 words, chunk, row, slot) and as A's elements, and the shared
        addresses of the ring and of the A stages: what `_produce_tile_rows` takes."""
        bm, _, bk = self.tile_shape_mnk
        chunks = raw_row_chunks(bk, self.a_dtype.width // 8)
        slots = raw_stages(self.tile_shape_mnk, self.ab_stage)
        words = storage.sRaw.get_tensor(cute.make_layout(
            (4, chunks, bm, slots), stride=(1, 4, 4 * chunks, 4 * chunks * bm)))
        ring_words = 4 * chunks * bm * slots
        elems = cute.make_tensor(cute.recast_ptr(storage.sRaw.data_ptr(), dtype=self.a_dtype),
                                 cute.make_layout(ring_words * 32 // self.a_dtype.width))
        return (words, elems, storage.sRaw.data_ptr().toint(),
                storage.sA.data_ptr().toint())
