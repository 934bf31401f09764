"""Fit the `op: bmm` buckets of the SM90 table to `bench/sweep_bmm.py` records (CPU only).

Each record row is one attention-shaped problem (kind, L, M, K, N) with the time of every
candidate kernel, of torch.bmm and (in records whose meta has `table_timing`) of the table's
own choice (`table`).
Rows are grouped by the bucket the current table gives them (`dispatch.lookup`), and per
bucket:

1. the candidate with the fewest rows below `--floor` x torch.bmm, then the best geomean of
   torch / candidate over the bucket's rows (candidates timed on every row whose bits
   matched);
2. up to `--splits` cuts of the bucket's M range (between two measured M), each side with
   its own candidate, kept where a cut lowers the rows below the floor or raises the
   geomean by `--min-gain`;
3. where the bucket has rows of both kinds, the rows whose outputs the tile's threads store
   (the table's kernel ran them `c_direct`) get their own candidate, the bucket's `direct`
   kernel, and the others decide steps 1-2 (the box cannot tell the two kinds apart);
   where the threads store some rows 8 bytes at a time (`c_align` 8) and others element by
   element, and the two want different kernels, the 8-byte ones get `direct_vector`.

A bucket whose choice beats the current table's kernel (its `table` time, else the
candidate with the table's kernel) by `--min-gain`, or lifts rows over the floor, goes into
`--out`: a user layer of `bench/sweep_bmm.py`'s candidates that shadows those buckets
(`DETGEMM_CUTE_CONFIG=FILE`, or copy its buckets into configs/sm90.yaml). The report lists,
per bucket, the rows, the current and fitted speeds, and every row still below the floor
with how the table runs it (output stored by the threads, P read by the producer
warpgroup) and the best any candidate reached there (a row no tile lifts needs a kernel
change, not a table change). A tile never changes an entry's bits, so this trades speed
only; the records' own `bits_ok` says the candidates agreed.

    python bench/fit_bmm.py RECORDS.json [MORE.json.gz ...] --out bmm_layer.yaml
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
from pathlib import Path

FLOOR = 0.9
_LABEL = re.compile(r"(\d+)x(\d+)x(\d+)_c(\d+)x(\d+)_s(\d+)(_p)?(_pingpong)?$")
DIRECT_TWIN = "+direct"  # sweep_bmm.DIRECT (not imported: this fit needs no torch)
PEERS = ("torch_bmm", "table", "stage_copy", "aligned_gemm", "staged")
DIRECT_FIELDS = ("direct", "direct_vector")  # registry.DIRECT_FIELDS


def kernel_fields(name: str) -> dict:
    """The bucket fields of a sweep candidate ("bcand.128x128x64_c2x1_s4_p[_pingpong]")."""
    m = _LABEL.search(name.split(".", 1)[-1])
    if m is None:
        raise ValueError(f"fit_bmm: {name!r} is not a candidate name of bench/sweep_bmm.py")
    bm, bn, bk, cm, cn, st = map(int, m.groups()[:6])
    out = {"tile": [bm, bn, bk], "cluster": [cm, cn], "stages": st,
           "persistent": bool(m.group(7))}
    if m.group(8):
        out["pingpong"] = True
    return out


def bucket_fields(b) -> dict:
    out = {"tile": list(b.tile), "cluster": list(b.cluster), "stages": b.stages,
           "persistent": b.persistent}
    if b.pingpong:
        out["pingpong"] = True
    return out


def read_rows(paths) -> list[dict]:
    """Rows of every records file whose candidates agreed on the bits; a problem measured
    in several files keeps its last row. A file whose meta has no `table_timing` timed its
    candidate layer's first tile as `table` (the layer shadowed the table): that column is
    dropped, and the table's speed comes from the candidate with its kernel."""
    rows = {}
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            raise ValueError(f"fit_bmm: {path}: no 'rows' list (a bench/sweep_bmm.py --out file?)")
        table_timed = bool((doc.get("meta") or {}).get("table_timing"))
        for r in doc["rows"]:
            if r.get("bits_ok") and (r.get("us") or {}).get("torch_bmm"):
                if not table_timed and "table" in r["us"]:
                    r = {**r, "us": {k: v for k, v in r["us"].items() if k != "table"}}
                rows[(r["kind"], r["L"], r["M"], r["K"], r["N"])] = _twins_as_plain(r)
    return list(rows.values())


def _twins_as_plain(r) -> dict:
    """On a row whose outputs the threads store anyway, a candidate's direct-store twin
    (`sweep_bmm.py --direct`/`--direct-only`, name + "+direct") is the candidate itself:
    it is counted under the candidate's name where that was not timed."""
    if not thread_stored(r):
        return r
    us = dict(r["us"])
    for nm in [nm for nm in us if nm.endswith(DIRECT_TWIN)]:
        us.setdefault(nm[:-len(DIRECT_TWIN)], us[nm])
    return {**r, "us": us}


def speeds(rows, name) -> list[float] | None:
    """torch / `name` per row, or None when `name` was not timed on every row."""
    out = []
    for r in rows:
        t = r["us"].get(name)
        if not t:
            return None
        out.append(r["us"]["torch_bmm"] / t)
    return out


def geomean(v) -> float:
    return math.exp(sum(map(math.log, v)) / len(v))


def score(v) -> tuple:
    """Larger is better: fewer rows below the floor, then the geomean."""
    return (-sum(x < FLOOR for x in v), geomean(v))


def candidates_of(rows) -> list[str]:
    names = {nm for r in rows for nm in r["us"] if nm not in PEERS and "+" not in nm}
    return sorted(nm for nm in names if speeds(rows, nm))


def best_candidate(rows, ok=None):
    """(name, speeds) of the best candidate on `rows` (of those `ok` accepts), or None."""
    scored = [(score(v), nm, v) for nm in candidates_of(rows) if ok is None or ok(nm)
              for v in [speeds(rows, nm)]]
    if not scored:
        return None
    _, nm, v = max(scored, key=lambda t: (t[0], t[1]))
    return nm, v


def better(new, old, min_gain) -> bool:
    """`new` speeds beat `old`: fewer rows below the floor, or the geomean by min_gain."""
    (nb, ng), (ob, og) = score(new), score(old)
    return nb > ob or (nb == ob and ng > og * (1 + min_gain))


def fit_bucket(rows, lo, hi, splits, min_gain, ok=None):
    """[(m_lo, m_hi, candidate, speeds)] covering [lo, hi] (hi None: unbounded), greedily cut
    along M at most `splits` times (candidates `ok` accepts)."""
    first = best_candidate(rows, ok)
    if first is None:
        return []
    parts = [(lo, hi, rows, *first)]
    for _ in range(splits):
        best = None
        for i, (plo, phi, prow, _, pv) in enumerate(parts):
            ms = sorted({r["M"] for r in prow})
            for cut in ms[1:]:
                left = [r for r in prow if r["M"] < cut]
                right = [r for r in prow if r["M"] >= cut]
                bl, br = best_candidate(left, ok), best_candidate(right, ok)
                if bl is None or br is None:
                    continue
                merged = bl[1] + br[1]
                if better(merged, [pv[prow.index(r)] for r in left + right], min_gain) and (
                        best is None or score(merged) > best[0]):
                    best = (score(merged), i, [(plo, cut - 1, left, *bl),
                                               (cut, phi, right, *br)])
        if best is None:
            break
        _, i, new = best
        parts[i:i + 1] = new
    return [(plo, phi, nm, v) for plo, phi, _, nm, v in parts]


def thread_stored(r) -> bool:
    """The row's outputs are stored by the tile's threads (the table's kernel for it ran
    `c_direct`): a bucket's `direct` kernel serves such rows."""
    return bool((r.get("layout") or {}).get("c_direct"))


def vector_stored(r) -> bool:
    """... 8 bytes at a time (`c_align` 8): the bucket's `direct_vector` kernel, if any."""
    return thread_stored(r) and (r.get("layout") or {}).get("c_align") == 8


def _ran(bucket, width=None):
    """The kernel a row ran on the table's `bucket`: its own tile where TMA stored the
    outputs (`width` None), else the one for the threads' store width (8 bytes, or 0:
    element by element; `Bucket.direct_kernel`)."""
    return bucket if width is None else bucket.direct_kernel(width) or bucket


def _width(r):
    """The store width of row `r` as `_ran` takes it."""
    return (8 if vector_stored(r) else 0) if thread_stored(r) else None


def current_speeds(rows, bucket):
    """The table's speeds on `rows`: its `table` timing, else the candidate with its kernel
    (per row: the bucket's `direct` kernel on thread-stored rows, where it has one)."""
    v = speeds(rows, "table")
    if v:
        return v, "table"
    out, used = [], set()
    for r in rows:
        want = bucket_fields(_ran(bucket, _width(r)))
        nm = next((nm for nm in candidates_of([r]) if kernel_fields(nm) == want), None)
        if nm is None:
            return None, None
        out.append(r["us"]["torch_bmm"] / r["us"][nm])
        used.add(nm)
    return out, " + ".join(sorted(used))


def _yaml_bucket(name, b, lo, hi, fields, note, directs=()) -> list[str]:
    rng = lambda r: f"[{r[0]}, {'null' if r[1] is None else r[1]}]"  # noqa: E731
    lines = [f"  - name: {name}", "    op: bmm", f"    dtypes: [{', '.join(b.dtypes)}]",
             f"    m: {rng((lo, hi))}", f"    n: {rng(b.n)}", f"    k: {rng(b.k)}",
             f"    tile: {fields['tile']}", f"    cluster: {fields['cluster']}",
             f"    stages: {fields['stages']}",
             f"    persistent: {str(fields['persistent']).lower()}"]
    if fields.get("pingpong"):
        lines.append("    pingpong: true")
    for field, d in directs:
        lines.append(f"    {field}: {{tile: {d['tile']}, stages: {d['stages']}, "
                     f"persistent: {str(d['persistent']).lower()}}}")
    return lines + [f"    note: {json.dumps(note)}"]


def _row_text(r, v, best_v, best_nm) -> str:
    lay = r.get("layout") or {}
    how = ", ".join(k for k in ("c_direct", "a_loads", "stage_a", "stage_b") if lay.get(k))
    return (f"    {r['kind']} L={r['L']} M={r['M']} K={r['K']} N={r['N']}: {v:.2f}x"
            f" (best tile {best_nm.split('.', 1)[-1]} {best_v:.2f}x){' [' + how + ']' if how else ''}")


def _direct_ok(nm) -> bool:
    """A candidate that can be a `direct` kernel: its threads store outputs (BM >= 64, no
    ping-pong); a cluster it was timed with was not used on such rows (`batched.plan_key`)."""
    f = kernel_fields(nm)
    return f["tile"][0] >= 64 and not f.get("pingpong")


def _short(nm) -> str:
    return nm.split(".", 1)[-1]


def _own_directs(b) -> list:
    """The bucket's own direct kernels, kept as they are: [(field, fields, label, [])]."""
    return [(f, bucket_fields(d), "the bucket's own", []) for f in DIRECT_FIELDS
            for d in [getattr(b, f)] if d is not None]


def _same_kernel(f, g) -> bool:
    """Two kernels as thread-stored rows run them (no cluster: `batched.plan_key`)."""
    return all(f.get(k) == g.get(k) for k in ("tile", "stages", "persistent"))


def _keep_untimed(b, threads, directs) -> list:
    """`directs` plus, for each store width that no row of `threads` has, the kernel its
    rows ran before, where the fitted bucket would run another one (or its tile): a fit
    changes the kernel of the widths it timed only."""
    widths = {8 if vector_stored(r) else 0 for r in threads}
    out = list(directs)
    for width, field in ((0, "direct"), (8, "direct_vector")):
        have = {f: fields for f, fields, *_ in out}
        after = have.get(field) or (have.get("direct") if width == 8 else None)
        before = bucket_fields(_ran(b, width))
        if width not in widths and (after is None or not _same_kernel(before, after)):
            out.append((field, before, "the bucket's own", []))
    return sorted(out, key=lambda d: DIRECT_FIELDS.index(d[0]))


def _direct_picks(threads):
    """([(field, fields, label, speeds)], rows in the picks' order) for thread-stored rows:
    one kernel for all (`direct`, or `direct_vector` where every row is stored 8 bytes at a
    time), or, where the rows stored 8 bytes at a time and those stored element by element
    want different kernels and that scores better, `direct` for the latter and
    `direct_vector` for the former; (None, []) without a candidate."""
    one = best_candidate(threads, _direct_ok)
    if one is None:
        return None, []
    vec = [r for r in threads if vector_stored(r)]
    elem = [r for r in threads if not vector_stored(r)]
    field = "direct_vector" if not elem else "direct"
    best = ([(field, kernel_fields(one[0]), _short(one[0]), one[1])], threads)
    if vec and elem:
        pe, pv = best_candidate(elem, _direct_ok), best_candidate(vec, _direct_ok)
        if pe and pv and pe[0] != pv[0] and score(pe[1] + pv[1]) > score(
                [one[1][threads.index(r)] for r in elem + vec]):
            best = ([("direct", kernel_fields(pe[0]), _short(pe[0]), pe[1]),
                     ("direct_vector", kernel_fields(pv[0]), _short(pv[0]), pv[1])],
                    elem + vec)
    return best


def _speeds_of(fit) -> list:
    """Every row's speed of a fit (parts, directs, order), in `order`."""
    return [x for *_, v in fit[0] for x in v] + [x for *_, v in fit[1] for x in v]


def fit_rows(b, rows, splits, min_gain):
    """The fit of bucket `b` on its `rows`: (parts, directs, order) or None, where parts are
    (m_lo, m_hi, kernel fields, label, speeds) along M, directs are (field, kernel fields,
    label, speeds) for the bucket's `direct` / `direct_vector`, and order lists the rows as
    the parts' speeds then the directs' run.

    Thread-stored rows (`thread_stored`) and TMA-stored ones favour different tiles and the
    box cannot tell them apart. Where the bucket has thread-stored rows next to TMA-stored
    ones or a direct kernel already, they get their own pick (`_direct_picks`; the
    bucket's tile then has no ping-pong, whose threads store no outputs) and the rest fit
    the bucket's tile; that is kept where it scores at least as well as one fit over all
    rows. A store width no row has keeps the kernel it ran (`_keep_untimed`), so a bucket
    whose rows are all TMA-stored keeps its direct kernels."""
    threads = [r for r in rows if thread_stored(r)]
    tma = [r for r in rows if not thread_stored(r)]
    own = b.direct or b.direct_vector
    plain = fit_bucket(rows, b.m[0], b.m[1], splits, min_gain,
                       ok=_direct_ok if own is not None and not threads else None)
    one = None if not plain else (
        [(lo, hi, kernel_fields(nm), _short(nm), v) for lo, hi, nm, v in plain],
        _keep_untimed(b, threads, []) if threads else _own_directs(b),
        [r for lo, hi, *_ in plain for r in rows if lo <= r["M"] <= (hi or r["M"])])
    if not threads or not (tma or own is not None):
        return one
    picks, picked_rows = _direct_picks(threads)
    if tma:
        main = fit_bucket(tma, b.m[0], b.m[1], splits, min_gain, ok=_direct_ok)
        parts = [(lo, hi, kernel_fields(nm), _short(nm), v) for lo, hi, nm, v in main]
    else:
        parts = [(b.m[0], b.m[1], bucket_fields(b), "the bucket's own tile", [])]
    if picks is None or not parts or b.pingpong and not tma:
        return one
    split = (parts, _keep_untimed(b, threads, picks),
             [r for lo, hi, *_ in parts for r in tma if lo <= r["M"] <= (hi or r["M"])]
             + picked_rows)
    return split if one is None or score(_speeds_of(split)) >= score(_speeds_of(one)) else one


def fit(rows, arch="sm90", splits=2, min_gain=0.02, device="this GPU", out=print):
    """YAML lines of the layer (possibly just the header) and the report, printed via `out`."""
    from detgemm_cute import dispatch

    by_bucket: dict = {}
    for r in rows:
        b = dispatch.lookup("bmm", "bf16", arch, r["M"], r["N"], r["K"])
        by_bucket.setdefault(b.name, (b, []))[1].append(r)
    lines = [f"arch: {arch}", "buckets:"]
    before, after = [], []
    for name, (b, brows) in sorted(by_bucket.items()):
        got = fit_rows(b, brows, splits, min_gain)
        if got is None:
            out(f"{name}: {len(brows)} rows, no candidate timed on all of them"
                + (" that keeps the bucket's direct kernels (not ping-pong)"
                   if b.direct or b.direct_vector else ""))
            continue
        parts, directs, order = got
        new = [x for *_, v in parts for x in v] + [x for *_, v in directs for x in v]
        cur, how = current_speeds(order, b)
        take = cur is not None and better(new, cur, min_gain)
        before += cur or []
        after += new if take else cur or []
        cur_txt = "not timed (nothing written)" if cur is None else (
            f"{geomean(cur):.3f}x ({how}), {sum(x < FLOOR for x in cur)} below {FLOOR}")
        out(f"{name} ({len(order)} rows, M {b.m[0]}..{b.m[1] or 'inf'}): table {cur_txt}; "
            f"fit {geomean(new):.3f}x, {sum(x < FLOOR for x in new)} below"
            f"{'' if take or cur is None else ' (kept: gain too small)'}")
        for lo, hi, fields, label, v in parts:
            out(f"  M {lo}..{hi or 'inf'}: {label} " + (
                f"{geomean(v):.3f}x on {len(v)}" if v else "(no rows TMA stores: kept)")
                + (" (outputs TMA stores)" if directs else ""))
        for field, _, label, v in directs:
            out(f"  {field} (outputs the threads store"
                f"{' 8 bytes at a time' if field != 'direct' else ''}): {label} " + (
                    f"{geomean(v):.3f}x on {len(v)}" if v else
                    "(no such rows timed: kept)"))
        for i, r in enumerate(order):
            v = (new if take or cur is None else cur)[i]
            if v < FLOOR:
                best_nm, best_v = max(((nm, r["us"]["torch_bmm"] / r["us"][nm])
                                       for nm in r["us"] if nm not in PEERS and "+" not in nm
                                       and r["us"][nm]),
                                      key=lambda t: t[1])
                out(_row_text(r, v, best_v, best_nm))
        if take:
            for lo, hi, fields, label, v in parts:
                nm_out = name if len(parts) == 1 else f"{name}_m{lo}_{hi or 'up'}"
                note = f"fit_bmm on {device}: {label} " + (
                    f"{geomean(v):.3f}x torch.bmm on {len(v)} attention rows (worst "
                    f"{min(v):.2f}x)" if v else "(no rows TMA stores)")
                for field, _, dlabel, dv in directs:
                    if dv:
                        note += (f"; {field} {dlabel} {geomean(dv):.3f}x on {len(dv)} rows "
                                 f"the threads store"
                                 f"{' 8 bytes at a time' if field != 'direct' else ''}")
                lines += _yaml_bucket(nm_out, b, lo, hi, fields, note,  # a ping-pong
                                      [] if fields.get("pingpong") else  # tile's threads
                                      [(f, d) for f, d, *_ in directs])  # store nothing
    if before:
        out(f"all rows with a table timing: {geomean(before):.3f}x torch.bmm, "
            f"{sum(x < FLOOR for x in before)} of {len(before)} below {FLOOR}; fitted "
            f"{geomean(after):.3f}x, {sum(x < FLOOR for x in after)} below")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+", help="bench/sweep_bmm.py --out files (.gz ok)")
    p.add_argument("--out", help="the layer YAML to write (only buckets the fit changes)")
    p.add_argument("--splits", type=int, default=2, help="cuts along M per bucket, at most")
    p.add_argument("--min-gain", type=float, default=0.02)
    args = p.parse_args(argv)
    rows = read_rows(args.records)
    if not rows:
        print("fit_bmm: no rows with matching bits and a torch.bmm time", file=sys.stderr)
        return 1
    device = next((json.load((gzip.open if str(f).endswith(".gz") else open)(f, "rt"))
                   .get("meta", {}).get("device") for f in args.records), None) or "this GPU"
    lines = fit(rows, splits=args.splits, min_gain=args.min_gain, device=device)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        if len(lines) > 2:
            from detgemm_cute import registry

            registry.load_config(args.out, arch="sm90")  # validates: ConfigError names the line
        print(f"wrote {args.out} ({sum(ln.startswith('  - name') for ln in lines)} buckets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
