"""The mode's attention vs torch SDPA's default backend, in one run (needs an SM90 GPU):

1. prefill forward and forward+backward (causal, bf16), S 512..8192, small and large B*H,
   head_dim 64 and 128 (GQA 32/8 at 128): `dg.attention` (flash-attn-4, configured for the
   contract) vs `F.scaled_dot_product_attention` outside the mode (torch picks its backend).
   CUDA graphs, medians, interleaved replays, fresh random inputs (`benchlib.timing`).
   Speed is reported as torch's time / ours (> 1: we are faster).
2. decode: one query against KV 1k..32k, B 1..64, GQA 32/8 x 128.
3. a Hugging Face Llama (built from a config, random weights, sdpa attention, bf16): forward
   and a training step (forward + backward + AdamW) inside `batch_invariant_mode()` vs plain
   PyTorch, eager, event-timed medians (the model's own launches included).

    python bench/bench_attention.py --out bench/results [--quick]

Writes markdown + JSON (+ a plot when matplotlib is installed), device named.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import detgemm_cute as dg
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.fmt import device_slug, json_default
from detgemm_cute.benchlib.timing import QUICK_PLAN, eager_median_us, time_units

BF16 = torch.bfloat16
# (B, Hq, Hkv, S, D)
PREFILL = [(b, h, hk, s, d) for d, h, hk in ((128, 32, 8), (64, 16, 16))
           for b, s in ((1, 512), (8, 512), (1, 1024), (8, 1024), (2, 2048), (8, 2048),
                        (1, 4096), (4, 4096), (1, 8192), (2, 8192))]
DECODE = [(b, 32, 8, kv, 128) for b in (1, 8, 64) for kv in (1024, 4096, 16384, 32768)
          if b * kv <= 64 * 16384]


def _sets(b, hq, hk, sq, sk, d, grad, n=4):
    sets = []
    for _ in range(n):
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=BF16)
        k = torch.randn(b, hk, sk, d, device="cuda", dtype=BF16)
        v = torch.randn(b, hk, sk, d, device="cuda", dtype=BF16)
        if grad:
            for t in (q, k, v):
                t.requires_grad_(True)
        dout = torch.randn(b, hq, sq, d, device="cuda", dtype=BF16)
        sets.append(SimpleNamespace(q=q, k=k, v=v, dout=dout))
    return sets


def _fwd(fn):
    return lambda s: fn(s.q, s.k, s.v)


def _fwd_bwd(fn):
    def run(s):
        out = fn(s.q, s.k, s.v)
        return torch.autograd.grad(out, (s.q, s.k, s.v), s.dout)
    return run


def ours(causal):
    return lambda q, k, v: dg.attention(q, k, v, causal=causal)


def torch_sdpa(causal):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          enable_gqa=q.shape[1] != k.shape[1])


def attention_flops(b, hq, sq, sk, d, causal):
    pairs = sq * sk - (sq * (sq - 1) / 2 if causal and sq == sk else 0)
    return 4 * b * hq * pairs * d


def time_pair(fns, sets, plan, cap):
    res = time_units(fns, sets, plan, cap)
    return {name: r.get("us") for name, r in res.items()}, {n: r.get("error") for n, r in res.items()}


def bench_prefill(plan, cap, shapes, log):
    rows = []
    for b, hq, hk, s, d in shapes:
        row = dict(kind="prefill", b=b, hq=hq, hk=hk, sq=s, sk=s, d=d)
        sets = _sets(b, hq, hk, s, s, d, grad=True, n=2)
        for phase, wrap in (("fwd", _fwd), ("fwd_bwd", _fwd_bwd)):
            us, err = time_pair({"detgemm": wrap(ours(True)), "torch": wrap(torch_sdpa(True))},
                                sets, plan, cap)
            row[f"{phase}_us"], row[f"{phase}_torch_us"] = us["detgemm"], us["torch"]
            row[f"{phase}_errors"] = {k: v for k, v in err.items() if v}
        fl = attention_flops(b, hq, s, s, d, True)
        row["fwd_tflops"] = fl / row["fwd_us"] / 1e6 if row["fwd_us"] else None
        rows.append(row)
        log(f"prefill {b}x{hq}/{hk}x{s}x{d}: fwd {row['fwd_us']} vs {row['fwd_torch_us']} us, "
            f"fwd+bwd {row['fwd_bwd_us']} vs {row['fwd_bwd_torch_us']} us")
        del sets
    return rows


def bench_decode(plan, cap, shapes, log):
    rows = []
    for b, hq, hk, kv, d in shapes:
        sets = _sets(b, hq, hk, 1, kv, d, grad=False, n=2)
        us, err = time_pair({"detgemm": _fwd(ours(False)), "torch": _fwd(torch_sdpa(False))},
                            sets, plan, cap)
        row = dict(kind="decode", b=b, hq=hq, hk=hk, sq=1, sk=kv, d=d, fwd_us=us["detgemm"],
                   fwd_torch_us=us["torch"], fwd_errors={k: v for k, v in err.items() if v})
        kv_bytes = 2 * b * hk * kv * d * 2
        row["kv_tb_per_s"] = kv_bytes / row["fwd_us"] / 1e6 if row["fwd_us"] else None
        rows.append(row)
        log(f"decode B{b} kv{kv}: {row['fwd_us']} vs {row['fwd_torch_us']} us")
        del sets
    return rows


def bench_model(log, quick):
    """HF Llama forward / training step, in the mode vs plain, eager medians (ms)."""
    try:
        import transformers
    except ImportError:
        return {"error": "transformers not installed"}
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4 if quick
        else 8, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    out = dict(config=f"{cfg.num_hidden_layers} layers, hidden 2048, 16/4 heads x 128, "
               f"batch 4 x 2048 tokens, bf16")

    def fwd():
        with torch.no_grad():
            model(ids)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reps = 5 if quick else 10
    for name, ctx in (("torch", None), ("detgemm", dg.batch_invariant_mode)):
        if ctx is None:
            out[f"fwd_ms_{name}"] = eager_median_us(fwd, reps, 2) / 1e3
            out[f"step_ms_{name}"] = eager_median_us(step, reps, 2) / 1e3
        else:
            with ctx():
                out[f"fwd_ms_{name}"] = eager_median_us(fwd, reps, 2) / 1e3
                out[f"step_ms_{name}"] = eager_median_us(step, reps, 2) / 1e3
                out["report"] = str(dg.report())
    log(f"model: fwd {out['fwd_ms_detgemm']:.2f} vs {out['fwd_ms_torch']:.2f} ms, step "
        f"{out['step_ms_detgemm']:.2f} vs {out['step_ms_torch']:.2f} ms")
    return out


def _ratio(a, b):
    return b / a if a and b else None


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def summarise(prefill, decode, model):
    s = {}
    for phase in ("fwd", "fwd_bwd"):
        r = [_ratio(row[f"{phase}_us"], row[f"{phase}_torch_us"]) for row in prefill]
        s[f"prefill_{phase}_speed_geomean"] = _geomean(r)
        s[f"prefill_{phase}_speed_min"] = min((x for x in r if x), default=None)
    bwd = [_ratio(row["fwd_bwd_us"] - row["fwd_us"], row["fwd_bwd_torch_us"] - row["fwd_torch_us"])
           for row in prefill if row["fwd_bwd_us"] and row["fwd_bwd_torch_us"]]
    s["prefill_bwd_speed_geomean"] = _geomean(bwd)
    s["prefill_bwd_speed_min"] = min((x for x in bwd if x), default=None)
    dec = [row["fwd_us"] / row["fwd_torch_us"] for row in decode
           if row["fwd_us"] and row["fwd_torch_us"]]
    s["decode_time_ratio_max"] = max(dec, default=None)
    s["decode_time_ratio_geomean"] = _geomean(dec)
    if "fwd_ms_torch" in model:
        s["model_fwd_time_ratio"] = model["fwd_ms_detgemm"] / model["fwd_ms_torch"]
        s["model_step_time_ratio"] = model["step_ms_detgemm"] / model["step_ms_torch"]
    return s


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def render(meta, prefill, decode, model, summary) -> str:
    lines = [f"# Attention: detgemm (flash-attn-4, invariant config) vs torch SDPA",
             "", f"Device: **{meta['device']}**, torch {meta['torch']}, CUDA {meta['cuda']}, "
             f"{meta['date']}. `python bench/bench_attention.py {' '.join(meta['argv'])}`", "",
             "Speed = torch time / detgemm time (> 1: detgemm faster). CUDA graphs, medians.", "",
             "## Summary", ""]
    for k, v in summary.items():
        lines.append(f"- {k}: {_f(v, '{:.3f}')}")
    lines += ["", "## Prefill (causal, bf16)", "",
              "| B | Hq/Hkv | S | D | fwd us | torch fwd us | fwd speed | fwd+bwd us | torch "
              "fwd+bwd us | bwd speed | TFLOP/s fwd |", "|" + "---|" * 11]
    for r in prefill:
        bwd = _ratio((r["fwd_bwd_us"] or 0) - (r["fwd_us"] or 0),
                     (r["fwd_bwd_torch_us"] or 0) - (r["fwd_torch_us"] or 0))
        lines.append(f"| {r['b']} | {r['hq']}/{r['hk']} | {r['sq']} | {r['d']} | "
                     f"{_f(r['fwd_us'], '{:.1f}')} | {_f(r['fwd_torch_us'], '{:.1f}')} | "
                     f"{_f(_ratio(r['fwd_us'], r['fwd_torch_us']))} | "
                     f"{_f(r['fwd_bwd_us'], '{:.1f}')} | {_f(r['fwd_bwd_torch_us'], '{:.1f}')} | "
                     f"{_f(bwd)} | {_f(r['fwd_tflops'], '{:.0f}')} |")
    lines += ["", "## Decode (one query, GQA 32/8 x 128, bf16)", "",
              "| B | KV | us | torch us | time ratio | KV TB/s |", "|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['b']} | {r['sk']} | {_f(r['fwd_us'], '{:.1f}')} | "
                     f"{_f(r['fwd_torch_us'], '{:.1f}')} | "
                     f"{_f(r['fwd_us'] / r['fwd_torch_us'] if r['fwd_us'] and r['fwd_torch_us'] else None)}"
                     f" | {_f(r['kv_tb_per_s'])} |")
    lines += ["", "## Hugging Face Llama, in the mode vs plain PyTorch", ""]
    if "error" in model:
        lines.append(f"not run: {model['error']}")
    else:
        lines += [f"{model['config']}; eager, median of event-timed calls.", "",
                  "| | detgemm mode ms | torch ms | ratio |", "|---|---|---|---|",
                  f"| forward | {model['fwd_ms_detgemm']:.2f} | {model['fwd_ms_torch']:.2f} | "
                  f"{model['fwd_ms_detgemm'] / model['fwd_ms_torch']:.3f} |",
                  f"| training step | {model['step_ms_detgemm']:.2f} | {model['step_ms_torch']:.2f}"
                  f" | {model['step_ms_detgemm'] / model['step_ms_torch']:.3f} |", "", "```",
                  model.get("report", ""), "```"]
    return "\n".join(lines) + "\n"


def plot(prefill, decode, path, device):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['b']}x{r['hq']}x{r['sq']}\nd{r['d']}" for r in prefill]
    x = range(len(prefill))
    for key, name in (("fwd", "forward"), ("fwd_bwd", "fwd+bwd")):
        axes[0].plot(x, [_ratio(r[f"{key}_us"], r[f"{key}_torch_us"]) for r in prefill], "o-",
                     label=name)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_xticks(list(x), labels, rotation=90, fontsize=6)
    axes[0].set_ylabel("torch SDPA time / detgemm time")
    axes[0].set_title("prefill (causal)")
    axes[0].legend()
    for b in sorted({r["b"] for r in decode}):
        rs = [r for r in decode if r["b"] == b]
        axes[1].plot([r["sk"] for r in rs], [r["fwd_us"] / r["fwd_torch_us"] for r in rs], "o-",
                     label=f"B={b}")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("KV length")
    axes[1].set_ylabel("detgemm time / torch time")
    axes[1].set_title("decode (1 query)")
    axes[1].legend()
    fig.suptitle(f"Invariant attention vs torch SDPA on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--no-model", action="store_true", help="skip the Hugging Face model rows")
    args = p.parse_args(argv)
    why, _ = gpu.gpu_check()
    if why:
        print(f"bench_attention: {why}", file=sys.stderr)
        return 2
    meta = gpu.device_meta()
    plan = QUICK_PLAN
    cap = torch.cuda.Stream()
    prefill_shapes = PREFILL[::2] if args.quick else PREFILL
    decode_shapes = DECODE[::2] if args.quick else DECODE
    prefill = bench_prefill(plan, cap, prefill_shapes, gpu.log)
    decode = bench_decode(plan, cap, decode_shapes, gpu.log)
    model = {"error": "skipped (--no-model)"} if args.no_model else bench_model(gpu.log, args.quick)
    summary = summarise(prefill, decode, model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"attention_{device_slug(meta['device'])}"
    report = dict(meta=meta, summary=summary, prefill=prefill, decode=decode, model=model)
    base.with_suffix(".json").write_text(json.dumps(report, indent=1, default=json_default))
    base.with_suffix(".md").write_text(render(meta, prefill, decode, model, summary))
    plot(prefill, decode, str(base) + ".png", meta["device"])
    print(render(meta, prefill, decode, model, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
