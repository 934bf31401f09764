"""The decode floor: what a row cannot beat under the contract (no split-K), from measurements.

    floor(row) = max(bytes(row) / copy bandwidth,  ceil(K / 16) x t_step(MMA form)) + launch

`bytes` is what the bench counts for the row (operands read once, output written once),
the copy bandwidth and the launch time (one minimal kernel per call inside a CUDA graph) are
measured by `bench/bench_chain_floor.py` in the same command, and t_step is the slope of
the chain probe (`chain_kernel.py`) for the MMA the row's kernel issues: ``m64nBNk16`` with
BN the bucket's tile width, batches of BK / 16 steps, one batch left in flight, every SM
busy. Pure Python: fits, the per-row floor, and the report section (tests run it on CPU).
"""

from __future__ import annotations

import json
import math
import re

from .fmt import cell, fmt_num, fmt_us, short
from .stats import geomean

WITHIN = 1.15  # the target: every decode row within 1.15x of its floor


def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs (at least two distinct xs)."""
    n = len(xs)
    if n != len(ys) or n < 2 or len(set(xs)) < 2:
        raise ValueError(f"fit_line: need >= 2 distinct x values, got {list(xs)}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


class FloorModel:
    """The measured numbers of one `bench_chain_floor` run (its JSON, as a dict)."""

    def __init__(self, data: dict):
        self.data = data
        self.copy_tbs = float(data["bandwidth"]["copy_tbs"])
        self.launch_us = float(data["launch_us"])
        self.sms = data.get("sms")
        # (form, n, steps, depth) -> t_step in ns with every SM busy
        self.steps = {}
        for p in data["probes"]:
            if p.get("ctas") == self.sms and p.get("t_step_ns"):
                self.steps[(p["form"], p["n"], p["steps"], p["depth"])] = p["t_step_ns"]

    @classmethod
    def load(cls, path: str) -> "FloorModel":
        with open_text(path) as f:
            return cls(json.load(f))

    def step_ns(self, n: int, form: str = "wgmma", steps: int = 8, depth: int = 1):
        """t_step of `form` at MMA width n: the measured width n, else the narrowest measured
        one above it (a wider MMA is never faster), else the widest; None if none."""
        have = sorted(w for (f, w, s, d) in self.steps if (f, s, d) == (form, steps, depth))
        if not have:
            return None
        w = next((w for w in have if w >= n), have[-1])
        return self.steps[(form, w, steps, depth)]

    def row_floor(self, row: dict) -> dict | None:
        """{bw_us, chain_us, launch_us, floor_us, bound, ratio} of one bench row, or None
        when its bucket's tile or bytes are unknown."""
        tile = bucket_tile(row.get("bucket"))
        if tile is None or not row.get("bytes"):
            return None
        kdim = row["K"]  # fwd: the reduction; the decode report is fwd only
        t_step = self.step_ns(tile[1], steps=max(1, tile[2] // 16))
        if t_step is None:
            return None
        bw_us = row["bytes"] / (self.copy_tbs * 1e6)
        chain_us = math.ceil(kdim / 16) * t_step / 1e3
        floor_us = max(bw_us, chain_us) + self.launch_us
        det = ((row.get("peers") or {}).get("detgemm") or {}).get("us")
        return {"bw_us": bw_us, "chain_us": chain_us, "launch_us": self.launch_us,
                "floor_us": floor_us, "t_step_ns": t_step,
                "bound": "bandwidth" if bw_us >= chain_us else "chain",
                "ratio": det / floor_us if det else None}


def open_text(path: str):
    """A stored record, gzip-compressed (``.gz``) or not."""
    import gzip

    return gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)


_TILE = re.compile(r"\b(\d+)x(\d+)x(\d+)\b")


def bucket_tile(text) -> tuple | None:
    """(BM, BN, BK) from the bench's bucket cell (`fmt.fmt_bucket`), else None."""
    m = _TILE.search(text or "")
    return tuple(int(g) for g in m.groups()) if m else None


def attach(rows, model: FloorModel) -> int:
    """Set row['floor'] on every row that gets one; returns how many did."""
    n = 0
    for r in rows:
        r["floor"] = model.row_floor(r) if r.get("op", "fwd") == "fwd" else None
        n += r["floor"] is not None
    return n


def _ratio(r, key="ratio"):
    return (r.get("floor") or {}).get(key)


def summary(rows) -> dict:
    """Counts and geomeans of the floor ratios (detgemm time / floor), per bound."""
    out = {}
    for bound in ("all", "bandwidth", "chain"):
        sel = [r for r in rows if _ratio(r) and (bound == "all" or r["floor"]["bound"] == bound)]
        vals = [_ratio(r) for r in sel]
        cub = [r["peers"]["cublas"]["us"] / r["peers"]["detgemm"]["us"] for r in sel
               if ((r.get("peers") or {}).get("cublas") or {}).get("us")]
        out[bound] = {"rows": len(sel), "geomean": geomean(vals),
                      "max": max(vals) if vals else None,
                      "within": sum(v <= WITHIN for v in vals),
                      "time_vs_cublas": (1 / geomean(cub)) if cub else None}
    return out


def render(rows, model: FloorModel, n_worst: int = 25) -> str:
    """The markdown section: the measured inputs, the summary, the rows farthest above."""
    s = summary(rows)
    d = model.data
    lines = [
        "## Against the floor (no split-K)",
        "",
        f"floor = max(bytes / {model.copy_tbs:.3f} TB/s (device copy, read + write, measured), "
        f"ceil(K / 16) x t_step) + {model.launch_us:.2f} us (one minimal kernel per call in "
        f"a CUDA graph, measured); t_step = the chain probe's time per dependent "
        f"m64nBNk16 step for the row's tile width BN, BK / 16 steps per batch, every SM busy "
        f"(`bench/bench_chain_floor.py`, {d.get('date', '?')}). ratio = detgemm time / floor "
        f"(target <= {WITHIN}).",
        "",
        "| rows | n | ratio geomean | worst | within 1.15x | detgemm time / cuBLAS time (geomean) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for bound, v in s.items():
        lines.append(f"| {bound}-bound | {v['rows']} | {fmt_num(v['geomean'], '{:.3f}')} | "
                     f"{fmt_num(v['max'], '{:.2f}')} | {v['within']} | "
                     f"{fmt_num(v['time_vs_cublas'], '{:.3f}')} |")
    lines += ["", "t_step per MMA width (ns, every SM busy): " + ", ".join(
        f"n{w}: {t:.2f}" for (f, w, st, dp), t in sorted(model.steps.items())
        if (f, st, dp) == ("wgmma", 8, 1)), "",
        f"Rows farthest above their floor ({n_worst}):", "",
        "| M | K | N | bucket | detgemm us | floor us | bound | bytes/BW us | chain us | ratio |",
        "|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    worst = sorted((r for r in rows if _ratio(r)), key=_ratio, reverse=True)[:n_worst]
    for r in worst:
        f = r["floor"]
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {cell(short(r.get('bucket') or '?', 40))} | "
                     f"{fmt_us(r['peers']['detgemm']['us'])} | {fmt_us(f['floor_us'])} | "
                     f"{f['bound']} | {fmt_us(f['bw_us'])} | {fmt_us(f['chain_us'])} | "
                     f"{f['ratio']:.2f} |")
    return "\n".join(lines)


def write_plot(rows, path: str, title: str):
    """detgemm time / floor against the row's weight bytes, coloured by bound. Returns None
    or a note saying why there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"no floor plot: matplotlib unavailable ({type(e).__name__})"
    pts = [(r["bytes"] / 1e6, _ratio(r), r["floor"]["bound"]) for r in rows if _ratio(r)]
    if not pts:
        return "no floor plot: no rows with a floor"
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for bound, colour in (("bandwidth", "tab:blue"), ("chain", "tab:red")):
        sel = [(b, v) for b, v, bd in pts if bd == bound]
        if sel:
            ax.scatter([b for b, _ in sel], [v for _, v in sel], s=9, alpha=0.6, c=colour,
                       label=f"{bound}-bound")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(WITHIN, color="k", lw=0.8, ls="--", label=f"{WITHIN}x")
    ax.set_xscale("log")
    ax.set_xlabel("bytes moved (MB)")
    ax.set_ylabel("detgemm time / floor")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    """`python -m detgemm_cute.benchlib.floor REPORT.json[.gz] FLOOR.json[.gz]`: print the floor
    section for the fwd rows of a stored bench_gemm report (no GPU)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(main.__doc__.strip(), file=sys.stderr)
        return 2
    with open_text(argv[0]) as f:
        rows = json.load(f)["rows"]
    model = FloorModel.load(argv[1])
    attach(rows, model)
    print(render(rows, model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["FloorModel", "attach", "bucket_tile", "fit_line", "render", "summary",
           "write_plot", "WITHIN"]
