"""A/B of two `bench_gemm.py` records of the same problems (before and after a change, one
call on one machine): detgemm's speed ratio per bucket and per size band, the cuBLAS drift
between the runs (the same library timed twice), and, with `--floor`, each run's rows
against the decode floor (`benchlib.floor`). Needs no GPU.

    python bench/compare_runs.py OLD.json[.gz] NEW.json[.gz] [--floor chain_floor.json.gz]
        [--title TEXT] [--out FILE.md]
"""

import argparse
import json
import sys

from detgemm_cute.benchlib import floor as floorlib
from detgemm_cute.benchlib.stats import geomean

BANDS = ((0, 5), (5, 10), (10, 20), (20, 50), (50, None))  # detgemm us in the old run


def _rows(path: str) -> dict:
    with floorlib.open_text(path) as f:
        data = json.load(f)
    return {(r["op"], r["M"], r["K"], r["N"]): r for r in data["rows"]
            if ((r.get("peers") or {}).get("detgemm") or {}).get("us")}


def _us(row, peer="detgemm"):
    return ((row.get("peers") or {}).get(peer) or {}).get("us")


def _vs_cublas(row):
    return (row.get("ratio") or {}).get("cublas")


def _speed(pairs, peer="detgemm"):
    """Geomean of old time / new time (> 1: the new run is faster) over (old, new) rows."""
    return geomean([_us(o, peer) / _us(n, peer) for o, n in pairs if _us(o, peer) and _us(n, peer)])


def compare(old: dict, new: dict, model=None) -> list[str]:
    keys = [k for k in old if k in new]
    pairs = [(old[k], new[k]) for k in keys]
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    out = [f"{len(keys)} problems in both runs. detgemm speed new / old: **{f(_speed(pairs))}x** "
           f"(per problem {min(_us(o) / _us(n) for o, n in pairs):.3f}.."
           f"{max(_us(o) / _us(n) for o, n in pairs):.3f}); cuBLAS timed in both runs, new / "
           f"old: {f(_speed(pairs, 'cublas'))}x (the drift between the runs).", "",
           "| bucket (new run) | rows | detgemm new / old | vs cuBLAS old | vs cuBLAS new |",
           "|---|---:|---:|---:|---:|"]
    by = {}
    for o, n in pairs:
        by.setdefault(((n.get("bucket") or "").split() or ["-"])[0], []).append((o, n))
    for name, sel in sorted(by.items()):
        out.append(f"| `{name}` | {len(sel)} | {f(_speed(sel))} | "
                   f"{f(geomean([_vs_cublas(o) for o, _ in sel]))} | "
                   f"{f(geomean([_vs_cublas(n) for _, n in sel]))} |")
    out += ["", "| detgemm us (old run) | rows | detgemm new / old |", "|---|---:|---:|"]
    for lo, hi in BANDS:
        sel = [(o, n) for o, n in pairs if _us(o) >= lo and (hi is None or _us(o) < hi)]
        if sel:
            out.append(f"| {lo}..{hi if hi else ''} | {len(sel)} | {f(_speed(sel))} |")
    if model is not None:
        out += ["", "Against the floor (`benchlib.floor`; ratio = detgemm time / floor):", "",
                "| run | rows | ratio geomean | worst | within 1.15x | time / cuBLAS |",
                "|---|---:|---:|---:|---:|---:|"]
        for label, run in (("old", [o for o, _ in pairs]), ("new", [n for _, n in pairs])):
            floorlib.attach(run, model)
            s = floorlib.summary(run)["all"]
            out.append(f"| {label} | {s['rows']} | {f(s['geomean'])} | {f(s['max'])} | "
                       f"{s['within']} | {f(s['time_vs_cublas'])} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--floor", help="a bench_chain_floor.py record")
    ap.add_argument("--title", default="A/B of two bench_gemm runs")
    ap.add_argument("--out", help="write the markdown here (default: stdout)")
    args = ap.parse_args(argv)
    try:
        model = floorlib.FloorModel.load(args.floor) if args.floor else None
        old, new = _rows(args.old), _rows(args.new)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"compare_runs: not a bench_gemm (or chain floor) record ({type(e).__name__}: "
              f"{e})",
              file=sys.stderr)
        return 1
    if not any(k in new for k in old):
        print("compare_runs: no problem is in both records", file=sys.stderr)
        return 1
    text = "\n".join([f"# {args.title}", ""] + compare(old, new, model))
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
