"""Two `bench_moe.py` records of the same layers (a baseline tree and a changed one, run on
one machine one after the other) as one A/B table: detgemm's time in each, the torch peer's
time in each (its drift is the machine's), and the speed against the faster torch path.

    python bench/compare_moe.py OLD.json.gz NEW.json.gz --title "..." > ab.md

Importing it touches no CUDA state.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

from detgemm_cute.benchlib.stats import geomean

TORCH = ("torch_grouped_mm", "torch_loop")


_FIELDS = ("model", "tokens", "proj", "pass", "rows", "experts", "us", "speed")


def load(path: str) -> list[dict]:
    """The rows of a `bench_moe.py` record; ValueError for any other file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = json.load(f).get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in _FIELDS)
                                             for r in rows):
        raise ValueError(f"{path}: not a bench_moe.py record (rows with {', '.join(_FIELDS)})")
    return rows


def _key(r):
    return r["model"], r["tokens"], r["proj"], r["pass"]


def compare(old: list[dict], new: list[dict]) -> list[dict]:
    """Per layer both records timed: times and speeds, old and new."""
    by_key = {_key(r): r for r in old}
    out = []
    for r in new:
        o = by_key.get(_key(r))
        if o is None or any(not rec["us"].get(k) for rec in (r, o) for k in ("detgemm",) + TORCH):
            continue  # a unit that failed or did not run in either record
        out.append({"model": r["model"], "tokens": r["tokens"], "proj": r["proj"],
                    "pass": r["pass"], "rows_per_expert": r["rows"] / r["experts"],
                    "old_us": o["us"]["detgemm"], "new_us": r["us"]["detgemm"],
                    "old_torch_us": min(o["us"][k] for k in TORCH),
                    "new_torch_us": min(r["us"][k] for k in TORCH),
                    "old_speed": o["speed"], "new_speed": r["speed"],
                    "bits": bool(r.get("group_bits_equal_mm"))})
    return out


def render(rows: list[dict], title: str) -> str:
    lines = [f"# {title}", ""]
    bands = (("<= 128 rows per expert", 0, 128), ("129..767", 128, 767),
             (">= 768", 767, float("inf")))
    lines += ["| layers | n | detgemm speedup (old time / new time) | speed vs torch, old -> new "
              "| torch peer drift (old / new time) |", "|---|---:|---:|---:|---:|"]
    for p in sorted({r["pass"] for r in rows}):
        for label, lo, hi in (("all", -1, float("inf")),) + bands:
            sel = [r for r in rows if r["pass"] == p and lo < r["rows_per_expert"] <= hi]
            if not sel:
                continue
            lines.append(
                f"| {p}, {label} | {len(sel)} "
                f"| {geomean([r['old_us'] / r['new_us'] for r in sel]):.3f}x "
                f"| {geomean([r['old_speed'] for r in sel]):.3f}x -> "
                f"{geomean([r['new_speed'] for r in sel]):.3f}x "
                f"| {geomean([r['old_torch_us'] / r['new_torch_us'] for r in sel]):.3f} |")
    lines += ["", "| model | tokens | proj | pass | rows per expert | old us | new us | old/new "
              "| torch old us | torch new us | speed old | speed new | group == dg.mm |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['proj']} | {r['pass']} "
                     f"| {r['rows_per_expert']:.1f} | {r['old_us']:.1f} | {r['new_us']:.1f} "
                     f"| {r['old_us'] / r['new_us']:.3f} | {r['old_torch_us']:.1f} "
                     f"| {r['new_torch_us']:.1f} | {r['old_speed']:.2f} | {r['new_speed']:.2f} "
                     f"| {r['bits']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--title", default="MoE layers: baseline vs changed tree")
    args = ap.parse_args(argv)
    try:
        rows = compare(load(args.old), load(args.new))
    except (OSError, ValueError) as e:
        print(f"compare_moe: {e}", file=sys.stderr)
        return 1
    if not rows:
        print("compare_moe: no layer is in both records", file=sys.stderr)
        return 1
    sys.stdout.write(render(rows, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
