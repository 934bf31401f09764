"""fp32 "ieee" GEMMs with few rows: W split inside the GEMM (`kernels.split_gemv`).

At small M the split path (`split.scaled_operand_cuda` on W, then the chunked GEMM) spends
most of its time writing W's three fp16 parts and reading them back: 160 MB of traffic for a
64 MB fp32 W. `SplitGemvFp32` reads W as fp32 and splits it in registers, with the split
path's bits. W's row scales are guessed (`guesses`: the weight's scales from its last
call) and checked after each block, which runs again where a guess was wrong (`GUESS`), so
W is read once. Without a guess buffer (``DETGEMM_CUTE_FP32_GUESS=0``, a weight first seen
under CUDA-graph capture, `GUESS_CAP_BYTES` held) each CTA reads its block of W twice (the
row maxima that set the scales, then the chunks; at K = 14336 the second read comes from
DRAM again: ncu on an H100, 445 MB for a 235 MB W), and the two-pass rules choose the
kernel: on sm_90, one row of X at K in 8192..16384 then runs
`kernels.cluster_gemv.ClusterGemvFp32`, a cluster of up to 8 CTAs that keeps each block's K
range in shared memory and meets the row maxima in distributed shared memory.

At 17..64 rows of X and wide N (`tile_min_n`: N >= 3584; 17..32 rows from N = 8192 with
the two-pass rules), sm_90 runs
`kernels.split_tile.SplitTileFp32`: each warp owns outputs over the whole K and adds its
chunks in registers (`tile_shape`). Up to `X_INLINE_M` rows of X the streaming kernel takes
X's row scales itself (`x_inline`), and no split kernel runs on X.

Which calls take it (`applies`): fwd/dX of the full-precision tier, no accumulation buffer,
1 <= M <= 64 (32 on sm_80, whose shared memory cannot stage 64 rows of X), K a positive
multiple of 32, the weight K-contiguous with 16-byte-aligned rows and base
(`tensor_needs.SPLIT_ROWS`), a GPU from sm_80 up. ``DETGEMM_CUTE_FP32_DECODE=0`` (read at
import) turns it off.

A weight given [K, N] with N contiguous (`applies_kn`: dX's W [N_out, K_out] reduces down
its columns; mm's [K, N] operand) takes it too, where the split path would read W for its
column maxima, again for the split, write 1.5x its bytes as fp16 parts and read those back
in a GEMM with few tiles. On sm_90, with N a multiple of 4 and 16-byte-aligned rows
(`kn_in_place`), the fused kernels read W's columns in place (`w_kn` of `SplitGemvFp32`
and `SplitTileFp32`, `kn_shape`), always at given scales: the weight's guesses, else its
exact column scales taken first (`kn_plan`). Elsewhere, up to `KN_COPY_MAX_M` rows of X,
it runs on a K-major copy of W (`staging.transposed`: one read and one write of W). Either
way the guessed scales are kept for the given weight itself (`guesses`' ``of``), apart
from its fwd row scales.

The launch shapes are plain arithmetic: `launch_shape` (rows of W per CTA, chunks per warp
and round, a persistent grid of two CTAs per SM at most, X staged as its parts or as fp32)
and `cluster_shape` (CTAs per cluster and chunks per CTA from a byte target).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from . import split, staging
from .env import env_flag
from .kernels import tensor_needs as needs

MAX_M = 64  # above, X's rows (128 in fp32, 2 stages: 272 KiB) do not fit one CTA
SM80_MAX_M = 32  # sm_80's 163 KiB cannot stage 64 rows of X
X_FP32_M = 8  # rows of X (m_rows) from which X is staged as fp32 and split in registers
X_INLINE_M = 4  # rows of X (m_rows) up to which the kernel takes X's row scales itself
ENV = "DETGEMM_CUTE_FP32_DECODE"
_ON = env_flag(ENV, True)
_KN_ON = True  # `applies_kn` (`fused_kn` turns it off: benchmarks and tests compare)
# Rows of X up to which a [K, N] weight not read in place takes its K-major copy: above, the
# copy lost to the split path on 5 of 12 weights at M = 64 (0.89-0.996x; 1.31x geomean at
# M = 32, min 1.09x: bench/results/fp32-decode-dx_nvidia-h200.md and its first run in git).
KN_COPY_MAX_M = 32
CTAS_PER_SM = 2
# The streaming kernel guesses W's row scales (the weight's scales from its last call on the
# stream, kept in `guesses`' buffers) instead of taking the row maxima before the block, and
# checks them against the maxima of the values it split: a block whose guess was wrong runs
# again at the right scales. A weight that has not changed since its last call (decode) is
# read once instead of twice. ``DETGEMM_CUTE_FP32_GUESS=0`` (read at import) turns it off.
GUESS = env_flag("DETGEMM_CUTE_FP32_GUESS", True)
# Rows of X -> (rows of W per block, chunks per warp and round, stages, CTAs per SM) of the
# streaming kernel with guessed scales (X in fp32; its scales in the kernel up to 4 rows).
GUESS_SHAPES = {1: (8, 2, 2, 2), 2: (8, 2, 2, 2), 4: (8, 2, 2, 2), 8: (8, 2, 3, 2),
                16: (16, 1, 4, 1)}
GUESS_CAP_BYTES = 64 << 20  # guess buffers held at most (4 bytes a row of W)
_GUESSES: dict = {}
_guess_bytes = 0
WIDE_M = 32  # rows of X from which a block of `SplitGemvFp32` takes 16 rows of W
_WARPS = 8  # kernels.split_gemv.WARPS (that module imports the DSL)
_SMEM_BYTES = 110 * 1024  # per CTA: two CTAs share an SM's 228 KiB
SMEM_LIMIT = 227 * 1024  # one CTA's most on sm_90
SM80_SMEM = 163 * 1024  # one CTA's most on sm_80 (A100)
# Where sm_90 runs `ClusterGemvFp32` (bench_fp32_decode on an H100): one row of X and K in
# 8192..16384, where `SplitGemvFp32`'s second read of a block misses L2. Below that K, and at
# M >= 2, the streaming kernel is as fast or faster; above it a CTA's slice takes so much
# shared memory that two CTAs share an SM (K = 18944: 205-208 us against 195 in two of three
# runs).
CLUSTER_M = 1
CLUSTER_MIN_K = 8192
CLUSTER_MAX_K = 16384
CLUSTER_MAX = 8  # CTAs per cluster (the portable most)
CLUSTER_ROWS = 8  # rows of W per cluster (kernels.cluster_gemv.ROWS)
CLUSTER_CTA_BYTES = 44 * 1024  # a cluster CTA's chunks: the best of 32-100 KiB at M = 1
# Rows of X (m_rows) -> the least N from which `SplitTileFp32` runs on sm_90 (`tile_shape`),
# W's scales taken first (`TILE_MIN_N`) or guessed (`TILE_MIN_N_GUESS`, `tile_min_n`). With
# guesses the tile kernel (its m16 tiles' chains interleaved) beat the streaming kernel at
# 17..32 rows of X on all 15 fwd and dX problems with N >= 3584, 1.16-1.73x at the rule's
# launch; at N = 2048 it lost (0.69x): bench/results/tune/fp32-decode-tile-guess-sweep_*.
TILE_MIN_N = {32: 8192, 64: 3584}
TILE_MIN_N_GUESS = {32: 3584, 64: 3584}


W_NEED = needs.SPLIT_ROWS  # fp32 rows, 16-byte loads
OUT_NEED = needs.Need(needs.ELEMENT, (needs.ANY, needs.UNIT))
BIAS_NEED = needs.Need(needs.ELEMENT, (needs.UNIT,))
GUESS_NEED = needs.Need(needs.ELEMENT, (needs.UNIT,))  # int32 [N]: W's guessed row scales


@contextlib.contextmanager
def fused(on: bool):
    """Turn the fused path on or off inside the block (process-wide; tests and benchmarks
    compare it with the split path)."""
    global _ON
    prev, _ON = _ON, bool(on)
    try:
        yield
    finally:
        _ON = prev


@contextlib.contextmanager
def fused_kn(on: bool):
    """Turn the fused path of weights given [K, N] (`applies_kn`) on or off inside the block
    (process-wide, as `fused`)."""
    global _KN_ON
    prev, _KN_ON = _KN_ON, bool(on)
    try:
        yield
    finally:
        _KN_ON = prev


def covers(op: str, m: int, k: int, max_m: int = MAX_M) -> bool:
    """Whether a problem's shape is one the fused path serves (fwd or dX, 1 <= M <= max_m,
    K a positive multiple of 32): `applies` adds the operands' layout and the GPU."""
    return op != "dw" and 0 < m <= max_m and k > 0 and k % split.BLOCK_K == 0


def max_m(capability: tuple[int, int]) -> int:
    """The most rows of X the fused path serves on a GPU of this compute capability."""
    return MAX_M if capability >= (9, 0) else SM80_MAX_M


def applies(a: torch.Tensor, b_nk: torch.Tensor, acc, op: str) -> bool:
    """Whether this fp32 "ieee" call runs on the fused kernel (see the module docstring)."""
    m, k = a.shape
    if not (_ON and acc is None and covers(op, m, k) and W_NEED.meets(b_nk)):
        return False
    capability = _capability(a.device)
    return capability >= (8, 0) and m <= max_m(capability)


def applies_kn(a: torch.Tensor, b_kn: torch.Tensor, acc, op: str) -> bool:
    """Whether this fp32 "ieee" call, its B given [K, N] with unit stride along N (dX's
    weight, mm's [K, N] operand), runs on the fused kernels (`decode_gemm_kn`): B read in
    place where `kn_in_place`, else through its K-major copy up to `KN_COPY_MAX_M` rows of
    X (the transpose kernel on)."""
    m, k = a.shape
    if not (_ON and _KN_ON and acc is None and covers(op, m, k)):
        return False
    capability = _capability(a.device)
    if capability < (8, 0) or m > max_m(capability):
        return False
    return kn_in_place(b_kn) or (m <= KN_COPY_MAX_M and needs.TRANSPOSE_SRC.meets(b_kn)
                                 and split._kernels_on())


def kn_in_place(b_kn: torch.Tensor) -> bool:
    """Whether a [K, N] weight of `applies_kn` is read in place (`SplitGemvFp32`'s `w_kn`:
    sm_90, 16-byte vectors along N), not through its K-major copy."""
    return (_capability(b_kn.device)[0] == 9 and b_kn.shape[1] % 4 == 0
            and W_NEED.meets(b_kn))


def explain_note(op: str, dtype: str, m: int, k: int, arch: str = "sm90",
                 n: int | None = None) -> str | None:
    """The line `detgemm-cute explain` adds where the fused path, not the bucket, serves an
    fp32 problem (None elsewhere); `arch` is the table's ("sm90", "sm80"); with `n` it names
    the one kernel of that N (`tile_shape` at an H100's 132 SMs)."""
    if dtype != "fp32" or not covers(op, m, k, max_m((9, 0) if arch == "sm90" else (8, 0))):
        return None
    cluster = arch == "sm90" and uses_cluster(m, k, (9, 0))
    tile = arch == "sm90" and n is not None and not cluster and tile_shape(m, n, 132)
    if cluster:
        kernel = f"kernels/cluster_gemv.py, clusters of {cluster_shape(m, k).cluster} CTAs"
    elif tile:
        kernel = (f"kernels/split_tile.py, {tile.rows}-row blocks of W, {tile.group} chunks "
                  "a round (tile_shape at 132 SMs)")
    else:
        kernel = "kernels/split_gemv.py"
        if arch == "sm90" and n is None and m_rows_for(m) in tile_min_n():
            kernel += (f"; kernels/split_tile.py from N = {tile_min_n()[m_rows_for(m)]} "
                       "(tile_shape)")
    if GUESS and not cluster:
        kernel += ", W's row scales guessed from its last call and checked"
    return ('  fused:   at precision "ieee" with a K-contiguous weight (16-byte-aligned rows), '
            "or one given [K, N] (dX's weight: its columns read in place on sm_90, "
            "kn_in_place, else a K-major copy up to KN_COPY_MAX_M rows), "
            f"this call runs split_decode's kernel (W split inside the GEMM, {kernel}; "
            "the same bits), not the bucket above; precision "
            f'"tf32", force_bucket or {ENV}=0 run the bucket')


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_min_n(guess: bool | None = None) -> dict[int, int]:
    """`TILE_MIN_N_GUESS` with guessed W scales (`guess`, default `GUESS`), else
    `TILE_MIN_N`."""
    return TILE_MIN_N_GUESS if (GUESS if guess is None else guess) else TILE_MIN_N


def m_rows_for(m: int) -> int:
    """The rows of X a kernel is built for (1 <= m <= MAX_M): the next power of two."""
    return 1 << max(m - 1, 0).bit_length()


class StreamShape(NamedTuple):
    """A launch of `SplitGemvFp32`: X's rows, rows of W per block, chunks per warp and
    round, cp.async stages, CTAs (persistent), X staged as fp32 (else as its parts)."""
    m_rows: int
    rows: int
    group: int
    stages: int
    ctas: int
    x_fp32: bool = False
    x_inline: bool = False  # X's row scales taken in the kernel: no split kernel launch
    w_guess: bool = False  # W's row scales guessed from the weight's last call, then checked


def w_stage_floats(rows: int, slots: int, w_kn: bool) -> int:
    """`kernels.split_gemv.w_stage_floats` (that module imports the DSL): floats of one
    stage of W in shared memory, `slots` chunk slots of `rows` rows (`w_kn`: columns)."""
    return slots * 8 * (4 * rows + 8) if w_kn else rows * (slots * 32 + 16)


def smem_bytes(m_rows: int, rows: int, group: int, stages: int, x_fp32: bool = False,
               x_inline: bool = False, w_guess: bool = False, w_kn: bool = False) -> int:
    """Shared memory of one CTA (`SplitGemvFp32`): the stages of W rows (`w_kn`: of its
    columns, padded) and of X (fp32 or its parts), the chunk exchange, the row scales (X's
    too with `x_inline`), the row maxima (W's per warp with `w_guess`)."""
    slots = _WARPS * group
    w = stages * w_stage_floats(rows, slots, w_kn) * 4
    a = stages * m_rows * ((slots * 32 + 16) * 4 if x_fp32 else (slots * 96 + 16) * 2)
    scales = 2 * (max(8, rows) + (m_rows if x_inline else 0)) * 4
    tops = 4 * max(_WARPS * (m_rows if x_inline else 1),
                   _WARPS * max(8, rows) + 1 if w_guess else 0)
    return w + a + slots * m_rows * rows * 4 + scales + tops + 4 * 128


@functools.lru_cache(maxsize=4096)
def launch_shape(m: int, n: int, k: int, sms: int, smem_limit: int = SM80_SMEM,
                 guess: bool | None = None) -> StreamShape:
    """The `StreamShape` of an M x N x K problem: X's rows (`m_rows_for`); rows of W per
    block; chunks per warp and round; cp.async stages; a persistent grid; X's form
    (`bench/bench_fp32_decode.py --sweep stream` measured the choices on an H100):

    - up to `X_INLINE_M` rows of X: X in fp32 with its row scales taken in the kernel
      (`x_inline`: no split kernel launch), 8 rows of W, two chunks per warp and round,
      3 stages, two CTAs per SM (`--sweep inline`: 1.054x, 1.052x and 1.028x the speed
      before at M = 1 (9 shapes: not those of the cluster kernel), 2 and 4 (12 shapes),
      geomean; at M = 8 and 16, where every CTA reads more of X, 0.97x and 0.92x);
    - X's form: its fp16 parts (from the split kernel) below `X_FP32_M` rows of X, from
      there fp32, split in registers (4 bytes a value staged per block instead of 6; 1.07x
      the speed at M = 8 and 1.11x at M = 16, geomean of 12 shapes; 0.95x at M = 2);
    - up to 16 rows of X, and wherever 16-row blocks would leave more than half the SMs
      without one: 8 rows of W (one n8 block: faster than 2, 4 or 16 rows at few rows of
      X), as many stages (2..4; 2 with X in fp32, where 3 measured 2% slower at M = 8) and
      chunks per warp and round (2, else 1) as two CTAs per SM leave room for,
      `CTAS_PER_SM` CTAs per SM where two fit;
    - 32 or 64 rows of X: 16 rows of W, one chunk per warp and round, 3 stages where one
      CTA's shared memory allows (`smem_limit`), else 2, one CTA per SM (X, staged per
      block of W, costs half as much per row of W: at M = 32 4096 x 4096 took 73 us against
      97 us with 8 rows). With fewer than sms / 2 blocks they lost to 8 rows (N = 1024:
      M = 32 26 us against 33, M = 64 41 against 50), with 80 of 132 they won (N = 1280).

    With guessed W scales (`GUESS`), up to 16 rows of X take `GUESS_SHAPES` (`--sweep guess`:
    11 shapes on the first 10 weights; at M = 16, 16 rows of W and 4 stages ran 1.29x the
    speed of 8 rows and 2 stages, 1.13-1.35x per problem; at M = 1..8, 1.01-1.04x), but
    8 rows of W where 16-row blocks leave SMs idle, as above (M = 16, N = 1024: 20.3 us
    with 16 rows, 16.5 with 8 in an earlier run of the same session)."""
    guess = GUESS if guess is None else guess
    m_rows = m_rows_for(m)
    if guess and m_rows in GUESS_SHAPES:
        rows, group, stages, per_sm = GUESS_SHAPES[m_rows]
        if rows == 16 and 2 * -(-n // 16) < sms:  # 16-row blocks would leave SMs idle
            rows, group, stages, per_sm = GUESS_SHAPES[m_rows // 2]
        inline = m_rows <= X_INLINE_M
        if smem_bytes(m_rows, rows, group, stages, True, inline, True) <= smem_limit:
            return StreamShape(m_rows, rows, group, stages, min(-(-n // rows), per_sm * sms),
                               True, inline, True)
    if m_rows <= X_INLINE_M:
        return StreamShape(m_rows, 8, 2, 3, min(-(-n // 8), CTAS_PER_SM * sms), True, True,
                           guess)
    x_fp32 = m_rows >= X_FP32_M
    stages = next((s for s in (3, 2)
                   if smem_bytes(m_rows, 16, 1, s, x_fp32, w_guess=guess) <= smem_limit), 0)
    if m_rows >= WIDE_M and stages and 2 * -(-n // 16) >= sms:
        rows, group, per_sm = 16, 1, 1
    else:
        rows, group, stages = 8, 2, 2 if x_fp32 else 4
        size = functools.partial(smem_bytes, m_rows, rows, x_fp32=x_fp32, w_guess=guess)
        while stages > 2 and size(group, stages) > _SMEM_BYTES:
            stages -= 1
        while group > 1 and size(group, stages) > _SMEM_BYTES:
            group //= 2
        fits = size(group, stages) <= _SMEM_BYTES
        per_sm = CTAS_PER_SM if fits else 1
    blocks = -(-n // rows)
    return StreamShape(m_rows, rows, group, stages, min(blocks, per_sm * sms), x_fp32, False,
                       guess)


@functools.lru_cache(maxsize=4096)
def kn_shape(m: int, n: int, k: int, sms: int) -> StreamShape | TileShape:
    """The launch of a [K, N] weight read in place (`kn_in_place`, sm_90):

    - where `tile_shape` (guessing) gives a tile kernel, that one, as for a forward (its
      padded column stages take less shared memory than its rows of W would);
    - else the guessing shape of `launch_shape` (8 or 16 rows of W), but up to 8 rows of X,
      where 16-row blocks give every SM one, 16 rows of W, two chunks per warp and round,
      2 stages, one CTA per SM (`bench_fp32_decode.py --op dx --sweep kn`, H200, N the
      output's width: 1.08-1.13x at N = 4096, 1.02-1.06x at N = 8192; at N = 1024, 64 such
      blocks, 0.80-0.85x); fewer stages where the padded stages no longer fit two CTAs per
      SM (or one; 2 stages always fit, `test_kn_shape_fits_its_ctas`)."""
    tile = tile_shape(m, n, sms, True)
    if tile is not None:
        return tile
    shape = launch_shape(m, n, k, sms, SMEM_LIMIT, True)
    if shape.m_rows <= 8 and -(-n // 16) >= sms:
        shape = shape._replace(rows=16, group=2, stages=2, ctas=min(-(-n // 16), sms))

    def size(stages):
        return smem_bytes(shape.m_rows, shape.rows, shape.group, stages, shape.x_fp32,
                          shape.x_inline, True, True)

    limit = _SMEM_BYTES if shape.ctas > sms else SMEM_LIMIT
    stages = shape.stages
    while stages > 2 and size(stages) > limit:
        stages -= 1
    return shape._replace(stages=stages)


class TileShape(NamedTuple):
    """A launch of `SplitTileFp32`: X's rows (16, 32 or 64), rows of W per block (16, 32 or
    64), chunks per round, cp.async stages, CTAs (persistent)."""
    m_rows: int
    rows: int
    group: int
    stages: int
    ctas: int
    w_guess: bool = False  # W's row scales guessed, then checked (`StreamShape.w_guess`)


def tile_smem_bytes(m_rows: int, rows: int, group: int, stages: int,
                    w_guess: bool = False, w_kn: bool = False) -> int:
    """Shared memory of one CTA of `SplitTileFp32`: the stages of W rows (`w_kn`: of its
    columns, padded) and of X's parts, the row scales (and with `w_guess` the row maxima
    per warp)."""
    w = stages * w_stage_floats(rows, group, w_kn) * 4
    a = stages * m_rows * (group * 96 + 16) * 2
    tops = 4 * (_WARPS * rows + 1) if w_guess else 0
    return w + a + 2 * rows * 4 + tops + 4 * 128


@functools.lru_cache(maxsize=4096)
def tile_shape(m: int, n: int, sms: int, guess: bool | None = None) -> TileShape | None:
    """The `SplitTileFp32` launch of an M x N problem on sm_90, or None where the streaming
    kernel is faster (`bench/bench_fp32_decode.py --sweep tile` on an H100, 12 public-model
    weights at M = 32 and 64; `bench/results/tune/fp32-decode-tile-sweep_*`):

    - 33..64 rows of X from N = `TILE_MIN_N[64]`, and with guessed scales 17..32 rows from
      `TILE_MIN_N_GUESS[32]` (the same rule won there: `TILE_MIN_N_GUESS`): 32 rows of W
      per block where that leaves at most one block per SM, else 64; four chunks per round,
      2 stages, one CTA per SM; where even 64-row blocks outnumber the SMs, two chunks per
      round and two CTAs per SM (16 warps per SM: the chains are latency-bound; 1.15x at
      N = 14336);
    - 17..32 rows of X with W's scales taken first, from N = `TILE_MIN_N[32]`: 64-row
      blocks, two chunks per round, 2 stages, two CTAs per SM.
    Below those N the blocks leave SMs idle and the streaming kernel, which splits K among
    a block's warps, wins (N = 2048: 105 us against 91 at M = 64)."""
    guess = GUESS if guess is None else guess
    m_rows = m_rows_for(m)
    min_n = tile_min_n(guess)
    if m_rows not in min_n or n < min_n[m_rows]:
        return None
    if m_rows == 32 and not guess:
        rows, group, per_sm = 64, 2, 2
    elif -(-n // 32) <= sms:
        rows, group, per_sm = 32, 4, 1
    elif -(-n // 64) <= sms:
        rows, group, per_sm = 64, 4, 1
    else:
        rows, group, per_sm = 64, 2, 2
    return TileShape(m_rows, rows, group, 2, min(-(-n // rows), per_sm * sms), guess)


class ClusterShape(NamedTuple):
    """A launch of `ClusterGemvFp32`: X's rows, CTAs per cluster, chunks per CTA, cp.async
    commit groups per CTA."""
    m_rows: int
    cluster: int
    cap: int
    groups: int


def cluster_smem_bytes(m_rows: int, cluster: int, cap: int) -> int:
    """Shared memory of one CTA of `ClusterGemvFp32`: its slice of 8 W rows and of X's parts,
    the chunk values of the outputs it owns, the cluster's row maxima."""
    w = CLUSTER_ROWS * (cap * 32 + 16) * 4
    a = m_rows * (cap * 96 + 16) * 2
    owned = -(-m_rows * CLUSTER_ROWS // cluster)
    return w + a + cluster * cap * owned * 4 + CLUSTER_ROWS * cluster * 4 + 4 * 128


@functools.lru_cache(maxsize=4096)
def cluster_shape(m: int, k: int, budget: int = CLUSTER_CTA_BYTES) -> ClusterShape | None:
    """The `ClusterGemvFp32` launch for an M x K problem, or None where a cluster of 8
    cannot hold a block: as many CTAs (up to 8) as bring each one's chunks (W's 8 rows, X's
    parts and the chunk values) near `budget` bytes; cap = the chunks per CTA rounded up to
    a multiple of 8 (and the cluster shrunk to what that cap needs); four cp.async groups
    along K where cap allows."""
    chunks, m_rows = k // split.BLOCK_K, m_rows_for(m)
    per_chunk = CLUSTER_ROWS * 128 + m_rows * 192 + m_rows * CLUSTER_ROWS * 4
    cluster = min(CLUSTER_MAX, -(-chunks // max(8, budget // per_chunk)))
    cap = -(-(-(-chunks // cluster)) // 8) * 8
    cluster = -(-chunks // cap)  # no CTA left without chunks after the rounding
    if cluster_smem_bytes(m_rows, cluster, cap) > SMEM_LIMIT:
        return None
    return ClusterShape(m_rows, cluster, cap, 4 if cap >= 32 else 2 if cap >= 16 else 1)


def uses_cluster(m: int, k: int, capability: tuple[int, int],
                 guess: bool | None = None) -> bool:
    """Whether the fused path runs `ClusterGemvFp32` (sm_90 up, M <= CLUSTER_M,
    CLUSTER_MIN_K <= K <= CLUSTER_MAX_K) rather than `SplitGemvFp32`."""
    guess = GUESS if guess is None else guess
    return (not guess and capability >= (9, 0) and m <= CLUSTER_M
            and CLUSTER_MIN_K <= k <= CLUSTER_MAX_K
            and cluster_shape(m, k) is not None)


def stream_shape(m: int, n: int, k: int, device: torch.device, guess: bool | None = None):
    """`launch_shape` for `device` (its SM count and one CTA's shared memory)."""
    limit = SMEM_LIMIT if _capability(device) >= (9, 0) else SM80_SMEM
    return launch_shape(m, n, k, _sms(device), limit, guess)


@functools.lru_cache(maxsize=4096)
def default_shape(m: int, n: int, k: int, device: torch.device, guess: bool | None = None):
    """The kernel and launch `decode_gemm` runs an M x N x K problem with on `device`: a
    `ClusterShape` (`uses_cluster`), a `TileShape` (`tile_shape`, sm_90 only) or a
    `StreamShape` (one lookup per call); `guess` False: the two-pass rules (default
    `GUESS`)."""
    capability = _capability(device)
    if uses_cluster(m, k, capability, guess):
        return cluster_shape(m, k)
    # The tile kernel's shapes were measured on sm_90 only (and take up to 177 KiB of shared
    # memory, more than some later GPUs give a CTA).
    tile = tile_shape(m, n, _sms(device), guess) if capability[0] == 9 else None
    return tile or stream_shape(m, n, k, device, guess)


def decode_gemm_kn(a: torch.Tensor, b_kn: torch.Tensor, bias: torch.Tensor | None,
                   via_copy: bool | None = None,
                   shape: StreamShape | TileShape | None = None):
    """`decode_gemm` of a B given [K, N] (`applies_kn`): in place where `kn_in_place`, else
    (or with `via_copy`) on its K-major copy, with the guessed scales kept for `b_kn`
    itself. `shape` forces the in-place launch (benchmarks, tests: a `StreamShape` or a
    `TileShape`)."""
    in_place = kn_in_place(b_kn)
    if via_copy or (via_copy is None and not in_place):
        w = staging.transposed(b_kn, b_kn.shape[0])
        return decode_gemm(a, b_kn.t().contiguous() if w is None else w, bias, guess_of=b_kn)
    if not in_place or not isinstance(shape, (StreamShape, TileShape, type(None))):
        raise ValueError(f"decode_gemm_kn: an in-place read needs kn_in_place(b_kn) (sm_90, N "
                         f"a multiple of 4, 16-byte-aligned rows) and a StreamShape or "
                         f"TileShape; got b_kn {tuple(b_kn.shape)} strides {b_kn.stride()}, "
                         f"shape {shape!r}")
    return decode_gemm(a, b_kn, bias, shape, kn=True)


def kn_plan(m: int, n: int, k: int, b_kn: torch.Tensor, shape=None):
    """(`kn_shape` or the forced `shape`, scale bits) of an in-place [K, N] call: the
    weight's guesses (`guesses(..., of=b_kn)`), else (no buffer, or ``GUESS`` off) its
    exact column scales, taken here (every check then passes)."""
    shape = shape or kn_shape(m, n, k, _sms(b_kn.device))
    guess = guesses(b_kn.t(), of=b_kn) if GUESS else None
    if guess is None:
        guess = split.row_scales(b_kn.t()).view(torch.int32)
    return shape, guess


def decode_gemm(a: torch.Tensor, b_nk: torch.Tensor, bias: torch.Tensor | None,
                shape: tuple[int, ...] | None = None,
                guess_of: torch.Tensor | None = None, kn: bool = False) -> torch.Tensor:
    """fp32 [M, N] = the split path's unscaled result of a [M, K] @ b_nk [N, K]^T, plus
    bias in fp32 (not yet rounded to another output dtype). `shape` forces a kernel
    (benchmarks, tests): a `ClusterShape`, a `TileShape`, or a `StreamShape` (also as a plain
    tuple). `guess_of`: the tensor whose guess buffer b_nk's row scales take (`guesses`;
    b_nk a copy of it). With `kn`, b_nk is B given [K, N] and read in place (`kn_plan`)."""
    m, k = a.shape
    n = b_nk.shape[1] if kn else b_nk.shape[0]
    chunks = k // split.BLOCK_K
    y = torch.empty((m, n), dtype=torch.float32, device=a.device)
    if n == 0:
        return y
    if kn:
        shape, guess = kn_plan(m, n, k, b_nk, shape)
    else:
        shape, guess = plan(m, n, k, b_nk, shape, guess_of)
    inline = isinstance(shape, StreamShape) and shape.x_inline
    a2, sa = (a, None) if inline else split.scaled_operand_cuda(a, "a")
    if bias is not None:
        bias = needs.conform(bias.to(torch.float32), BIAS_NEED)
    if kn:
        w = b_nk.as_strided((k, n // 4, 4), (b_nk.stride(0) if k > 1 else n, 4, 1))
    else:
        ld = b_nk.stride(0) if n > 1 else k
        w = b_nk.as_strided((n, chunks, 2, 4, 4), (ld, 32, 16, 4, 1))
    parts = None if inline else a2.view(m, chunks, 3, 2, 4, 4)
    arch = split.helper_arch(a.device)
    # On the current device (`gemm.launch_on`).
    if isinstance(shape, ClusterShape):
        if chunks > shape.cluster * shape.cap:
            raise ValueError(f"decode_gemm: {shape} holds {shape.cluster * shape.cap} "
                             f"chunks, K = {k} has {chunks}")
        key = ("cluster_gemv", *shape, bias is not None, arch)
        fn = split.compiled_once(key, lambda: compile_cluster_kernel(*shape, bias is not None,
                                                                     arch))
        fn(w, parts, sa, y, bias)
        return y
    w_bits = w if kn else b_nk.view(torch.int32).as_strided((n, chunks * 8, 4), (ld, 4, 1))
    if isinstance(shape, TileShape):
        build = (*shape[:4], bias is not None, arch, guess is not None, kn)
        fn = split.compiled_once(("tile", *build), lambda: compile_tile_kernel(*build))
        fn(w, w_bits, parts, sa, y, bias, guess, shape.ctas)
    else:
        if shape.x_fp32:  # X itself, 16-byte rows, as [M, chunks, 8, 4]
            a = needs.conform(a, needs.SPLIT_ROWS)
            parts = a.as_strided((m, chunks, 8, 4), (a.stride(0) if m > 1 else k, 32, 4, 1))
        build = (shape.m_rows, shape.rows, shape.group, shape.stages, bias is not None, arch,
                 shape.x_fp32, shape.x_inline, guess is not None, kn)
        fn = split.compiled_once(("gemv", *build), lambda: compile_kernel(*build))
        fn(w, w_bits, parts, sa, y, bias, guess, shape.ctas)
    return y


def plan(m: int, n: int, k: int, b_nk: torch.Tensor, shape=None, guess_of=None):
    """(kernel shape, guess buffer or None) for one call: `shape` forced (a plain tuple is
    a `StreamShape`) or `default_shape`; a guessing shape gets the weight's buffer
    (`guesses`), and where it has none the default becomes the two-pass rules' shape (a
    forced one runs as given, taking the row maxima first)."""
    forced = shape is not None
    if not forced:
        shape = default_shape(m, n, k, b_nk.device)
    elif not isinstance(shape, (ClusterShape, TileShape, StreamShape)):
        shape = StreamShape(*shape)  # a plain tuple: the streaming kernel's fields
    if isinstance(shape, ClusterShape) or not shape.w_guess:
        return shape, None
    guess = guesses(b_nk, guess_of)
    if guess is None and not forced:
        return default_shape(m, n, k, b_nk.device, False), None
    return shape, guess


def guesses(b_nk: torch.Tensor, of: torch.Tensor | None = None) -> torch.Tensor | None:
    """The int32 [N] buffer of W's guessed row scales for this weight (`SplitGemvFp32`'s
    `w_guess`), or None (the call then takes the row maxima first): under CUDA-graph capture
    for a weight with no buffer yet (a buffer made there would pin the graph's memory pool),
    or once `GUESS_CAP_BYTES` are held. A buffer is made on a weight's first call outside
    capture, uninitialized (every guess is checked, so any content is safe), and kept for
    the process: captured graphs keep its address, so it is never freed. Keyed by the
    weight's address, shape and row pitch: a new tensor at an old address inherits guesses,
    which costs at most a second pass over a block, never a bit. Kernels on several streams
    may read and write one buffer at once: each checks what it reads. With `of` (b_nk a
    K-major copy or view of it, `decode_gemm_kn`) the buffer is keyed by `of`, apart from
    the buffer of the same tensor read as [N, K] (dX's weight keeps its column scales, its
    fwd its row scales)."""
    global _guess_bytes
    src = b_nk if of is None else of
    key = (src.data_ptr(), *src.shape, src.stride(0), src.device.index, of is not None)
    buf = _GUESSES.get(key)
    if buf is None:
        n = b_nk.shape[0]
        if (_guess_bytes + 4 * n > GUESS_CAP_BYTES
                or torch.cuda.is_current_stream_capturing()):
            return None
        buf = torch.empty(n, dtype=torch.int32, device=b_nk.device)
        _GUESSES[key] = buf
        _guess_bytes += 4 * n
    return buf


def _fake_operands(has_bias: bool, x_fp32: bool = False, x_inline: bool = False,
                   w_kn: bool = False):
    """Fake W (`w_kn`: [K, N / 4, 4], also standing for its unused int32 view), W's int32
    view, X's parts (`x_fp32`: X as [M, chunks, 8, 4]), X's scales, Y and bias for
    `cute.compile`."""
    import cutlass
    import cutlass.cute as cute

    n, m, chunks, quads = (cute.sym_int() for _ in range(4))
    if w_kn:
        w = w_bits = needs.fake(cutlass.Float32, (cute.sym_int(), cute.sym_int(), 4),
                                W_NEED, strides=(W_NEED.strides[0], 4, needs.UNIT))
    else:
        w = needs.fake(cutlass.Float32, (n, chunks, 2, 4, 4), W_NEED,
                       strides=(W_NEED.strides[0], 32, 16, 4, needs.UNIT))
        w_bits = needs.fake(cutlass.Int32, (n, quads, 4), W_NEED,
                            strides=(W_NEED.strides[0], 4, needs.UNIT))
    if x_fp32:
        parts = needs.fake(cutlass.Float32, (m, chunks, 8, 4), needs.SPLIT_ROWS,
                           strides=(needs.SPLIT_ROWS.strides[0], 32, 4, needs.UNIT))
    else:
        parts = needs.fake(cutlass.Float16, (m, chunks, 3, 2, 4, 4), needs.SPLIT_PARTS,
                           strides=(needs.SPLIT_PARTS.strides[0], 96, 32, 16, 4, needs.UNIT))
    scales = None if x_inline else needs.fake(cutlass.Float32, (m,), needs.SPLIT_SCALES)
    y = needs.fake(cutlass.Float32, (m, n), OUT_NEED)
    bias = needs.fake(cutlass.Float32, (n,), BIAS_NEED) if has_bias else None
    return w, w_bits, parts, scales, y, bias


def _compile(kernel, args, arch: str, extra_options: str):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *args, stream,
                        options=f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip())


def compile_kernel(m_rows: int, rows: int, group: int, stages: int, has_bias: bool,
                   arch: str, x_fp32: bool = False, x_inline: bool = False,
                   w_guess: bool = False, w_kn: bool = False, extra_options: str = ""):
    """The compiled `SplitGemvFp32` for one launch shape (no GPU needed: fake tensors).
    `extra_options` passes DSL flags through (``--keep-ptx --dump-dir=D`` for audits)."""
    import cutlass

    from .kernels.split_gemv import SplitGemvFp32

    w, w_bits, parts, scales, y, bias = _fake_operands(has_bias, x_fp32, x_inline, w_kn)
    guess = needs.fake(cutlass.Int32, (y.shape[1],), GUESS_NEED) if w_guess else None
    kernel = SplitGemvFp32(m_rows, rows, group, stages, has_bias, x_fp32, x_inline, w_guess,
                           w_kn)
    return _compile(kernel, (w, w_bits, parts, scales, y, bias, guess, cutlass.Int32(1)), arch,
                    extra_options)


def compile_tile_kernel(m_rows: int, rows: int, group: int, stages: int, has_bias: bool,
                        arch: str, w_guess: bool = False, w_kn: bool = False,
                        extra_options: str = ""):
    """The compiled `SplitTileFp32` for one launch shape (no GPU needed: fake tensors)."""
    import cutlass

    from .kernels.split_tile import SplitTileFp32

    w, w_bits, parts, scales, y, bias = _fake_operands(has_bias, w_kn=w_kn)
    guess = needs.fake(cutlass.Int32, (y.shape[1],), GUESS_NEED) if w_guess else None
    return _compile(SplitTileFp32(m_rows, rows, group, stages, has_bias, w_guess, w_kn),
                    (w, w_bits, parts, scales, y, bias, guess, cutlass.Int32(1)), arch,
                    extra_options)


def compile_cluster_kernel(m_rows: int, cluster: int, cap: int, groups: int, has_bias: bool,
                           arch: str, extra_options: str = ""):
    """The compiled `ClusterGemvFp32` for one cluster shape (sm_90 up; no GPU needed)."""
    from .kernels.cluster_gemv import ClusterGemvFp32

    w, _, parts, scales, y, bias = _fake_operands(has_bias)
    return _compile(ClusterGemvFp32(m_rows, cluster, cap, groups, has_bias),
                    (w, parts, scales, y, bias), arch, extra_options)


__all__ = ["fused", "fused_kn", "covers", "max_m", "applies", "applies_kn", "kn_in_place",
           "kn_shape", "kn_plan", "decode_gemm_kn", "KN_COPY_MAX_M", "explain_note",
           "decode_gemm",
           "launch_shape", "stream_shape", "StreamShape", "cluster_shape", "ClusterShape",
           "uses_cluster", "default_shape", "tile_shape", "TILE_MIN_N", "TILE_MIN_N_GUESS",
           "tile_min_n", "guesses", "plan", "GUESS", "GUESS_SHAPES", "GUESS_CAP_BYTES",
           "m_rows_for",
           "smem_bytes", "cluster_smem_bytes",
           "compile_kernel", "compile_cluster_kernel", "compile_tile_kernel", "TileShape",
           "tile_smem_bytes", "MAX_M", "SM80_MAX_M", "X_FP32_M", "X_INLINE_M",
           "CLUSTER_M", "CLUSTER_MIN_K", "CLUSTER_MAX_K", "ENV"]
