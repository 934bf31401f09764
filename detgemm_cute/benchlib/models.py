"""Public model dimensions and the weight shapes of their Linear layers.

Numbers from each model's published `config.json` (hidden_size, num_attention_heads,
num_key_value_heads, head_dim, intermediate_size, vocab_size). Tensor parallelism (TP)
shards the layers the usual Megatron / vLLM way:

  qkv      N = (heads + 2 * kv_heads) * head_dim / tp   K = hidden          (column parallel)
  o        N = hidden                                  K = heads * head_dim / tp  (row parallel)
  gate_up  N = 2 * ffn / tp (gate and up fused)         K = hidden          (gated MLPs)
  up       N = ffn / tp                                 K = hidden          (plain MLPs)
  down     N = hidden                                  K = ffn / tp
  lm_head  N = vocab / tp                               K = hidden          (TP 1 and 8 only)

A TP degree is used only where the shard is an integer: heads and ffn divide by tp, and the
KV heads either divide by tp or are replicated (tp a multiple of kv_heads: one KV head per
rank). The vocabulary must divide by tp for lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

TPS = (1, 2, 4, 8)
LM_HEAD_TPS = (1, 8)


@dataclass(frozen=True)
class ModelDims:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # intermediate size (per expert for MoE models)
    vocab: int
    gated: bool = True  # gate and up projections (SwiGLU / GeGLU)
    tps: tuple = TPS
    note: str = ""


MODELS = (
    ModelDims("llama3-8b", 4096, 32, 8, 128, 14336, 128256),
    ModelDims("llama3-70b", 8192, 64, 8, 128, 28672, 128256),
    ModelDims("qwen2.5-7b", 3584, 28, 4, 128, 18944, 152064),
    ModelDims("qwen2.5-72b", 8192, 64, 8, 128, 29568, 152064),
    ModelDims("mistral-7b-v0.3", 4096, 32, 8, 128, 14336, 32768),
    ModelDims("mixtral-8x7b", 4096, 32, 8, 128, 14336, 32000,
              note="ffn is one expert's; each expert is its own GEMM"),
    ModelDims("gemma2-9b", 3584, 16, 8, 256, 14336, 256000,
              note="heads * head_dim = 4096 != hidden"),
    ModelDims("gpt2", 768, 12, 12, 64, 3072, 50257, gated=False, tps=(1,)),
    ModelDims("bert-large", 1024, 16, 16, 64, 4096, 30522, gated=False, tps=(1,)),
)


@dataclass(frozen=True)
class Weight:
    """One Linear weight W[N, K] of a model at a TP degree."""

    model: str
    tp: int
    layer: str
    k: int
    n: int

    @property
    def label(self) -> str:
        return f"{self.model} tp{self.tp} {self.layer}"


def kv_heads_per_rank(model: ModelDims, tp: int) -> int | None:
    if model.kv_heads % tp == 0:
        return model.kv_heads // tp
    if tp % model.kv_heads == 0:
        return 1  # replicated KV heads
    return None


def shard_ok(model: ModelDims, tp: int) -> bool:
    return (model.heads % tp == 0 and model.ffn % tp == 0
            and kv_heads_per_rank(model, tp) is not None)


def model_weights(model: ModelDims, tp: int) -> list[Weight]:
    """The Linear weights of one transformer block (and lm_head) at TP degree `tp`."""
    if not shard_ok(model, tp):
        return []
    q = model.heads // tp
    kv = kv_heads_per_rank(model, tp)
    hd, h = model.head_dim, model.hidden
    ffn = model.ffn // tp
    out = [
        Weight(model.name, tp, "qkv", h, (q + 2 * kv) * hd),
        Weight(model.name, tp, "o", q * hd, h),
    ]
    if model.gated:
        out.append(Weight(model.name, tp, "gate_up", h, 2 * ffn))
    else:
        out.append(Weight(model.name, tp, "up", h, ffn))
    out.append(Weight(model.name, tp, "down", ffn, h))
    if tp in LM_HEAD_TPS and model.vocab % tp == 0:
        out.append(Weight(model.name, tp, "lm_head", h, model.vocab // tp))
    return out


def all_weights(models=MODELS, tps=None) -> list[Weight]:
    """Every model's weights at every TP degree it allows (or only those in `tps`)."""
    out = []
    for model in models:
        for tp in model.tps:
            if tps is None or tp in tps:
                out.extend(model_weights(model, tp))
    return out


def distinct_weights(weights) -> list[tuple[int, int, str]]:
    """(K, N, labels) per distinct (K, N), first-seen order; labels of repeats joined."""
    seen: dict = {}
    for w in weights:
        seen.setdefault((w.k, w.n), []).append(w.label)
    return [(k, n, " / ".join(labels[:3]) + (f" (+{len(labels) - 3})" if len(labels) > 3
                                               else ""))
            for (k, n), labels in seen.items()]
