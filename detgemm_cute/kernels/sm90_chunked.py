"""The SM90 kernels' chunked chain: the fp32 tier's mainloop (a mixin of `Sm90Base`: it
reads the kernel's pipeline helpers and tile from `self`).

Each k tile is one chunk (six 16-wide steps of the split operands, `split.py`). Its WGMMA
steps run onto a chunk fragment that starts at +0.0; once they retire the fragment is
added to the fp32 accumulator, one IEEE add (round to nearest even) per element, in
ascending chunk order: ``acc = ((+0.0 + c0) + c1) + ...``.

Pipeline (one consumer warpgroup's share of a tile): the chunks go in groups of
`CHUNK_GROUP`, over two chunk fragments (so three accumulator fragments per thread, at most
64 x 128 each: `sm90_limits.SPLIT_TILE_N_MAX`). In a group,

1. chunk 0 is issued onto fragment 0;
2. each next chunk j: wait for its stage, issue it onto fragment j % 2, wait until only it
   is in flight (so chunk j - 1 has retired), add chunk j - 1's fragment to the
   accumulator, release chunk j - 1's stage (the non-persistent kernel's warp 0 refills it);
3. the group's last chunk is waited for and added.

So the adds and the next chunk's issue overlap the tensor cores, and the WGMMA pipe drains
once a group instead of after every chunk. A group ends with nothing in flight: where a
WGMMA stayed in flight across the loop's back edge onto a fragment the loop also reads,
ptxas serialized every WGMMA (warning C7514). The k_tiles % CHUNK_GROUP chunks left over run
one at a time. Every chunk starts at +0.0 and the adds keep their order: the bits of the
one-chunk-at-a-time loop.

Two volatile asm helpers (`wgmma_registers`) hold that schedule: `zero_pinned` writes each
zero a chunk starts from into its own register before the WGMMA fence, and `fence_operands`
pins a fragment's values (an empty asm that reads and writes each register) so a chunk's adds
sit between the wait that retires it and the next chunk's issue. Without them the compiler
copied one zero register into the others after the fence and moved the adds past the next
chunk's WGMMAs; ptxas then serialized the WGMMAs (C7514) or injected waits of its own (C7517).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .wgmma_registers import fence_operands, zero_pinned


# Chunks per group (the module docstring): the WGMMA pipe drains once per group.
CHUNK_GROUP = 8


class ChunkedChain:
    """The chunked mainloop of the SM90 kernels (see the module docstring)."""

    def _chunk_parts(self, thr_mma):
        """The two chunk fragments, shaped as the accumulator."""
        return tuple(cute.make_rmem_tensor(self._acc_shape(thr_mma), self.acc_dtype)
                     for _ in range(2))

    @cute.jit
    def _mainloop_chunked(self, ab_pipeline, read, tiled_mma, acc, parts, tCrA, tCrB, k_tiles,
                          refill):
        """All k tiles (chunks) of one output tile onto `acc`, in order; every stage this tile
        read is released on return (unlike `_mainloop`). `parts`: `_chunk_parts`. `refill`
        as in `_mainloop`. Returns the advanced (read, producer) states."""
        prod = None
        if cutlass.const_expr(refill is not None):
            prod = refill[1]
        release = read.clone()
        for _g in cutlass.range(k_tiles // CHUNK_GROUP, unroll=1):
            read, release, prod = self._chunk_group(ab_pipeline, read, release, prod,
                                                    tiled_mma, acc, parts, tCrA, tCrB,
                                                    k_tiles, refill, CHUNK_GROUP)
        for _k in cutlass.range(k_tiles % CHUNK_GROUP, unroll=1):  # the chunks left over, alone
            read, release, prod = self._chunk_group(ab_pipeline, read, release, prod,
                                                    tiled_mma, acc, parts, tCrA, tCrB,
                                                    k_tiles, refill, 1)
        return read, prod

    @cute.jit
    def _chunk_group(self, ab_pipeline, read, release, prod, tiled_mma, acc, parts, tCrA,
                     tCrB, k_tiles, refill, size: cutlass.Constexpr):
        """`size` consecutive chunks, the fragments taken in turn: each chunk after the first
        is issued before the one before it is added. Nothing is in flight on return."""
        ab_pipeline.consumer_wait(read)
        self._issue_chunk(tiled_mma, parts[0], tCrA, tCrB, read.index)
        read.advance()
        for j in cutlass.range_constexpr(1, size):
            ab_pipeline.consumer_wait(read)
            self._issue_chunk(tiled_mma, parts[j % 2], tCrA, tCrB, read.index)
            read.advance()
            self._retire_chunk(acc, parts[(j - 1) % 2], 1)
            release, prod = self._release_chunk(ab_pipeline, release, prod, k_tiles, refill)
        self._retire_chunk(acc, parts[(size - 1) % 2], 0)
        release, prod = self._release_chunk(ab_pipeline, release, prod, k_tiles, refill)
        return read, release, prod

    @cute.jit
    def _issue_chunk(self, tiled_mma, part, tCrA, tCrB, stage):
        """One chunk's WGMMA steps onto `part`, from +0.0 (committed, not waited for). Each
        zero is written into its own register before the WGMMA fence."""
        zero_pinned(part)
        self._mma_k_tile(tiled_mma, part, tCrA, tCrB, stage)

    @cute.jit
    def _retire_chunk(self, acc, part, in_flight: cutlass.Constexpr):
        """Wait until at most `in_flight` WGMMA groups run (so `part`'s has retired), then
        acc = acc + part: the chain's one fp32 add per element and chunk, pinned between
        the wait and the next chunk's issue."""
        cute.nvgpu.warpgroup.wait_group(in_flight)
        fence_operands(part)
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] + part[i]
        fence_operands(acc)

    @cute.jit
    def _release_chunk(self, ab_pipeline, release, prod, k_tiles, refill):
        """Release the oldest stage still held; the non-persistent kernel's warp 0 reloads
        it at once with the next k tile."""
        ab_pipeline.consumer_release(release)
        release.advance()
        if cutlass.const_expr(refill is not None):
            if refill[0] and prod.count < k_tiles:
                self._load_k_tile(ab_pipeline, prod, *refill[2:])
                prod.advance()
        return release, prod
