"""The flash engine: flash-attn-4's SM90 kernels (CuTe DSL), configured for the contract.

flash-attn-4 is an optional dependency (``pip install detgemm-cute[attention]``, pinned).
What this module fixes so a query row's bits depend only on that query and the keys it sees:

- **No split-KV**: ``num_splits=1`` always; one CTA walks all of a row's key blocks.
- **One key-block width per head_dim**: flash-attn-4 picks its tile from ``causal`` too (at
  head_dim 65..96 the non-causal tile is 144 keys wide, the causal one 128), and a row's
  online-softmax chain is a function of the block partition. `tile_for` pins the causal
  choice for every call, so a decode step (one query, all keys visible) and row t of a
  causal prefill walk the same 128-key blocks.
- **Deterministic backward**: ``deterministic=True`` (dQ/dK/dV accumulated in a fixed order
  through semaphores, no order-dependent atomics). The backward is the same kernels for every
  batch: a sequence's gradients do not depend on its batch-mates.

Key blocks past a row's last visible key are fully masked and leave its running max, sum
and output unchanged, which is why the number of queries run together, their tile and the
cache's allocated length change nothing (measured and tested bit for bit, `tests/`).

Registered as ``torch.library`` ops (``detgemm::flash_attention_fwd``/``_bwd``) with fake
implementations, so meta/fake tensors and ``torch.compile`` get shapes.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

PINNED_VERSION = "4.0.0b36"


@functools.lru_cache(maxsize=None)
def _module():
    """flash-attn-4's interface module, or the reason it cannot be used."""
    try:
        from flash_attn.cute import interface  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to fall back
        return None, f"flash-attn-4 is not installed ({type(e).__name__}: {e})".splitlines()[0]
    return interface, None


def unavailable_reason(q: Tensor, head_dim: int, head_dim_v: int) -> Optional[str]:
    """Why the flash engine cannot run this call (None when it can)."""
    if q.device.type != "cuda":
        return f"{q.device.type} tensors (the flash engine is CUDA only)"
    return _cuda_reason(q.device.index, q.dtype, head_dim, head_dim_v)


@functools.lru_cache(maxsize=None)
def _cuda_reason(index: int, dtype: torch.dtype, head_dim: int, head_dim_v: int):
    """`unavailable_reason` for a CUDA device, once per (device, dtype, head dims)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} inputs (the flash engine takes bf16/fp16)"
    major, _ = torch.cuda.get_device_capability(index)
    if major != 9:
        return (f"compute capability {major}.x (the flash engine's invariance is measured on "
                f"SM90 only)")
    if not (8 <= head_dim <= 256 and 8 <= head_dim_v <= 256 and head_dim % 8 == 0
            and head_dim_v % 8 == 0):
        return f"head_dim {head_dim}/{head_dim_v} (the flash engine takes multiples of 8 in 8..256)"
    if head_dim_v != head_dim and not (head_dim == 192 and head_dim_v == 128):
        return f"head_dim {head_dim} with value head_dim {head_dim_v}"
    return _module()[1]


def tile_for(head_dim: int, head_dim_v: int):
    """The forward tile every call of this head_dim uses: flash-attn-4's causal choice."""
    interface, _ = _module()
    return interface._tile_size_fwd_sm90(head_dim, head_dim_v, True, False)


def _bshd(t: Tensor) -> Tensor:
    return t.transpose(1, 2)  # bhsd <-> bshd, a view


@torch.library.custom_op("detgemm::flash_attention_fwd", mutates_args=())
def flash_fwd(q: Tensor, k: Tensor, v: Tensor, kv_lengths: Optional[Tensor], causal: bool,
              scale: float) -> tuple[Tensor, Tensor]:
    """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] (bhsd) -> (out [B, Hq, Sq, Dv] bhsd, lse [B, Hq, Sq])."""
    interface, _ = _module()
    cfg = tile_for(q.shape[3], v.shape[3])
    out, lse, *_ = interface._flash_attn_fwd(
        _bshd(q), _bshd(k), _bshd(v), seqused_k=kv_lengths, softmax_scale=scale,
        causal=causal, tile_mn=(cfg.m_block_size, cfg.n_block_size),
        mma_pv_is_rs=cfg.mma_pv_is_rs, intra_wg_overlap=cfg.intra_wg_overlap,
        num_splits=1, return_lse=True)
    return _bshd(out), lse


@flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, kv_lengths, causal, scale):
    b, hq, sq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[3])).transpose(1, 2)
    return out, q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("detgemm::flash_attention_bwd", mutates_args=())
def flash_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              kv_lengths: Optional[Tensor], causal: bool, scale: float
              ) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV (bhsd) by flash-attn-4's deterministic backward."""
    interface, _ = _module()
    dq, dk, dv = interface._flash_attn_bwd(
        _bshd(q), _bshd(k), _bshd(v), _bshd(out), _bshd(dout).contiguous(), lse,
        softmax_scale=scale, causal=causal, seqused_k=kv_lengths, deterministic=True)
    return _bshd(dq), _bshd(dk), _bshd(dv)


@flash_bwd.register_fake
def _flash_bwd_fake(dout, q, k, v, out, lse, kv_lengths, causal, scale):
    def like(t):
        return t.new_empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3])).transpose(1, 2)
    return like(q), like(k), like(v)


def _setup(ctx, inputs, output):
    q, k, v, kv_lengths, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_lengths)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_lengths = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.detgemm.flash_attention_bwd(dout, q, k, v, out, lse, kv_lengths,
                                                       ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


flash_fwd.register_autograd(_backward, setup_context=_setup)
