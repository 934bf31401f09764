"""Bucket checks shared by the kernel families' limits modules: allowed tile dimensions,
a stage range, and a shared-memory budget. Pure Python (run when a YAML file is loaded)."""

from __future__ import annotations


def config_label(tile, cluster, stages: int, persistent: bool) -> str:
    """128x256x64_c1x2_s4_p: the kernel configuration in names (bucket alternatives, tune
    candidates); options follow as suffixes in each caller's own form."""
    return (f"{'x'.join(map(str, tile))}_c{'x'.join(map(str, cluster))}"
            f"_s{stages}{'_p' if persistent else ''}")


def max_stages(tile, smem_bytes, stage_range, smem_limit) -> int:
    """The most stages of `tile` that fit `smem_limit` (below the range's low end: none)."""
    lo, hi = stage_range
    s = hi
    while s >= lo and smem_bytes(tile, s) > smem_limit:
        s -= 1
    return s


def tile_and_stage_problems(tile, stages, allowed, stage_range, smem_bytes,
                            smem_limit) -> list[tuple[str, str]]:
    """(field, message) for a tile dimension outside `allowed` (per M, N, K), a stage count
    outside `stage_range`, or stages that do not fit the shared-memory budget."""
    problems: list[tuple[str, str]] = []
    for dim, value, options in zip("MNK", tile, allowed):
        if value not in options:
            problems.append(("tile", f"tile {dim} must be one of {options}, got {value}"))
    lo, hi = stage_range
    if not (lo <= stages <= hi):
        problems.append(("stages", f"stages must be in [{lo}, {hi}], got {stages}"))
    elif not problems and smem_bytes(tile, stages) > smem_limit:
        problems.append(
            ("stages", f"{stages} stages of tile {list(tile)} need {smem_bytes(tile, stages)} "
                       f"bytes of shared memory, more than {smem_limit}; at most "
                       f"{max_stages(tile, smem_bytes, stage_range, smem_limit)} stages fit"))
    return problems


def fp32_tier_dtype_problems(dtypes) -> list[tuple[str, str]]:
    """fp32 (split, chunked) and tf32 buckets follow their own tile rules, so they must list
    that dtype alone."""
    for name, rules in (("fp32", "the split (chunked) kernel"), ("tf32", "TF32 operands")):
        if name in dtypes and len(dtypes) > 1:
            return [("dtypes", f"{name} buckets run {rules} with its own tile rules: list "
                               f"{name} alone, got {list(dtypes)}")]
    return []
