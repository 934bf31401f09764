"""What the SM80 (cp.async + ldmatrix + mma.sync) kernel can be built with.

Pure Python on purpose, like `sm90_limits`: the registry checks every bucket of an sm80
table against these rules when the YAML file is loaded, before anything is compiled.

Shared memory holds `stages` copies of the A and B tiles and nothing else (the epilogue
stores from registers), so the bound is plain arithmetic. 166912 bytes (163 KiB) is what one
block may use on an A100; an H100 running this family allows more, but the tables must fit
the smallest GPU of the family.
"""

from __future__ import annotations

from . import limits_common

TILE_M = (64, 128)
TILE_N = (16, 32, 64, 128, 256)
TILE_K = (32, 64)
# The fp32 tier (split.py), as on SM90: split parts run the chunked chain with one 96-wide
# chunk per k tile (BK is part of the bits); a chunked tile holds two accumulator fragments,
# so at most SPLIT_ACC_PER_THREAD fp32 values of each per thread.
SPLIT_TILE_K = 96
SPLIT_ACC_PER_THREAD = 64
# tf32: fp32 operands (both K-major) in shared memory, BK counts fp32 elements.
TF32_TILE_K = (32, 64)
TF32_BYTES = 4
STAGES = (2, 8)  # inclusive
SMEM_BYTES = 166912  # 163 KiB usable per block on sm_80 (A100)
IN_BYTES = 2  # bf16 / fp16 operands (and the fp32 tier's parts)
SMEM_ALIGN = 1024  # each operand's buffer starts on this boundary


def warp_layout(tile_m: int, tile_n: int) -> tuple[int, int]:
    """Warps along (M, N). Each warp owns a (tile_m / wm) x (tile_n / wn) block of C and
    walks it in 16x8 mma.sync steps; N per warp is a multiple of 16 so B fragments load
    with one four-matrix ldmatrix."""
    if tile_n == 16:
        return 4, 1
    if tile_n >= 256:
        return 2, 4
    return 2, 2


def threads(tile_m: int, tile_n: int) -> int:
    wm, wn = warp_layout(tile_m, tile_n)
    return 32 * wm * wn


def smem_bytes(tile: tuple[int, int, int], stages: int, in_bytes: int = IN_BYTES) -> int:
    """Shared memory the kernel allocates: `stages` A tiles and B tiles, each buffer aligned
    (`in_bytes`: 2 for 16-bit operands and split parts, 4 for tf32)."""
    bm, bn, bk = tile

    def aligned(n: int) -> int:
        return -(-n // SMEM_ALIGN) * SMEM_ALIGN

    return aligned(stages * bm * bk * in_bytes) + aligned(stages * bn * bk * in_bytes)


def max_stages(tile: tuple[int, int, int], in_bytes: int = IN_BYTES) -> int:
    return limits_common.max_stages(tile, lambda t, s: smem_bytes(t, s, in_bytes), STAGES,
                                    SMEM_BYTES)


def check_config(tile, cluster, stages, persistent, dtypes=(), pingpong=False,
                 swap_ab=False, raster_n=False) -> list[tuple[str, str]]:
    """Return a list of (field, message) problems; empty when the kernel can be built."""
    split, tf32 = "fp32" in dtypes, "tf32" in dtypes
    dtype_problems = limits_common.fp32_tier_dtype_problems(dtypes)
    if dtype_problems:
        return dtype_problems
    tile_k = (SPLIT_TILE_K,) if split else TF32_TILE_K if tf32 else TILE_K
    in_bytes = TF32_BYTES if tf32 else IN_BYTES
    problems = limits_common.tile_and_stage_problems(
        tile, stages, (TILE_M, TILE_N, tile_k), STAGES,
        lambda t, s: smem_bytes(t, s, in_bytes), SMEM_BYTES)
    if split and not problems and tile[0] * tile[1] // threads(tile[0], tile[1]) > \
            SPLIT_ACC_PER_THREAD:
        problems.append(("tile", f"a chunked (fp32) tile keeps two fp32 fragments per thread: "
                                 f"at most {SPLIT_ACC_PER_THREAD} values each, got "
                                 f"{tile[0] * tile[1] // threads(tile[0], tile[1])} for tile "
                                 f"{list(tile)}"))
    if tuple(cluster) != (1, 1):
        problems.append(("cluster", f"the sm80 kernel has no thread block clusters: cluster "
                                    f"must be [1, 1], got {list(cluster)}"))
    if persistent is True:
        problems.append(("persistent", "the sm80 kernel has no persistent variant: "
                                       "persistent must be false"))
    elif persistent is not False:
        problems.append(("persistent", f"persistent must be true or false, got {persistent!r}"))
    if pingpong is not False:
        problems.append(("pingpong", "the sm80 kernel has no ping-pong variant: pingpong "
                                     "must be false"))
    if swap_ab is not False:
        problems.append(("swap_ab", "the sm80 family does not swap operands: swap_ab must "
                                    "be false"))
    if raster_n is not False:
        problems.append(("raster_n", "the sm80 kernel has no persistent schedule: raster_n "
                                     "must be false"))
    return problems
