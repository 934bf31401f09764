"""The eager GEMM path: validate, pick the bucket, stage what TMA cannot take, launch.

Per-call work on a warm shape is a few attribute reads, one dict lookup for the plan, the
output allocation and the TVM-FFI call. Everything derived from (shape, dtype, layout) is
computed once and memoised in `_plans`.

Layouts taken without copies: A [M, K] row-major or a transposed view (M-major); B as
[N, K] (linear's weight) or [K, N] (mm), either contiguous dim. What TMA cannot address
(a unit stride missing, a non-unit stride that is not a multiple of 16 bytes, a base pointer
not 16-byte aligned) is copied once: a 16-bit operand whose contiguous dim is M or N (dW's
dY^T at an odd vocabulary size) keeps that layout, its contiguous dim padded to a multiple
of 8 (`stage_padded`); anything else goes into a K-major buffer whose K is zero-padded to a
multiple of 8. Zeros at the end of K add exact zero products, exactly what TMA's
out-of-bounds fill already feeds the kernel past K, and padding past M or N is never read
(TMA's extent is the real one), so the bits do not change. An output
whose row stride cannot be 16-byte aligned (N not a multiple of 8 for 16-bit outputs) is
written into a padded buffer and copied out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading

import torch

from . import compile as kcompile
from . import dispatch, registry, split, split_decode, staging
from .errors import check_gemm_args
from .kernels import sm90_limits
from .kernels import tensor_needs as needs

_ALIGN = needs.VEC_BYTES
_MAX_DIM = 2**31 - 1
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TF32 = "tf32"  # the dtype name of fp32 operands on the TF32 kernels (tables, kernel keys)
_F32 = torch.float32

_plans: dict = {}  # cleared whenever the registry's user layers change
_arch_of_device: dict = {}


class _Forced(threading.local):
    name = None  # class defaults: reading them in the hot path raises nothing
    family = os.environ.get(dispatch.FAMILY_ENV) or None


_forced = _Forced()


@contextlib.contextmanager
def force_bucket(name: str | None):
    """Run every GEMM in this thread through the bucket `name`, whatever the shape.

    Tiles do not change bits, so tests use this to prove every bucket gives the same
    result on the same problem."""
    prev = _forced.name
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = prev


@contextlib.contextmanager
def use_family(name: str | None):
    """Run every GEMM in this thread on kernel family `name` ("sm90" | "sm80"; None: the
    GPU's default). Default for all threads: the ``DETGEMM_CUTE_FAMILY`` environment
    variable. The SM80 family (cp.async + mma.sync) runs on any GPU from sm_80 up, which is
    how it is tested on an H100; each family keeps the contract on its own."""
    if name is not None and name not in dispatch.FAMILIES:
        raise ValueError(f"use_family: unknown kernel family {name!r}; known: "
                         f"{', '.join(dispatch.FAMILIES)} or None")
    prev = _forced.family
    _forced.family = name
    try:
        yield
    finally:
        _forced.family = prev


def forced_family() -> str | None:
    """The kernel family `use_family` set for this thread (None: the GPU's default)."""
    return _forced.family


def arch_of(device: torch.device) -> str:
    """The kernel family (registry arch) that serves `device` in this thread."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    family = _forced.family
    arch = _arch_of_device.get((idx, family))
    if arch is None:
        major, minor = torch.cuda.get_device_capability(idx)
        arch = dispatch.arch_for_capability(major, minor, family)
        _arch_of_device[(idx, family)] = arch
    return arch


def _gpu_arch(arch: str, device: torch.device) -> str:
    return kcompile.gpu_arch_for(arch, torch.cuda.get_device_capability(device))


def _k_major_b(b_form: str, unit: str | None) -> bool:
    """Whether B (given as `b_form`, its unit-stride dim `unit`) is K-major."""
    return (b_form, unit) in (("nk", "last"), ("kn", "first"))


def _unit_dim(t: torch.Tensor) -> str | None:
    """Which dim of a 2-D operand TMA can take as contiguous ("last" or "first"), or None
    when it cannot read the tensor in place (no unit stride, a non-unit stride that is not
    a multiple of 16 bytes, or a base pointer not 16-byte aligned): `tensor_needs`'s check
    against the needs the kernels are compiled with."""
    return needs.tma_unit_dim(t)


@functools.lru_cache(maxsize=None)
def _cluster_slots(device_index: int, size: int) -> int:
    """How many clusters of `size` CTAs (one CTA per SM) the GPU holds at once: the
    persistent grid's size. A cluster lives inside one GPC, so for 4 or 8 CTAs this is
    below SMs / size (the driver's occupancy query says by how much); a persistent grid one
    cluster too large would run that cluster as a second wave."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    if size <= 2:  # every TPC holds two SMs
        return max(1, sms // size)
    try:
        import cutlass.utils

        with torch.cuda.device(device_index):
            n = cutlass.utils.HardwareInfo(device_index).get_max_active_clusters(size)
        return max(1, min(int(n), sms // size))
    except Exception:  # noqa: BLE001 - no driver bindings: the upper bound
        return max(1, sms // size)


def max_clusters_for(device: torch.device, cluster) -> int:
    """The persistent grid, in clusters, for a bucket's cluster shape on `device`."""
    return _cluster_slots(device.index if device.index is not None
                          else torch.cuda.current_device(), cluster[0] * cluster[1])


def padded_width(n: int, out_dtype: torch.dtype) -> int:
    """The row width (a multiple of 16 bytes) an output of `n` columns is written into when
    its rows cannot start on 16 bytes for TMA; 0 when they can (no padding, no copy out)."""
    el = _ALIGN // out_dtype.itemsize
    return -(-n // el) * el if n % el else 0


def half_sector_rows(n: int, out_dtype: torch.dtype) -> bool:
    """Whether rows of `n` elements start every other one 16 bytes into a 32-byte sector
    (a pitch of 16 mod 32 bytes: q @ k^T at S = 1000, 3000). TMA can store such rows, but
    each box row then writes two half sectors: on an H100, 128x128 persistent tiles stored
    q @ k^T at S = 3000 at 0.70x torch.bmm by TMA, 0.95x by the tile's threads; at S = 2992
    (whole sectors) TMA was the faster path (bench/results/tune/bmm_qk_align_*). bmm stores
    such outputs directly where the kernel can (`stores_direct`): 1.10-1.37x over TMA on 6 of
    8 q @ k^T rows; linear layers keep TMA (0.96-1.00x), bench/results/half-sector-ab_*."""
    return n * out_dtype.itemsize % 32 == 16


def stores_direct(arch: str, bucket, plain: bool) -> bool:
    """Whether an output whose rows TMA cannot address (a nonzero `padded_width`), or in bmm
    would store as half sectors (`half_sector_rows`), is stored by the kernel's threads from
    its staged sub-tiles (SM90 tiles of BM >= 64, `plain`: no split parts, no TF32, no
    accumulate) instead of into padded rows copied out after.

    Not where a warpgroup's accumulator leaves too few registers for the stores' addresses:
    ping-pong (a whole tile per warpgroup: 1.5 KB spilled, 0.26-0.56x of the padded rows'
    speed: the first direct-store A/B, bench/results/README.md) and swapped 128-row tiles (12-64
    bytes spilled)."""
    tight = bucket.pingpong or (bucket.swap_ab and bucket.tile[0] > 64)
    return plain and arch == "sm90" and bucket.tile[0] >= 64 and not tight


def output_rows(arch: str, bucket, n: int, out_dtype: torch.dtype, plain: bool,
                half_sectors: bool = False) -> tuple[bool, int]:
    """How a plan stores an output of `n` columns: (c_direct, padded width or 0). Rows TMA
    cannot address are stored by the kernel's threads where `stores_direct` allows it, else
    written into padded rows copied out after; with `half_sectors` (bmm), rows TMA would
    store as half sectors take the threads' stores too."""
    pad_cols = padded_width(n, out_dtype)
    direct = ((pad_cols > 0 or (half_sectors and half_sector_rows(n, out_dtype)))
              and stores_direct(arch, bucket, plain))
    return direct, 0 if direct else pad_cols


def direct_align(c_direct: bool, n: int, out_dtype: torch.dtype) -> int:
    """`KernelKey.c_align` of a directly stored fresh output of `n` columns (bmm, grouped-K:
    the plan allocates it): 8 where its row pitch is a multiple of 8 bytes (q @ k^T at S =
    1000, 1500, 2500, 3000), so each thread stores 8 bytes at once, else 0 (element by
    element). 8-byte stores from 256-byte sub-tile rows beat 2-, 4- and 16-byte ones on an
    H100 (bench/results/vector-store-ab_*). `gemm` keeps 0: it may store into the caller's
    `out`, of any pitch."""
    return 8 if c_direct and n * out_dtype.itemsize % 8 == 0 else 0


def _pad_rows(src: torch.Tensor) -> torch.Tensor:
    """`src` (last dim contiguous) copied into fresh rows zero-padded to a multiple of 8:
    the row-copy kernel where it applies, else PyTorch's copy."""
    cols = src.shape[-1]
    width = -(-cols // 8) * 8
    out = staging.rows(src, width)
    if out is not None:
        return out
    out = torch.empty((*src.shape[:-1], width), dtype=src.dtype, device=src.device)
    out[..., :cols].copy_(src)
    out[..., cols:].zero_()
    return out


def stage_k_major(t: torch.Tensor, k_last: bool) -> torch.Tensor:
    """Copy `t` ([..., rows, K] when `k_last`, else [..., K, rows]) into a fresh
    [..., rows, Kp] buffer, K contiguous and zero-padded to a multiple of 8. Rows already
    K-contiguous (an odd K) take the row-copy kernel; a transposed fp32 matrix (the TF32
    kernels' staged weight) takes the tiled transpose kernel."""
    src = t if k_last else t.transpose(-1, -2)
    if src.dim() == 2 and src.stride(0) == 1:  # [rows, K] is a transposed view of [K, rows]
        out = staging.transposed(src.t(), -(-src.shape[-1] // 8) * 8)
        if out is not None:
            return out
    return _pad_rows(src)


def stage_padded(t: torch.Tensor) -> torch.Tensor:
    """Copy a 2-D 16-bit `t` into a fresh buffer with the same dim contiguous, that dim
    padded to a multiple of 8 elements (`_pad_rows` over its rows): the same [R, C] view,
    which TMA reads in place. For operands whose contiguous dim is M or N
    (`padded_staging`), which `stage_k_major` would transpose at about a third of the copy
    bandwidth."""
    if t.stride(0) == 1 and t.stride(1) != 1:  # contiguous along the first dim
        return _pad_rows(t.t())[:, :t.shape[0]].t()
    return _pad_rows(t)[:, :t.shape[1]]


def padded_staging(t: torch.Tensor, k_dim: int, first_ok: bool = True) -> str | None:
    """The unit dim ("first" or "last") a 2-D operand that TMA cannot read in place keeps
    when `stage_padded` copies it, or None when it is copied K-major instead: only 16-bit
    operands whose unit-stride dim is not K (dim `k_dim`), where the kernels can read that
    layout (`first_ok`: an M-major A needs row tiles of at least 64)."""
    if t.dim() != 2 or t.element_size() != 2 or min(t.shape) < 2:
        return None
    non_k = 1 - k_dim
    if (t.stride(non_k) != 1 or t.stride(k_dim) < t.shape[non_k]  # overlapping views: K-major
            or (non_k == 0 and not first_ok)):
        return None
    return "first" if non_k == 0 else "last"


class _Plan:
    """What a call with this key needs: the kernel, which operands to stage, the padded
    output width (0 when none), whether the bias needs a unit-stride copy, whether an
    accumulator must go through a TMA-aligned copy, the grid cap. `fast`: none of those
    apply, so a warm call is allocate + launch (`out_shape`, `out_dtype`, `device`)."""

    __slots__ = ("fn", "stage_a", "stage_b", "pad_cols", "bias_copy", "acc_copy",
                 "max_clusters", "fast", "out_shape", "out_dtype", "device", "dev_index", "swap")

    def __init__(self, fn, stage_a, stage_b, pad_cols, bias_copy, acc_copy, max_clusters,
                 out_shape=None, out_dtype=None, device=None, accumulate=False, split=False,
                 swap=False):
        self.fn, self.stage_a, self.stage_b = fn, stage_a, stage_b
        self.pad_cols, self.bias_copy, self.max_clusters = pad_cols, bias_copy, max_clusters
        self.acc_copy = acc_copy
        # The bucket swaps operands: the kernel computes C^T = op(B)^T A^T into C.t(), and
        # stage_a / stage_b refer to the kernel's A (the caller's B) and B (the caller's A).
        self.swap = swap
        self.fast = not (stage_a or stage_b or pad_cols or bias_copy or accumulate or split
                         or swap)
        self.out_shape, self.out_dtype, self.device = out_shape, out_dtype, device
        self.dev_index = None if device is None else device.index


def _make_plan(op, a, b, b_form, bias, out_dtype, acc, m, n, k, tier=0):
    """`tier`: 0 for 16-bit operands; K per chunk (an int) when a and b are the fp32 tier's
    16-bit parts (K-major [rows, K'], b as [N, K']), whose bucket comes from the fp32 table
    at the original K; TF32 for fp32 operands on the TF32 kernels (both K-major: any other
    layout is staged)."""
    arch = arch_of(a.device)
    tf32 = tier == TF32
    split_in = 0 if tf32 else tier
    dtype = TF32 if tf32 else _NAMES[a.dtype]
    forced = _forced.name
    table_dtype = "fp32" if split_in else dtype
    bucket = (dispatch.bucket_by_name(arch, forced) if forced
              else dispatch.lookup(op, table_dtype, arch, m, n, k))
    if forced and table_dtype not in bucket.dtypes:
        raise ValueError(f"force_bucket: bucket {forced!r} serves {'/'.join(bucket.dtypes)}, "
                         f"not this call's {table_dtype} operands")
    if tf32 and not forced:
        bucket = tf32_orientation(op, arch, bucket, a, b, b_form, m, n, k)
    swap = bucket.swap_ab and not split_in
    if swap:  # the kernel's A is op(B)^T ([N, K]), its B the caller's A ([M, K], "nk")
        a, b, b_form = swapped_operands(a, b, b_form)
    if split_in:  # K-major parts, B's [N, K'] or its N-major [K', N] (`split.columns_apply`)
        stage_a = stage_b = None
        a_major, b_form_eff, b_contig = "k", b_form, "last"
    else:
        a_unit, b_contig = _unit_dim(a), _unit_dim(b)
        if a_unit == "first" and bucket.tile[0] < 64:
            a_unit = None  # a row tile loads BM-row boxes of a K-major A: stage an M-major one
        if tf32:  # the TF32 kernels read B K-major only; A too, but sm90 reads an
            # M-major A through registers (kernels/sm90_base.py `ARegs`) where the tile
            # does that well: with a swapped bucket that is dX's weight, read in place
            in_regs = arch == "sm90" and sm90_limits.reads_a_in_registers(bucket.tile[0],
                                                                          bucket.pingpong)
            a_unit = a_unit if a_unit == "last" or (a_unit == "first" and in_regs) else None
            b_contig = b_contig if _k_major_b(b_form, b_contig) else None
        stage_a = stage_b = None
        if a_unit is None:  # padded in its own layout, else copied K-major
            a_unit = padded_staging(a, 1, bucket.tile[0] >= 64)  # None for fp32 (TF32)
            stage_a = "pad" if a_unit else "k"
        a_major = "m" if a_unit == "first" else "k"
        b_form_eff = b_form
        if b_contig is None:
            b_contig = padded_staging(b, 1 if b_form == "nk" else 0)
            stage_b = "pad" if b_contig else "k"
        if stage_b == "k":  # staged B is [N, K] K-major
            b_form_eff, b_contig = "nk", "last"
    # Rows TMA would store as half sectors keep the TMA store here: linear layers of such
    # widths ran at 0.96-1.00x with the threads' stores (bench/results/half-sector-ab_*).
    c_direct, pad_cols = output_rows(arch, bucket, n, out_dtype,
                                     acc is None and not split_in and not tf32)
    key = kcompile.KernelKey.for_bucket(
        bucket, dtype=dtype, out_dtype=_NAMES[out_dtype], a_major=a_major, b_form=b_form_eff,
        b_contig=b_contig, has_bias=bias is not None, arch=_gpu_arch(arch, a.device),
        accumulate=acc is not None, split=bool(split_in), swap_ab=swap, c_direct=c_direct)
    max_clusters = max_clusters_for(a.device, bucket.cluster)
    bias_copy = bias is not None and not needs.BIAS.meets(bias)
    acc_copy = acc is not None and (pad_cols > 0 or _unit_dim(acc) != "last")
    return _Plan(kcompile.get(key), stage_a, stage_b, pad_cols, bias_copy, acc_copy,
                 max_clusters, (m, n), out_dtype, a.device, accumulate=acc is not None,
                 split=bool(split_in), swap=swap)


def tf32_orientation(op, arch, bucket, a, b, b_form, m, n, k):
    """The bucket a TF32 call runs on. sm90's TF32 kernels read an M-major A through
    registers but B K-major only: where the caller's B is M- or N-major (mm's [K, N] weight,
    the mode's dX = dY @ W) and A K-major, the call runs swapped, C^T = op(B)^T A^T, so B
    is the kernel's A and is read in place, on the bucket the table picks for the transposed
    problem (N, M, K). Unless that bucket swaps itself (the table prefers this orientation:
    B is staged K-major) or does not read A through registers well
    (`sm90_limits.reads_a_in_registers`)."""
    b_unit = _unit_dim(b)
    if (arch != "sm90" or bucket.swap_ab or b_unit is None or _unit_dim(a) != "last"
            or _k_major_b(b_form, b_unit)):
        return bucket
    flipped = dispatch.lookup(op, TF32, arch, n, m, k)
    if flipped.swap_ab or not sm90_limits.reads_a_in_registers(flipped.tile[0],
                                                                flipped.pingpong):
        return bucket
    return dataclasses.replace(flipped, swap_ab=True)


def swapped_operands(a, b, b_form):
    """(A', B', "nk") with A' @ B'^T = (A @ op(B))^T: A' = op(B)^T as [N, K], B' = A."""
    return (b if b_form == "nk" else b.t()), a, "nk"


_KEY_TIER = 3  # where `_key` puts the tier


def _key(a, b, b_form, bias, out_dtype, op="fwd", acc=None, tier=0):
    """Everything the plan and the input checks depend on, so a hit needs neither again.
    (Built on every call: attribute reads in one tuple; fp32 inputs also read the precision,
    which decides their `tier`: the TF32 kernels or the split tier.)"""
    dt = a.dtype
    if dt is _F32 and not tier:
        tier = _fp32_route(op)
    return (op, b_form, out_dtype, tier, a.shape, a.stride(), b.shape, b.stride(), dt, b.dtype,
            a.device, b.device, not a.data_ptr() & 15, not b.data_ptr() & 15,
            None if bias is None else (bias.shape, bias.dtype, bias.device, bias.stride()),
            None if acc is None else (acc.shape, acc.dtype, acc.device, acc.stride(),
                                      not acc.data_ptr() & 15),
            _forced.name, _forced.family)


def _plan_for(op, a, b, b_form, bias, out_dtype, acc, key, m, n, k, tier=0):
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(op, a, b, b_form, bias, out_dtype, acc, m, n, k, tier)
        if len(_plans) > 8192:
            _plans.clear()
        _plans[key] = plan
    return plan


def gemm(a: torch.Tensor, b: torch.Tensor, b_form: str, bias: torch.Tensor | None,
         out_dtype: torch.dtype | None, key=None, plan=None, op: str = "fwd",
         acc: torch.Tensor | None = None, out: torch.Tensor | None = None,
         split_in: int = 0) -> torch.Tensor:
    """C = A @ op(B) (+ bias), op(B) = B^T for b_form 'nk', B for 'kn'. Validated inputs.

    `op` picks the dispatch table (fwd | dx | dw). With `acc` (fp32 [M, N], dW +=) the
    chain continues from acc's values and the result is written back into acc, which is
    returned; out_dtype must then be fp32 and bias None. `out` ([M, N] of out_dtype) receives
    the result: written in place when TMA can address it, else copied in. fp32 inputs run
    the fp32 tier: the TF32 kernels at precision "tf32" (fwd/dX), else the split (`split`),
    whose inner call on the 16-bit parts passes `split_in` (original K per chunk)."""
    m, k = a.shape
    n = b.shape[0] if b_form == "nk" else b.shape[1]
    out_dtype = out_dtype or a.dtype
    if m == 0:
        if acc is not None or out is not None:
            return acc if acc is not None else out
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    if a.device.type == "cpu":
        c = _on_cpu(a, b, b_form, bias, out_dtype, acc, op)
        return out.copy_(c) if out is not None else c
    tier = split_in
    if a.dtype is _F32 and not split_in:  # the route `checked_gemm`'s key already read
        tier = key[_KEY_TIER] if key is not None else _fp32_route(op)
        if tier != TF32:
            return _gemm_fp32(a, b, b_form, bias, out_dtype, op, acc, out)
    if plan is None:
        if split_in:  # the fp32 table is keyed by the real K (split_in: K per chunk)
            k = k // split.CHUNK_K * split_in
        plan = _plan_for(op, a, b, b_form, bias, out_dtype, acc,
                         key or _key(a, b, b_form, bias, out_dtype, op, acc, tier), m, n, k, tier)
    if plan.swap:
        a, b, b_form = swapped_operands(a, b, b_form)
    if plan.stage_a:
        a = stage_padded(a) if plan.stage_a == "pad" else stage_k_major(a, True)
    if plan.stage_b:
        b = stage_padded(b) if plan.stage_b == "pad" else stage_k_major(b, b_form == "nk")
    if plan.bias_copy:
        bias = needs.conform(bias, needs.BIAS)
    if acc is not None and not plan.acc_copy:
        c = acc
    elif out is not None and not plan.pad_cols and _unit_dim(out) == "last":
        c = out
    else:
        if plan.pad_cols:
            c = torch.empty((m, plan.pad_cols), dtype=out_dtype, device=a.device)[:, :n]
        else:
            c = torch.empty((m, n), dtype=out_dtype, device=a.device)
        if acc is not None:
            c.copy_(acc)
    launch_on(a.device, plan.fn, a, b, c.t() if plan.swap else c, bias, plan.max_clusters)
    if acc is not None:
        if plan.acc_copy:
            acc.copy_(c)
        return acc
    if out is not None:
        return out if c is out else out.copy_(c)
    return c.contiguous() if plan.pad_cols else c


def _fp32_route(op: str):
    """How an fp32 GEMM of `op` runs here: TF32 (the TF32 kernels, at precision "tf32",
    fwd and dX) or 0 (the split tier: precision "ieee", and dW always)."""
    return TF32 if op != "dw" and split.precision() == TF32 else 0


def _gemm_fp32(a, b, b_form, bias, out_dtype, op, acc, out):
    """The fp32 tier's full precision on the GPU (`split`). fwd/dX: scale and split both
    operands into fp16 parts, one chunked GEMM into a scaled fp32 accumulator, then unscale,
    bias and the one rounding (`split.finish`: one kernel); with few rows
    (`split_decode.applies`) W's split runs inside the GEMM instead, with the same bits (a
    B given N-major, "kn": read in place or through its K-major copy, `applies_kn`).
    Otherwise a B given N-major (dX's weight, mm's [K, N]) is split in place into N-major
    parts (`split.scaled_columns_cuda`), not copied K-major.
    dW: exact bf16 parts, no scales, the chunked GEMM continuing `acc`. (Precision "tf32"
    runs the TF32 kernels through the plain path.)"""
    b_nk = b if b_form == "nk" else b.t()
    if op == "dw":
        a2, b2 = split.exact_operand_cuda(a, "a"), split.exact_operand_cuda(b_nk, "b")
        y = gemm(a2, b2, "nk", None, torch.float32, op=op, acc=acc,
                 split_in=split.EXACT_BLOCK_K)
        if acc is not None:
            return acc
    elif _forced.name is None and split_decode.applies(a, b_nk, acc, op):  # W split in-GEMM
        y, bias = launch_on(a.device, split_decode.decode_gemm, a, b_nk, bias), None
    elif _forced.name is None and b_form == "kn" and split_decode.applies_kn(a, b, acc, op):
        y, bias = launch_on(a.device, split_decode.decode_gemm_kn, a, b, bias), None
    else:
        a2, sa = split.scaled_operand_cuda(a, "a")
        if b_form == "kn" and arch_of(a.device) == "sm90" and split.columns_apply(b):
            # dX's W (or mm's [K, N] weight): split in place, the parts read N-major
            (b2, sb), b2_form = split.scaled_columns_cuda(b), "kn"
        else:
            (b2, sb), b2_form = split.scaled_operand_cuda(b_nk, "b"), "nk"
        c = None if acc is None else split.scale_acc(acc, sa, sb)
        c = gemm(a2, b2, b2_form, None, torch.float32, op=op, acc=c, split_in=split.BLOCK_K)
        if acc is not None:
            return acc.copy_(split.unscale(c, sa, sb))
        y = split.finish(c, sa, sb, bias, out_dtype)  # unscale, bias, rounding: one kernel
        return out.copy_(y) if out is not None else y
    y = split.biased_rounded(y, bias, out_dtype)
    return out.copy_(y) if out is not None else y


def _on_cpu(a, b, b_form, bias, out_dtype, acc=None, op="fwd"):
    """CPU tensors: the bit-exact reference of the SM90 chain (same bits, much slower).
    `op` matters for fp32 inputs only: dW runs the fp32 tier's exact-parts scheme. The
    user tables are read as a GPU call reads them, so a bad DETGEMM_CUTE_CONFIG is reported
    here too (ConfigError)."""
    from . import reference

    registry.user_configs()

    b_kn = b.t() if b_form == "nk" else b
    if a.dtype == torch.float32:
        y = reference.chain(a, b_kn, acc, op=op, precision=split.precision())
        if acc is not None:
            return acc.copy_(y)
        y = y if bias is None else y + bias
        return reference.canonical_nans(y.to(out_dtype))
    if acc is not None:
        return acc.copy_(reference.chain(a, b_kn, acc, op=op))
    if b_form == "nk":
        return reference.linear(a, b, bias, out_dtype=out_dtype)
    if bias is None:
        return reference.mm(a, b, out_dtype=out_dtype)
    return reference.addmm(bias, a, b, out_dtype=out_dtype)


def checked_gemm(a, b, b_form, bias, out_dtype, op_name, names, op="fwd"):
    """Validate (clear Python errors before any launch), then run. A call whose key (shapes,
    dtypes, strides, devices, alignment) already has a plan passed these checks before; if
    that plan needs no staging, the call is one allocation and the launch."""
    try:
        key = _key(a, b, b_form, bias, out_dtype, op)
        plan = _plans.get(key)
    except AttributeError:  # not tensors: let the checks name the argument
        key = plan = None
    if plan is None:
        check_gemm_args(a, b, b_form, bias, out_dtype, op_name, names)
    elif plan.fast and plan.dev_index == _current_device():
        c = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=plan.device)
        plan.fn(a, b, c, bias, plan.max_clusters)
        return c
    return gemm(a, b, b_form, bias, out_dtype, key, plan, op)


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def launch_on(device: torch.device, fn, *args):
    """fn(*args) with `device` the current CUDA device (kernels launch on the current one)."""
    dev = device.index
    if dev is not None and dev != _current_device():
        with torch.cuda.device(dev):
            return fn(*args)
    return fn(*args)


registry.on_change(_plans.clear)

__all__ = ["gemm", "checked_gemm", "force_bucket", "use_family", "arch_of", "_MAX_DIM"]
