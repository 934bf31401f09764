"""Training throughput: detgemm's Linear vs PyTorch's (cuBLAS), same GPU, same run.

    python bench/bench_train.py [--quick] [--out bench/results]

Two tables:
- one Linear layer, forward + backward (dX, dW, db) on fresh random inputs per iteration;
- a whole small-transformer training step (forward, backward, AdamW) at d_model 1024 and
  2048, sequence 2048. Attention is `F.scaled_dot_product_attention(is_causal=True)` in every
  arm, so only the Linears differ: torch `nn.Linear`, `detgemm_cute.nn.convert(model)`, and
  `convert(model, fp32_grad_accum=True)` (dW continued in fp32 `main_grad` buffers, then
  `finalize_grads`).

Timing: CUDA events around a block of iterations, after warm-up; the arms are interleaved
round-robin so clock drift falls on all of them alike; the median block is reported. Results
go to `<out>/train_<device>.md|json|png`; the target is detgemm step throughput >= 0.9x
PyTorch's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS = [(1024, 4096), (4096, 1024), (2048, 8192), (8192, 2048), (4096, 4096)]
MODELS = [(1024, 8), (2048, 4)]  # (d_model, sequences of 2048 tokens)
SEQ, N_LAYERS, VOCAB, HEAD_DIM = 2048, 4, 8192, 128
ARMS = ("torch", "detgemm", "detgemm+fp32acc")


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _convert(model, arm):
    import detgemm_cute as dg

    if arm == "detgemm":
        dg.nn.convert(model)
    elif arm == "detgemm+fp32acc":
        dg.nn.convert(model, fp32_grad_accum=True)
    return model


def _finish_grads(model, arm):
    if arm == "detgemm+fp32acc":
        import detgemm_cute as dg

        dg.nn.finalize_grads(model)
        dg.nn.zero_main_grads(model)


def time_arms(steps: dict, iters: int, reps: int, warm: int) -> dict:
    """Median ms per iteration of each arm; blocks of `iters` interleaved across arms."""
    for fn in steps.values():
        for _ in range(warm):
            fn()
    torch.cuda.synchronize()
    times = {a: [] for a in steps}
    names = list(steps)
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for a in order:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                steps[a]()
            e.record()
            e.synchronize()
            times[a].append(s.elapsed_time(e) / iters)
    return {a: statistics.median(t) for a, t in times.items()}


# ----------------------------------------------------------------------------- layer
def layer_rows(tokens: int, shapes, iters, reps):
    rows = []
    for d_in, d_out in shapes:
        torch.manual_seed(0)
        base = torch.nn.Linear(d_in, d_out, device="cuda", dtype=torch.bfloat16)
        xs = [torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        gs = [torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        steps, it = {}, [0]
        for arm in ARMS:
            lin = torch.nn.Linear(d_in, d_out, device="cuda", dtype=torch.bfloat16)
            lin.load_state_dict(base.state_dict())
            lin = _convert(torch.nn.Sequential(lin), arm)[0]

            def step(lin=lin):
                i = it[0] = (it[0] + 1) % 3
                x = xs[i].requires_grad_()
                lin(x).backward(gs[i])
                x.grad = None

            steps[arm] = step
        ms = time_arms(steps, iters, reps, warm=3)
        flops = 3 * 2 * tokens * d_in * d_out
        rows.append({"tokens": tokens, "d_in": d_in, "d_out": d_out, **{
            f"{a}_ms": ms[a] for a in ARMS}, "torch_tflops": flops / ms["torch"] / 1e9,
            **{f"{a}_ratio": ms["torch"] / ms[a] for a in ARMS[1:]}})
    return rows


# ----------------------------------------------------------------------------- model
class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.n1 = torch.nn.RMSNorm(d)
        self.n2 = torch.nn.RMSNorm(d)
        self.heads = d // HEAD_DIM

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, HEAD_DIM).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(N_LAYERS))
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def model_rows(models, iters, reps):
    rows = []
    for d, seqs in models:
        torch.manual_seed(0)
        base = Model(d).to("cuda", torch.bfloat16)
        data = [torch.randint(0, VOCAB, (seqs, SEQ + 1), device="cuda") for _ in range(3)]
        steps, it = {}, [0]
        for arm in ARMS:
            m = Model(d).to("cuda", torch.bfloat16)
            m.load_state_dict(base.state_dict())
            _convert(m, arm)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

            def step(m=m, opt=opt, arm=arm):
                i = it[0] = (it[0] + 1) % 3
                ids = data[i]
                logits = m(ids[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, VOCAB), ids[:, 1:].reshape(-1))
                loss.backward()
                _finish_grads(m, arm)
                opt.step()
                opt.zero_grad(set_to_none=True)

            steps[arm] = step
        ms = time_arms(steps, iters, reps, warm=2)
        tokens = seqs * SEQ
        rows.append({"d_model": d, "tokens": tokens, "layers": N_LAYERS,
                     **{f"{a}_ms": ms[a] for a in ARMS},
                     **{f"{a}_tok_s": tokens / ms[a] * 1e3 for a in ARMS},
                     **{f"{a}_ratio": ms["torch"] / ms[a] for a in ARMS[1:]}})
        del base, steps
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------- output
def to_markdown(device: str, layers, models) -> str:
    out = [f"# Training throughput on {device}", "",
           "detgemm vs PyTorch's cuBLAS path, bf16, same run; ratio = torch time / detgemm "
           "time (>= 0.9 is the target; > 1 is faster).", "",
           "## One Linear layer, forward + backward (dX, dW, db)", "",
           "| tokens | in | out | torch ms | detgemm ms | ratio | +fp32 main_grad ms | ratio |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in layers:
        out.append(f"| {r['tokens']} | {r['d_in']} | {r['d_out']} | {r['torch_ms']:.3f} | "
                   f"{r['detgemm_ms']:.3f} | {r['detgemm_ratio']:.2f} | "
                   f"{r['detgemm+fp32acc_ms']:.3f} | {r['detgemm+fp32acc_ratio']:.2f} |")
    out += ["", f"## Training step: {N_LAYERS}-layer transformer, seq {SEQ}, vocab {VOCAB}, "
            "AdamW", "",
            "| d_model | tokens/step | torch ms | detgemm ms | ratio | +fp32 main_grad ms | "
            "ratio | detgemm tokens/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in models:
        out.append(f"| {r['d_model']} | {r['tokens']} | {r['torch_ms']:.1f} | "
                   f"{r['detgemm_ms']:.1f} | {r['detgemm_ratio']:.2f} | "
                   f"{r['detgemm+fp32acc_ms']:.1f} | {r['detgemm+fp32acc_ratio']:.2f} | "
                   f"{r['detgemm_tok_s']:.0f} |")
    return "\n".join(out) + "\n"


def plot(path: Path, device: str, layers, models) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['d_in']}x{r['d_out']}" for r in layers] + \
        [f"model d{r['d_model']}" for r in models]
    rows = layers + models
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(rows))
    for j, arm in enumerate(ARMS[1:]):
        ax.bar([x + 0.4 * j for x in xs], [r[f"{arm}_ratio"] for r in rows], width=0.4,
               label=arm)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.9, color="r", lw=0.8, ls="--", label="target 0.9")
    ax.set_xticks([x + 0.2 for x in xs], labels, rotation=30, ha="right")
    ax.set_ylabel("torch time / detgemm time")
    ax.set_title(f"Training throughput vs PyTorch (cuBLAS), {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="detgemm vs PyTorch training throughput")
    ap.add_argument("--quick", action="store_true", help="one layer shape, one model size")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--tokens", type=int, default=8192, help="tokens for the layer table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        print("bench_train: needs an SM90 GPU (H100/H200) or an SM80-family GPU (A100 and "
              "newer); nothing to measure here")
        return 0
    device = torch.cuda.get_device_name()
    layers = layer_rows(args.tokens, LAYERS[:1] if args.quick else LAYERS,
                        iters=5 if args.quick else 10, reps=3 if args.quick else 7)
    models = model_rows(MODELS[:1] if args.quick else MODELS, iters=2 if args.quick else 4,
                        reps=3 if args.quick else 5)
    md = to_markdown(device, layers, models)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"train_{slug(device)}"
    stem.with_suffix(".md").write_text(md)
    stem.with_suffix(".json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "layers": layers, "models": models},
        indent=1))
    if plot(stem.with_suffix(".png"), device, layers, models):
        print(f"wrote {stem}.md/.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
