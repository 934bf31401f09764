"""Per-shape choice among a bucket's alternatives: a measured wave-cost model.

A bucket may list several kernel configurations (`alternatives` in the YAML). For a problem
(M, N, K) each alternative gets a predicted time from plain arithmetic, and the fastest
prediction runs (DeepGEMM's wave arithmetic, with coefficients measured by `detgemm-cute
tune` instead of guessed). The tile never changes bits, so the choice only changes speed.

For an alternative with tile (BM, BN, BK) and cluster (CM, CN) on a GPU of S SMs (the `sms`
the table was measured on), the tile's rows running along M (or along N when it swaps
operands). The unit the GPU schedules is a cluster of CM x CN tiles:
    units  = ceil(ceil(M / BM) / CM) * ceil(ceil(N / BN) / CN)
    slots  = clusters of CM x CN CTAs that run at once (`cluster_slots`: S // (CM * CN) for
             up to 2 CTAs; a cluster stays inside one GPC, so 4 and 8 CTAs fit fewer)
    waves  = ceil(units / slots)        rounds of clusters the SMs run one after another
    active = min(units, slots) * CM * CN  SMs busy in a full wave
    work   = waves * ceil(K / BK)       k-blocks one SM runs in sequence
    fed    = MB of operand tiles TMA brings into the SMs over the whole grid: every tile
             loads (BM + BN) x BK x 2 bytes per k-block, a multicast operand once per cluster
    pad    = the fraction of the tiles' extent along the GEMM's M (the caller's rows) that
             lies past M: 1 - M / (ceil(M / T) * T), T = BN if the tile swaps, else BM
    predicted us = c0 + c1 * work + c2 * work * active / S + c3 * waves
                   + c4 * fed * active / S + c5 * work * pad
c0: launch and fill; c1: one k-block on an SM with the memory system to itself; c2: what
sharing L2 and DRAM with `active` SMs adds to it; c3: a tile's prologue and epilogue; c4:
the operand traffic, which grows when a small M is cut into several tiles that each read
the whole weight (it separates one 192-wide tile over M = 176 from two 112-wide ones); c5:
what a k-block costs more when the last tile along M is mostly padding (measured: a swapped
64x160 tile over M = 176, one full tile and one of 16 rows, took 566 us on a 28672 x 8192
weight, over M = 320, two full tiles, 291 us; tune_raster_pool_* of 2026-11-25, in git at
7b3a174; the SM90 kernels have since moved a ragged last tile back inside the edge, which
removed most of that cost, and tables fitted on later timings find a smaller c5). The
coefficients (`cost: [c0, ..., c5]`, microseconds, all >= 0; a shorter cost has the missing
ones 0) are fitted per alternative to its timings (`detgemm_cute.tune.choice`).
"""

from __future__ import annotations

N_COEFFS = 6
# Clusters of 4 and 8 CTAs the GPU holds at once, by SM count: the driver's occupancy query
# (cudaOccupancyMaxActiveClusters, one CTA per SM) on an H100 SXM, 2026-11-26. Below
# SMs / size because clusters are placed per GPC: 128 tiles in 32 clusters of four run as
# two waves there (measured: dx 960 x 2048 <- 3584 on 2 x 2 clusters at half speed).
MEASURED_SLOTS = {132: {4: 30, 8: 15}}


def cluster_slots(sms: int, size: int) -> int:
    """Clusters of `size` CTAs that run at once on a GPU of `sms` SMs (one CTA per SM)."""
    return max(1, MEASURED_SLOTS.get(sms, {}).get(size, sms // size))


def features(tile, cluster, swap_ab: bool, m: int, n: int, k: int, sms: int) -> tuple:
    """(1, work, work * active / S, waves, fed * active / S, work * pad) of one alternative
    on one problem."""
    bm, bn, bk = tile
    cm, cn = cluster
    rows = bn if swap_ab else bm  # the tile's extent along the GEMM's M
    pad = 1.0 - m / (-(-m // rows) * rows)
    if swap_ab:
        m, n = n, m
    tiles_m, tiles_n, k_blocks = -(-m // bm), -(-n // bn), -(-k // bk)
    units = -(-tiles_m // cm) * -(-tiles_n // cn)
    slots = cluster_slots(sms, cm * cn)
    waves = -(-units // slots)
    work = waves * k_blocks
    share = min(units, slots) * cm * cn / sms
    # A is multicast along the cluster's N, B along its M (kernels/sm90_base.py)
    fed = tiles_m * tiles_n * k_blocks * (bm / cn + bn / cm) * bk * 2 / 1e6
    return (1.0, float(work), work * share, float(waves), fed * share, work * pad)


def predict_us(cost, tile, cluster, swap_ab: bool, m: int, n: int, k: int, sms: int) -> float:
    """The predicted time in microseconds of one alternative (see the module docstring)."""
    return sum(c * f for c, f in zip(cost, features(tile, cluster, swap_ab, m, n, k, sms)))


def bucket_us(b, m: int, n: int, k: int) -> float:
    """The predicted time of an alternative (a registry Bucket with `cost` and `sms`)."""
    return predict_us(b.cost, b.tile, b.cluster, b.swap_ab, m, n, k, b.sms)


def choose(alternatives, m: int, n: int, k: int):
    """The alternative of least predicted time; ties go to the earlier one in the file."""
    return min(alternatives, key=lambda b: bucket_us(b, m, n, k))


__all__ = ["N_COEFFS", "features", "predict_us", "bucket_us", "choose"]
