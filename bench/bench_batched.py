"""Batched and grouped GEMMs vs PyTorch, in one run (needs a GPU):

1. bmm on attention shapes (q @ k^T with B a transposed view, p @ v; B*H 8..4096, head_dim
   64/128, sequence 1..4096, lengths that are not a multiple of 8 or of 16) and four more
   batched shapes: `dg.bmm` (one launch) vs `torch.bmm` (cuBLAS), CUDA-graph timed, medians,
   fresh inputs per set; bits of detgemm's entry 0 vs `dg.mm` on that entry.
2. A mixture-of-experts layer (8 experts, top-2, hidden 4096, ffn 14336): `dg.grouped_mm` (one
   launch) vs `torch._grouped_mm` and a per-expert `torch.mm` loop, CUDA-graph timed, and
   detgemm and torch._grouped_mm eager as well, with detgemm's one-GEMM-per-group path (the
   one before the grouped kernel, kept for calls that kernel does not take) in the same run.
3. A Llama-architecture model (bench/llama_model.py; hidden 2048, 4 layers, 16 heads / 4 KV
   heads, eager attention, bf16): eager forward of 16 x 128 tokens and one AdamW training
   step, inside `batch_invariant_mode()` vs without; logits of sequence 0 alone vs in
   batches of 2, 8 and 31 inside the mode.

    python bench/bench_batched.py --out bench/results [--quick] [--parts moe --tag T]

Writes gemm-style markdown + JSON (+ a plot when matplotlib is installed), device named.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import grouped  # noqa: E402
from detgemm_cute.benchlib import gpu  # noqa: E402
from detgemm_cute.benchlib.peers import LtNoSplit  # noqa: E402
from detgemm_cute.benchlib.timing import (QUICK_PLAN, eager_median_us, n_sets_for,  # noqa: E402
                                           time_units)

BF16 = torch.bfloat16


def attention_shapes(quick: bool):
    """(L, M, K, N, B layout): qk has B = k^T (a transposed view), pv has B = v."""
    pairs = [(4096, 64), (2048, 128), (1024, 256), (512, 512), (256, 1024), (128, 2048),
             (64, 4096), (96, 777), (48, 1000), (24, 3000), (288, 333), (80, 1500),
             (48, 2500), (16, 4000), (8, 4095)]
    if quick:
        pairs = pairs[::3]
    rows = []
    for bh, s in pairs:
        for d in (64, 128):
            rows.append((bh, s, d, s, "qk"))
            rows.append((bh, s, s, d, "pv"))
    rows += [(512, 128, 128, 128, "pv"), (2048, 64, 64, 64, "pv"), (64, 1024, 128, 1024, "pv"),
             (8, 4096, 4096, 128, "pv")]
    for bh, s in ((1024, 2048), (256, 8192), (4096, 512)):  # decode: one query per head
        rows.append((bh, 1, 128, s, "qk"))
        rows.append((bh, 1, s, 128, "pv"))
    for g, s in ((8, 4096), (4, 1024)):  # grouped-query decode: g query heads per KV head
        rows.append((256, g, 128, s, "qk"))
        rows.append((256, g, s, 128, "pv"))
    return rows


def bmm_sets(shape, l2):
    lb, m, k, n, kind = shape
    nbytes = 2 * lb * (m * k + k * n + m * n)
    sets = []
    for _ in range(n_sets_for(nbytes, l2, QUICK_PLAN)):
        a = torch.randn(lb, m, k, device="cuda", dtype=BF16)
        if kind == "qk":
            b = torch.randn(lb, n, k, device="cuda", dtype=BF16).transpose(1, 2)
        else:
            b = torch.randn(lb, k, n, device="cuda", dtype=BF16)
        sets.append((a, b))
    return sets


def run_bmm(shapes, cap_stream, log):
    rows = []
    l2 = gpu.l2_bytes()
    for shape in shapes:
        sets = bmm_sets(shape, l2)
        a, b = sets[0]
        c = dg.bmm(a, b)
        entry_ok = bool(torch.equal(c[0].view(torch.int16), dg.mm(a[0], b[0]).view(torch.int16)))
        t = time_units({"torch": lambda s: torch.bmm(*s), "detgemm": lambda s: dg.bmm(*s)},
                       sets, QUICK_PLAN, cap_stream)
        row = {"L": shape[0], "M": shape[1], "K": shape[2], "N": shape[3], "kind": shape[4],
               "torch_us": t["torch"].get("us"), "detgemm_us": t["detgemm"].get("us"),
               "entry_bits_equal_mm": entry_ok}
        row["speed"] = (row["torch_us"] / row["detgemm_us"]
                        if row["torch_us"] and row["detgemm_us"] else None)
        log(f"bmm {shape}: torch {row['torch_us']:.1f} us, detgemm {row['detgemm_us']:.1f} us, "
            f"{row['speed']:.2f}x, entry bits == mm: {entry_ok}")
        rows.append(row)
        del sets, a, b, c
    return rows


def moe_offsets(tokens, experts, topk, gen):
    rows = tokens * topk
    expert_of_row = torch.randint(experts, (rows,), generator=gen)
    counts = torch.bincount(expert_of_row, minlength=experts)
    return counts.cumsum(0).to(torch.int32).cuda(), counts.tolist()


@contextlib.contextmanager
def one_gemm_per_group():
    """grouped_mm as it ran before the one-launch kernel: one GEMM per group (the library's
    path for calls the grouped kernel does not take), for a same-run comparison."""
    saved = grouped.grouped_mm, grouped.planned
    grouped.grouped_mm = grouped.planned = lambda *args: None
    try:
        yield
    finally:
        grouped.grouped_mm, grouped.planned = saved


def eager_us(fn, reps=15):
    return eager_median_us(fn, reps, warmup=3)


def run_moe(token_counts, cap_stream, log):
    """Each projection of the layer: detgemm (one launch), torch._grouped_mm and a
    per-expert torch.mm loop on the same tensors, CUDA-graph timed (`time_units`), and
    detgemm and torch._grouped_mm eager as well (detgemm's eager call checks offs on the
    host: one device sync)."""
    experts, topk, hidden, ffn = 8, 2, 4096, 14336
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in token_counts:
        offs, counts = moe_offsets(tokens, experts, topk, gen)
        ends = torch.tensor(counts).cumsum(0).tolist()
        for name, k, n in (("up", hidden, ffn), ("down", ffn, hidden)):
            x = torch.randn(tokens * topk, k, device="cuda", dtype=BF16)
            # K contiguous per expert ([G, N, K] storage, like nn.Linear weights): the layout
            # torch._grouped_mm wants; every peer gets the same tensor
            w = torch.randn(experts, n, k, device="cuda", dtype=BF16).mul_(k ** -0.5)
            w = w.transpose(1, 2)

            def loop(_s):
                start = 0
                out = torch.empty(x.shape[0], n, device="cuda", dtype=BF16)
                for g, end in enumerate(ends):
                    if end > start:
                        torch.mm(x[start:end], w[g], out=out[start:end])
                    start = end
                return out

            lt = LtNoSplit()

            def lt_loop(_s):  # cuBLASLt with split-K off: the same chain as detgemm
                with lt:
                    return loop(_s)

            peers = {"detgemm": lambda _s: dg.grouped_mm(x, w, offs), "torch_loop": loop,
                     "lt_loop": lt_loop}
            try:
                torch._grouped_mm(x, w, offs)
                peers["torch_grouped_mm"] = lambda _s: torch._grouped_mm(x, w, offs)
            except Exception as e:  # noqa: BLE001
                log(f"torch._grouped_mm unavailable: {str(e).splitlines()[0][:120]}")
            res = time_units(peers, [None], QUICK_PLAN, cap_stream)
            t = {p: r.get("us") for p, r in res.items()}
            eager = {p: eager_us(lambda p=p: peers[p](None))
                     for p in ("detgemm", "torch_grouped_mm") if p in peers}
            with one_gemm_per_group():  # the path before the grouped kernel, same tensors
                eager["detgemm_per_group"] = eager_us(lambda: dg.grouped_mm(x, w, offs))
            y = dg.grouped_mm(x, w, offs)
            g0 = counts.index(max(counts))
            s0 = ([0] + ends)[g0]
            inv = bool(torch.equal(y[s0:s0 + 1].view(torch.int16),
                                   dg.mm(x[s0:s0 + 1], w[g0]).view(torch.int16)))
            lt_same = bool(torch.equal(y.view(torch.int16), lt_loop(None).view(torch.int16)))
            best_torch = min(v for p, v in t.items() if p != "detgemm" and v)
            row = {"tokens": tokens, "rows": tokens * topk, "gemm": name, "K": k, "N": n,
                   **{f"{p}_us": v for p, v in t.items()},
                   **{f"{p}_eager_us": v for p, v in eager.items()},
                   "speed_vs_best_torch": best_torch / t["detgemm"],
                   "row_alone_bits_equal": inv, "lt_loop_bits_equal": lt_same}
            if "torch_grouped_mm" in eager:
                row["eager_speed_vs_torch_grouped_mm"] = (eager["torch_grouped_mm"]
                                                          / eager["detgemm"])
            log(f"moe {tokens} tokens {name}: " + ", ".join(f"{p} {v:.1f} us" for p, v in
                                                             t.items())
                + f"; {row['speed_vs_best_torch']:.2f}x; eager " + ", ".join(
                    f"{p} {v:.1f} us" for p, v in eager.items())
                + f"; token alone == in group: {inv}")
            rows.append(row)
            del x, w
    return rows


def run_model(log):
    from llama_model import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM().cuda().to(BF16)
    ids = torch.randint(32000, (16, 128), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def fwd():
        with torch.no_grad():
            return model(ids)

    def step():
        loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {"config": "hidden 2048, 4 layers, 16 heads / 4 KV heads, ffn 5632, vocab 32000, "
                     "bf16, eager attention, batch 16 x 128 tokens; medians of 7 rounds that "
                     "alternate without / with the mode (the eager forward is host-bound, "
                     "so one round is noisy)"}
    times = {k: [] for k in ("forward_ms", "train_step_ms", "forward_mode_ms",
                             "train_step_mode_ms")}
    dg.reset_report()
    for _ in range(7):
        times["forward_ms"].append(eager_us(fwd, 5) / 1000)
        times["train_step_ms"].append(eager_us(step, 5) / 1000)
        with dg.batch_invariant_mode():
            times["forward_mode_ms"].append(eager_us(fwd, 5) / 1000)
            times["train_step_mode_ms"].append(eager_us(step, 5) / 1000)
    out.update({k: statistics.median(v) for k, v in times.items()})
    with dg.batch_invariant_mode():
        batch = torch.randint(32000, (31, 128), device="cuda")
        with torch.no_grad():
            alone = model(batch[:1])
            same = {str(nb): bool(torch.equal(model(batch[:nb])[:1].view(torch.int16),
                                              alone.view(torch.int16))) for nb in (2, 8, 31)}
    rep = dg.report()
    out["logits_alone_equal_batched"] = same
    out["mode_fell_back"] = rep.total_fell_back
    out["mode_routed"] = rep.total_routed
    out["forward_ratio"] = out["forward_mode_ms"] / out["forward_ms"]
    out["train_step_ratio"] = out["train_step_mode_ms"] / out["train_step_ms"]
    log(f"model: forward {out['forward_ms']:.2f} ms, in mode {out['forward_mode_ms']:.2f} ms "
        f"({out['forward_ratio']:.2f}x); train step {out['train_step_ms']:.2f} ms, in mode "
        f"{out['train_step_mode_ms']:.2f} ms ({out['train_step_ratio']:.2f}x); logits alone == "
        f"batched: {same}; fell back: {rep.total_fell_back}")
    return out


def geomean(xs):
    xs = [x for x in xs if x]
    return float(torch.tensor(xs).log().mean().exp()) if xs else None


def render(meta, bmm_rows, moe_rows, model):
    lines = [f"# Batched and grouped GEMMs: {meta['device']}", "",
             f"{meta['date']}, torch {meta['torch']}, CUDA {meta['cuda']}, bf16. "
             "`speed` = torch time / detgemm time (> 1: detgemm faster).", ""]
    if bmm_rows:
        sp = [r["speed"] for r in bmm_rows]
        lines += ["## bmm (CUDA graphs, medians)", "",
                  f"{len(bmm_rows)} shapes: geomean speed {geomean(sp):.3f}x torch.bmm, worst "
                  f"{min(sp):.2f}x; entry 0 bits == dg.mm: "
                  f"{sum(r['entry_bits_equal_mm'] for r in bmm_rows)}/{len(bmm_rows)}", "",
                  "| L | M | K | N | kind | torch us | detgemm us | speed | entry == mm |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in bmm_rows:
            lines.append(f"| {r['L']} | {r['M']} | {r['K']} | {r['N']} | {r['kind']} | "
                         f"{r['torch_us']:.1f} | {r['detgemm_us']:.1f} | {r['speed']:.2f} | "
                         f"{r['entry_bits_equal_mm']} |")
        lines.append("")
    if moe_rows:
        sp = [r["speed_vs_best_torch"] for r in moe_rows]
        vs_tg = [r["torch_grouped_mm_us"] / r["detgemm_us"] for r in moe_rows
                 if r.get("torch_grouped_mm_us") and r.get("detgemm_us")]
        tg_text = "".join(
            f" Against {label} (graphs): geomean {geomean(v):.3f}x, {min(v):.2f}x to "
            f"{max(v):.2f}x." for label, v in (
                ("torch._grouped_mm", vs_tg),
                ("the cuBLASLt no-split-K loop", [r["lt_loop_us"] / r["detgemm_us"]
                                                  for r in moe_rows if r.get("lt_loop_us")]))
            if v)
        lines += ["## Mixture-of-experts grouped GEMM (8 experts, top-2, hidden 4096, ffn 14336)",
                  "", "CUDA graphs, medians; `eager`: medians of eager calls, host time "
                  "included; `one GEMM per group`: detgemm's path before the grouped kernel "
                  "(offs read on the host), same run. "
                  f"Geomean speed vs the better torch (graphs): {geomean(sp):.3f}x, worst "
                  f"{min(sp):.2f}x." + tg_text, "",
                  "| tokens | rows | GEMM | K | N | detgemm us | torch._grouped_mm us | "
                  "torch mm loop us | Lt no split-K loop us | speed vs best torch | "
                  "eager detgemm us | "
                  "eager torch._grouped_mm us | eager one GEMM per group us | "
                  "token alone == in group | bits == Lt loop |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def us(v):
            return "-" if v is None else f"{v:.1f}"
        for r in moe_rows:
            lines.append(f"| {r['tokens']} | {r['rows']} | {r['gemm']} | {r['K']} | {r['N']} | "
                         f"{us(r['detgemm_us'])} | {us(r.get('torch_grouped_mm_us'))} | "
                         f"{us(r.get('torch_loop_us'))} | {us(r.get('lt_loop_us'))} | "
                         f"{r['speed_vs_best_torch']:.2f} | "
                         f"{us(r.get('detgemm_eager_us'))} | "
                         f"{us(r.get('torch_grouped_mm_eager_us'))} | "
                         f"{us(r.get('detgemm_per_group_eager_us'))} | "
                         f"{r['row_alone_bits_equal']} | {r.get('lt_loop_bits_equal', '-')} |")
        lines.append("")
    if model:
        lines += ["## Llama-architecture model inside batch_invariant_mode()", "",
                  model["config"], "",
                  "| | without mode | in mode | ratio |", "|---|---|---|---|",
                  f"| eager forward | {model['forward_ms']:.2f} ms | "
                  f"{model['forward_mode_ms']:.2f} ms | {model['forward_ratio']:.2f}x |",
                  f"| AdamW train step | {model['train_step_ms']:.2f} ms | "
                  f"{model['train_step_mode_ms']:.2f} ms | {model['train_step_ratio']:.2f}x |", "",
                  f"Logits of sequence 0 alone == in batches of 2 / 8 / 31 (in mode): "
                  f"{model['logits_alone_equal_batched']}; matmuls routed "
                  f"{model['mode_routed']}, fell back {model['mode_fell_back']}.", ""]
    return "\n".join(lines)


def plot(meta, bmm_rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['kind']} {r['L']}x{r['M']}x{r['K']}x{r['N']}" for r in bmm_rows]
    ax.bar(range(len(bmm_rows)), [r["speed"] for r in bmm_rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.9, color="r", lw=0.8, ls="--")
    ax.set_xticks(range(len(bmm_rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("speed vs torch.bmm")
    ax.set_title(f"detgemm bmm vs torch.bmm, {meta['device']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="bmm,moe,model")
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    args = p.parse_args(argv)
    why, _ = gpu.gpu_check()
    if why:
        print(f"bench_batched: {why}")
        return 2
    parts = set(args.parts.split(","))
    meta = gpu.device_meta()
    cap = torch.cuda.Stream()
    t0 = time.time()
    bmm_rows = run_bmm(attention_shapes(args.quick), cap, gpu.log) if "bmm" in parts else []
    moe_rows = run_moe((256, 1024, 4096, 16384), cap, gpu.log) if "moe" in parts else []
    model = run_model(gpu.log) if "model" in parts else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (f"batched_{meta['device'].lower().replace(' ', '-')}"
                  + (f"_{args.tag}" if args.tag else ""))
    report = {"meta": meta, "bmm": bmm_rows, "moe": moe_rows, "model": model,
              "seconds": time.time() - t0}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(render(meta, bmm_rows, moe_rows, model))
    if bmm_rows:
        plot(meta, bmm_rows, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
