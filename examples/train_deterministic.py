"""Train a small GPT twice from one seed and get the same bits; then show that a sequence's
logits do not depend on the batch it rides in.

    python examples/train_deterministic.py [--steps 200] [--d-model 512] [--compare-torch]

Why every piece of the forward is batch-invariant (a sequence's result depends only on that
sequence and the weights):
- Linears (QKV, output projection, MLP, LM head): `detgemm_cute.nn.Linear` via
  `nn.convert`: a fixed fp32 chain per output element, whatever the number of rows.
- Embedding: a gather. RMSNorm, GELU, residual adds: per row / per element.
- Attention: computed per sequence (a loop over the batch), so each call sees one
  sequence with a shape that does not depend on the batch size.

What is not covered: attention's own products are PyTorch's kernels (SDPA here; cuBLAS in
an explicit q @ k^T version). They are deterministic for fixed shapes, and they are
batch-invariant here only because the loop fixes their shapes; batching attention across
sequences, or padding sequences to a common length, would change the computation. Bits are
promised for the same GPU kind and software versions, not across them.

Training reproducibility also needs the backward of the non-GEMM ops to be deterministic.
`torch.use_deterministic_algorithms(True)` selects PyTorch's deterministic kernels (the
embedding backward, the deterministic flash-attention backward; with `warn_only=True`
flash attention keeps its atomic dQ accumulation, whose order varies from run to run), and
`CUBLAS_WORKSPACE_CONFIG` is what cuBLAS then requires; it must be set before CUDA starts.
Gradient accumulation runs in fp32 `main_grad` buffers (`fp32_grad_accum=True`) with
micro-batches of a multiple of 16 tokens, so it equals one large batch bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA initialises

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def attention(self, x):
        """Causal self-attention, one sequence at a time (shapes independent of batch)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = torch.cat([F.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                                        is_causal=True) for i in range(b)])
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(args, seed: int, device="cuda"):
    """The model from `seed`, in bf16, every nn.Linear swapped for detgemm's."""
    import detgemm_cute as dg

    torch.manual_seed(seed)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads).to(device, torch.bfloat16)
    return dg.nn.convert(model, fp32_grad_accum=True)


def make_corpus(args, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """A learnable toy language: `args.pool` sequences of seq + 1 tokens in which each token
    follows its predecessor through a fixed random table 3 times in 4 and is uniform noise
    otherwise. Built token by token, once per run, from the generator alone."""
    n, length = args.pool, args.seq + 1
    table = torch.randint(0, args.vocab, (args.vocab,), device=device, generator=gen)
    noise = torch.randint(0, args.vocab, (n, length), device=device, generator=gen)
    keep = torch.rand(n, length, device=device, generator=gen) < 0.75
    seqs = noise.clone()
    for t in range(1, length):
        seqs[:, t] = torch.where(keep[:, t], table[seqs[:, t - 1]], noise[:, t])
    return seqs


def train(args, seed: int, device="cuda", log=None):
    """AdamW with gradient accumulation; returns (losses, parameters, model).

    dW of every Linear accumulates over the micro-batches in fp32 `main_grad`;
    `finalize_grads` rounds it once to bf16 into `.grad` for the optimizer. The other
    parameters (embedding, norms) accumulate `.grad` as PyTorch does, in a fixed order."""
    import detgemm_cute as dg

    model = build(args, seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    corpus = make_corpus(args, gen, device)
    losses = []
    for step in range(args.steps):
        dg.nn.zero_main_grads(model)
        for _micro in range(args.micro_batches):
            pick = torch.randint(0, corpus.shape[0], (args.batch,), device=device, generator=gen)
            ids = corpus[pick]
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
            (loss / args.micro_batches).backward()
            losses.append(loss.detach())
        dg.nn.finalize_grads(model)  # p.grad = main_grad rounded once to bf16
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log and (step + 1) % max(1, args.steps // 4) == 0:
            log(f"  step {step + 1}/{args.steps}: loss "
                f"{torch.stack(losses[-args.micro_batches:]).mean().item():.4f}")
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], model


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs with the same payload compare equal, -0.0 != +0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def batch_invariance(model, args, device="cuda", others=(2, 8, 31)) -> dict:
    """Logits of one sequence alone vs at a middle position among 2, 8 and 31 others."""
    gen = torch.Generator(device=device).manual_seed(123)
    target = torch.randint(0, args.vocab, (1, args.seq), device=device, generator=gen)
    with torch.no_grad():
        alone = model(target)[0]
        result = {}
        for n in others:
            rest = torch.randint(0, args.vocab, (n, args.seq), device=device, generator=gen)
            ids = torch.cat([rest[: n // 2], target, rest[n // 2:]])
            result[n] = same_bits(model(ids)[n // 2], alone)
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--pool", type=int, default=1024, help="sequences in the toy corpus")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-torch", action="store_true",
                    help="also run the batch-invariance check with plain nn.Linear (cuBLAS)")
    ap.add_argument("--require-gpu", action="store_true",
                    help="exit 1 instead of 0 when no GPU with detgemm kernels (SM90 family: "
                         "H100/H200; SM80 family: A100 and newer) is present")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        print("train_deterministic: the detgemm kernels need an SM90 GPU (H100/H200) or an "
              "SM80-family GPU (A100 and newer) for the training runs and the batch-invariance "
              "check; this machine has none, so nothing was trained. On a CPU, "
              "detgemm_cute.reference reproduces the kernels' bits (see README).")
        return 1 if args.require_gpu else 0
    if (args.batch * args.seq) % 16:
        print("note: micro-batch token counts that are not multiples of 16 are deterministic "
              "but do not equal one large batch bit for bit (docs/training.md)")
    # Strict: an op without a deterministic kernel raises instead of running a
    # nondeterministic one (warn_only=True would let flash attention's backward do so).
    torch.use_deterministic_algorithms(True)
    print(f"device: {torch.cuda.get_device_name()}; model d={args.d_model} x {args.layers} "
          f"layers, {args.steps} steps x {args.micro_batches} micro-batches of "
          f"{args.batch}x{args.seq} tokens")
    print("run 1")
    l1, w1, _ = train(args, args.seed, log=print)
    print("run 2")
    l2, w2, model = train(args, args.seed)
    losses_same = same_bits(l1, l2)
    weights_same = len(w1) == len(w2) and all(same_bits(a, b) for a, b in zip(w1, w2))
    print(f"loss {l1[:args.micro_batches].mean():.4f} -> {l1[-args.micro_batches:].mean():.4f}; "
          f"run 1 vs run 2: losses bit-identical: {losses_same} ({l1.numel()} values), "
          f"weights bit-identical: {weights_same} ({len(w1)} tensors)")
    model.eval()
    inv = batch_invariance(model, args)
    print("trained model, one sequence's logits alone vs inside a batch with N others: " +
          ", ".join(f"N={n}: {'identical' if ok else 'DIFFERENT'}" for n, ok in inv.items()))
    if args.compare_torch:
        plain = GPT(args.vocab, args.d_model, args.layers, args.heads).to("cuda", torch.bfloat16)
        plain.load_state_dict(model.state_dict())  # same weights, cuBLAS Linears
        ref = batch_invariance(plain.eval(), args)
        print("plain nn.Linear (cuBLAS), same weights, same check: " +
              ", ".join(f"N={n}: {'identical' if ok else 'different'}" for n, ok in ref.items()))
    ok = losses_same and weights_same and all(inv.values())
    print("OK: bit-identical training and batch-invariant logits" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
