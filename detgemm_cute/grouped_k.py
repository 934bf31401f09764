"""The one-launch grouped GEMM with groups along K (grouped_mm's 2-D x 2-D form) on SM90.

``out[g] = a[:, group g] @ b[group g, :]`` for a [M, T], b [T, N] and offs [G] (int32
cumulative ends along T, on the device) -> out [G, M, N]: the weight gradient of a
mixture-of-experts layer (a = x^T, b = dY, T the tokens sorted by expert). The kernel
(`kernels.sm90.Sm90GemmGroupedK`) reads offs on the device and runs every (M tile, N tile,
group) of the output, each over its own group's k tiles, so the whole call is one launch that
a CUDA graph can capture. Every entry is the chain of its group alone: its bits equal
`dg.mm(a[:, group g], b[group g, :])`, whatever the other groups hold. An empty group's entry
is zeros; columns of a past offs[-1] are read by nothing.

The bucket comes from the table's ``op: grouped_k`` buckets, keyed by M, N and the tokens per
group on average (ceil(T / G)). The kernel reads a M-contiguous and b N-contiguous (as the
MoE backward passes them: x^T and dY), with 16-byte-aligned rows: a TMA box starts at each
group's start along T, which must not fall inside a 16-byte granule of the contiguous
dimension (a T-contiguous box at an unaligned column traps). An operand in another layout is
copied once into that layout (its rows padded to 16 bytes), which costs one pass over it.
"""

from __future__ import annotations

import torch

from . import compile as kcompile
from .gemm import (_NAMES, _gpu_arch, _unit_dim, direct_align, launch_on, max_clusters_for,
                   output_rows)
from .grouped import Plan, PlanCache, table_bucket
from .kernels import tensor_needs as needs

OP = "grouped_k"


def _t_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, T] as a view of a fresh [T, Rp] buffer (R contiguous, rows padded to 16 bytes):
    the layout the kernel reads."""
    r, t = x.shape
    el = needs.VEC_BYTES // x.element_size()
    buf = torch.empty((t, -(-r // el) * el), dtype=x.dtype, device=x.device)[:, :r]
    return buf.copy_(x.t()).t()


def bucket_for(a, b, groups: int):
    """The grouped_k bucket for this call, or None when it runs one GEMM per group (another
    kernel family, fp32 inputs, a forced bucket that is not a grouped_k one)."""
    if a.dtype not in (torch.bfloat16, torch.float16) or groups < 1:
        return None
    m, t = a.shape
    return table_bucket(OP, a, m, b.shape[1], max(1, -(-t // groups)))


def kernel_key(bucket, a, b, out_dtype, c_direct: bool = False) -> kcompile.KernelKey:
    """The kernel a call on `bucket` runs (also what a bench prebuilds): one layout, a
    M-contiguous and b N-contiguous (`_make_plan` copies other layouts into it); a direct
    store writes the fresh output's rows 8 bytes at a time where their pitch allows."""
    return kcompile.KernelKey.for_bucket(
        bucket, dtype=_NAMES[a.dtype], out_dtype=_NAMES[out_dtype], a_major="m", b_form="kn",
        b_contig="last", has_bias=False, grouped_k=True, c_direct=c_direct,
        c_align=direct_align(c_direct, b.shape[1], out_dtype), arch=_gpu_arch("sm90", a.device))


def _make_plan(a, b, offs, out_dtype):
    bucket = bucket_for(a, b, offs.shape[0])
    if bucket is None:
        return None
    c_direct, pad_cols = output_rows("sm90", bucket, b.shape[1], out_dtype, True)
    return Plan(kcompile.get(kernel_key(bucket, a, b, out_dtype, c_direct)),
                 _unit_dim(a) != "first", _unit_dim(b) != "last", pad_cols,
                 max_clusters_for(a.device, bucket.cluster))


def _run(plan, a, b, offs, out_dtype):
    (m, t), n, groups = a.shape, b.shape[1], offs.shape[0]
    if not (m and n and t):  # nothing to read: every entry is zeros (or there are none)
        return torch.zeros((groups, m, n), dtype=out_dtype, device=a.device)
    if plan.stage_a:
        a = _t_rows(a)
    if plan.stage_b:
        b = _t_rows(b.t()).t()
    if plan.pad_cols:
        out = torch.empty((groups, m, plan.pad_cols), dtype=out_dtype,
                          device=a.device)[..., :n]
    else:
        out = torch.empty((groups, m, n), dtype=out_dtype, device=a.device)
    launch_on(a.device, plan.fn, a, b, out, needs.conform(offs, needs.OFFS), plan.max_clusters)
    return out.contiguous() if plan.pad_cols else out


_cache = PlanCache(_make_plan, _run)
# planned(a, b, offs, out_dtype): the warm call, or None; grouped_mm_k(a, b, offs, out_dtype):
# out [G, M, N] in one launch (checked inputs on a CUDA device), or None when this call runs
# one GEMM per group (see `bucket_for`).
planned, grouped_mm_k = _cache.planned, _cache.call

__all__ = ["grouped_mm_k", "planned", "kernel_key", "bucket_for"]
