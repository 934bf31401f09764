"""What the SM90 (TMA + WGMMA) kernel can be built with.

Pure Python on purpose: the registry validates every bucket against these rules when a
YAML file is loaded, long before anything is compiled, so a bad tile is reported with the
file and bucket that declared it instead of failing at first use.
"""

from __future__ import annotations

from . import limits_common

# BM < 64 ("row tiles", for decode): WGMMA still computes 64 rows, but TMA loads only BM
# rows of A, the stages lie BM rows apart (WGMMA's other rows of a stage are the next
# stages' rows, products never stored), and only BM rows are stored, so a stage carries BM
# rows of X instead of a 64-row box that is mostly zero fill.
# BM 256: two consumer warpgroups of 128 rows each (two 64-row WGMMAs per k step); a
# swapped 256-row tile covers 256 weight rows per token tile, the wide tiles cuBLAS runs.
TILE_M = (8, 16, 32, 64, 128, 256)
# A 256-row tile keeps BN fp32 accumulators per consumer thread: BN 192 fits the 232
# registers a consumer gets, BN 208 spilled (ptxas, 2026-11-25). 16-bit operands only.
WIDE_TILE_M = 256
WIDE_TILE_N_MAX = 192
# Widths WGMMA takes (n16..n256) for wave quantization (e.g. 160: 32 N tiles at N=5120): the
# multiples of 16 and, from 72 up, the odd multiples of 8 cuBLAS also runs (88, 104, 152, ...).
# An odd count of 8-row swizzle atoms is sliced per stage from the outer layout
# (`sm90_base._stage`: the DSL 4.8.1 aborts slicing such a composed layout), and the epilogue
# takes 8-column sub-tiles stored with stmatrix .x2 (an .x4 copy spans 16 columns: the cause of
# the wrong bits BN 8 stored on the H100, 2026-11-23). Checked on an H100 (2026-11-28,
# tests/test_gpu_tile_shapes.py `ODD8`; bench/results/fwd-odd8-ab_*).
TILE_N = (16, 32, 48, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184,
          192, 200, 208, 216, 224, 232, 240, 248, 256)
TILE_K = (64, 128)
# The ops an odd-multiple-of-8 width serves (the GEMM kernels the GPU tests checked with them;
# bmm and the grouped kernels keep multiples of 16), on 16-bit operands and BM >= 64.
ODD_WIDTH_OPS = ("fwd", "dx", "dw")
# The fp32 tier (split.py: 16-bit parts, chunked chain): a k tile is one chunk of six 16-wide
# steps (one 32-wide block of the original K in fwd/dX, one 16-wide block in dW); BK is
# fixed because it is part of the bits.
SPLIT_TILE_K = 96
# Chunked tiles keep three accumulator fragments (the sum and two chunks, `sm90_chunked`) per
# thread: at most 64 x 128 per consumer warpgroup, so BN <= 128 and BM 128 runs on two
# warpgroups.
SPLIT_TILE_N_MAX = 128
# tf32 (fp32 operands read as TF32 by TMA and WGMMA, k8 steps): BK counts fp32 elements, so
# 32 is one 128-byte swizzle row, as BK 64 is for 16-bit operands; both operands K-major.
TF32_TILE_K = (32, 64)
TF32_BYTES = 4
# Clusters multicast the shared operand: a tile's A goes to the CN CTAs of its cluster row,
# its B to the CM CTAs of its column (4 x 1 shares one token tile among four weight tiles).
# Up to 8 CTAs (4 x 2, 2 x 4): the most a GPC holds portably; cuBLAS runs mid-M narrow
# GEMMs on such clusters (64x128 tiles, 4 x 2), which cut the L2 traffic per CTA.
CLUSTER_DIMS = (1, 2, 4)
MAX_CLUSTER_SIZE = 8
STAGES = (2, 16)  # inclusive
SMEM_BYTES = 232448  # 227 KiB usable per CTA on sm_90
BARRIER_BYTES = 1024
IN_BYTES = 2  # bf16 / fp16 operands
EPI_BYTES_PER_ROWCOL = 8  # 4 stages of 16-bit output or 2 stages of fp32: same smem


GROUPED = True  # the grouped (mixture-of-experts) kernel exists in this family
# Outputs whose rows TMA cannot store are stored by the tile's threads (tiles of BM >= 64,
# no ping-pong: `gemm.stores_direct`), so a bmm bucket may name a `direct` kernel for them.
DIRECT_STORE = True
# Grouped kernels keep each group's first tile index in shared memory (groups + 2 int32, the
# rows past the last group counted as one more group), next to the stage barriers (at most
# 16 stages x 16 bytes) in the 1 KiB before the 1024-byte-aligned A stages.
GROUPED_MAX_GROUPS = (BARRIER_BYTES - STAGES[1] * 16) // 4 - 2


def epi_stages(out_bytes: int, cols: int = 32) -> int:
    """Epilogue staging buffers: a fixed byte budget, so fp32 outputs get half the stages,
    and sub-tiles wider than 32 columns (a direct kernel's) fewer again, in the bytes of 32."""
    stages = EPI_BYTES_PER_ROWCOL // out_bytes
    return max(1, stages * 32 // cols) if cols > 32 else stages


def mma_rows(tile_m: int) -> int:
    """Rows WGMMA computes per tile: BM, or 64 for a row tile (BM < 64)."""
    return max(64, tile_m)


def epilogue_tile(tile_m: int, tile_n: int, chunked: bool = False,
                  pingpong: bool = False, direct_vector: int = 1) -> tuple[int, int]:
    """Sub-tile the epilogue stages through shared memory (rows, cols): rows of the
    accumulator (64 or 128), and the wider of 32/16 columns that divides BN. A kernel whose
    threads store C `direct_vector` > 1 elements at a time (`Sm90Base.c_vector`) takes
    sub-tiles of 32 x that many columns where BN allows: each warp's store then covers one
    run of one row (256 bytes with 8-byte stores), which measured fastest on an H100
    (bench/results/vector-store-ab_*)."""
    m = mma_rows(tile_m)
    two = warpgroups(tile_m, tile_n, chunked, pingpong) == 2
    rows = min(128, m) if two else min(64, m)
    wide = (32 * direct_vector, 16 * direct_vector) if direct_vector > 1 else ()
    cols = next(c for c in (*wide, 32, 16, 8) if tile_n % c == 0)
    return rows, cols


def warpgroups(tile_m: int, tile_n: int, chunked: bool = False, pingpong: bool = False) -> int:
    """Warpgroups that compute one tile. Wide tiles are split over two along M to avoid
    register spills; a chunked tile holds two fragments, so it splits from BN 128 down; a
    256-row tile always runs on two (128 rows each). In ping-pong one warpgroup runs a whole
    tile (so BN is capped, `PINGPONG_TILE_N_MAX`)."""
    two = tile_m > 128 or (tile_m > 64 and (chunked or tile_n > 128))
    return 2 if two and not pingpong else 1


# Ping-pong (two consumer warpgroups on alternate tiles, one warpgroup per tile): one
# warpgroup holds a BM x BN fp32 accumulator, BN registers per thread at BM 128, so BN is
# capped where the fragment still fits next to the mainloop's registers.
PINGPONG_TILE_M = (64, 128)
PINGPONG_TILE_N_MAX = {64: 256, 128: 192}


def reads_a_in_registers(tile_m: int, pingpong: bool) -> bool:
    """Whether a TF32 tile takes an M-major A through registers (`Sm90Base.a_regs`) well:
    BM >= 64 (a row tile reads A K-major only), and not a 128-row ping-pong tile, whose one
    warpgroup holds the whole accumulator: with A's registers beside it ptxas serializes the
    WGMMAs (warning C7512, 128 x 192 on 2026-11-28)."""
    return tile_m >= 64 and not (pingpong and tile_m > 64)


def smem_bytes(tile: tuple[int, int, int], stages: int, pingpong: bool = False,
               in_bytes: int = IN_BYTES) -> int:
    """Shared memory the kernel allocates: A/B stages, barriers, and the epilogue staging
    buffer (its own region of the same size for every output dtype). `in_bytes`: 2 for
    16-bit operands (and the fp32 tier's parts), 4 for tf32."""
    bm, bn, bk = tile
    er, ec = epilogue_tile(bm, bn, bk == SPLIT_TILE_K, pingpong)
    # A row tile's stages are BM rows apart; WGMMA reads 64 from each (the last one's reach
    # past the stages: mma_rows - BM rows of slack).
    a_rows = stages * bm + mma_rows(bm) - bm
    return ((a_rows + stages * bn) * bk * in_bytes + BARRIER_BYTES
            + EPI_BYTES_PER_ROWCOL * er * ec)


# `a_loads` (a K-major A whose rows TMA cannot address, read by the producer warpgroup,
# `sm90_a_rows`): its raw ring holds k tiles of BM rows of BK / 8 + 1 16-byte chunks (BK
# elements from anywhere in the first chunk) in the shared memory the stages and the
# epilogue leave, minus 2 KiB of alignment; it needs 2 slots and uses at most 8.
A_ROWS_MAX_STAGES = 3
A_ROWS_SLOTS = (2, 8)


def a_rows_slots(tile: tuple[int, int, int], stages: int) -> int:
    """Slots of A's raw ring that fit beside `stages` stages of `tile` (may be < 2)."""
    bm, _, bk = tile
    free = SMEM_BYTES - smem_bytes(tile, stages) - 2048
    return min(A_ROWS_SLOTS[1], free // (bm * (bk * IN_BYTES // 16 + 1) * 16))


def a_rows_stages(tile: tuple[int, int, int], stages: int) -> int:
    """Stages of `tile`'s `a_loads` kernel: the most, up to `stages` and A_ROWS_MAX_STAGES
    (the ring, not the stages, carries A's read latency), beside which the raw ring gets
    its 2 slots; 0 where none do (such a tile stages A in padded rows instead). A 256 x 128
    tile at 3 stages leaves 1 slot's room (its launch asked for 249 KiB), at 2 it fits."""
    for s in range(min(stages, A_ROWS_MAX_STAGES), STAGES[0] - 1, -1):
        if a_rows_slots(tile, s) >= A_ROWS_SLOTS[0]:
            return s
    return 0


def max_stages(tile: tuple[int, int, int], pingpong: bool = False,
               in_bytes: int = IN_BYTES) -> int:
    return limits_common.max_stages(tile, lambda t, s: smem_bytes(t, s, pingpong, in_bytes),
                                    STAGES, SMEM_BYTES)


# Extra bucket keys `detgemm-cute tune` tries (first value = the default).
TUNE_OPTIONS = {"pingpong": (False, True), "swap_ab": (False, True)}
# The option that swaps operands (C^T = B A^T): tune ranks its tiles on (N, M).
SWAP_KEY = "swap_ab"


def check_config(tile, cluster, stages, persistent, dtypes=(), pingpong=False,
                 swap_ab=False, raster_n=False) -> list[tuple[str, str]]:
    """Return a list of (field, message) problems; empty when the kernel can be built."""
    split, tf32 = "fp32" in dtypes, "tf32" in dtypes
    dtype_problems = limits_common.fp32_tier_dtype_problems(dtypes)
    if dtype_problems:
        return dtype_problems
    tile_n = tuple(n for n in TILE_N if n <= SPLIT_TILE_N_MAX) if split else TILE_N
    tile_k = (SPLIT_TILE_K,) if split else TF32_TILE_K if tf32 else TILE_K
    tile_m = tuple(m for m in TILE_M if 64 <= m < WIDE_TILE_M) if split else TILE_M
    in_bytes = TF32_BYTES if tf32 else IN_BYTES
    problems = limits_common.tile_and_stage_problems(
        tile, stages, (tile_m, tile_n, tile_k), STAGES,
        lambda t, s: smem_bytes(t, s, pingpong is True, in_bytes), SMEM_BYTES)
    if not problems and tile[0] == WIDE_TILE_M:
        if tile[1] > WIDE_TILE_N_MAX:
            problems.append(("tile", f"a {WIDE_TILE_M}-row tile keeps BN accumulators per "
                                     f"thread: BN <= {WIDE_TILE_N_MAX}, got {tile[1]}"))
        if tf32:
            problems.append(("tile", f"BM {WIDE_TILE_M} is for 16-bit operands; tf32 buckets "
                                     f"take BM <= 128"))
    if not problems and tile[1] % 16 and (split or tf32 or tile[0] < 64):
        problems.append(("tile", f"BN {tile[1]} (an odd multiple of 8) needs 16-bit operands "
                                 f"and BM >= 64; use a multiple of 16"))
    if not problems and tile[0] == 8 and tile[1] % 32:
        # Measured on an H100 (2026-11-23): BM 8 with a 16-column epilogue sub-tile stored
        # wrong rows once a problem had more than one row tile; BM 16/32 and BN % 32 == 0
        # were right. Refused until that is understood; BM 16 is as fast there.
        problems.append(("tile", f"a BM 8 row tile needs BN a multiple of 32, got {tile[1]}; "
                                 f"use BM 16 for narrower N tiles"))
    cm, cn = cluster
    if cm not in CLUSTER_DIMS or cn not in CLUSTER_DIMS or cm * cn > MAX_CLUSTER_SIZE:
        problems.append(
            ("cluster", f"cluster must be [m, n] with each in {CLUSTER_DIMS} and m*n <= "
                        f"{MAX_CLUSTER_SIZE}, got {[cm, cn]}"))
    if persistent not in (False, True):
        problems.append(("persistent", f"persistent must be true or false, got {persistent!r}"))
    problems += _pingpong_problems(tile, persistent, split, pingpong)
    if raster_n is not False:
        if raster_n is not True:
            problems.append(("raster_n", f"raster_n must be true or false, got {raster_n!r}"))
        elif persistent is not True:
            problems.append(("raster_n", "raster_n orders the persistent schedule: set "
                                         "persistent: true"))
    if swap_ab is not False:
        if swap_ab is not True:
            problems.append(("swap_ab", f"swap_ab must be true or false, got {swap_ab!r}"))
        elif split:
            problems.append(("swap_ab", "fp32 (split) buckets do not swap operands"))
        elif tile[0] < 64:
            problems.append(("swap_ab", f"swapped operands put the caller's N on the tile's "
                                        f"M: row tiles (BM < 64) are for small M, got BM "
                                        f"{tile[0]}"))
    return problems


def _pingpong_problems(tile, persistent, split, pingpong) -> list[tuple[str, str]]:
    if pingpong is False:
        return []
    if pingpong is not True:
        return [("pingpong", f"pingpong must be true or false, got {pingpong!r}")]
    if persistent is not True:
        return [("pingpong", "the ping-pong kernel is persistent: set persistent: true")]
    if split:
        return [("pingpong", "fp32 (split) buckets have no ping-pong kernel")]
    bm, bn, _ = tile
    if bm not in PINGPONG_TILE_M:
        return [("tile", f"ping-pong needs BM in {PINGPONG_TILE_M}, got {bm}")]
    if bn > PINGPONG_TILE_N_MAX[bm]:
        return [("tile", f"ping-pong runs a tile on one warpgroup: BN <= "
                         f"{PINGPONG_TILE_N_MAX[bm]} at BM {bm}, got {bn}")]
    return []
