"""The report of bench_distributed.py: markdown, JSON and (with matplotlib) a plot of every
world's rows, one table per model, and the step-time target at 2 and 4 GPUs."""

from __future__ import annotations

import json
from pathlib import Path

from detgemm_cute.benchlib.fmt import device_slug, fmt_num

PHASES = ("forward", "backward", "chain_tail", "chain_wait", "finish", "gather", "optimizer")
MIB = 1 << 20


def _last_rank(row: dict) -> dict:
    return row["ranks"][-1]


def _ratio(a, b):
    return a / b if a and b else None


def _model_table(name: str, results: list[dict]) -> list[str]:
    head = ["world", "arm", "step ms", "vs DDP torch", "vs DDP dg", *PHASES,
            "peak GiB", "held MiB", "sent MiB", "recv MiB", "final MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        arms = res["models"].get(name, {}).get("arms", {})
        ddp = {row["kind"]: row["step_ms"] for row in arms.values()
               if row["kind"].startswith("ddp")}
        for label, row in arms.items():
            last = _last_rank(row)
            ph = last.get("phases", {})
            cells = [str(res["world"]), label, fmt_num(row["step_ms"], "{:.2f}"),
                     fmt_num(_ratio(row["step_ms"], ddp.get("ddp_torch")), "{:.2f}x"),
                     fmt_num(_ratio(row["step_ms"], ddp.get("ddp_dg")), "{:.2f}x"),
                     *(fmt_num(ph.get(k), "{:.2f}") for k in PHASES),
                     fmt_num(max(r["peak_bytes"] for r in row["ranks"]) / (1 << 30), "{:.1f}"),
                     fmt_num(max(r.get("held_bytes", 0) for r in row["ranks"]) / MIB, "{:.0f}"),
                     fmt_num(row["ranks"][0].get("sent_bytes", 0) / MIB, "{:.0f}"),
                     fmt_num(last.get("received_bytes", 0) / MIB, "{:.0f}"),
                     fmt_num(max(r.get("final_bytes", 0) for r in row["ranks"]) / MIB,
                             "{:.0f}")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _targets(models: list[str], results: list[dict], target: float) -> list[str]:
    lines = ["| model | world | fastest IDP arm | ms | DDP torch ms | ratio | DDP dg ms | "
             f"ratio | <= {target}x DDP torch |", "|---|---|---|---|---|---|---|---|---|"]
    for name in models:
        for res in results:
            if res["world"] < 2:
                continue
            arms = res["models"].get(name, {}).get("arms", {})
            idp = {k: v for k, v in arms.items() if v["kind"] == "idp"}
            ddp = {v["kind"]: v["step_ms"] for v in arms.values() if v["kind"].startswith("ddp")}
            if not idp:
                continue
            label, best = min(idp.items(), key=lambda kv: kv[1]["step_ms"])
            r_torch = _ratio(best["step_ms"], ddp.get("ddp_torch"))
            r_dg = _ratio(best["step_ms"], ddp.get("ddp_dg"))
            met = "-" if r_torch is None else ("yes" if r_torch <= target else "no")
            lines.append(f"| {name} | {res['world']} | {label} | {best['step_ms']:.2f} | "
                         f"{fmt_num(ddp.get('ddp_torch'), '{:.2f}')} | "
                         f"{fmt_num(r_torch, '{:.2f}x')} | {fmt_num(ddp.get('ddp_dg'), '{:.2f}')} "
                         f"| {fmt_num(r_dg, '{:.2f}x')} | {met} |")
    return lines


def render(results: list[dict], notes: list[str], target: float) -> str:
    meta = results[0]["meta"]
    models = list(results[0]["models"])
    worlds = ", ".join(str(r["world"]) for r in results)
    out = [f"# Data-parallel training step: InvariantDataParallel vs DDP ({meta['device']})",
           "",
           f"{meta['device']}, worlds {worlds}; torch {meta['torch']}, CUDA {meta['cuda']}; "
           f"{meta['date']}. {results[0]['tokens_per_rank']} tokens per rank per step, bf16 "
           f"GEMMs, AdamW. Step: the median of the timed steps on the slowest rank (CUDA "
           f"events). Phases (ms, median of the profiled steps, last rank): forward; "
           f"backward on the main stream; chain_tail: after it, until this rank's chain work "
           f"is done; chain_wait: side-stream time waiting for rank r-1's slices; finish: "
           f"finalize_grads; gather: the sharded finish's all-gather (inside optimizer). "
           f"held: X/dY records held at once (peak); sent / recv: fp32 bytes to the next / "
           f"from the previous rank; final: fp32 bytes of final results (broadcast or "
           f"delivered to owners).", ""]
    for r in results:
        if r.get("p2p_gbs"):
            out.append(f"- world {r['world']}: NCCL send rank 0 -> 1, 64 MiB: "
                       f"{r['p2p_gbs']:.0f} GB/s")
    out += ["", f"## Target: step time <= {target}x DDP at 2 and 4 GPUs", "",
            *_targets(models, results, target), ""]
    for name in models:
        out += [f"## {name}: {results[0]['models'][name]['describe']}", "",
                *_model_table(name, results), ""]
    if notes:
        out += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(out)


def write_plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(results[0]["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        labels = list(results[0]["models"][name]["arms"])
        for label in labels:
            pts = [(r["world"], r["models"][name]["arms"][label]["step_ms"]) for r in results
                   if label in r["models"].get(name, {}).get("arms", {})]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_title(f"{name}: {results[0]['models'][name]['describe']}", fontsize=9)
        ax.set_xlabel("GPUs (data-parallel ranks)")
        ax.set_ylabel("ms per step (slowest rank)")
        ax.set_xticks([r["world"] for r in results])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(results: list[dict], notes: list[str], out: Path, target: float) -> list:
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"distributed_{device_slug(results[0]['meta']['device'])}"
    paths = [base.with_suffix(".md"), base.with_suffix(".json")]
    paths[0].write_text(render(results, notes, target))
    with open(paths[1], "w") as f:
        json.dump({"target": target, "notes": notes, "worlds": results}, f, indent=1)
    if write_plot(results, base.with_suffix(".png")):
        paths.append(base.with_suffix(".png"))
    return paths
