"""The bench report: markdown tables, strict JSON, and a plot naming the device.

`report` is a dict: meta (device, versions, settings, notes), rows (`runner` rows),
summary (`stats.summarize`), probe, overhead. Pure Python (matplotlib only for the plot)."""

from __future__ import annotations

import json

from . import peers as P
from .fmt import cell, fmt_num, fmt_us, json_clean, json_default, short
from .runner import DET_TOL, row_notes
from .shapes import OP_FORMULAS
from .stats import RATIO_PEERS, geomean, summary_groups, tbytes_per_s, worst_rows

_HEAD = {"detgemm": "detgemm", "cublas": "cuBLAS", "pedantic": "PEDANTIC",
         "cublaslt": "Lt-nosplit"}
_RATIO_HEAD = {"cublas": "det/cuBLAS", "pedantic": "det/PEDANTIC", "cublaslt": "det/Lt"}


def peers_in(report) -> tuple:
    """The peers this run asked for (meta['peers']), in the canonical order."""
    asked = (report.get("meta") or {}).get("peers") or P.PEERS
    return tuple(p for p in P.PEERS if p in asked or p == "detgemm")


def main_columns(peers=P.PEERS) -> tuple:
    cols = ["op", "M", "K", "N", "bucket"]
    cols += [f"{_HEAD[p]} us" for p in peers]
    cols += ["detgemm TFLOP/s"]
    cols += [f"{_HEAD[p]} TB/s" for p in peers if p != "pedantic"]
    cols += [_RATIO_HEAD[p] for p in peers if p != "detgemm"]
    cols += ["det err", "same bits", "notes"]
    return tuple(cols)


def same_bits_cell(row, peers=P.PEERS) -> str:
    sb = row.get("same_bits") or {}
    marks = [P.SHORT[p] for p in peers if p != "detgemm" and sb.get(p)]
    if marks:
        return ",".join(marks)
    if not any(sb.get(p) is not None for p in peers):
        return "-"
    return "no"


def render_main_table(rows, peers=P.PEERS) -> str:
    cols = main_columns(peers)
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---" if c in ("op", "bucket", "notes", "same bits") else "---:"
                            for c in cols) + "|"]
    for r in rows:
        cells = (r.get("peers") or {})
        us = {p: (cells.get(p) or {}).get("us") for p in peers}
        det_err = fmt_num((r.get("err") or {}).get("detgemm"), "{:.1e}")
        if (r.get("ok") or {}).get("detgemm") is False:
            det_err += " WRONG"
        vals = [r.get("op", "fwd"), r["M"], r["K"], r["N"], short(r.get("bucket") or "?", 40)]
        vals += [fmt_us(us[p]) for p in peers]
        vals += [fmt_num((cells.get("detgemm") or {}).get("tflops"))]
        vals += [fmt_num(tbytes_per_s(r.get("bytes"), us[p]), "{:.2f}")
                 for p in peers if p != "pedantic"]
        vals += [fmt_num((r.get("ratio") or {}).get(p), "{:.2f}") for p in peers
                 if p != "detgemm"]
        vals += [det_err, same_bits_cell(r, peers), short("; ".join(row_notes(r)), 90)]
        lines.append("| " + " | ".join(cell(v) for v in vals) + " |")
    return "\n".join(lines)


def render_summary(summary, peers=RATIO_PEERS) -> str:
    lines = ["| detgemm speed / peer speed | rows | geomean | min | max | time ratio (geomean) |",
             "|---|---|---:|---:|---:|---:|"]
    for p in peers:
        for label, s in (summary.get(p) or {}).items():
            g = s.get("geomean")
            lines.append(
                f"| vs {P.LABELS[p]} | {label} ({s.get('n', 0)} of {s.get('rows', 0)}) | "
                f"{fmt_num(g, '{:.3f}')} | {fmt_num(s.get('min'), '{:.2f}')} | "
                f"{fmt_num(s.get('max'), '{:.2f}')} | {fmt_num(1 / g if g else None, '{:.3f}')}x |")
    return "\n".join(lines)


def render_worst(rows, peers=("cublas", "cublaslt"), n: int = 8) -> str:
    lines = ["| vs | op | M | K | N | detgemm us | peer us | det/peer | bucket | weight |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    any_row = False
    for p in peers:
        for r in worst_rows(rows, p, n):
            any_row = True
            cells = r.get("peers") or {}
            lines.append(
                f"| {P.LABELS[p]} | {r.get('op', 'fwd')} | {r['M']} | {r['K']} | {r['N']} | "
                f"{fmt_us((cells.get('detgemm') or {}).get('us'))} | "
                f"{fmt_us((cells.get(p) or {}).get('us'))} | {r['ratio'][p]:.2f} | "
                f"{cell(short(r.get('bucket') or '?', 40))} | {cell(short(r.get('label') or '', 50))} |")
    return "\n".join(lines) if any_row else "(no rows with ratios)"


def _ms_list(ms) -> str:
    if ms is None:
        return "n/a"
    if not ms:
        return "none"
    return ", ".join(str(m) for m in ms)


def render_probe(probe) -> str:
    if not probe:
        return "(not run)"
    order = ("cublas", "pedantic", "cublaslt", "detgemm")
    lines = ["| K | N | " + " | ".join(f"{P.LABELS[p]}: M that differ" for p in order)
             + " | run-to-run identical (" + "/".join(P.SHORT[p] for p in order) + ") |",
             "|---:|---:|" + "---|" * (len(order) + 1)]
    for e in probe:
        br, errs, rr = e.get("breaks") or {}, e.get("errors") or {}, e.get("rerun_same") or {}

        def one(p):
            if p in errs:
                return "error: " + short(errs[p], 50)
            return _ms_list(br.get(p))

        rerun = "/".join({True: "yes", False: "NO", None: "-"}[rr.get(p)] for p in order)
        lines.append(f"| {e['K']} | {e['N']} | " + " | ".join(one(p) for p in order)
                     + f" | {rerun} |")
    return "\n".join(lines)


def render_overhead(overhead) -> str:
    if not overhead:
        return "(not run)"
    shape = overhead.get("shape", (64, 64, 64))
    lines = [
        f"Each op on a {shape[0]}x{shape[1]}x{shape[2]} (MxKxN) problem, "
        f"{overhead.get('calls', '?')} calls then one synchronize, wall time per call "
        f"(time.perf_counter), median of {overhead.get('repeats', '?')} repetitions.",
        "",
        "`enqueue` is the host time of the calls before the synchronize; `GPU` is the device "
        "time of one such GEMM (CUDA graph of 200). A per-call time near `GPU` is "
        "device-bound, near `enqueue` host-bound.",
        "",
        "| op | us per call | enqueue us | GPU us | all repetitions (us) |",
        "|---|---:|---:|---:|---|",
    ]
    for peer in ("detgemm", "cublas"):
        o = overhead.get(peer) or {}
        how = P.HOWTO["fwd"][peer]
        if o.get("error"):
            lines.append(f"| {how} | - | - | - | error: {short(o['error'], 60)} |")
            continue
        reps = ", ".join(fmt_num(v, "{:.2f}") for v in (o.get("reps_us") or []))
        lines.append(f"| {how} | {fmt_num(o.get('us_per_call'), '{:.2f}')} | "
                     f"{fmt_num(o.get('enqueue_us'), '{:.2f}')} | "
                     f"{fmt_num(o.get('device_us'), '{:.2f}')} | {reps} |")
    return "\n".join(lines)


def render_markdown(report) -> str:
    meta = report.get("meta") or {}
    rows = report.get("rows") or []
    peers = peers_in(report)
    dev = meta.get("device", "unknown device")
    ops = list(dict.fromkeys(r.get("op", "fwd") for r in rows)) or ["fwd"]
    lines = [
        f"# GEMM benchmark: detgemm_cute vs cuBLAS on {dev}",
        "",
        f"- device: {dev} (sm_{meta.get('capability', '?')}, {meta.get('sm_count', '?')} SMs, "
        f"L2 {fmt_num(meta.get('l2_mb'), '{:.0f}')} MB); kernel family "
        f"{meta.get('arch', '?')}",
        f"- torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}, "
        f"cuBLAS {meta.get('cublas_version', '?')} (PEDANTIC handle), "
        f"CuPy {meta.get('cupy', '?')}; PEDANTIC called through "
        f"{meta.get('pedantic_backend') or 'n/a'}",
        f"- detgemm_cute {meta.get('detgemm', '?')}, nvidia-cutlass-dsl "
        f"{meta.get('cutlass_dsl', '?')}; dtype {meta.get('dtype', '?')}; "
        f"date {meta.get('date', '?')}; suite {meta.get('suite', '?')}",
        "- problems: " + "; ".join(f"{op}: {OP_FORMULAS[op]}" for op in ops)
        + "; inputs randn (weights / sqrt(reduction)), fresh per problem",
        f"- timing: {meta.get('timing', '?')}",
    ]
    for op in ops:
        lines.append(f"- peers ({op}): " + "; ".join(
            f"{P.LABELS[p]} = `{P.HOWTO[op][p]}`" for p in peers if p != "pedantic")
            + ("; cuBLAS PEDANTIC = " + P.PEDANTIC_HOWTO if "pedantic" in peers else ""))
    if "cublaslt" in peers:
        lines.append(f"- LtNoSplit: {P.LT_HOWTO}")
    for note in meta.get("notes") or []:
        lines.append(f"- note: {note}")
    lines += [
        "",
        "## Speed (per GEMM; ratios are detgemm speed / peer speed, > 1 = detgemm faster)",
        "",
        render_main_table(rows, peers),
        "",
        f"TB/s: bytes of the operands read once and the output written once, over the time. "
        f"`det err`: norm(detgemm - cuBLAS) / norm(cuBLAS) in fp32 (must be < {DET_TOL:g}; a "
        f"WRONG row gets no speed). `same bits`: the peers whose output is bit-identical to "
        f"detgemm's (" + ", ".join(f"{P.SHORT[p]} = {P.LABELS[p]}" for p in peers
                                   if p != "detgemm") + ").",
        "",
        "## Summary (geometric mean over rows that have both times)",
        "",
        render_summary(report.get("summary") or {}, [p for p in RATIO_PEERS if p in peers]),
        "",
        "## Slowest rows relative to each peer",
        "",
        render_worst(rows, [p for p in ("cublas", "cublaslt") if p in peers]),
        "",
    ]
    if report.get("probe") is not None:
        lines += ["## Batch invariance (fwd; row bits of op(X[:M]) vs op(X[8192])[:M])", "",
                  render_probe(report.get("probe")), ""]
    if report.get("overhead") is not None:
        lines += ["## Host overhead", "", render_overhead(report.get("overhead")), ""]
    return "\n".join(lines)


def write_plot(rows, path: str, title: str, peers=("cublas", "cublaslt", "pedantic")):
    """detgemm speed / peer speed against M, one panel per peer that has ratios: lines per
    weight when there are few, else points per row with the geomean per M as a line.
    Returns None, or a note saying why there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"no plot: matplotlib unavailable ({type(e).__name__})"
    panels = [p for p in peers if any((r.get("ratio") or {}).get(p) for r in rows)]
    if not panels:
        return "no plot: no rows with ratios"
    series = list(dict.fromkeys((r.get("op", "fwd"), r["K"], r["N"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6), squeeze=False)
    for ax, p in zip(axes[0], panels):
        pts_all = [(r["M"], r["ratio"][p], r.get("op", "fwd")) for r in rows
                   if (r.get("ratio") or {}).get(p)]
        if len(series) <= 8:
            for (op, k, n) in series:
                pts = sorted((r["M"], r["ratio"][p]) for r in rows
                             if (r.get("op", "fwd"), r["K"], r["N"]) == (op, k, n)
                             and (r.get("ratio") or {}).get(p))
                if pts:
                    ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", ms=4,
                            label=f"{op} K={k}, N={n}")
        else:
            for op in dict.fromkeys(o for _, _, o in pts_all):
                sel = [(m, v) for m, v, o in pts_all if o == op]
                ax.scatter([m for m, _ in sel], [v for _, v in sel], s=9, alpha=0.6, label=op)
            ms = sorted({m for m, _, _ in pts_all})
            ax.plot(ms, [geomean(v for m2, v, _ in pts_all if m2 == m) for m in ms],
                    color="k", lw=1.2, label="geomean")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("detgemm speed / peer speed")
        ax.set_title(f"vs {P.LABELS[p]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def write_report(report, base: str, title: str) -> tuple[str, list[str]]:
    """Writes base.md, base.json and base.png; returns (markdown, notes)."""
    md = render_markdown(report)
    notes = []
    with open(base + ".md", "w") as f:
        f.write(md)
    with open(base + ".json", "w") as f:
        json.dump(json_clean(report), f, indent=1, default=json_default, allow_nan=False)
    try:
        note = write_plot(report.get("rows") or [], base + ".png", title)
    except Exception as e:  # noqa: BLE001
        note = f"plot failed: {type(e).__name__}: {e}"
    if note:
        notes.append(note)
    return md, notes


__all__ = ["render_markdown", "render_main_table", "render_summary", "render_worst",
           "render_probe", "render_overhead", "write_plot", "write_report", "main_columns",
           "summary_groups"]
