"""Sweep records of `sweep_grouped.py` -> the ``op: grouped`` (or, with ``--op grouped_k``,
``op: grouped_k``) buckets of configs/sm90.yaml (no GPU).

    python bench/fit_grouped.py SWEEP.json[.gz|.xz] [...] [--op grouped|grouped_k]
        [--max-buckets 8] [--tol 0.02] [--layer grouped.yaml]
        [--write-table configs/sm90.yaml] [--report fit.md]

Each row of a record is a point of the table's key -- grouped: (m_avg = ceil(T / G), N, K);
grouped_k (the dw pass): (M, N, ceil(T / G)) -- with the time of every candidate and of the
torch peers (torch._grouped_mm, the per-expert loop, that loop under cuBLASLt without
split-K). Rows of the other op's passes are left out. The boxes come from `detgemm_cute.tune.table`
(`build_boxes`: split (M, N, K) where one candidate is more than `tol` slower than a point's
best, at most `max_buckets` boxes, then merge neighbours with the same pick), so the buckets
cover every (M, N, K) exactly once. Prints, per row, the current table's pick and the fitted
pick against the fastest torch path, and the same with each model left out of the fit.

`--layer` writes the buckets as a user layer (try it with DETGEMM_CUTE_CONFIG before changing
the table); `--write-table` replaces the table's block of the op, between the lines
`# >>> grouped buckets` and `# <<< grouped buckets` (`grouped_k buckets` for grouped_k). The
output depends on the records only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from detgemm_cute import registry
from detgemm_cute.benchlib.stats import geomean
from detgemm_cute.tune.fit_command import OPENERS
from detgemm_cute.tune.layer import bucket_lines
from detgemm_cute.tune.table import Point, build_boxes, bucket_name

PEERS = ("torch_grouped_mm", "torch_loop", "lt_loop")
OPS = ("grouped", "grouped_k")
DW_PASS = "dw"  # the pass grouped_k buckets serve


def markers(op: str) -> tuple[str, str]:
    return f"# >>> {op} buckets", f"# <<< {op} buckets"


def table_key(row) -> tuple[int, int, int]:
    """The point a row is in its table's key: grouped (m_avg, N, K), grouped_k (M, N,
    ceil(T / G)) -- the sweep writes the latter as `table_key`."""
    return tuple(row["table_key"]) if "table_key" in row else (row["m_avg"], row["N"], row["K"])


def op_of(row) -> str:
    return "grouped_k" if row.get("pass") == DW_PASS else "grouped"
_NAME = re.compile(r"(\d+)x(\d+)x(\d+)_c(\d+)x(\d+)_s(\d+)(_p)?(_pingpong)?$")


def read_records(paths) -> tuple[dict, list[str], dict, list[dict]]:
    """(meta of the first file, candidate names, {name: kernel fields}, rows of all files)."""
    meta, names, fields, rows = None, [], {}, []
    for path in paths:
        opener = OPENERS.get(Path(path).suffix, open)  # .json, .json.gz, .json.xz
        with opener(path, "rt", encoding="utf-8") as f:
            rec = json.load(f)
        if not isinstance(rec, dict) or "rows" not in rec or "candidates" not in rec:
            raise ValueError(f"{path}: not a sweep_grouped.py record (no rows/candidates)")
        meta = meta or rec.get("meta", {})
        for nm in rec["candidates"]:
            if nm not in fields:
                names.append(nm)
                fields[nm] = (rec.get("candidate_fields") or {}).get(nm) or fields_of_name(nm)
        rows += rec["rows"]
    return meta, names, fields, rows


def fields_of_name(name: str) -> dict:
    """Kernel fields from a candidate's bucket name (e.g. gcand.128x256x64_c1x2_s4_p)."""
    m = _NAME.search(name)
    if not m:
        raise ValueError(f"cannot read the kernel fields of candidate {name!r}")
    bm, bn, bk, cm, cn, st = map(int, m.groups()[:6])
    return {"tile": [bm, bn, bk], "cluster": [cm, cn], "stages": st,
            "persistent": m.group(7) is not None, "pingpong": m.group(8) is not None}


def peer_us(row) -> tuple[float | None, str | None]:
    """(time, name) of the fastest torch path on a row."""
    got = [(v, nm) for nm, v in row["us"].items() if nm in PEERS and v]
    return min(got) if got else (None, None)


def points_of(rows, names, op="grouped") -> list[Point]:
    pts = []
    for r in rows:
        if op_of(r) != op:
            continue
        times = {nm: r["us"][nm] for nm in names if r["us"].get(nm)}
        peer = peer_us(r)[0]
        if not times or peer is None:
            continue
        label = f"{r['model']} T={r['tokens']} {r['proj']} {r.get('pass', 'fwd')}"
        pts.append(Point(*table_key(r), times, {"torch": peer}, label))
    return pts


def key_of(fields: dict) -> tuple:
    return (tuple(fields["tile"]), tuple(fields.get("cluster", (1, 1))), fields["stages"],
            bool(fields.get("pingpong", False)))


def table_picker(names, fields, table_path=None, op="grouped"):
    """pick(point) -> the candidate the table (built-in, or the file at `table_path`) runs
    there, or None when it runs a kernel no candidate matches."""
    by_key = {key_of(fields[nm]): nm for nm in names}
    if table_path is None:
        reg = registry.build_registry("sm90")
    else:
        reg = registry.Registry("sm90", [registry.load_config(table_path, complete=True)],
                                registry.generation())

    def pick(p: Point):
        b = reg.lookup(op, "bf16", p.m, p.n, p.k)
        return by_key.get((tuple(b.tile), tuple(b.cluster), b.stages, b.pingpong))
    return pick


def box_picker(boxes):
    def pick(p: Point):
        for b in boxes:
            if all(lo <= c and (hi is None or c <= hi)
                   for (lo, hi), c in zip(b.ranges, (p.m, p.n, p.k))):
                return b.choice
        raise AssertionError(f"no box holds {p.label}")
    return pick


def speeds(points, pick) -> list[float | None]:
    """torch peer time / picked candidate's time per point (None: pick not measured)."""
    out = []
    for p in points:
        t = p.times.get(pick(p))
        out.append(p.peers["torch"] / t if t else None)
    return out


def summary(sp) -> str:
    got = [s for s in sp if s]
    if not got:
        return "no measured picks"
    return (f"geomean {geomean(got):.3f}x, worst {min(got):.2f}x, "
            f"{sum(s < 0.9 for s in got)} of {len(got)} below 0.9x")


def leave_one_model_out(points, names, tol, max_buckets) -> list[float | None]:
    """Each point's speed under boxes fitted without its model's points."""
    by_model = {}
    for i, p in enumerate(points):
        by_model.setdefault(p.label.split(" ")[0], []).append(i)
    out = [None] * len(points)
    for idx in by_model.values():
        train = [p for i, p in enumerate(points) if i not in set(idx)]
        pick = box_picker(build_boxes(train, names, tol, max_buckets))
        for i, s in zip(idx, speeds([points[i] for i in idx], pick)):
            out[i] = s
    return out


def bucket_note(box, meta, op="grouped") -> str:
    sp = [s for s in speeds(box.points, lambda p: box.choice) if s]
    ms = [p.m if op == "grouped" else p.k for p in box.points]
    what = "rows" if op == "grouped" else "tokens"
    return (f"{meta.get('device', '?')} {meta.get('date', '?')[:10]}, {len(box.points)} MoE "
            f"GEMMs with {min(ms)}..{max(ms)} {what} per expert: {geomean(sp):.3f}x the "
            f"fastest of torch._grouped_mm, a per-expert torch.mm loop and that loop under "
            f"cuBLASLt without split-K (geomean, CUDA graphs), worst {min(sp):.2f}x"
            if sp else "no measured points")


def block_lines(boxes, fields, meta, header, op="grouped") -> list[str]:
    """The table's block of `op`: marker, comment, one bucket per box, marker."""
    begin, end = markers(op)
    flag = "" if op == "grouped" else f" --op {op}"
    lines = [f"  {begin} (written by bench/fit_grouped.py{flag}; refit rather than edit)"]
    lines += [f"  # {h}".rstrip() for h in header]
    for box in boxes:
        name = bucket_name(op, box.ranges).replace(f"tuned_{op}_", f"{op}_")
        f = fields[box.choice]
        lines += bucket_lines(
            {"name": name, "op": op, "dtypes": ["bf16", "fp16"],
             "m": list(box.ranges[0]), "n": list(box.ranges[1]), "k": list(box.ranges[2]),
             "tile": list(f["tile"]), "cluster": list(f.get("cluster", (1, 1))),
             "stages": f["stages"], "persistent": True,
             **({"pingpong": True} if f.get("pingpong") else {}),
             "note": bucket_note(box, meta, op)})
        lines.append("")
    return lines[:-1] + [f"  {end}"]


def replace_block(text: str, block: list[str], op="grouped") -> str:
    begin, end = markers(op)
    lines = text.splitlines()
    try:
        lo = next(i for i, ln in enumerate(lines) if ln.strip().startswith(begin))
        hi = next(i for i, ln in enumerate(lines) if ln.strip().startswith(end))
    except StopIteration:
        raise ValueError(f"the table has no '{begin}' ... '{end}' block") from None
    return "\n".join(lines[:lo] + block + lines[hi + 1:]) + "\n"


def layer_text(block: list[str]) -> str:
    return "arch: sm90\nbuckets:\n" + "\n".join(block) + "\n"


def row_table(points, picks: dict) -> list[str]:
    """Markdown: every point with the torch peer and each picker's speed."""
    out = ["| layer | m_avg | K | N | best torch us | " + " | ".join(picks) + " | best candidate |",
           "|---|---|---|---|---|" + "---|" * len(picks) + "---|"]
    for p in points:
        best = min(p.times, key=p.times.get)
        cells = []
        for pick in picks.values():
            nm = pick(p)
            t = p.times.get(nm)
            cells.append(f"{short(nm)} {p.peers['torch'] / t:.2f}" if t else "-")
        out.append(f"| {p.label} | {p.m} | {p.k} | {p.n} | {p.peers['torch']:.1f} | "
                   + " | ".join(cells) + f" | {short(best)} {p.peers['torch'] / p.best:.2f} |")
    return out


def short(name) -> str:
    """'gcand.128x192x64_c1x2_s5_p_pingpong' -> '128x192_c1x2_s5_pingpong'."""
    if name is None:
        return "-"
    return re.sub(r"_p(?=$|_)", "", name.split(".", 1)[-1].replace("x64_", "_"))


def fit(paths, tol=0.02, max_buckets=8, table=None, leave_out=True, op="grouped"):
    """(report lines, table block lines) from the records at `paths` (`leave_out`: also score
    each model under a fit without it, one more fit per model)."""
    meta, names, fields, rows = read_records(paths)
    points = points_of(rows, names, op)
    if not points:
        raise ValueError(f"the records hold no {op} row with a candidate and a torch peer "
                         f"timed")
    boxes = build_boxes(points, names, tol, max_buckets)
    current, fitted = table_picker(names, fields, table, op), box_picker(boxes)
    loo = leave_one_model_out(points, names, tol, max_buckets) if leave_out else [None]
    oracle = [p.peers["torch"] / p.best for p in points]
    head = [f"{len(points)} MoE GEMMs ({len({p.label.split(' ')[0] for p in points})} models),"
            f" {len(names)} candidates; vs the fastest torch path (torch._grouped_mm, the"
            f" per-expert loop, the loop under cuBLASLt without split-K):",
            f"current table: {summary(speeds(points, current))}",
            f"fitted ({len(boxes)} buckets): {summary(speeds(points, fitted))}",
            "fitted, each model left out: "
            + (summary(loo) if leave_out else "not run (--no-leave-out)"),
            f"best candidate per GEMM: {summary(oracle)}"]
    passes = " and ".join(sorted({r.get("pass", "fwd") for r in rows if op_of(r) == op}))
    keyed = ("the rows per expert on average (ceil(T / G)), N and K" if op == "grouped"
             else "M, N and the tokens per expert on average (ceil(T / G))")
    header = [f"Fitted from bench/sweep_grouped.py on {meta.get('device', '?')} "
              f"({meta.get('date', '?')[:10]}): {len(points)} MoE GEMMs",
              f"({passes}, {len(names)} candidates), keyed by {keyed}.",
              "On those GEMMs, " + head[2] + ";", head[3] + "."]
    report = head + [""] + row_table(points, {"current": current, "fitted": fitted}) + [""]
    report += [f"box m {b.ranges[0]} n {b.ranges[1]} k {b.ranges[2]}: {short(b.choice)} "
               f"({len(b.points)} GEMMs)" for b in boxes]
    return report, block_lines(boxes, fields, meta, header, op)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+")
    p.add_argument("--op", choices=OPS, default="grouped",
                   help="the table block to fit: grouped (fwd/dx rows) or grouped_k (dw rows)")
    p.add_argument("--tol", type=float, default=0.02)
    p.add_argument("--max-buckets", type=int, default=8)
    p.add_argument("--table", help="score this table as 'current' (default: the built-in)")
    p.add_argument("--layer", help="write the buckets as a user layer here")
    p.add_argument("--write-table", help="replace the grouped block of this table file")
    p.add_argument("--report", help="write the report (markdown) here too")
    p.add_argument("--no-leave-out", action="store_true",
                   help="skip the fits with each model left out (one fit per model)")
    args = p.parse_args(argv)
    if args.max_buckets < 1 or not 0 <= args.tol < 1:
        p.error("--max-buckets must be >= 1 and --tol in [0, 1)")
    report, block = fit(args.records, args.tol, args.max_buckets, args.table,
                        not args.no_leave_out, args.op)
    print("\n".join(report))
    if args.report:
        Path(args.report).write_text("\n".join(report) + "\n")
    if args.layer:
        Path(args.layer).write_text(layer_text(block))
        registry.load_config(args.layer, arch="sm90")  # validates it
    if args.write_table:
        path = Path(args.write_table)
        path.write_text(replace_block(path.read_text(), block, args.op))
        registry.load_config(path, arch="sm90", complete=True)  # validates it
        print(f"wrote the {args.op} block of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
