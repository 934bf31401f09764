"""Candidate bucket configurations for one GEMM, from the kernel family's limits.

The allowed values (BM in TILE_M, BN in TILE_N, BK in TILE_K, clusters, stage range,
shared-memory budget) are read from the family's limits module (`kernels/sm90_limits.py`,
`kernels/sm80_limits.py`) when the list is built, so a new tile width there becomes a
candidate without a change here. A limits module may also declare `TUNE_OPTIONS = {key:
(default, other, ...)}` for extra bucket keys; `--option key=v1,v2` does the same from the
command line. Extra keys are copied into the candidate buckets as they are.

How the list is built, for a GEMM of M rows, N columns and reduction K on a GPU of S SMs
(plain arithmetic; the constants in `Machine` rank tiles, they are not speed claims):

1. Every tile shape (BM, BN) gets a predicted time:
     tiles     = ceil(M / BM) * ceil(N / BN)
     per k     = max(2 * R * BN / F,                  MMA work (R = rows the MMA computes:
                                                      BM, or 64 for row tiles)
                     2 * (BM + BN) / B,               operand bytes fed to the SM
                     (R / 64) * (2 * 64 + 2 * BN) / Q) shared-memory reads of each 64-row MMA
     per tile  = K * per k + out_bytes * BM * BN / B
     waves     = ceil(tiles / S)
     compute   = waves * per tile
     predicted = max(compute, unique bytes / DRAM bytes per us)
   F, B, Q: MMA flops, fed bytes and shared-memory bytes per us of one SM (`Machine`). That is
   DeepGEMM's wave arithmetic (number of waves, last-wave utilisation) with a per-tile cost:
   a tile that leaves most SMs idle in its last wave, pads M or N a lot, or is too thin to
   keep the MMA busy ranks low. Ties (e.g. every decode tiling sits on the DRAM bound) are
   broken by `compute`, then by the larger tile.
2. Tile shapes are kept best first, at most 2 with the same BM: the first `min_tiles` (4)
   whatever their prediction (the model is rough; timing decides), then more while within
   `slack` (1.3x) of the best prediction, up to `max_tiles` (5).
3. BK: the largest allowed BK with which at least 4 pipeline stages fit in shared memory
   (else the BK that fits the most stages).
4. Variants per tile shape, in this order:
     v0 persistent, cluster 1x1, the most stages that fit (one CTA per SM)
        then v0 with each non-default value of each extra option (the limits accept)
     (row tiles, BM < 64: v0 again with the stages a 64-row A stage would leave, if fewer)
     v1 persistent, a 2-CTA cluster along the dimension with more tiles (if >= 2 tiles there)
        then v1 with each extra option value, as for v0
     v2 one tile per CTA, cluster 1x1, the most stages that fit
     v3 one tile per CTA, the cluster of v1
     v4 one tile per CTA, cluster 1x1, the most stages with which two CTAs fit per SM
        (one CTA's epilogue runs under the other's mainloop), if that is >= 3
   Variants the limits reject are skipped.
5. Where the family can swap operands (limits `SWAP_KEY`, e.g. sm90's swap_ab: the kernel
   computes C^T = B A^T, so the tile's M runs along N), steps 1-4 run again on (N, M) and
   those candidates carry the swap key; the swapped tile shapes join the others.
6. Round-robin over the kept tile shapes, variant by variant (v0 of every tile, then v1 ...)
   until `max_candidates` (16). The table's current bucket for the problem is added first.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

from ..kernels.limits_common import config_label
from ..registry import DIRECT_FIELDS

_STANDARD = ("tile", "cluster", "stages", "persistent")
_NOT_KERNEL = ("name", "op", "dtypes", "m", "n", "k", "note", "source", "line", "layer",
               "group", "cost", "sms", *DIRECT_FIELDS)


@dataclass(frozen=True)
class Candidate:
    """One kernel configuration: the bucket fields that select machine code."""

    tile: tuple
    cluster: tuple = (1, 1)
    stages: int = 4
    persistent: bool = False
    extra: tuple = ()  # sorted ((key, value), ...): bucket keys beyond the standard ones

    @property
    def name(self) -> str:
        """A file- and YAML-safe name: 128x256x64_c2x1_s4_p (+ _key-value per extra)."""
        s = config_label(self.tile, self.cluster, self.stages, self.persistent)
        for k, v in self.extra:
            s += f"_{k}-{str(v).lower()}"
        return s

    def fields(self) -> dict:
        """Bucket fields for a YAML file (lists, not tuples)."""
        out = {"tile": list(self.tile), "cluster": list(self.cluster), "stages": self.stages,
               "persistent": self.persistent}
        out.update(dict(self.extra))
        return out

    @classmethod
    def from_fields(cls, fields: dict) -> "Candidate":
        extra = tuple(sorted((k, v) for k, v in fields.items() if k not in _STANDARD))
        return cls(tuple(fields["tile"]), tuple(fields.get("cluster", (1, 1))),
                   int(fields["stages"]), bool(fields.get("persistent", False)), extra)

    @classmethod
    def from_bucket(cls, bucket) -> "Candidate":
        """The configuration of a registry Bucket. Extra kernel fields pass through; one at a
        false or empty value (False, None, 0, "") counts as unset, so a table bucket equals
        the generated candidate that leaves the key out."""
        fields = {f.name: getattr(bucket, f.name) for f in dataclasses.fields(bucket)
                  if f.name not in _NOT_KERNEL
                  and (f.name in _STANDARD or getattr(bucket, f.name) not in (False, None, 0, ""))}
        return cls.from_fields(fields)


@dataclass(frozen=True)
class Machine:
    """GPU numbers for ranking tiles (H100-like defaults; `sms` is read from the device)."""

    sms: int = 132
    mma_flops_per_us_sm: float = 7.5e6  # ~990 TFLOP/s dense 16-bit MMA / 132 SMs
    feed_bytes_per_us_sm: float = 1.0e5  # operand bytes one SM is fed per us (~13 TB/s in all)
    smem_bytes_per_us_sm: float = 2.3e5  # 128 B per clock at ~1.8 GHz
    dram_bytes_per_us: float = 3.0e6  # ~3.0 TB/s measured device copy
    smem_per_sm: int = 233472  # 228 KiB; each CTA also reserves 1 KiB
    cta_reserved_smem: int = 1024


@dataclass(frozen=True)
class Space:
    """What the kernel family allows, read from its limits module."""

    tile_m: tuple
    tile_n: tuple
    tile_k: tuple
    clusters: tuple  # 2-CTA clusters allowed, e.g. ((2, 1), (1, 2)); () for none
    limits: object
    options: tuple = ()  # ((key, (default, other, ...)), ...)
    swap_key: str = ""  # the option that swaps operands (tiles ranked on (N, M)), if any

    def mma_rows(self, bm: int) -> int:
        fn = getattr(self.limits, "mma_rows", None)
        return fn(bm) if fn else bm

    def check(self, tile, cluster, stages, persistent, extra=()) -> bool:
        try:
            return not self.limits.check_config(tuple(tile), tuple(cluster), stages, persistent,
                                                **dict(extra))
        except TypeError:  # a key the limits do not take: the registry validates later
            return True

    def max_stages(self, tile, extra=()) -> int:
        """The most stages that fit; `extra` options the limits' max_stages takes count."""
        takes = inspect.signature(self.limits.max_stages).parameters
        # options that do not change shared memory (swap_ab, raster_n) are not passed
        return self.limits.max_stages(tuple(tile),
                                      **{k: v for k, v in extra if k in takes})

    def stages_for_ctas(self, tile, ctas: int, machine: Machine) -> int:
        """The most stages with which `ctas` CTAs fit in one SM's shared memory (or 0)."""
        budget = machine.smem_per_sm // ctas - machine.cta_reserved_smem
        lo, hi = getattr(self.limits, "STAGES", (2, 16))
        s = hi
        while s >= lo and self.limits.smem_bytes(tuple(tile), s) > budget:
            s -= 1
        return s if s >= lo else 0


def limits_module(arch: str):
    from .. import registry

    return registry.limits_for(arch)


def space_for(arch: str, options=None) -> Space:
    """The candidate space of `arch` ("sm90" | "sm80") from its limits module, now."""
    lim = limits_module(arch)
    cdims = getattr(lim, "CLUSTER_DIMS", (1,))
    cmax = getattr(lim, "MAX_CLUSTER_SIZE", 1)
    clusters = tuple(c for c in ((2, 1), (1, 2)) if c[0] in cdims and c[1] in cdims
                     and c[0] * c[1] <= cmax)
    opts = dict(getattr(lim, "TUNE_OPTIONS", {}) or {})
    opts.update(options or {})
    return Space(tuple(lim.TILE_M), tuple(lim.TILE_N), tuple(lim.TILE_K), clusters, lim,
                 tuple((k, tuple(v)) for k, v in opts.items()), getattr(lim, "SWAP_KEY", ""))


def predict_us(m: int, n: int, k: int, bm: int, bn: int, space: Space, machine: Machine,
               out_bytes: int = 2, in_bytes: int = 2) -> tuple[float, float]:
    """(predicted, compute) time in us of a (BM, BN) tiling (see the module docstring)."""
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    rows = space.mma_rows(bm)
    per_k = max(2 * rows * bn / machine.mma_flops_per_us_sm,
                in_bytes * (bm + bn) / machine.feed_bytes_per_us_sm,
                (rows / 64) * in_bytes * (64 + bn) / machine.smem_bytes_per_us_sm)
    per_tile = k * per_k + out_bytes * bm * bn / machine.feed_bytes_per_us_sm
    compute = math.ceil(tiles / machine.sms) * per_tile
    dram = (in_bytes * (m * k + n * k) + out_bytes * m * n) / machine.dram_bytes_per_us
    return max(compute, dram), compute


def wave_stats(m: int, n: int, bm: int, bn: int, sms: int) -> dict:
    """tiles, waves and last-wave utilisation of a (BM, BN) tiling (for reports)."""
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    waves = math.ceil(tiles / sms)
    last = tiles - (waves - 1) * sms
    return {"tiles": tiles, "waves": waves, "last_wave_util": last / sms}


def rank_tiles(m, n, k, space: Space, machine: Machine, out_bytes=2, slack=1.3,
               max_tiles=5, per_bm=2, min_tiles=4) -> list[tuple[int, int, float]]:
    """(BM, BN, predicted us) of the kept tile shapes, best first."""
    scored = []
    lo = getattr(space.limits, "STAGES", (2, 16))[0]
    for bm in space.tile_m:
        for bn in space.tile_n:
            if not any(space.check((bm, bn, bk), (1, 1), lo, persistent)
                       for bk in space.tile_k for persistent in (False, True)):
                continue  # a shape the limits refuse at every BK (e.g. BM 256 past BN 192)
            pred, compute = predict_us(m, n, k, bm, bn, space, machine, out_bytes)
            scored.append((pred, compute, -bm * bn, bm, bn))
    scored.sort()
    best = scored[0][0]
    kept, per = [], {}
    for pred, _c, _a, bm, bn in scored:
        if len(kept) >= max_tiles or (len(kept) >= min_tiles and pred > slack * best):
            break
        if per.get(bm, 0) >= per_bm:
            continue
        per[bm] = per.get(bm, 0) + 1
        kept.append((bm, bn, pred))
    return kept


def pick_bk(bm: int, bn: int, space: Space, min_stages: int = 4) -> int | None:
    """The largest BK with >= min_stages stages; else the BK with the most stages."""
    fits = [(space.max_stages((bm, bn, bk)), bk) for bk in space.tile_k]
    deep = [bk for s, bk in fits if s >= min_stages]
    if deep:
        return max(deep)
    s, bk = max(fits)
    return bk if s >= getattr(space.limits, "STAGES", (2, 16))[0] else None


def tile_variants(m, n, bm, bn, bk, space: Space, machine: Machine,
                  fixed: tuple = ()) -> list[Candidate]:
    """v0..v4 and the extra-option variants of one tile shape, in priority order. `fixed`:
    extra ((key, value), ...) every variant carries (the swapped orientation)."""
    tile = (bm, bn, bk)
    full = space.max_stages(tile)
    two = space.stages_for_ctas(tile, 2, machine)
    tm, tn = math.ceil(m / bm), math.ceil(n / bn)
    cluster = None
    if space.clusters:
        want = (2, 1) if tm >= tn else (1, 2)
        if want in space.clusters and (tm if want == (2, 1) else tn) >= 2:
            cluster = want
    raw = [(True, (1, 1), full)]
    rows = space.mma_rows(bm)
    if rows > bm:
        # A row tile's stages hold BM rows of A, so the most that fit can be twice the depth
        # of a 64-row stage's; that depth lost 5-8% on some decode rows (16x32x128: 16
        # against 8 stages, bench/results/tune/decode-row-tile-stages_*), so it is a
        # candidate too.
        shallow = space.max_stages((rows, bn, bk))
        if 2 <= shallow < full:
            raw.append((True, (1, 1), shallow))
    if cluster:
        raw.append((True, cluster, full))
    raw.append((False, (1, 1), full))
    if cluster:
        raw.append((False, cluster, full))
    if two >= 3 and two != full:
        raw.append((False, (1, 1), two))
    out = [Candidate(tile, c, s, p, fixed) for p, c, s in raw
           if s >= 2 and space.check(tile, c, s, p, fixed)]
    # Each non-default value of each extra option on every persistent variant, right after it.
    with_options = []
    for cand in out:
        with_options.append(cand)
        if not cand.persistent:
            continue
        for key, values in space.options:
            if key == space.swap_key or key in dict(fixed):
                continue
            for v in values[1:]:
                extra = tuple(sorted(dict(cand.extra, **{key: v}).items()))
                alt = dataclasses.replace(cand, extra=extra,
                                          stages=space.max_stages(cand.tile, extra))
                if space.check(alt.tile, alt.cluster, alt.stages, alt.persistent, alt.extra):
                    with_options.append(alt)
    return with_options


def candidates_for(m: int, n: int, k: int, space: Space, machine: Machine = Machine(),
                   out_bytes: int = 2, max_candidates: int = 16, max_tiles: int = 5,
                   slack: float = 1.3, incumbent: Candidate | None = None,
                   tiles=None) -> list[Candidate]:
    """The candidate list of one GEMM (M rows, N columns, reduction K), incumbent first.
    `tiles`: (BM, BN) shapes to use instead of the ranked ones (step 1-2)."""
    per_tile = []
    # The problem as given, and (where the family can swap operands) as C^T = B A^T: the
    # tile's M then runs along N, so its tiles are ranked on (N, M).
    orientations = [(m, n, ())]
    if space.swap_key and space.swap_key in dict(space.options):
        orientations.append((n, m, ((space.swap_key, True),)))
    for om, on, fixed in orientations:
        ranked = tiles if tiles else [(bm, bn) for bm, bn, _t in rank_tiles(
            om, on, k, space, machine, out_bytes, slack, max_tiles)]
        for bm, bn in ranked:
            bk = pick_bk(bm, bn, space)
            if bk is not None:
                variants = tile_variants(om, on, bm, bn, bk, space, machine, fixed)
                if variants:
                    per_tile.append(variants)
    out = [incumbent] if incumbent is not None else []
    depth = max((len(v) for v in per_tile), default=0)
    for i in range(depth):
        for variants in per_tile:
            if i < len(variants) and variants[i] not in out:
                if len(out) >= max_candidates:
                    return out
                out.append(variants[i])
    return out


def parse_option(text: str) -> tuple[str, tuple]:
    """'swap_ab=false,true' -> ('swap_ab', (False, True)); values read as YAML scalars."""
    import yaml

    key, sep, vals = str(text).partition("=")
    if not sep or not key.strip() or not vals.strip():
        raise ValueError(f"--option {text!r}: expected KEY=V1,V2 (the first is the default)")
    values = tuple(yaml.safe_load(v.strip()) for v in vals.split(","))
    return key.strip(), values


__all__ = ["Candidate", "Machine", "Space", "space_for", "predict_us", "wave_stats",
           "rank_tiles", "pick_bk", "tile_variants", "candidates_for", "parse_option"]
