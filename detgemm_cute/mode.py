"""`batch_invariant_mode()`: PyTorch's own matmuls on CUDA, computed by detgemm.

While enabled, the CUDA kernels of ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``,
``addmv`` (plus their ``out=`` and in-place forms) and ``scaled_dot_product_attention``
are replaced through a ``torch.library.Library("aten", "IMPL")`` registration (SDPA at its
autograd key too: `attention.sdpa` says how torch's semantics map onto the invariant
attention op, and which calls still fall back). ``F.linear``, ``torch.matmul``,
``@`` and ``nn.Linear`` reach these ops on CUDA, and so does autograd: the backward of a
matmul is again ``mm``/``bmm`` on CUDA tensors, so dX and dW run on detgemm too (one fp32
chain per backward call, rounded once; accumulation of ``.grad`` across backward calls is
PyTorch's, in the parameter dtype: use `nn.convert(fp32_grad_accum=True)` for the fp32
chain across micro-batches). Disabling destroys the registration, which restores PyTorch's
kernels exactly. CPU matmuls keep PyTorch's kernels unless ``cpu=True`` (then they run the
bit-exact reference); a PyTorch built without CUDA enables the mode without error and
routes nothing on its own (`routed_devices()` says what is routed).

Semantics kept: ``addmm``/``baddbmm``/``addmv`` with beta=alpha=1 and a bias row add the bias
in fp32 before the one rounding; other beta/alpha compute ``alpha * (A @ B) + beta * self``
in fp32 from the fp32 GEMM result and round once. ``bmm``/``baddbmm`` run the whole batch in
one launch (`batched`: the same chain per entry; the batch count changes nothing), and
``_grouped_mm`` (mixture-of-experts) runs `batched_ops.grouped_mm`. The dispatch table follows the
operand layout: a transposed A is a dW-shaped GEMM (``dw`` table), a ``[K, N]``-contiguous B
a dX-shaped one (``dx``), anything else ``fwd`` -- tables change speed, never bits.

fp32 ``mm``/``addmm``/``mv``/``bmm``/``baddbmm`` run on the fp32 tier (`split`; its precision
follows ``torch.backends.cuda.matmul``'s TF32 switch or `detgemm_cute.fp32_precision`: fp32
``bmm`` is one launch at "tf32", entry by entry at "ieee"; fp32 ``_grouped_mm`` one GEMM per
group). What detgemm cannot take (other dtypes, mixed dtypes, a GPU
without detgemm kernels) falls back to PyTorch's own kernel (the original, obtained with
``torch.library.get_kernel``) with a one-time warning naming the op and what is no longer
guaranteed; ``strict=True`` raises instead. Malformed calls (wrong ranks or shapes) go to
PyTorch's kernel so its usual error comes out.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from . import batched
from .batched_ops import _grouped_impl, bias_row, broadcasts_to, scaled_sum
from .errors import GEMM_DTYPES
from .gemm import arch_of, gemm

_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_lock = threading.RLock()
_stack: list[bool] = []  # strictness of each active enable(), innermost last
_lib = None
_keys: tuple[str, ...] = ()  # dispatch keys registered now
_requested_keys: tuple[str, ...] = ()
_warned_no_backend = False
_routed: Counter = Counter()
_fell_back: Counter = Counter()
_warned: set = set()
_device_reason: dict = {}


class BatchInvariantError(RuntimeError):
    """strict=True and a matmul detgemm cannot run."""


# ----------------------------------------------------------------------------- helpers
def _device_problem(t: torch.Tensor) -> str | None:
    """Why detgemm cannot run on t's device (None when it can). Cached per device."""
    dev = t.device
    if dev.type == "cpu":
        return None if "CPU" in _keys else "CPU tensors"
    reason = _device_reason.get(dev)
    if dev not in _device_reason:
        try:
            from . import registry

            registry.get_registry(arch_of(dev))
            reason = None
        except Exception as e:  # noqa: BLE001 - the message is the reason
            reason = str(e).splitlines()[0]
        _device_reason[dev] = reason
    return reason


def _problem(*ts) -> str | None:
    dt, dev = ts[0].dtype, ts[0].device
    for t in ts:
        if t.dtype not in GEMM_DTYPES:  # every op takes fp32 (the fp32 tier)
            names = "/".join(str(d).replace("torch.", "") for d in GEMM_DTYPES)
            return f"{t.dtype} inputs (detgemm takes {names} here)"
        if t.dtype != dt:
            return f"mixed dtypes {ts[0].dtype}/{t.dtype}"
        if t.device != dev:
            return f"tensors on {dev} and {t.device}"
    return _device_problem(ts[0])


def _table(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dim() == 2 and a.stride(0) == 1 and a.stride(1) != 1 and a.shape[0] > 1:
        return "dw"  # A^T @ G: autograd's dW
    if b.stride(1) == 1 and b.shape[1] > 1:
        return "dx"  # G @ W with W [K, N] row-major: autograd's dX
    return "fwd"


def _shapes(*ts) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in ts if isinstance(t, torch.Tensor))


class _Fallback(Exception):
    pass


def _route(op: str, *ts):
    """Count a routed call, or decide a fallback (raise when strict)."""
    why = _problem(*ts)
    if why is None:
        _routed[(op, _NAMES[ts[0].dtype])] += 1
        return
    _refuse(op, why, *ts, stacklevel=5)


def _refuse(op: str, why: str, *ts, stacklevel: int = 4):
    """A call detgemm cannot take: raise under strict=True, else warn once and fall back."""
    if _stack and _stack[-1]:
        raise BatchInvariantError(
            f"batch_invariant_mode(strict=True): aten::{op} on {_shapes(*ts)} cannot run on "
            f"detgemm: {why}")
    _fell_back[(op, str(ts[0].dtype).replace("torch.", ""), why)] += 1
    if (op, why) not in _warned:
        _warned.add((op, why))
        warnings.warn(f"detgemm batch_invariant_mode: aten::{op} with {why} falls back to "
                      f"PyTorch's kernel; those results are not guaranteed to be "
                      f"batch-invariant (this warning is shown once per op and reason)",
                      stacklevel=stacklevel)
    raise _Fallback


def _mm2d(a, b, out=None, bias=None, out_dtype=None):
    """One 2-D GEMM a [M, K] @ b [K, N] (K >= 0), optional fp32 bias, into `out`."""
    m, k = a.shape
    n = b.shape[1]
    dt = out_dtype or a.dtype
    if k == 0 or n == 0:
        r = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        if bias is not None:
            r = r + bias.float()
        r = r.to(dt)
        return r if out is None else out.copy_(r)
    # fp32: the fwd scheme whatever the layout (dW's exact-parts scheme is for weight_grad),
    # so the bits of an fp32 matmul never depend on how its operands are stored.
    op = _table(a, b) if a.dtype != torch.float32 else "fwd"
    return gemm(a, b, "kn", bias, out_dtype, op=op, out=out)


def _addmm_value(self, m1, m2, beta, alpha):
    n = m2.shape[1]
    bias = bias_row(self, n) if beta == 1 and alpha == 1 else None
    if bias is not None:
        return _mm2d(m1, m2, bias=bias)
    return scaled_sum(_mm2d(m1, m2, out_dtype=torch.float32), self, beta, alpha, m1.dtype)


def _bmm_value(b1, b2, out_dtype=None, bias=None):
    return batched.bmm(b1, b2, bias, out_dtype)


def _ok_2d(a, b):
    return a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]


def _ok_3d(a, b):
    return (a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]
            and a.shape[2] == b.shape[1])


def _ok_baddbmm(self, b1, b2):
    return _ok_3d(b1, b2) and broadcasts_to(self, (b1.shape[0], b1.shape[1], b2.shape[2]))


def _into(out, r):
    if out.shape != r.shape:
        out.resize_(r.shape)
    return out.copy_(r)


# ------------------------------------------------------------------- the replacements
def _mm(a, b):
    if not _ok_2d(a, b):
        raise _Fallback
    _route("mm", a, b)
    return _mm2d(a, b)


def _mm_out(a, b, *, out):
    if not _ok_2d(a, b) or out.dtype != a.dtype:
        raise _Fallback
    _route("mm.out", a, b)
    return _into(out, _mm2d(a, b))


def _addmm(self, m1, m2, *, beta=1, alpha=1):
    if not _ok_2d(m1, m2):
        raise _Fallback
    _route("addmm", m1, m2, self)
    return _addmm_value(self, m1, m2, beta, alpha)


def _addmm_out(self, m1, m2, *, beta=1, alpha=1, out):
    if not _ok_2d(m1, m2) or out.dtype != m1.dtype:
        raise _Fallback
    _route("addmm.out", m1, m2, self)
    return _into(out, _addmm_value(self, m1, m2, beta, alpha))


def _addmm_(self, m1, m2, *, beta=1, alpha=1):
    if not _ok_2d(m1, m2):
        raise _Fallback
    _route("addmm_", m1, m2, self)
    return self.copy_(_addmm_value(self, m1, m2, beta, alpha))


def _bmm(a, b):
    if not _ok_3d(a, b):
        raise _Fallback
    _route("bmm", a, b)
    return _bmm_value(a, b)


def _bmm_out(a, b, *, out):
    if not _ok_3d(a, b) or out.dtype != a.dtype:
        raise _Fallback
    _route("bmm.out", a, b)
    return _into(out, _bmm_value(a, b))


def _baddbmm_value(self, b1, b2, beta, alpha):
    row = bias_row(self, b2.shape[2]) if beta == 1 and alpha == 1 else None
    if row is not None and row.dtype == b1.dtype:
        return _bmm_value(b1, b2, bias=row)
    y32 = _bmm_value(b1, b2, out_dtype=torch.float32)
    return scaled_sum(y32, self, beta, alpha, b1.dtype)


def _baddbmm(self, b1, b2, *, beta=1, alpha=1):
    if not _ok_baddbmm(self, b1, b2):
        raise _Fallback
    _route("baddbmm", b1, b2, self)
    return _baddbmm_value(self, b1, b2, beta, alpha)


def _baddbmm_out(self, b1, b2, *, beta=1, alpha=1, out):
    if not _ok_baddbmm(self, b1, b2) or out.dtype != b1.dtype:
        raise _Fallback
    _route("baddbmm.out", b1, b2, self)
    return _into(out, _baddbmm_value(self, b1, b2, beta, alpha))


def _baddbmm_(self, b1, b2, *, beta=1, alpha=1):
    if not _ok_baddbmm(self, b1, b2):
        raise _Fallback
    _route("baddbmm_", b1, b2, self)
    return self.copy_(_baddbmm_value(self, b1, b2, beta, alpha))


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    forms = ((2, 3), (2, 2)) if offs is not None else ((3, 3),)
    if (a.dim(), b.dim()) not in forms:
        _refuse("_grouped_mm", f"the {a.dim()}-D x {b.dim()}-D form"
                f"{' with' if offs is not None else ' without'} offs", a, b)
    if bias is not None or (offs is not None and offs.dtype != torch.int32):
        _refuse("_grouped_mm", "a bias or non-int32 offs", a, b)
    _route("_grouped_mm", a, b)
    return _grouped_impl(a, b, offs, out_dtype, "aten::_grouped_mm")


def _mv(a, v):
    if a.dim() != 2 or v.dim() != 1 or a.shape[1] != v.shape[0]:
        raise _Fallback
    _route("mv", a, v)
    return _mm2d(a, v.unsqueeze(1))[:, 0]


def _addmv(self, a, v, *, beta=1, alpha=1):
    if a.dim() != 2 or v.dim() != 1 or a.shape[1] != v.shape[0]:
        raise _Fallback
    _route("addmv", a, v, self)
    y32 = _mm2d(a, v.unsqueeze(1), out_dtype=torch.float32)[:, 0]
    return scaled_sum(y32, self, beta, alpha, a.dtype)


_REPLACEMENTS = {
    "mm": _mm, "mm.out": _mm_out, "addmm": _addmm, "addmm.out": _addmm_out,
    "addmm_": _addmm_, "bmm": _bmm, "bmm.out": _bmm_out, "baddbmm": _baddbmm,
    "baddbmm.out": _baddbmm_out, "baddbmm_": _baddbmm_, "mv": _mv, "addmv": _addmv,
}
if hasattr(torch.ops.aten, "_grouped_mm"):  # torch >= 2.8
    _REPLACEMENTS["_grouped_mm"] = _grouped_mm


def _kernel(name, fn, original):
    def impl(keyset, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _Fallback:
            return original.call_boxed(keyset, *args, **kwargs)

    impl.__name__ = f"detgemm_{name.replace('.', '_')}"
    return impl


_SDPA = "scaled_dot_product_attention"


def _sdpa_kernel(original):
    """aten::scaled_dot_product_attention on detgemm's attention (`attention.sdpa` maps torch's
    semantics); what it cannot map falls back like a matmul: warn once, or raise when strict."""
    from .attention import api as attention_api
    from .attention import sdpa

    def impl(keyset, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
             scale=None, enable_gqa=False):
        args = (query, key, value, attn_mask, dropout_p, is_causal)
        try:
            why = _device_problem(query)
            if why is not None:
                _refuse(_SDPA, why, query, key, value)
            try:
                spec, engine, mask = sdpa.plan(*args, scale, enable_gqa,
                                               strict=bool(_stack and _stack[-1]))
            except sdpa.Unsupported as e:
                _refuse(_SDPA, str(e), query, key, value)
        except _Fallback:
            return original.call_boxed(keyset, *args, scale=scale, enable_gqa=enable_gqa)
        _routed[(f"sdpa[{engine}]", _NAMES[query.dtype])] += 1
        out = attention_api.run(spec, engine, mask)
        return out[0] if query.dim() == 3 else out

    impl.__name__ = "detgemm_scaled_dot_product_attention"
    return impl


def _register(keys):
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": intended
        warnings.simplefilter("ignore", UserWarning)
        for key in keys:
            for name, fn in _REPLACEMENTS.items():
                original = torch.library.get_kernel(f"aten::{name}", key)
                lib.impl(name, _kernel(name, fn, original), key, with_keyset=True)
            # SDPA is a composite op: its autograd key must be taken too, or autograd would
            # decompose it before the backend key is reached.
            for sdpa_key in (key, f"Autograd{key}"):
                original = torch.library.get_kernel(f"aten::{_SDPA}", sdpa_key)
                lib.impl(_SDPA, _sdpa_kernel(original), sdpa_key, with_keyset=True)
    return lib


# -------------------------------------------------------------------------- public API
def _has_kernels(key: str) -> bool:
    """This PyTorch build has a kernel for every replaced op under `key` (a CPU-only build
    has none for CUDA)."""
    try:
        for name in _REPLACEMENTS:
            torch.library.get_kernel(f"aten::{name}", key)
    except RuntimeError:
        return False
    return True


def _requested(cpu: bool, dispatch_keys) -> tuple[str, ...]:
    if dispatch_keys is not None:
        return tuple(dispatch_keys)
    return ("CUDA", "CPU") if cpu else ("CUDA",)


def enable(strict: bool = False, *, cpu: bool = False,
           _dispatch_keys: tuple[str, ...] | None = None, _stacklevel: int = 3) -> None:
    """Route PyTorch's CUDA matmuls through detgemm until the matching `disable()`.

    Calls nest: each enable() pushes its strictness, each disable() pops it; the kernels are
    replaced at the first enable and restored at the last disable. `strict=True` raises
    `BatchInvariantError` for a matmul detgemm cannot run instead of falling back.
    `cpu=True` also routes CPU matmuls, through the bit-exact reference (slow; the same
    bits as the kernels). Without it CPU matmuls keep PyTorch's kernels. On a PyTorch built
    without CUDA the mode enables and disables normally but routes nothing (one warning),
    unless `cpu=True`."""
    global _lib, _keys, _requested_keys
    from . import registry

    registry.user_configs()  # a bad DETGEMM_CUTE_CONFIG is reported here, on any device
    with _lock:
        keys = _requested(cpu, _dispatch_keys)
        if not _stack:
            live = tuple(k for k in keys if _has_kernels(k))
            if not live and not _warned_no_backend:
                _warn_no_backend(keys, _stacklevel)
            _lib = _register(live) if live else None
            _keys, _requested_keys = live, keys
            _device_reason.clear()
        elif keys != _requested_keys:
            raise RuntimeError(f"batch_invariant_mode is already enabled for {_requested_keys}; "
                               f"cannot nest a different set {keys}")
        _stack.append(bool(strict))


def _warn_no_backend(keys, stacklevel) -> None:
    global _warned_no_backend
    _warned_no_backend = True
    warnings.warn(f"detgemm batch_invariant_mode: this PyTorch build has no "
                  f"{'/'.join(keys)} kernels, so the mode routes no matmul; CPU matmuls keep "
                  f"PyTorch's kernels (batch_invariant_mode(cpu=True) runs them on the "
                  f"bit-exact reference). Shown once per process.", stacklevel=stacklevel)


def disable() -> bool:
    """Undo the innermost `enable()`; the last one restores PyTorch's kernels. Returns
    False (and does nothing) when the mode is not enabled."""
    global _lib, _keys, _requested_keys
    with _lock:
        if not _stack:
            return False
        _stack.pop()
        if not _stack:
            if _lib is not None:
                _lib._destroy()
            _lib, _keys, _requested_keys = None, (), ()
        return True


def is_enabled() -> bool:
    return bool(_stack)


def routed_devices() -> tuple[str, ...]:
    """The device types whose matmuls the active mode routes through detgemm ("cuda",
    "cpu"); empty when the mode is off or this PyTorch has none of the requested ones."""
    return tuple(k.lower() for k in _keys)


@contextlib.contextmanager
def batch_invariant_mode(strict: bool = False, *, cpu: bool = False,
                         _dispatch_keys: tuple[str, ...] | None = None):
    """Context manager form of `enable()`/`disable()`; the previous state comes back on exit,
    also when the body raises."""
    enable(strict, cpu=cpu, _dispatch_keys=_dispatch_keys, _stacklevel=5)
    try:
        yield
    finally:
        disable()


@dataclass
class Report:
    """Calls since the last `reset_report()`: routed through detgemm by (op, dtype), and
    fallen back to PyTorch by (op, dtype, reason); `attention`: every attention call (the
    mode's SDPA and `dg.attention`) by (engine, why it is not flash)."""

    routed: dict
    fell_back: dict
    attention: dict = field(default_factory=dict)

    @property
    def total_routed(self) -> int:
        return sum(self.routed.values())

    @property
    def total_fell_back(self) -> int:
        return sum(self.fell_back.values())

    def __str__(self) -> str:
        lines = [f"detgemm batch_invariant_mode: {self.total_routed} calls on detgemm, "
                 f"{self.total_fell_back} fell back to PyTorch"]
        for (op, dt), n in sorted(self.routed.items()):
            lines.append(f"  detgemm   aten::{op:12s} {dt:5s} {n}")
        for (op, dt, why), n in sorted(self.fell_back.items()):
            lines.append(f"  fallback  aten::{op:12s} {dt:5s} {n}  ({why})")
        for (engine, why), n in sorted(self.attention.items()):
            lines.append(f"  attention {engine:5s} {n}" + (f"  ({why})" if why else ""))
        return "\n".join(lines)


def report() -> Report:
    from .attention import api as attention_api

    return Report(dict(_routed), dict(_fell_back), attention_api.report())


def reset_report() -> None:
    """Zero the counters and show each fallback warning again."""
    from .attention import api as attention_api

    _routed.clear()
    _fell_back.clear()
    _warned.clear()
    attention_api.reset_report()


__all__ = ["batch_invariant_mode", "enable", "disable", "is_enabled", "routed_devices",
           "report", "reset_report", "Report", "BatchInvariantError"]
