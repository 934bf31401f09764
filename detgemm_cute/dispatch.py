"""(op, dtype, arch, M, N, K) -> bucket: a table lookup, no shape heuristics in code.

Every choice lives in the YAML registry, so what runs can always be traced to one line of
one file (`explain`). Results are memoised per exact problem; the memo is cleared whenever
the user layers change, so a cached bucket is never stale. A warm call is one dict hit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from . import registry as _registry
from . import wave_cost
from .registry import ArchNotAvailable, Bucket, ConfigError, NoBucketError, Registry

_memo: dict = {}
_memo_lock = threading.Lock()
_MEMO_MAX = 1 << 16
_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def _clear_memo() -> None:
    with _memo_lock:
        _memo.clear()


_registry.on_change(_clear_memo)


def lookup(op: str, dtype: str, arch: str, m: int, n: int, k: int) -> Bucket:
    """The bucket that serves this problem (memoised; the hot path is one dict hit)."""
    b = _memo.get((op, dtype, arch, m, n, k))
    if b is None:
        b = _lookup_slow(op, dtype, arch, m, n, k)
    return b


def _lookup_slow(op, dtype, arch, m, n, k) -> Bucket:
    _check_dims(m, n, k)
    reg = _registry.get_registry(arch)
    b = reg.lookup(op, dtype, m, n, k)
    with _memo_lock:
        # Store only if no config was added meanwhile (the change clears under this lock).
        if _registry.generation() == reg.generation:
            if len(_memo) >= _MEMO_MAX:
                _memo.clear()
            _memo[(op, dtype, arch, m, n, k)] = b
    return b


def _check_dims(m, n, k) -> None:
    for name, v in (("M", m), ("N", n), ("K", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def generation() -> int:
    """Changes whenever user configs are added or reset; key kernel caches by it."""
    return _registry.generation()


def bucket_by_name(arch: str, name: str) -> Bucket:
    """The bucket called `name` (a user bucket shadows a built-in one of the same name)."""
    return _registry.get_registry(arch).bucket(name)


def dtype_name(dtype) -> str:
    """'bf16' / 'fp16' / 'fp32' for torch.bfloat16 / float16 / float32 (names pass through)."""
    if isinstance(dtype, str) and dtype in _registry.DTYPES:
        return dtype
    name = _DTYPE_NAMES.get(str(dtype))
    if name is None:
        raise TypeError(f"unsupported dtype {dtype}; supported: torch.bfloat16 (bf16), "
                        f"torch.float16 (fp16), torch.float32 (fp32)")
    return name


FAMILY_ENV = "DETGEMM_CUTE_FAMILY"
FAMILIES = ("sm90", "sm80")


def arch_for_capability(major: int, minor: int, family: str | None = None) -> str:
    """The kernel family for a CUDA compute capability, or a RuntimeError saying why none.

    Default: sm90 (TMA + WGMMA) on 9.0, sm80 (cp.async + mma.sync) on 8.x. `family` forces
    one: "sm80" runs on any GPU from 8.0 up (how it is tested on an H100); "sm90" needs 9.0."""
    if family is not None:
        if family not in FAMILIES:
            raise ValueError(f"unknown kernel family {family!r} (from {FAMILY_ENV} or "
                             f"use_family); known: {', '.join(FAMILIES)}")
        if major < 8:
            raise RuntimeError(f"detgemm_cute needs an SM80+ GPU (compute capability 8.0 or "
                               f"newer); this GPU is {major}.{minor}")
        if family == "sm90" and (major, minor) != (9, 0):
            raise RuntimeError(f"the sm90 kernel family (WGMMA, sm_90a-only) cannot run on "
                               f"compute capability {major}.{minor}; use sm80")
        return family
    if (major, minor) == (9, 0):
        return "sm90"
    if major == 8:
        return "sm80"
    if major < 8:
        raise RuntimeError(f"detgemm_cute needs an SM80+ GPU (compute capability 8.0 or newer); "
                           f"this GPU is {major}.{minor}")
    raise RuntimeError(f"detgemm_cute has no tuned kernel family for compute capability "
                       f"{major}.{minor} (sm_{major}{minor}): the sm90 family's WGMMA is "
                       f"sm_90a-only; set {FAMILY_ENV}=sm80 to run the SM80 (mma.sync) family, "
                       f"which any GPU from sm_80 up can run")


@dataclass(frozen=True)
class Explanation:
    """Why a problem runs on a bucket: the bucket, where it is declared, and what it beat."""

    op: str
    dtype: str
    arch: str
    m: int
    n: int
    k: int
    bucket: Bucket
    reason: str
    shadowed: tuple[Bucket, ...]  # lower-precedence buckets that also contain the point
    same_name: tuple[Bucket, ...]  # lower-layer buckets hidden by the chosen bucket's name
    predicted: tuple = ()  # ((alternative, predicted us), ...) when the bucket has several

    @property
    def source(self):
        return self.bucket.source

    @property
    def line(self) -> int:
        return self.bucket.line

    @property
    def layer(self) -> int:
        return self.bucket.layer

    def __str__(self) -> str:
        b = self.bucket
        lines = [
            f"{self.op} {self.dtype} {self.arch} M={self.m} N={self.n} K={self.k}",
            f"  bucket:  {b.name} ({b.where}, layer {b.layer} = {b.layer_label})",
            f"  why:     {self.reason}",
            f"  kernel:  tile {'x'.join(map(str, b.tile))}, cluster "
            f"{'x'.join(map(str, b.cluster))}, stages {b.stages}, persistent "
            f"{str(b.persistent).lower()}{', ping-pong' if b.pingpong else ''}"
            f"{', operands swapped (C^T = B A^T)' if b.swap_ab else ''}",
        ]
        for d, which in ((b.direct, ""), (b.direct_vector, " 8 bytes at a time")):
            if d is not None:
                lines.append(
                    f"  {'direct:' if not which else 'vector:'}  outputs the tile's threads "
                    f"store{which} (rows TMA cannot address or would store as half sectors) "
                    f"run tile {'x'.join(map(str, d.tile))}, stages {d.stages}, persistent "
                    f"{str(d.persistent).lower()}, no cluster")
        if b.note:
            lines.append(f"  note:    {b.note}")
        for alt, us in self.predicted:
            mark = "<- runs" if alt is b else ""
            lines.append(f"  option:  {alt.name.rsplit('.', 1)[-1]:44s} predicted "
                         f"{us:9.1f} us {mark}".rstrip())
        for s in self.shadowed:
            lines.append(f"  shadows: {s.name} ({s.where}, layer {s.layer} = {s.layer_label}) "
                         f"also matches, but layer {b.layer} comes first")
        for s in self.same_name:
            if s not in self.shadowed:
                lines.append(f"  hides:   {s.name} ({s.where}, layer {s.layer} = "
                             f"{s.layer_label}), same name")
        if not self.shadowed:
            lines.append("  shadows: nothing (no other bucket matches)")
        return "\n".join(lines)


def _reason(b: Bucket, m: int, n: int, k: int, choices: int = 1) -> str:
    parts = []
    for dim, v, (lo, hi) in (("M", m, b.m), ("N", n, b.n), ("K", k, b.k)):
        if (lo, hi) == (1, None):
            parts.append(f"{dim} any")
        else:
            parts.append(f"{dim}={v} in [{lo}, {'inf)' if hi is None else f'{hi}]'}")
    text = ", ".join(parts)
    if choices > 1:
        text += f"; the least predicted time of its {choices} alternatives (wave_cost.py)"
    return text


def explain(op: str, dtype: str, arch: str, m: int, n: int, k: int, *,
            registry: Registry | None = None) -> Explanation:
    """Which bucket serves this problem and why; `registry` defaults to the live one."""
    _check_dims(m, n, k)
    dtype = dtype_name(dtype)
    reg = registry if registry is not None else _registry.get_registry(arch)
    matches = reg.matches(op, dtype, m, n, k)
    if not matches:
        reg.lookup(op, dtype, m, n, k)  # raises NoBucketError with the reason
    b = matches[0]
    named = reg.named(b.name)  # highest layer first; b may sit below a same-named bucket
    below = next(i for i, x in enumerate(named) if x is b) + 1
    alts = reg.alternatives(b)
    predicted = tuple((a, wave_cost.bucket_us(a, m, n, k)) for a in alts) if len(alts) > 1 else ()
    return Explanation(op=op, dtype=dtype, arch=reg.arch, m=m, n=n, k=k, bucket=b,
                       reason=_reason(b, m, n, k, len(alts)), shadowed=matches[1:],
                       same_name=named[below:], predicted=predicted)


__all__ = ["lookup", "explain", "Explanation", "dtype_name", "arch_for_capability", "FAMILIES",
           "bucket_by_name", "generation", "Bucket", "ConfigError", "NoBucketError",
           "ArchNotAvailable"]
