"""The producer of A rows TMA cannot address (`a_loads`, persistent SM90 kernels).

A K-major A whose row pitch is not a multiple of 16 bytes (p @ v's softmax rows at an odd
sequence length) has no TMA tensor map. Copying it into padded rows first costs two more
passes over A; instead the producer warpgroup (128 threads) reads A itself:

1. **Raw copy** (cp.async, 16 bytes a copy, no registers held): for each of the tile's BM
   rows, the 16-byte-aligned chunks that cover the row's BK elements of this k tile (9
   chunks for BK = 64 at 16 bits, since the row starts anywhere inside its first chunk)
   land in a raw ring in shared memory, as many k tiles ahead of the one being stored as the
   shared memory left by the stages holds (`raw_stages`, `raw_ahead`). Each copy reads only
   the bytes up to the end of the row's k tile inside A and writes zeros for the rest
   (cp.async's source size): rows past M and elements past K arrive as zeros, and no read
   leaves the 16-byte granules that A's own elements lie in.
2. **Realign**: once a k tile's chunks have landed (cp.async.wait_group, then a barrier of
   the 128 threads), each thread builds 16-byte chunks of the stage: two raw chunks read
   (16 bytes each), shifted by where the row starts inside its first chunk, stored in
   WGMMA's 128-byte-swizzled K-major layout. Every k tile, the last one and a tile's rows
   past M included, takes this path (their zeros came with the copies).
3. The stage is handed to the consumers like a TMA stage: warp 0 has started B's TMA load
   with the stage's transaction count, and every producer thread fences its stores for the
   async proxy (WGMMA) and arrives on the stage's full barrier (1 + 128 arrivals).

Thread t owns chunk c = t % 8 of the tile rows t // 8 + 16 i, in both the copy (plus chunk 8
of row t + 128 j) and the realignment. A row's k tiles lie 128 bytes apart and rows 16 apart
share where they start inside a 16-byte chunk, so the addresses, the shift and the chunk
sizes are worked out once per output tile; a k tile adds 128 bytes to one 64-bit address and
the rows are fixed steps from it (immediate offsets in shared memory).

The consumers are unchanged: the same WGMMA steps in ascending K onto the same accumulators,
so every output element is the chain it is with TMA loads.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import dsl_user_op
from cutlass._mlir.dialects import llvm

from . import sm90_limits
from .sm90_base import WG

RAW_BARRIER = 6  # named barrier of the producer warpgroup (0: CTA, 1: epilogue, 2-5: turns)
CHUNK = 16  # bytes per cp.async, and per chunk of the swizzled stage
ROW_CHUNKS = 8  # chunks of a stage row: BK = 64 at 16 bits, one 128-byte swizzle atom
ROW_BYTES = ROW_CHUNKS * CHUNK


def raw_row_chunks(bk: int, elem_bytes: int) -> int:
    """16-byte chunks that cover BK elements starting anywhere inside the first chunk."""
    return bk * elem_bytes // CHUNK + 1


def raw_stages(tile, stages: int) -> int:
    """Raw k tiles in the ring (those in flight, plus the one being realigned): what the
    shared memory left by the kernel's stages and epilogue holds, 2 to 8. The ring, not the
    stages, carries the latency of A's reads (each slot is one k tile in flight)."""
    return max(sm90_limits.A_ROWS_SLOTS[0], sm90_limits.a_rows_slots(tile, stages))


def raw_ahead(slots: int) -> int:
    """k tiles copied ahead of the one being realigned. With 3 slots or more one slot stays
    between the copies and the realignment: a slot is refilled two k tiles after it was
    realigned, when every thread has passed the barrier that follows the next k tile's
    copies, so that barrier is the only one a k tile needs. With 2 slots, a second barrier
    after the realignment frees the slot for the next copies."""
    return slots - 2 if slots >= 3 else slots - 1


def _cp_async(asm, dst, src, last, loc, ip):
    """One cp.async.cg of 16 bytes: `asm` with the shared byte address `dst`, the global
    byte address `src` (both 16-byte aligned) and the 32-bit operand `last`."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(dst).ir_value(loc=loc, ip=ip), cutlass.Int64(src).ir_value(loc=loc, ip=ip),
         cutlass.Int32(last).ir_value(loc=loc, ip=ip)],
        asm, "r,l,r,~{memory}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cp_async_zfill(dst, src, src_bytes, *, loc=None, ip=None):
    """Copy 16 bytes from global `src` to shared `dst`, of which only the first
    `src_bytes` (0 to 16) are read; the rest are written as zeros."""
    _cp_async("cp.async.cg.shared.global [$0], [$1], 16, $2;", dst, src, src_bytes, loc, ip)


@dsl_user_op
def cp_async_if(dst, src, flag, *, loc=None, ip=None):
    """Copy 16 bytes from global `src` to shared `dst` where `flag` is not 0."""
    _cp_async("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t"
              "@p cp.async.cg.shared.global [$0], [$1], 16;\n\t}", dst, src, flag, loc, ip)


class RowSlots(NamedTuple):
    """One thread's share of an output tile's A rows (see the module doc), for all its k
    tiles: global byte addresses at k tile 0, shared byte addresses in raw slot 0 / stage 0."""

    chunk: object  # Int64: chunk c of row r0 = t // 8
    row_step: object  # Int64: bytes from row r to row r + 16
    lead: object  # Int32: bytes a chunk c copy reads = clamp(lead + the k tile's bytes, 0, 16)
    rows_left: object  # Int32: rows r0 + 16 i inside A are those with 16 i < rows_left
    last_chunk: object  # Int64: chunk 8 of row t
    last_raw: object  # Int32: raw chunk 8 of row t
    last_lead: object  # Int32: as `lead`, for chunk 8 of row t
    rows_here: object  # Int32: the tile's rows inside A
    raw: object  # Int32: raw chunk c of row r0
    # The realignment: row class h (rows r = w + 4 h mod 8 of warp w) of the warp's lane l,
    # chunk l % 8 of the rows w + 4 h + 8 (l // 8) + 32 s; each a pair, one per class.
    word: object  # Int32: the first of the raw chunk pair's words the chunk takes
    bits: object  # Int32: and the bits it is shifted by (0 or 16)
    realign_from: object  # Int32: the raw chunk pair of the class's first row
    realign_to: object  # Int32: its swizzled chunk


class ARowLoads:
    """Mixin of `Sm90GemmPersistent`: the producer path of `a_loads` (see the module doc).
    It takes BK = 64 at 16 bits: one 128-byte swizzle atom per stage row."""

    def _raw_words(self) -> int:
        """32-bit words of the raw ring in shared memory."""
        bm, _, bk = self.tile_shape_mnk
        slots = raw_stages(self.tile_shape_mnk, self.ab_stage)
        return slots * bm * raw_row_chunks(bk, 2) * CHUNK // 4

    @cute.jit
    def _row_slots(self, mA, m0, raw_base, stage_base, tidx):
        """Thread `tidx`'s `RowSlots` for the tile whose first row is `m0` in A's entry `mA`
        (`raw_base`, `stage_base`: shared addresses of the raw ring and of the A stages)."""
        bm, _, bk = self.tile_shape_mnk
        raw_row = raw_row_chunks(bk, self.a_dtype.width // 8) * CHUNK
        c = tidx % ROW_CHUNKS
        r0 = tidx // ROW_CHUNKS
        pitch = cutlass.Int64(cute.crd2idx((1, 0), mA.layout)) * (self.a_dtype.width // 8)
        base = mA.iterator.toint()
        start = base + cutlass.Int64(m0 + r0) * pitch  # rows 16 apart start alike: 16 | 16 pitch
        shift = cutlass.Int32(start & (CHUNK - 1))
        last = base + cutlass.Int64(m0 + tidx) * pitch
        last_shift = cutlass.Int32(last & (CHUNK - 1))
        rows_here = cutlass.min(bm, cute.size(mA, mode=[0]) - m0)
        warp, lane = tidx // 32, tidx % 32
        first = tuple(warp + 4 * h + 8 * (lane // ROW_CHUNKS) for h in range(2))
        # Rows 8 apart start alike (16 | 8 pitch: the pitch is even), so a warp's rows of one
        # class share their shift.
        shifts = tuple(cutlass.Int32((base + cutlass.Int64(m0 + warp + 4 * h) * pitch)
                                     & (CHUNK - 1)) for h in range(2))
        return RowSlots(
            chunk=start - cutlass.Int64(shift) + c * CHUNK, row_step=pitch * 16,
            lead=shift - c * CHUNK, rows_left=rows_here - r0,
            last_chunk=last - cutlass.Int64(last_shift) + ROW_BYTES,
            last_raw=raw_base + tidx * raw_row + ROW_BYTES, last_lead=last_shift - ROW_BYTES,
            rows_here=rows_here, raw=raw_base + r0 * raw_row + c * CHUNK,
            word=tuple(x // 4 for x in shifts), bits=tuple((x % 4) * 8 for x in shifts),
            realign_from=tuple(raw_base + r * raw_row + (lane % ROW_CHUNKS) * CHUNK
                               for r in first),
            realign_to=tuple(stage_base + r * ROW_BYTES
                             + (((lane % ROW_CHUNKS) ^ (warp + 4 * h)) * CHUNK)
                             for h, r in enumerate(first)))

    @cute.jit
    def _issue_raw(self, ts, k_bytes, valid, slot, tidx, full: cutlass.Constexpr):
        """cp.async the k tile that starts `k_bytes` into A's rows (`valid` bytes of it
        inside A, at most 128) into raw slot `slot`: one commit group per call. `full`: the
        tile's rows and the k tile lie inside A, and every copy reads its 16 bytes (chunk
        8 only where the row does not start on 16 bytes); else each copy reads what lies
        inside A of the row's k tile and writes zeros for the rest."""
        bm, _, bk = self.tile_shape_mnk
        raw_row = raw_row_chunks(bk, self.a_dtype.width // 8) * CHUNK
        slot_off = slot * (bm * raw_row)
        src = ts.chunk + k_bytes
        n = cutlass.max(0, cutlass.min(CHUNK, ts.lead + valid))
        for i in cutlass.range_constexpr(bm // 16):
            dst = ts.raw + slot_off + i * 16 * raw_row
            if cutlass.const_expr(full):
                cp_async_if(dst, src + ts.row_step * i, 1)
            else:
                cp_async_zfill(dst, src + ts.row_step * i,
                               cutlass.select_(16 * i < ts.rows_left, n, 0))
        n_last = cutlass.max(0, cutlass.min(CHUNK, ts.last_lead + valid))
        for j in cutlass.range_constexpr(-(-bm // WG)):
            if tidx + j * WG < bm:  # warp-uniform
                dst = ts.last_raw + slot_off + j * WG * raw_row
                last = ts.last_chunk + k_bytes + ts.row_step * (j * WG // 16)
                if cutlass.const_expr(full):
                    cp_async_if(dst, last, ts.last_lead + ROW_BYTES)
                else:
                    cp_async_zfill(dst, last, cutlass.select_(tidx + j * WG < ts.rows_here,
                                                              n_last, 0))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _issue(self, ts, kt, slot, cols, rows_inside, tidx):
        """`_issue_raw` of k tile `kt` (K = `cols`) into raw slot `slot`, `full` where it
        can be."""
        bk = self.tile_shape_mnk[2]
        elem_bytes = self.a_dtype.width // 8
        k_bytes = cutlass.Int64(kt) * (bk * elem_bytes)
        valid = cutlass.min(bk, cols - kt * bk) * elem_bytes
        if rows_inside and valid == bk * elem_bytes:
            self._issue_raw(ts, k_bytes, valid, slot, tidx, True)
        else:
            self._issue_raw(ts, k_bytes, valid, slot, tidx, False)

    @cute.jit
    def _realign(self, ts, slot, stage):
        """Move the k tile in raw slot `slot` into stage `stage`, 16 bytes at a time: for
        each of its two row classes, the thread's chunk of the class's rows (`RowSlots`),
        with the words the class's shift picks known to the code (a branch per class, the
        same for the whole warp)."""
        bm, _, bk = self.tile_shape_mnk
        raw_slot = slot * (bm * raw_row_chunks(bk, 2) * CHUNK)
        stage_off = stage * (bm * ROW_BYTES)
        for h in cutlass.range_constexpr(2):
            src, dst = ts.realign_from[h] + raw_slot, ts.realign_to[h] + stage_off
            q, bits = ts.word[h], ts.bits[h]
            if q == 0:
                self._shift_rows(src, dst, 0, bits)
            elif q == 1:
                self._shift_rows(src, dst, 1, bits)
            elif q == 2:
                self._shift_rows(src, dst, 2, bits)
            else:
                self._shift_rows(src, dst, 3, bits)

    @cute.jit
    def _shift_rows(self, src, dst, word: cutlass.Constexpr, bits):
        """The rows 32 apart from the raw chunk pair at `src` to the stage chunk at `dst`:
        words `word` .. `word` + 4 of the pair, shifted right by `bits` (0 or 16)."""
        bm, _, bk = self.tile_shape_mnk
        raw_row = raw_row_chunks(bk, 2) * CHUNK
        words = cute.make_rmem_tensor((8,), cutlass.Uint32)
        out = cute.make_rmem_tensor((4,), cutlass.Uint32)
        tail = 1 if word == 0 else (2 if word == 1 else 4)  # words of the second chunk read
        for s in cutlass.range_constexpr(bm // 32):
            at = src + s * 32 * raw_row
            cute.autovec_copy(self._smem_words(at), cute.make_tensor(words.iterator,
                                                                     cute.make_layout(4)))
            cute.autovec_copy(self._smem_words(at + CHUNK, tail),
                              cute.make_tensor(words.iterator + 4, cute.make_layout(tail)))
            for w in cutlass.range_constexpr(4):
                pair = ((cutlass.Uint64(words[word + w + 1]) << 32)
                        | cutlass.Uint64(words[word + w]))
                out[w] = cutlass.Uint32(pair >> cutlass.Uint64(bits))
            cute.autovec_copy(out, self._smem_words(dst + s * 32 * ROW_BYTES))

    @cute.jit
    def _smem_words(self, addr, n: cutlass.Constexpr = 4):
        """`n` 32-bit words of shared memory at byte address `addr` (16-byte aligned)."""
        return cute.make_tensor(cute.make_ptr(cutlass.Uint32, addr, cute.AddressSpace.smem,
                                              assumed_align=CHUNK), cute.make_layout(n))

    @cute.jit
    def _produce_tile_rows(self, ab_pipeline, prod, k_tiles, src, place, tBgB_k, tBsB,
                           b_mask, raw_base, stage_base):
        """Stream the k tiles 0, 1, 2, ... of the tile at `place` into the stage ring, A by
        the producer warpgroup's raw copies and realignment, B by warp 0's TMA.

        Per k tile: copy the k tile `ahead` further on into the slot realigned two k tiles
        ago, wait for this k tile's copies, pass a barrier of the 128 threads and realign
        (with 2 slots: into the slot realigned one k tile ago, so another barrier follows
        the realignment; see `raw_ahead`). A barrier at the end of the tile frees its slots
        for the next tile's first copies."""
        bm, _, bk = self.tile_shape_mnk
        tidx, _, _ = cute.arch.thread_idx()
        mA = src.mA_mk[(None, None, place.l_c)]
        cols = cute.size(mA, mode=[1])
        m0 = place.m * bm + place.off_m
        ts = self._row_slots(mA, m0, raw_base, stage_base, tidx)
        rows_inside = m0 + bm <= cute.size(mA, mode=[0])
        n_raw = raw_stages(self.tile_shape_mnk, self.ab_stage)
        ahead = raw_ahead(n_raw)
        for kt in cutlass.range_constexpr(ahead):
            if kt < k_tiles:
                self._issue(ts, kt, kt, cols, rows_inside, tidx)
            else:
                cute.arch.cp_async_commit_group()
        prod.reset_count()
        for kt in cutlass.range(k_tiles, unroll=1):
            slot = kt % n_raw
            ahead_kt = kt + ahead
            if ahead_kt < k_tiles:
                ahead_slot = slot + ahead
                if ahead_slot >= n_raw:
                    ahead_slot = ahead_slot - n_raw
                self._issue(ts, ahead_kt, ahead_slot, cols, rows_inside, tidx)
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
            self._realign(ts, slot, prod.index)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(ab_pipeline.producer_get_barrier(prod))
            if cutlass.const_expr(ahead == n_raw - 1):
                # Every thread is done reading this raw slot before it is refilled.
                cute.arch.barrier(barrier_id=RAW_BARRIER, number_of_threads=WG)
            prod.advance()
        if cutlass.const_expr(ahead < n_raw - 1):
            # The next tile's first copies go to slots 0, 1, ...: every thread is done
            # reading this tile's last slots first.
            cute.arch.barrier(barrier_id=RAW_BARRIER, number_of_threads=WG)
        return prod

    def _raw_views(self, storage):
        """The shared addresses of the raw ring and of the A stages: what
        `_produce_tile_rows` takes after `b_mask`."""
        return storage.sRaw.data_ptr().toint(), storage.sA.data_ptr().toint()
