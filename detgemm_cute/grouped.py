"""The one-launch grouped GEMM (grouped_mm's mixture-of-experts form) on SM90.

``out[rows of group g] = x[rows of group g] @ w[g]`` for x [T, K] with its rows sorted by
group, w [G, K, N] and offs [G] (int32 cumulative row ends, on the device). The grouped
kernel (`kernels.sm90.Sm90GemmGrouped`) reads offs on the device and walks the groups' own
row tiles, so the whole call is one launch that a CUDA graph can capture. Every row is the
chain of that row alone with its group's weight: its bits equal `dg.mm` of that row and
weight, whatever the other groups hold. Rows past offs[-1] are zeros.

The bucket comes from the table's ``op: grouped`` buckets, keyed by the rows per group on
average (ceil(T / G)), N and K. Layouts taken without copies: x K-major, w with N or K
contiguous (16-byte-aligned strides); anything else is copied once into a K-major buffer
(K zero-padded to a multiple of 8: exact zero products, the same bits).
"""

from __future__ import annotations

import torch

from . import compile as kcompile
from . import dispatch, registry
from .batched import _inner_unit
from .gemm import (_NAMES, _forced, _gpu_arch, arch_of, launch_on, max_clusters_for,
                   padded_width, stage_k_major)
from .kernels import tensor_needs as needs
from .kernels.sm90_limits import GROUPED_MAX_GROUPS


class Plan:
    """A one-launch grouped call's kernel, which operands it copies first (`stage_a`,
    `stage_b`), the padded output width (0: none) and the persistent grid."""

    __slots__ = ("fn", "stage_a", "stage_b", "pad_cols", "max_clusters")

    def __init__(self, fn, stage_a, stage_b, pad_cols, max_clusters):
        self.fn, self.stage_a, self.stage_b = fn, stage_a, stage_b
        self.pad_cols, self.max_clusters = pad_cols, max_clusters


def _bucket(x, w):
    """The grouped bucket for this call, or None when it runs one GEMM per group (another
    kernel family, fp32 inputs, more groups than the kernel's table holds, a forced
    bucket that is not a grouped one)."""
    if (x.dtype not in (torch.bfloat16, torch.float16)
            or not 0 < w.shape[0] <= GROUPED_MAX_GROUPS):
        return None
    t, k = x.shape
    groups, _, n = w.shape
    return table_bucket("grouped", x, max(1, -(-t // groups)), n, k)


def table_bucket(op: str, x: torch.Tensor, m: int, n: int, k: int):
    """The `op` bucket of a one-launch grouped call with 16-bit operands like `x` (table key
    m, n, k), or None off SM90 or under a forced bucket of another op."""
    arch = arch_of(x.device)
    if arch != "sm90":
        return None
    if _forced.name:
        b = dispatch.bucket_by_name(arch, _forced.name)
        return b if b.op == op else None
    return dispatch.lookup(op, _NAMES[x.dtype], arch, m, n, k)


def _operand_units(x, w):
    """(x's unit dim, w's unit dim): None where the operand is staged into a K-major copy."""
    return ("last" if _inner_unit(x.unsqueeze(0)) == "last" else None), _inner_unit(w)


def kernel_key(bucket, x, w, out_dtype, b_unit="derive") -> kcompile.KernelKey:
    """The kernel a call with these operands runs on `bucket` (also what a bench
    prebuilds): w's layout (`b_unit`, derived from w unless given) picks the B form."""
    if b_unit == "derive":
        b_unit = _operand_units(x, w)[1]
    b_form, b_contig = ("nk", "last") if b_unit is None else ("kn", b_unit)
    return kcompile.KernelKey.for_bucket(
        bucket, dtype=_NAMES[x.dtype], out_dtype=_NAMES[out_dtype], a_major="k",
        b_form=b_form, b_contig=b_contig, has_bias=False, grouped=True,
        arch=_gpu_arch("sm90", x.device))


def _make_plan(bucket, x, w, out_dtype):
    a_unit, b_unit = _operand_units(x, w)
    max_clusters = max_clusters_for(x.device, bucket.cluster)
    return Plan(kcompile.get(kernel_key(bucket, x, w, out_dtype, b_unit)), a_unit is None,
                 b_unit is None, padded_width(w.shape[2], out_dtype), max_clusters)


def plan_key(x, w, offs, out_dtype):
    """Everything the plan and the input checks depend on (attribute reads, one tuple)."""
    return (x.shape, x.stride(), w.shape, w.stride(), x.dtype, w.dtype, x.device, w.device,
            out_dtype, offs.shape, offs.dtype, offs.device, not x.data_ptr() & 15,
            not w.data_ptr() & 15, _forced.name, _forced.family)


class PlanCache:
    """The plans of a one-launch grouped op, by the call's `plan_key`: `make(a, b, offs,
    out_dtype)` builds one (None: the call runs one GEMM per group), `run(plan, a, b, offs,
    out_dtype)` launches it. Cleared whenever the registry's user layers change."""

    def __init__(self, make, run):
        self.make, self.run, self.plans = make, run, {}
        registry.on_change(self.plans.clear)

    def planned(self, a, b, offs, out_dtype) -> torch.Tensor | None:
        """The warm call: the output when a call with this key was checked and planned
        before (so its arguments pass the checks), else None (the caller checks, then
        `call`)."""
        try:
            key = plan_key(a, b, offs, out_dtype or a.dtype)
        except AttributeError:  # not tensors: the caller's checks name them
            return None
        plan = self.plans.get(key)
        return None if plan is None else self.run(plan, a, b, offs, out_dtype or a.dtype)

    def call(self, a, b, offs, out_dtype) -> torch.Tensor | None:
        """The output in one launch (checked inputs on a CUDA device), or None when this
        call runs one GEMM per group."""
        key = plan_key(a, b, offs, out_dtype)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.make(a, b, offs, out_dtype)
            if plan is None:
                return None
            if len(self.plans) > 4096:
                self.plans.clear()
            self.plans[key] = plan
        return self.run(plan, a, b, offs, out_dtype)


def _new_plan(x, w, offs, out_dtype):
    bucket = _bucket(x, w)
    return None if bucket is None else _make_plan(bucket, x, w, out_dtype)


def _run(plan, x, w, offs, out_dtype):
    if plan.stage_a:
        x = stage_k_major(x, True)
    if plan.stage_b:
        w = stage_k_major(w, False)  # [G, N, Kp]: the "nk" form
    t, n = x.shape[0], w.shape[1] if plan.stage_b else w.shape[2]
    if plan.pad_cols:
        out = torch.empty((t, plan.pad_cols), dtype=out_dtype, device=x.device)[:, :n]
    else:
        out = torch.empty((t, n), dtype=out_dtype, device=x.device)
    if t:
        launch_on(x.device, plan.fn, x, w, out, needs.conform(offs, needs.OFFS),
                  plan.max_clusters)
    return out.contiguous() if plan.pad_cols else out


_cache = PlanCache(_new_plan, _run)
# planned(x, w, offs, out_dtype): the warm call, or None; grouped_mm(x, w, offs, out_dtype):
# out [T, N] in one launch (checked inputs on a CUDA device, K and N >= 1), or None when this
# call runs one GEMM per group (see `_bucket`).
planned, grouped_mm = _cache.planned, _cache.call

__all__ = ["grouped_mm", "planned", "kernel_key", "plan_key", "Plan", "PlanCache", "table_bucket"]
