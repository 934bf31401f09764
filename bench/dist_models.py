"""The two models of bench_distributed.py, built for a data-parallel training step.

- ``mlp``: 4 residual blocks Linear(2048 -> 8192), GELU, Linear(8192 -> 2048), biases:
  detgemm Linears and element-wise ops only.
- ``llama``: a stack of Llama-3.2-1B-shaped decoder layers (hidden 2048, 32 query and 8
  key/value heads of 64, SwiGLU 8192, RMSNorm with weights), 4 of its 16 layers by default,
  no embedding or head: the input is a batch of hidden states. Attention is
  `F.scaled_dot_product_attention` (causal, grouped-query), so that the Linears and the
  data-parallel machinery, not eager attention, set the step time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import llama_model as L


class MlpStack(nn.Module):
    def __init__(self, d: int = 2048, h: int = 8192, blocks: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
                                    for _ in range(blocks))

    def forward(self, x):
        for blk in self.blocks:
            x = x + blk(x)
        return x


class SdpaAttention(L.Attention):
    """The Llama attention with torch's fused scaled-dot-product attention."""

    def forward(self, x, cos, sin, mask=None):
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class LlamaStack(nn.Module):
    def __init__(self, hidden=2048, layers=4, heads=32, kv_heads=8, inter=8192):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = L.Layer(hidden, heads, kv_heads, inter)
            layer.self_attn = SdpaAttention(hidden, heads, kv_heads)
            self.layers.append(layer)
        self.norm = L.RMSNorm(hidden)
        self.head_dim = hidden // heads

    def forward(self, x):
        cos, sin = L.rotary(x.shape[1], self.head_dim, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, None)
        return self.norm(x)


class Spec:
    """A model of the bench: how to build it and one rank's input of `tokens` tokens.
    ``tiny``: the same architectures at a few thousand parameters (a CPU check of the
    bench itself)."""

    def __init__(self, name: str, layers: int, seq: int, tiny: bool = False):
        self.name, self.layers, self.seq, self.tiny = name, layers, seq, tiny
        self.hidden = 64 if tiny else 2048

    def build(self) -> nn.Module:
        if self.name == "mlp":
            return MlpStack(self.hidden, 4 * self.hidden, self.layers)
        if self.tiny:
            return LlamaStack(self.hidden, self.layers, heads=4, kv_heads=2, inter=128)
        return LlamaStack(layers=self.layers)

    def batch(self, tokens: int, device) -> torch.Tensor:
        g = torch.Generator(device=device).manual_seed(1)
        if self.name == "mlp":
            shape = (tokens, self.hidden)
        elif tokens % self.seq:
            raise SystemExit(f"--tokens {tokens} must be a multiple of --seq {self.seq}")
        else:
            shape = (tokens // self.seq, self.seq, self.hidden)
        return torch.randn(shape, device=device, generator=g).to(torch.bfloat16)

    def describe(self, model: nn.Module) -> str:
        n = sum(p.numel() for p in model.parameters())
        d = self.hidden
        shape = (f"{self.layers} x ({d} -> {4 * d} -> {d}), GELU" if self.name == "mlp" else
                 f"{self.layers} Llama-3.2-1B-shaped layers" + (" (tiny)" if self.tiny else
                                                                " (2048, 32/8 heads x 64, "
                                                                "SwiGLU 8192)"))
        return f"{shape}, {n / 1e6:.1f}M parameters"
