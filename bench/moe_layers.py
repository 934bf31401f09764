"""Mixture-of-experts layers of public models and the calls that run them, shared by
`sweep_grouped.py` (the grouped table's data) and `bench_moe.py` (the MoE bench).

A layer is (model, experts, top-k, tokens, projection, K, N); tokens are routed top-k
uniformly at random, so expert e receives about tokens * top-k / experts rows. Expert weights
are stored as nn.Linear's [E, N, K] and passed to the forward as the [E, K, N] view, as
torch._grouped_mm wants them. Each layer runs in three passes:

| pass | detgemm | torch._grouped_mm | per-expert loop (torch.mm) |
|---|---|---|---|
| fwd | grouped_mm(x, w, offs) -> [T, N] | the same call | x_g @ w[g] |
| dx | grouped_mm(dy, w^T, offs) -> [T, K] | the same call | dy_g @ w[g]^T |
| dw | grouped_mm(x^T, dy, offs) -> [E, K, N] | the same call | x_g^T @ dy_g |

(autograd's own calls for `grouped_mm(x, w, offs)`). fwd and dx are one launch of the grouped
kernel, keyed by (ceil(T / E), N, K) of that pass's GEMM; dw is one launch of the grouped-K
kernel, keyed by (K, N, ceil(T / E)); all three read offs on the device only.
Importing this module touches no CUDA state.
"""

from __future__ import annotations

import math

import torch

import detgemm_cute as dg
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.peers import LtNoSplit

BF16 = torch.bfloat16
PASSES = ("fwd", "dx", "dw")
# (name, experts, top-k, hidden, expert ffn, fused gate/up): public configs; "/tpN": ffn
# sharded N ways, "/epN": the experts one of N expert-parallel ranks holds. Fused: the up
# projection computes gate and up together (N = 2 x ffn); unfused: one of them (N = ffn).
MODELS = [("mixtral-8x7b", 8, 2, 4096, 14336, True), ("mixtral-8x7b/tp2", 8, 2, 4096, 7168, True),
          ("mixtral-8x22b", 8, 2, 6144, 16384, True),
          ("qwen1.5-moe-a2.7b", 60, 4, 2048, 1408, True),
          ("qwen3-30b-a3b", 128, 8, 2048, 768, True), ("deepseek-v2-lite", 64, 6, 2048, 1408, True),
          ("olmoe-1b-7b", 64, 8, 2048, 1024, True), ("gpt-oss-20b", 32, 4, 2880, 2880, True),
          ("qwen3-235b-a22b/ep4", 32, 8, 4096, 1536, True),
          ("deepseek-v3/ep8", 32, 8, 7168, 2048, True),
          # issue 41's layers: Mixtral's w1/w3 as separate GEMMs, 128 narrow experts
          ("mixtral-8x7b/unfused", 8, 2, 4096, 14336, False),
          ("narrow-128e", 128, 8, 7168, 256, False)]
MODEL_BY_NAME = {m[0]: m for m in MODELS}


def layer_dims(model) -> list[tuple[str, int, int]]:
    """(projection, K, N) of a model's expert MLP: up (gate and up when fused), down."""
    _name, _experts, _topk, hidden, ffn, fused = model
    return [("up", hidden, 2 * ffn if fused else ffn), ("down", ffn, hidden)]


def gemm_dims(pass_: str, k: int, n: int, rows: int, experts: int) -> tuple[int, int, int]:
    """(m_avg, N, K) the dispatch table sees for this pass of a layer with K -> N (fwd: the
    grouped table's key; dx: the same with K and N swapped; dw: the grouped_k table's M=K,
    N=N and K = rows per expert on average)."""
    m_avg = max(1, math.ceil(rows / experts))
    return {"fwd": (m_avg, n, k), "dx": (m_avg, k, n), "dw": (k, n, m_avg)}[pass_]


def routing(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert of a uniform random top-k routing (a CPU int64 tensor)."""
    return torch.bincount(torch.randint(experts, (rows,), generator=gen), minlength=experts)


def make_set(pass_: str, experts: int, rows: int, k: int, n: int, gen: torch.Generator):
    """One input set of a pass: (a, b, offs on the device, group ends as a host list).
    fwd: a = x [T, K], b = w [E, K, N] (K contiguous); dx: a = dy [T, N], b = w^T [E, N, K]
    (row-major); dw: a = x^T [K, T], b = dy [T, N]."""
    counts = routing(rows, experts, gen)
    ends = counts.cumsum(0).tolist()
    offs = counts.cumsum(0).to(torch.int32).to(gpu.DEVICE)
    dev = gpu.DEVICE
    if pass_ == "dw":
        x = torch.randn(rows, k, device=dev, dtype=BF16)
        dy = torch.randn(rows, n, device=dev, dtype=BF16)
        return x.t(), dy, offs, ends
    w = torch.randn(experts, n, k, device=dev, dtype=BF16).mul_(k ** -0.5)  # [E, N, K]
    if pass_ == "fwd":
        return torch.randn(rows, k, device=dev, dtype=BF16), w.transpose(1, 2), offs, ends
    return torch.randn(rows, n, device=dev, dtype=BF16), w, offs, ends


def set_bytes(pass_: str, experts: int, rows: int, k: int, n: int) -> int:
    """Bytes one set of a pass reads and writes (for the number of sets that defeat L2)."""
    if pass_ == "dw":
        return 2 * (rows * k + rows * n + experts * k * n)
    return 2 * (rows * k + experts * k * n + rows * n)


def detgemm(s):
    return dg.grouped_mm(s[0], s[1], s[2])


def torch_grouped(s):
    return torch._grouped_mm(s[0], s[1], s[2])


def torch_loop(s):
    """One torch.mm per non-empty group, into its rows (2-D x 3-D) or its entry (dw)."""
    a, b, _, ends = s
    start = 0
    if b.dim() == 2:  # dw: a = x^T [K, T], b = dy [T, N]
        out = torch.zeros(len(ends), a.shape[0], b.shape[1], device=a.device, dtype=BF16)
        for g, end in enumerate(ends):
            if end > start:
                torch.mm(a[:, start:end], b[start:end], out=out[g])
            start = end
        return out
    out = torch.empty(a.shape[0], b.shape[2], device=a.device, dtype=BF16)
    for g, end in enumerate(ends):
        if end > start:
            torch.mm(a[start:end], b[g], out=out[start:end])
        start = end
    return out


def lt_loop(s):
    """The per-expert loop under cuBLASLt with split-K off (the same chain as detgemm)."""
    with LtNoSplit():
        return torch_loop(s)


def largest_group(ends) -> tuple[int, int, int]:
    """(group, start, end) of the group with the most rows."""
    starts = [0] + list(ends[:-1])
    g = max(range(len(ends)), key=lambda i: ends[i] - starts[i])
    return g, starts[g], ends[g]


def group_bits_equal_mm(out, s) -> bool:
    """Whether the largest group's rows (dw: entry) of `out` have the bits of `dg.mm` on that
    group alone: the grouped contract."""
    a, b, _, ends = s
    g, start, end = largest_group(ends)
    if b.dim() == 2:
        ref, got = dg.mm(a[:, start:end], b[start:end]), out[g]
    else:
        ref, got = dg.mm(a[start:end], b[g]), out[start:end]
    return bool(torch.equal(got.view(torch.int16), ref.view(torch.int16)))


__all__ = ["MODELS", "MODEL_BY_NAME", "PASSES", "layer_dims", "gemm_dims", "routing",
           "make_set", "set_bytes", "detgemm", "torch_grouped", "torch_loop", "lt_loop",
           "largest_group", "group_bits_equal_mm"]
