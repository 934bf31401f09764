"""`detgemm-cute tune-fit`: tune records -> a layer of buckets with alternatives (no GPU).

    detgemm-cute tune --preset prefill-models --ops fwd,dx,dw --json tune.json
    detgemm-cute tune-fit tune.json --ops fwd,dx --m-min 129 --out prefill.yaml
    detgemm-cute tune --preset prefill-models --ops fwd,dx --alternatives \\
        --max-candidates 1 --json alts.json                  (with prefill.yaml as a layer)
    detgemm-cute tune-fit tune.json alts.json --ops fwd,dx --m-min 129 --keep prefill.yaml \\
        --out prefill.yaml                                   (refit on the unbiased timings)

Reads one or more `--json` files of `detgemm-cute tune` (plain, .gz or .xz; records of one GEMM in
several files are merged; `--align-runs` scales a later run's times to the first's by the
candidates both timed), and per op writes one bucket covering --m-min <= M <= --m-max and
--n-min <= N <= --n-max (GEMM dims; every K; the records outside are not used),
its alternatives (selected among the contenders: candidates timed on >= 95% of the problems
and within 3% of the fastest on at least 3) and their cost coefficients fitted by
`detgemm_cute.tune.choice`. Prints,
per op, how the model's picks compare with cuBLASLt no split-K on the records, both fitted on
all of them and with each token count (M; K for dw) left out of fitting and selection.
`--keep FILE` refits the alternatives of that layer's buckets instead of selecting new ones;
`--also FILE` adds that layer's alternatives to the contenders the selection may take.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import sys
from pathlib import Path

from ..benchlib.stats import geomean
from . import choice
from .store import record_key
from .summary import all_fields, points_of

OPS = ("fwd", "dx", "dw")
# compressed records (the committed ones under bench/results/tune/ are .json.xz)
OPENERS = {".gz": gzip.open, ".xz": lzma.open}


def read_records(paths, align: bool = False) -> list[dict]:
    """Records of every file; the candidates of one problem (same device, arch, dtype, op and
    shape: the resume file's key) merged. A peer's time comes from the first file that has
    it, so a file of extra candidates may leave its peers out and the merge does not depend
    on the order of the files. `align`: runs on two machines (or at two clocks) join: a later
    file's times of a problem are scaled by the geomean ratio, earlier over later, of the
    candidates both timed on it (unscaled when they share none), and a candidate already
    timed keeps its first time."""
    merged: dict = {}
    for path in paths:
        for rec in _file_records(path):
            key = record_key(rec)
            cands = dict(rec.get("cands") or {})
            if key in merged:
                have = merged[key]["cands"]
                if align:
                    cands = _aligned(have, cands)
                have.update(cands)
                merged[key]["fields"].update(rec.get("fields") or {})
                for peer, us in (rec.get("peers") or {}).items():
                    merged[key]["peers"].setdefault(peer, us)
            else:
                merged[key] = dict(rec, cands=cands, fields=dict(rec.get("fields") or {}),
                                   peers=dict(rec.get("peers") or {}))
    return list(merged.values())


def _aligned(have: dict, new: dict) -> dict:
    """The candidates of `new` not in `have`, on `have`'s scale (see `read_records`)."""
    common = [c for c in new if c in have and have[c] and new[c]]
    scale = geomean([have[c] / new[c] for c in common]) if common else 1.0
    return {c: (t * scale if t is not None else None) for c, t in new.items() if c not in have}


def _file_records(path) -> list:
    """The records of one `tune --json` file; ValueError naming the file when it is not one."""
    opener = OPENERS.get(Path(path).suffix, open)
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, EOFError, lzma.LZMAError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise ValueError(f"tune-fit: {path}: not a JSON file of `detgemm-cute tune --json` "
                         f"({why})") from None
    records = doc.get("records") if isinstance(doc, dict) else None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"tune-fit: {path}: no list of tune records under 'records' (written "
                         f"by `detgemm-cute tune --json FILE`?)")
    return records


def kept_alternatives(path, op: str) -> list[str]:
    """Candidate names of the alternatives of the `op` buckets of a layer file."""
    from .. import registry
    from .candidates import Candidate

    f = registry.load_config(path)
    return [Candidate.from_bucket(b).name for b in f.buckets if b.op == op and b.group]


def _ratios(pairs) -> list[float]:
    return [p.peers["cublaslt"] / p.times[c] for p, c in pairs
            if c and p.peers.get("cublaslt") and p.times.get(c)]


def fit_op(records, op: str, args, out) -> list[str]:
    """YAML lines of one op's bucket, or [] when too little was measured."""
    fields = all_fields(records)
    m_hi, n_hi = args.m_max or float("inf"), args.n_max or float("inf")
    pts = [p for p in points_of(records, op)
           if args.m_min <= p.m <= m_hi and args.n_min <= p.n <= n_hi]
    token = "k" if op == "dw" else "m"
    also = set(kept_alternatives(args.also, op)) if args.also else set()
    costs = choice.fit_all(pts, fields, args.sms, args.min_points,
                           only=None if args.keep else choice.contenders(pts) | also)
    names = ([n for n in kept_alternatives(args.keep, op) if n in costs] if args.keep
             else choice.select(pts, costs, args.max_alternatives, args.min_gain))
    if len(names) < 1:
        out(f"{op}: too few candidates measured on >= {args.min_points} problems: no bucket")
        return []
    fitted = _ratios((p, choice.pick(p, names, costs, fields, args.sms)) for p in pts)
    held = _ratios(choice.cross_validate(pts, fields, args.sms, token, args.max_alternatives,
                                         args.min_points, args.min_gain, also)
                   ) if not args.keep else []
    dev = next((r.get("device") for r in records if r.get("device")), "this GPU")
    toks = sorted({getattr(p, token) for p in pts})
    note = (f"tune-fit on {dev}: {len(names)} alternatives, costs from {len(pts)} problems "
            f"({token.upper()} {toks[0]}..{toks[-1]}); ")
    note += (f"the model's picks {geomean(fitted):.3f}x cuBLASLt no split-K on them" if fitted
             else "no cuBLASLt no split-K times in the records to compare the picks with")
    if held:
        note += f", {geomean(held):.3f}x with each {token.upper()} left out"
    out(f"{op}: {note}")
    return choice.bucket_yaml(f"{op}_{args.name}", op, args.bucket_dtypes.split(","),
                              ((args.m_min, args.m_max), (args.n_min, args.n_max), (1, None)),
                              args.sms, names, costs, fields, note)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli_args import at_least, family_type, positive_int

    p.add_argument("records", nargs="+", help="--json files of `detgemm-cute tune` (.gz or .xz ok)")
    p.add_argument("--ops", default="fwd,dx,dw")
    p.add_argument("--align-runs", action="store_true",
                   help="records of one problem from several runs (other machines, clocks): "
                        "scale a later file's times by the candidates both runs timed on it "
                        "(a later file should time a few of the earlier one's candidates again)")
    p.add_argument("--m-min", type=int, default=1, help="the buckets serve GEMM M >= this")
    p.add_argument("--m-max", type=int, default=None, help="... and M <= this (default: any)")
    p.add_argument("--n-min", type=int, default=1, help="... and GEMM N >= this")
    p.add_argument("--n-max", type=int, default=None, help="... and N <= this (default: any)")
    p.add_argument("--sms", type=positive_int, default=132, help="SM count of the GPU measured on")
    p.add_argument("--max-alternatives", type=positive_int, default=12)
    p.add_argument("--min-gain", type=at_least(float, 0.0), default=0.001,
                   help="stop selecting when the next alternative raises the geomean of the best "
                        "alternative's time over the problems by less than this (0: select "
                        "--max-alternatives, or until no candidate gains)")
    p.add_argument("--min-points", type=positive_int, default=8,
                   help="fit only candidates measured on at least this many problems")
    p.add_argument("--keep", metavar="LAYER.yaml",
                   help="refit the alternatives of this layer's buckets (no new selection)")
    p.add_argument("--also", metavar="LAYER.yaml",
                   help="candidates for the selection besides the contenders: the alternatives "
                        "of this layer's buckets (e.g. the family table's, so a refit for one "
                        "GPU may keep its kernels)")
    p.add_argument("--name", default="alternatives", help="bucket names: <op>_<name>")
    p.add_argument("--bucket-dtypes", default="bf16,fp16")
    p.add_argument("--arch", default="sm90", type=family_type,
                   help="kernel family of the layer: sm90 (also sm_90, sm_90a) or sm80 (also "
                        "sm_80); default sm90")
    p.add_argument("--out", required=True, metavar="FILE.yaml")


def run(args, out=print) -> int:
    from .. import registry

    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        print(f"detgemm-cute tune-fit: error: --ops: unknown op {bad[0]!r}; one of "
              f"{', '.join(OPS)}", file=sys.stderr)
        return 2
    missing = [p for p in args.records if not Path(p).is_file()]
    if missing:
        print(f"detgemm-cute tune-fit: error: no such records file: {missing[0]}",
              file=sys.stderr)
        return 2
    for lo, hi in (("m_min", "m_max"), ("n_min", "n_max")):
        if getattr(args, lo) < 1 or (getattr(args, hi) is not None
                                     and getattr(args, hi) < getattr(args, lo)):
            print(f"detgemm-cute tune-fit: error: --{lo.replace('_', '-')} "
                  f"{getattr(args, lo)} / --{hi.replace('_', '-')} {getattr(args, hi)}: "
                  f"expected 1 <= min <= max", file=sys.stderr)
            return 2
    if args.keep and args.also:
        print("detgemm-cute tune-fit: error: --also adds candidates to a selection, and --keep "
              "selects nothing (it refits its layer's alternatives): give one of them",
              file=sys.stderr)
        return 2
    layer = args.keep or args.also
    if layer and not Path(layer).is_file():
        print(f"detgemm-cute tune-fit: error: no such layer file: {layer}", file=sys.stderr)
        return 2
    records = read_records(args.records, align=args.align_runs)
    lines = [f"arch: {args.arch}", "buckets:"]
    for op in ops:
        lines += fit_op(records, op, args, out)
    if len(lines) == 2:
        print(f"detgemm-cute tune-fit: no op of --ops {args.ops} has candidates measured on "
              f">= --min-points {args.min_points} problems in these records: nothing written",
              file=sys.stderr)
        return 1
    Path(args.out).write_text("\n".join(lines) + "\n")
    registry.load_config(args.out, arch=args.arch)  # validates (ConfigError names the line)
    out(f"wrote {args.out}; layer it with DETGEMM_CUTE_CONFIG={args.out} or "
        f"registry.add_config, check it with `detgemm-cute audit --config {args.out}`")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="detgemm-cute tune-fit", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = ["add_arguments", "run", "main", "read_records"]
