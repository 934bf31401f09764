"""`attention()`: the invariant attention op, its engine choice and its report.

The engine is chosen from what cannot differ between a decode step, a chunked prefill and a
training forward of the same sequence (device kind, dtype, head dims, whether flash-attn-4 is
installed, `engine=`), never from the batch, the number of queries or the key count, so one
query row always meets the same arithmetic. "flash" (flash-attn-4, SM90, bf16/fp16) is the
fast engine; "math" (`math_engine`) runs everywhere else, the CPU included. A call that
cannot use flash on CUDA warns once per reason (``strict=True`` raises); `report()` counts
every call by engine.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from typing import Optional

import torch

from . import flash_engine, math_engine
from .spec import OP, AttentionSpec, check

ENGINES = ("auto", "flash", "math")
_lock = threading.Lock()
_calls: Counter = Counter()  # (engine, reason or "") -> calls
_warned: set = set()


class AttentionEngineWarning(UserWarning):
    """A CUDA attention call ran on the math engine (invariant, slower) instead of flash."""


def choose_engine(spec: AttentionSpec, engine: str = "auto", strict: bool = False,
                  extra_reason: Optional[str] = None) -> str:
    """'flash' or 'math' for this call; warns (or raises, strict) when CUDA misses flash."""
    if engine not in ENGINES:
        raise ValueError(f"{OP}: engine must be one of {ENGINES}, got {engine!r}")
    if engine == "math":
        _count("math", "requested")
        return "math"
    d, dv = spec.head_dims
    why = extra_reason or flash_engine.unavailable_reason(spec.q, d, dv)
    if why is None:
        _count("flash", "")
        return "flash"
    if engine == "flash":
        raise RuntimeError(f"{OP}: engine='flash' cannot run this call: {why}")
    _count("math", why)
    if spec.q.device.type == "cuda":
        msg = (f"{OP}: {why}; this call runs on the math engine (same contract, much slower "
               f"than flash-attn-4)")
        if strict:
            raise RuntimeError(msg + " [strict]")
        with _lock:
            first = why not in _warned
            _warned.add(why)
        if first:
            warnings.warn(msg + " (shown once per reason)", AttentionEngineWarning, stacklevel=4)
    return "math"


def _count(engine: str, why: str) -> None:
    with _lock:
        _calls[(engine, why)] += 1


def report() -> dict:
    """Attention calls since the last `reset_report()`: {(engine, reason): count}."""
    with _lock:
        return dict(_calls)


def reset_report() -> None:
    with _lock:
        _calls.clear()
        _warned.clear()


def run(spec: AttentionSpec, engine: str, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Compute a checked call on the chosen engine (mask: math engine only)."""
    if engine == "flash":
        out, _ = torch.ops.detgemm.flash_attention_fwd(spec.q, spec.k, spec.v, spec.kv_lengths,
                                                       spec.causal, spec.scale)
        return out
    return math_engine.forward(spec, mask)


def _check_lengths(spec: AttentionSpec) -> None:
    """kv_lengths within [0, Sk]: one host sync, skipped while a CUDA graph is captured."""
    lengths = spec.kv_lengths
    if lengths is None or lengths.device.type == "meta":
        return
    if lengths.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    sk = spec.seqlens[1]
    if bool(((lengths < 0) | (lengths > sk)).any()):
        raise ValueError(f"{OP}: kv_lengths must lie in [0, Sk={sk}], got "
                         f"{lengths.tolist()}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: Optional[float] = None, kv_lengths: Optional[torch.Tensor] = None,
              layout: str = "bhsd", engine: str = "auto", strict: bool = False) -> torch.Tensor:
    """Batch-invariant softmax attention: ``softmax(scale * q k^T + rule) v``.

    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (``layout="bhsd"``, torch SDPA's;
    ``"bshd"`` takes and returns FlashAttention's [B, S, H, D]). Hq a multiple of Hkv
    (GQA/MQA). bf16, fp16 or fp32. ``scale`` defaults to 1/sqrt(D).

    Visibility is **bottom-right aligned**, as a KV cache needs: query i of Sq in sequence b
    sees key j when j < L_b and, with ``causal=True``, j <= i + L_b - Sq, where L_b is
    ``kv_lengths[b]`` (int32/int64 [B], the valid keys of a cache allocated for Sk) or Sk.
    A row that sees no key gives 0. Cache slots past ``kv_lengths`` never change a result,
    but must hold finite values on the flash engine (it loads whole key blocks and multiplies
    the masked ones by zero; 0 x NaN is NaN), as in flash-attn-4's own caches.

    Contract (tested bit for bit): a query row's output depends only on that query and the
    keys/values it sees: not on the batch or other sequences, not on how many queries run
    together (decode step, chunk, full prefill), not on the cache's allocated length. The
    backward is deterministic and a sequence's gradients do not depend on its batch-mates.
    ``engine``: "auto" (flash-attn-4 where it applies, else the math engine, with a one-time
    `AttentionEngineWarning` on CUDA; ``strict=True`` raises instead), "flash" or "math".
    """
    spec = check(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths, layout=layout)
    _check_lengths(spec)
    out = run(spec, choose_engine(spec, engine, strict))
    return out if layout == "bhsd" else out.transpose(1, 2)
