"""The eager batched GEMM path (bmm): validate, pick the bucket, stage what TMA cannot take,
one launch for every batch entry.

``C[l] = A[l] @ op(B[l]) (+ bias)`` for l in 0..L-1, each entry the same chain as `dg.mm` on
that entry alone: the kernels take the batch as their L mode (grid z, or part of the
persistent tile index), and a tile never spans two entries. So an entry's bits do not
depend on L, on the other entries, or on the tile chosen.

Layouts taken without copies: every entry's last two dims as `gemm` takes them (either dim
contiguous), with a batch stride that is a multiple of 16 bytes. A weight shared by all
entries (batch stride 0, e.g. ``w.expand(L, K, N)``) with a K-major A whose batch folds into
its rows runs as one 2-D GEMM of L*M rows (the same chain per row). A K-major A whose rows
TMA cannot address (p @ v's softmax rows at an odd sequence length: a row pitch that is not a
multiple of 16 bytes) is read by the producer warpgroup itself on SM90 tiles of BM >= 64, for
K >= 256 (`KernelKey.a_loads`, kernels/sm90_a_rows.py). Anything else TMA cannot address is
copied once into a K-major buffer (K zero-padded to a multiple of 8, which adds exact zero
products: the bits do not change).
"""

from __future__ import annotations

import dataclasses

import torch

from . import compile as kcompile
from . import dispatch, registry, split
from .errors import check_bmm_args
from .kernels import sm90_limits
from .kernels import tensor_needs as needs
from .gemm import (_NAMES, TF32, _forced, _gpu_arch, arch_of, gemm, launch_on,
                   direct_align, max_clusters_for, output_rows, stage_k_major)

_GRID_Z = 65535  # the one-CTA-per-tile kernels put the batch on grid z
_plans: dict = {}


def _inner_unit(t: torch.Tensor) -> str | None:
    """Which of the last two dims of a 3-D operand TMA can take as contiguous ("last" or
    "first"), or None when it must be staged: as `gemm._unit_dim` per entry, plus a batch
    stride that is a nonzero multiple of 16 bytes (or a single entry); `tensor_needs`."""
    return needs.tma_unit_dim(t)


# Below this K the copy into padded rows was faster: each tile waits one memory latency
# before its first k tile (H100, p @ v, threads / staged: S = 77: 0.75x, 129: 0.89x, 201:
# 1.03x, 333: 1.18-1.25x; bench/results/a-rows-ab_*).
A_ROWS_MIN_K = 256


def reads_a_rows(arch: str, bucket, k: int = A_ROWS_MIN_K) -> bool:
    """Whether `bucket`'s tile reads a K-major A of unaligned rows (K = `k`) with the
    producer warpgroup (`KernelKey.a_loads`): SM90 tiles of BM >= 64 (row tiles load BM-row
    TMA boxes into stages BM rows apart; the producer's rows are laid out for 64 and up) and
    BK = 64 (one 128-byte swizzle atom a row), not swapped, K >= A_ROWS_MIN_K, and whose
    shared memory holds the raw ring of A's rows beside 2 stages at least
    (`sm90_limits.a_rows_stages`)."""
    return (arch == "sm90" and bucket.tile[0] >= 64 and bucket.tile[2] == 64
            and not getattr(bucket, "swap_ab", False) and k >= A_ROWS_MIN_K
            and sm90_limits.a_rows_stages(bucket.tile, bucket.stages) > 0)


def with_a_loads(key):
    """`key` reading A with the producer warpgroup: on the persistent kernel (the one with
    a producer warpgroup), without A multicast (cluster [CM, 1]), with at most 3 stages, and
    fewer where the raw ring of A's rows (which carries the reads' latency) needs their
    shared memory (`sm90_limits.a_rows_stages`; `reads_a_rows` is the caller's check).
    Neither the schedule, the cluster nor the stages change an entry's chain."""
    return dataclasses.replace(key, a_loads=True, persistent=True, cluster=(key.cluster[0], 1),
                               stages=sm90_limits.a_rows_stages(key.tile, key.stages))


def plan_key(key):
    """The kernel a bmm plan runs for `key`: outputs the tile's threads store (`c_direct`)
    run without a multicast cluster. Their epilogue is slower than a TMA store, and the
    CTAs of a cluster wait on each other's stage releases: on an H100 the 2x1 cluster of
    128x128 tiles ran q @ k^T at S = 1000/3000 (head_dim 128) at 0.73x/0.69x torch.bmm, the
    same tile without it at 0.91x/0.96x (bench/results/tune/bmm_qk_cluster_*). The cluster
    never changes an entry's chain."""
    if key.c_direct and key.cluster != (1, 1):
        return dataclasses.replace(key, cluster=(1, 1))
    return key


class _Plan:
    __slots__ = ("fn", "stage_a", "stage_b", "pad_cols", "max_clusters", "chunk")

    def __init__(self, fn, stage_a, stage_b, pad_cols, max_clusters, chunk):
        self.fn, self.stage_a, self.stage_b = fn, stage_a, stage_b
        self.pad_cols, self.max_clusters, self.chunk = pad_cols, max_clusters, chunk


def kernel_layout(a, b, bias, out_dtype, bucket):
    """How `bucket` runs this call: (KernelKey, stage_a, stage_b, pad_cols). Outputs the
    tile's threads store run the bucket's `direct` kernel where it has one (their epilogue
    favours other tiles than TMA stores do), and its `direct_vector` kernel where they store
    8 bytes at a time (`direct_align`; on an H200 a 128x256 tile ran such q @ k^T rows
    1.17-1.23x faster than a 64x256 but element-stored ones 0.72-0.75x as fast,
    bench/results/tune/bmm_qk_direct_nvidia-h200.json.gz). Benchmarks use it to compile a
    sweep's kernels ahead, in parallel."""
    dtype = TF32 if a.dtype == torch.float32 else _NAMES[a.dtype]
    arch = arch_of(a.device)
    c_direct, pad_cols = output_rows(arch, bucket, b.shape[2], out_dtype, dtype != TF32,
                                     half_sectors=True)
    own = bucket.direct_kernel(direct_align(c_direct, b.shape[2], out_dtype)) if c_direct else None
    if own is not None:  # the bucket's kernel for such outputs
        bucket = own
        c_direct, pad_cols = output_rows(arch, bucket, b.shape[2], out_dtype, dtype != TF32,
                                         half_sectors=True)
    a_unit, b_unit = _inner_unit(a), _inner_unit(b)
    if a_unit == "first" and bucket.tile[0] < 64:
        a_unit = None  # row tiles load BM-row boxes of a K-major A
    if dtype == TF32:  # the TF32 kernels read both operands K-major: b [L, K, N] K-first
        a_unit = a_unit if a_unit == "last" else None
        b_unit = b_unit if b_unit == "first" else None
    stage_a, stage_b = a_unit is None, b_unit is None
    b_form, b_contig = ("nk", "last") if stage_b else ("kn", b_unit)
    a_loads = (stage_a and dtype != TF32 and needs.a_rows(batched=True).meets(a)
               and reads_a_rows(arch, bucket, a.shape[2]))
    stage_a = stage_a and not a_loads
    key = kcompile.KernelKey.for_bucket(
        bucket, dtype=dtype, out_dtype=_NAMES[out_dtype], a_major="m" if a_unit == "first"
        else "k", b_form=b_form, b_contig=b_contig, has_bias=bias is not None,
        arch=_gpu_arch(arch, a.device), batched=True, c_direct=c_direct,
        c_align=direct_align(c_direct, b.shape[2], out_dtype))
    return plan_key(with_a_loads(key) if a_loads else key), stage_a, stage_b, pad_cols


def _make_plan(a, b, bias, out_dtype, lb, m, n, k):
    arch = arch_of(a.device)
    dtype = TF32 if a.dtype == torch.float32 else _NAMES[a.dtype]
    forced = _forced.name
    bucket = (dispatch.bucket_by_name(arch, forced) if forced
              else dispatch.lookup("bmm", dtype, arch, m, n, k))
    if forced and dtype not in bucket.dtypes:
        raise ValueError(f"force_bucket: bucket {forced!r} serves {'/'.join(bucket.dtypes)}, "
                         f"not this call's {dtype} operands")
    key, stage_a, stage_b, pad_cols = kernel_layout(a, b, bias, out_dtype, bucket)
    max_clusters = max_clusters_for(a.device, key.cluster)
    chunk = lb if key.persistent and arch == "sm90" else _GRID_Z
    return _Plan(kcompile.get(key), stage_a, stage_b, pad_cols, max_clusters, chunk)


def _shared_weight_rows(a, b) -> bool:
    """b is one [K, N] matrix for every entry and a's entries fold into L*M rows of a
    K-major [L*M, K] view: the batch is then one 2-D GEMM (the same chain per row)."""
    lb, m, _ = a.shape
    return (lb > 1 and b.stride(0) == 0 and a.stride(2) == 1
            and a.stride(0) == m * a.stride(1))


def _key(a, b, bias, out_dtype):
    """Everything the plan and the input checks depend on (attribute reads, one tuple)."""
    return (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, b.device,
            out_dtype, not a.data_ptr() & 15, not b.data_ptr() & 15,
            None if bias is None else (bias.shape, bias.dtype, bias.device, bias.stride()),
            _forced.name, _forced.family)


def bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None, key=None) -> torch.Tensor:
    """C [L, M, N] = a [L, M, K] @ b [L, K, N] (+ bias [N]) per entry. Validated inputs;
    `key` is `_key` of this call when the caller has built it already."""
    lb, m, k = a.shape
    n = b.shape[2]
    out_dtype = out_dtype or a.dtype
    if lb == 0 or m == 0 or n == 0 or k == 0:
        r = torch.zeros((lb, m, n), dtype=torch.float32, device=a.device)
        r = (r + bias.float() if bias is not None else r).to(out_dtype)
        return _cpu_nans(r)
    if a.device.type == "cpu":
        return _on_cpu(a, b, bias, out_dtype)
    if lb == 1:  # one entry: the 2-D path (same chain; any batch stride)
        return gemm(a[0], b[0], "kn", bias, out_dtype, op="fwd").unsqueeze(0)
    if _shared_weight_rows(a, b):
        return gemm(a.reshape(lb * m, k), b[0], "kn", bias, out_dtype, op="fwd").view(lb, m, n)
    if a.dtype == torch.float32:
        if split.precision() != TF32:  # "ieee": the split tier, entry by entry (2-D GEMMs)
            return torch.stack([gemm(a[i], b[i], "kn", bias, out_dtype, op="fwd")
                                for i in range(lb)])
    if key is None:
        key = _key(a, b, bias, out_dtype)
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(a, b, bias, out_dtype, lb, m, n, k)
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = plan
    if plan.stage_a:
        a = stage_k_major(a, True)
    if plan.stage_b:
        b = stage_k_major(b, False)  # [L, N, Kp]: the "nk" form
    if bias is not None:
        bias = needs.conform(bias, needs.BIAS)
    if plan.pad_cols:
        c = torch.empty((lb, m, plan.pad_cols), dtype=out_dtype, device=a.device)[:, :, :n]
    else:
        c = torch.empty((lb, m, n), dtype=out_dtype, device=a.device)
    launch_on(a.device, _launch, plan, a, b, c, bias, lb)
    return c.contiguous() if plan.pad_cols else c


def _launch(plan, a, b, c, bias, lb):
    if lb <= plan.chunk:
        plan.fn(a, b, c, bias, plan.max_clusters)
        return
    for s in range(0, lb, plan.chunk):
        e = min(lb, s + plan.chunk)
        plan.fn(a[s:e], b[s:e], c[s:e], bias, plan.max_clusters)


def _cpu_nans(t):
    """NaNs the CPU computed, as the reference models the GPU's (`canonical_nans`)."""
    if t.device.type != "cpu":
        return t
    from . import reference

    return reference.canonical_nans(t)


def _on_cpu(a, b, bias, out_dtype):
    """CPU tensors: the bit-exact reference, entry by entry (a bad DETGEMM_CUTE_CONFIG is
    reported as on a GPU)."""
    from . import reference

    registry.user_configs()

    rows = [reference.mm(a[i], b[i], out_dtype=out_dtype) if bias is None
            else reference.addmm(bias, a[i], b[i], out_dtype=out_dtype)
            for i in range(a.shape[0])]
    return torch.stack(rows)


def checked_bmm(a, b, bias, out_dtype, op_name, names=("a", "b", "bias")):
    """Validate (clear errors before any launch), then run. A call whose key already has a
    plan passed these checks before, so a warm call skips them."""
    try:
        key = _key(a, b, bias, out_dtype)
        hit = key in _plans
    except (AttributeError, TypeError):  # not tensors, unhashable: the checks name them
        key, hit = None, False
    if not hit:
        check_bmm_args(a, b, bias, out_dtype, op_name, names)
    return bmm(a, b, bias, out_dtype, key=key)


registry.on_change(_plans.clear)

__all__ = ["bmm", "checked_bmm", "kernel_layout", "plan_key", "reads_a_rows", "with_a_loads"]
