"""torch's ``scaled_dot_product_attention`` semantics, mapped onto the invariant op.

`plan` turns one SDPA call (query/key/value, ``attn_mask``, ``dropout_p``, ``is_causal``,
``scale``, ``enable_gqa``) into an `AttentionSpec` plus the engine that computes it, or
raises `Unsupported` with the reason (the mode then falls back to torch's kernel, with a
warning, or raises under ``strict=True``).

Exact mappings (torch's rule -> the op's bottom-right rule, `spec`):

- no mask, ``is_causal=False``: every query sees every key (a single query, a decode step,
  is run in the causal form, which for one query is the same set of keys: `spec.check`).
- ``is_causal=True`` (torch aligns it top-left): Sq == Sk is the causal rule itself; Sq < Sk
  is the causal rule on the first Sq keys (no query may see a later one); Sq > Sk takes the
  math engine with the explicit mask.
- a boolean mask (True = may attend) or a float mask of zeros and -inf/finfo.min entries
  that equals, for every sequence b, either "key j < L_b" or "key j < L_b and j <= i + L_b -
  Sq" (a causal chunk or decode step against a cache holding L_b valid keys, which is what
  Hugging Face builds for chunked prefill, static caches and right-padded keys) becomes that
  rule with ``kv_lengths = L``. Recognising a mask costs one device sync; the answer is
  cached per mask tensor (by identity and version), so a model's layers pay it once per
  forward. While a CUDA graph is being captured an unseen mask cannot be read: it takes
  the math engine, with a warning.
- any other mask (left padding, sliding windows, document masks, additive biases) runs on
  the math engine, which applies it exactly.

Not supported (torch's kernel runs, with a warning): ``dropout_p > 0``, tensors that are not
3-D or 4-D, dtypes other than bf16/fp16/fp32, malformed calls (so torch's own error shows).
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from . import api
from .spec import AttentionSpec, check


class Unsupported(Exception):
    """This SDPA call cannot run on detgemm's attention; the message says why."""


_cache_lock = threading.Lock()
_mask_cache: dict = {}  # id(mask) -> (weakref, version, rule)
_CACHE_SIZE = 32


def _rule_key(mask: torch.Tensor):
    return (mask._version, mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()))


def _cached_rule(mask):
    with _cache_lock:
        hit = _mask_cache.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1] == _rule_key(mask):
        return hit[2]
    return None


def _store_rule(mask, rule):
    with _cache_lock:
        if len(_mask_cache) >= _CACHE_SIZE:
            _mask_cache.pop(next(iter(_mask_cache)))
        _mask_cache[id(mask)] = (weakref.ref(mask), _rule_key(mask), rule)


def _allowed(mask: torch.Tensor):
    """(boolean view of the mask, device flag: every entry is 0 or 'blocked') for a float
    mask; blocked means -inf or at most the dtype's lowest finite value."""
    blocked = mask <= torch.finfo(mask.dtype).min
    allowed = mask == 0
    return allowed, (allowed | blocked).all()


def _classify(mask: torch.Tensor, b: int, h: int, sq: int, sk: int):
    """('causal' | 'full', lengths or None) when the mask is one of the exact rules, else None.
    One device sync."""
    allowed, pure = (mask, None) if mask.dtype == torch.bool else _allowed(mask)
    full = allowed.expand(b, h, sq, sk)
    lengths = full[:, 0, sq - 1, :].sum(dim=-1, dtype=torch.int32)  # the last query sees L_b
    j = torch.arange(sk, device=mask.device).view(1, 1, 1, sk)
    i = torch.arange(sq, device=mask.device).view(1, 1, sq, 1)
    lb = lengths.view(b, 1, 1, 1)
    prefix = j < lb
    is_full = (full == prefix).all()
    is_causal = (full == (prefix & (j <= i + lb - sq))).all()
    every_key = (lengths == sk).all()
    flags = torch.stack([is_full, is_causal, every_key] + ([pure] if pure is not None else []))
    is_full, is_causal, every_key, *rest = flags.tolist()  # the one sync
    if rest and not rest[0]:
        return None
    if not (is_full or is_causal):
        return None
    kind = "causal" if is_causal else "full"
    return kind, (None if every_key else lengths)


def _mask_rule(mask, b, h, sq, sk):
    rule = _cached_rule(mask)
    if rule is not None:
        return rule
    if mask.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return ("unread", None)
    rule = _classify(mask, b, h, sq, sk) or ("general", None)
    _store_rule(mask, rule)
    return rule


_MATH_MASKS = {
    "general": "an attention mask that is neither causal nor key-length",
    "unread": "an attention mask first seen while a CUDA graph is captured (it cannot be read)",
}


def plan(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False, strict=False):
    """(spec, engine, mask for the math engine or None) for one SDPA call."""
    if dropout_p != 0.0:
        raise Unsupported(f"dropout_p={dropout_p} (attention dropout is not supported)")
    nd = query.dim()
    if nd not in (3, 4) or key.dim() != nd or value.dim() != nd:
        raise Unsupported(f"{nd}-D query (3-D or 4-D [B, H, S, D] are supported)")
    if attn_mask is not None and is_causal:
        raise Unsupported("attn_mask together with is_causal")
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise Unsupported(f"{query.dtype} inputs")
    q, k, v = (t.unsqueeze(0) if nd == 3 else t for t in (query, key, value))
    b, hq, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if hq != hk and not enable_gqa:
        raise Unsupported(f"{hq} query heads against {hk} key heads without enable_gqa")
    mask = None if attn_mask is None else (attn_mask.unsqueeze(0) if nd == 3 and attn_mask.dim() == 3
                                           else attn_mask)
    causal, lengths, math_mask, why = False, None, None, None
    if mask is not None:
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise Unsupported(f"a {mask.dtype} attn_mask")
        try:
            kind, lengths = _mask_rule(mask, b, hq, sq, sk)
        except RuntimeError as e:  # not broadcastable: torch's kernel says so
            raise Unsupported(f"attn_mask of shape {tuple(mask.shape)}: {e}") from None
        if kind in _MATH_MASKS:
            math_mask, why = mask, _MATH_MASKS[kind]
        causal = kind == "causal"
    elif is_causal:
        if sq <= sk:
            causal, k, v = True, k[:, :, :sq], v[:, :, :sq]
        else:
            math_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
            why = "is_causal with more queries than keys"
    spec = check(q, k, v, causal=causal, scale=scale, kv_lengths=lengths)
    engine = api.choose_engine(spec, "auto", strict, extra_reason=why)
    return spec, engine, math_mask


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
         enable_gqa=False, strict=False):
    """``F.scaled_dot_product_attention`` with detgemm's contract; raises `Unsupported`."""
    spec, engine, mask = plan(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa, strict)
    out = api.run(spec, engine, mask)
    return out[0] if query.dim() == 3 else out

