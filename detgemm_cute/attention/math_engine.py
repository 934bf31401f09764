"""The math engine: attention from detgemm's batched GEMMs and elementwise fp32 softmax.

Always available (any GPU detgemm runs on, and the CPU through the bit-exact GEMM
reference), any head_dim, any mask. Pipeline for q [B, Hq, Sq, D] against k, v
[B, Hkv, Sk, D/Dv] (g = Hq / Hkv query heads per key head):

1. S = q @ k^T per key head, as one `bmm` over [B*Hkv] entries of g*Sq rows, fp32 out: each
   score is detgemm's chain over D, so a row's scores depend on that query and the keys only.
2. S = S * scale, invisible keys set to -inf (or an additive mask added), all in fp32.
3. m = max over visible keys (exact whatever the order), P = exp(S - m) elementwise; rows that
   see no key get P = 0.
4. [O | l] = P @ [V | 1] as one `bmm` (P rounded to V's dtype, fp32 out): the numerator and
   the normaliser l (the sum of the very weights used) come out of one chain over the keys,
   ascending. Keys past a row's last visible one add exact zero terms, so a decode step over
   t + 1 keys and row t of a prefill over S keys give the same bits.
5. O = numerator / l in fp32, rounded once to the output dtype (0 where l = 0).

Autograd runs through the same ops (the GEMMs' backward is detgemm's deterministic dX/dW);
m is a constant for the gradient (softmax does not depend on the shift).
"""

from __future__ import annotations

from typing import Optional

import torch

from .spec import AttentionSpec, visible


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp of an fp32 tensor, the same bits for an element wherever it sits in the tensor.
    CUDA's elementwise exp is one function per element; the CPU's vectorised and scalar tails
    may differ in the last bit, so the CPU takes exp in fp64 and rounds once."""
    if x.device.type == "cpu":
        return torch.exp(x.double()).float()
    return torch.exp(x)


def _ones_column(v: torch.Tensor) -> torch.Tensor:
    """[..., Sk, Dv] -> [..., Sk, Dv + 8]: V, a column of ones, zero columns to keep rows on
    16 bytes."""
    pad = torch.zeros(*v.shape[:-1], 8, dtype=v.dtype, device=v.device)
    pad[..., 0] = 1
    return torch.cat([v, pad], dim=-1)


def forward(spec: AttentionSpec, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention by the pipeline above. `mask`: a boolean (True = may attend) or additive
    float mask broadcastable to [B, Hq, Sq, Sk], applied on top of the spec's rule."""
    from ..batched_ops import bmm

    q, k, v = spec.q, spec.k, spec.v
    b, hq, sq, d = q.shape
    hk, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    out_dtype = q.dtype
    if b * hq * sq == 0:
        return q.new_zeros((b, hq, sq, dv))
    if sk == 0:
        return q.new_zeros((b, hq, sq, dv))
    q3 = q.reshape(b * hk, g * sq, d)
    k3 = k.reshape(b * hk, sk, d)
    s = bmm(q3, k3.transpose(1, 2), out_dtype=torch.float32).view(b, hk, g, sq, sk)
    s = s * spec.scale
    seen = visible(spec).expand(b, 1, sq, sk).unsqueeze(2)
    if mask is not None:
        m5 = mask.expand(b, hq, sq, sk).reshape(b, hk, g, sq, sk)
        if m5.dtype == torch.bool:
            seen = seen & m5
        else:
            s = s + m5.float()
    s = s.masked_fill(~seen, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = _exp(s - row_max)  # -inf -> 0
    if spec.kv_lengths is not None:  # cache slots past a sequence's length: never read
        unused = torch.arange(sk, device=v.device).view(1, 1, sk, 1) >= \
            spec.kv_lengths.view(b, 1, 1, 1)
        v = v.masked_fill(unused, 0)
    v_ones = _ones_column(v.reshape(b * hk, sk, dv))
    p3 = p.reshape(b * hk, g * sq, sk).to(v.dtype)
    o = bmm(p3, v_ones, out_dtype=torch.float32).view(b, hk, g, sq, dv + 8)
    num, den = o[..., :dv], o[..., dv:dv + 1]
    den_safe = torch.where(den > 0, den, torch.ones_like(den))
    out = torch.where(den > 0, num / den_safe, torch.zeros_like(num))
    return out.reshape(b, hq, sq, dv).to(out_dtype)
