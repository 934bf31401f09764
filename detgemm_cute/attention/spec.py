"""What one attention call asks for, checked before any launch.

`AttentionSpec` is the call in one canonical form, whatever layout the caller used:
q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (torch SDPA's layout, "bhsd"), a
visibility rule, the softmax scale and optional per-sequence key counts. The rule is always
**bottom-right aligned**: query i of Sq in sequence b sees key j when j < L_b (L_b =
kv_lengths[b], or Sk) and, if causal, j <= i + L_b - Sq. That is what a KV cache needs (the
last query is the newest token); torch's `is_causal` (top-left when Sq != Sk) is mapped
onto it by `sdpa`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYOUTS = ("bhsd", "bshd")
OP = "detgemm_cute.attention"


@dataclass(frozen=True)
class AttentionSpec:
    """One call, in the bhsd layout, checked."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    scale: float
    kv_lengths: Optional[torch.Tensor]  # int32 [B] on q's device, or None (all Sk keys)

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def seqlens(self) -> tuple[int, int]:
        return self.q.shape[2], self.k.shape[2]

    @property
    def head_dims(self) -> tuple[int, int]:
        return self.q.shape[3], self.v.shape[3]


def _tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{OP}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "bhsd" else t.transpose(1, 2)


def check(q, k, v, *, causal=False, scale=None, kv_lengths=None, layout="bhsd") -> AttentionSpec:
    """Validate one call and return it in canonical form; every error names the argument."""
    if layout not in LAYOUTS:
        raise ValueError(f"{OP}: layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(t, name)
        if t.dim() != 4:
            want = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
            raise ValueError(f"{OP}: {name} must be 4-D {want} (layout={layout!r}), got shape "
                             f"{tuple(t.shape)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"{OP}: q must be torch.bfloat16, torch.float16 or torch.float32, "
                        f"got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{OP}: {name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but q is on {q.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"{OP}: causal must be a bool, got {type(causal).__name__}")
    q, k, v = (to_bhsd(t, layout) for t in (q, k, v))
    b, hq, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"{OP}: batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    hk, sk = k.shape[1], k.shape[2]
    if v.shape[1] != hk or v.shape[2] != sk:
        raise ValueError(f"{OP}: k and v must agree in heads and keys, got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)} (bhsd)")
    if k.shape[3] != d:
        raise ValueError(f"{OP}: q and k head_dim differ: {d} vs {k.shape[3]}")
    if hk < 1 or hq % hk != 0:
        raise ValueError(f"{OP}: q's {hq} heads must be a multiple of k/v's {hk} heads (GQA/MQA)")
    if d < 1 or v.shape[3] < 1:
        raise ValueError(f"{OP}: head_dim must be >= 1, got q {d}, v {v.shape[3]}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{OP}: scale must be a finite float or None, got {scale!r}")
    if kv_lengths is not None:
        _tensor(kv_lengths, "kv_lengths")
        if kv_lengths.dim() != 1 or kv_lengths.shape[0] != b:
            raise ValueError(f"{OP}: kv_lengths must be 1-D [B={b}], got shape "
                             f"{tuple(kv_lengths.shape)}")
        if kv_lengths.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{OP}: kv_lengths must be torch.int32 or torch.int64, got "
                            f"{kv_lengths.dtype}")
        if kv_lengths.device != q.device:
            raise ValueError(f"{OP}: kv_lengths is on {kv_lengths.device} but q is on {q.device}")
        kv_lengths = kv_lengths.to(torch.int32).contiguous()
    # One query: the causal rule sees every key the free rule sees, so a decode step always
    # takes the causal form, the arithmetic of the last row of a causal prefill.
    return AttentionSpec(q, k, v, causal or sq == 1, float(scale), kv_lengths)


def visible(spec: AttentionSpec) -> torch.Tensor:
    """The boolean [B, 1, Sq, Sk] visibility the rule gives (for the math engine)."""
    sq, sk = spec.seqlens
    dev = spec.q.device
    j = torch.arange(sk, device=dev).view(1, 1, 1, sk)
    i = torch.arange(sq, device=dev).view(1, 1, sq, 1)
    if spec.kv_lengths is None:
        lengths = torch.full((spec.batch, 1, 1, 1), sk, device=dev, dtype=torch.int64)
    else:
        lengths = spec.kv_lengths.to(torch.int64).view(-1, 1, 1, 1)
    seen = j < lengths
    if spec.causal:
        seen = seen & (j <= i + lengths - sq)
    return seen
