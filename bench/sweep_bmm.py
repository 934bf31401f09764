"""Time bmm-kernel candidates on the attention GEMMs of public models (needs an SM90 GPU): the
data the ``op: bmm`` buckets of configs/sm90.yaml are chosen from.

For every (model, batch x sequence) both attention GEMMs run: q @ k^T (B a transposed view of
k, no copy) and p @ v. The candidates (`CANDIDATES`, declared as the alternatives of one user
bucket that serves only K = 1, so each runs where it is forced by name), the table's own
choice (`table`: unforced `dg.bmm`, the built-in table) and `torch.bmm` run on the same
inputs in one `time_units` call (CUDA graphs, interleaved rounds, medians). Where p's rows
are not 16-byte aligned (S not a multiple of 8: detgemm reads them with the kernel's
producer warpgroup, or for K < 256 stages a padded K-major copy), the staging path is timed
as well, to compare: the copy alone (`stage_copy`), the table's GEMM on an aligned p
(`aligned_gemm`, the copy made outside the timed call) and both in one call (`staged`).
Every candidate's output must have the bits of the first one, and entry 0 the bits of
`dg.mm` on it.

    python bench/sweep_bmm.py --out bench/results/tune/bmm_sweep.json [--quick] [--jobs N]

`--problems L,S,d;...` replaces the model problems with explicit ones (`--kinds qk` keeps one
GEMM of each); `--direct` adds each candidate's direct-store twin (name suffix `+direct`:
the kernel's threads store every output, as they do where TMA cannot address the rows), to
compare the two epilogues on aligned outputs too.

`--preset broad` runs the broad attention sweep instead (`BROAD_HEADS` x `BROAD_SEQS`, odd
sequence lengths first, the candidates of `BROAD_ONLY`): the records `bench/fit_bmm.py`
fits the bmm buckets from. Every row also times the table's own choice (`table`, unforced
`dg.bmm`) and says how it runs (`layout`: output stored by the threads, P read by the
producer warpgroup). The records file is rewritten after every problem, so a run cut off
by its time limit keeps what it measured; `--max-seconds` stops it cleanly (compiling
included).

    python bench/sweep_bmm.py --preset broad --jobs 14 --max-seconds 200 --out $OUT/bmm_broad.json

`--seqs S,...` keeps the problems (of any list) at those sequence lengths; `--direct-only` times
the direct-store twins alone (for rows the threads store whatever the tile).

`--preset pv` times 8 p @ v problems at unaligned S (`PV_PROBLEMS`) on the tiles of the
table's p @ v buckets and the 64x64 tile (`PV_ONLY`): the table against the same tile forced
and against the staging path.

    python bench/sweep_bmm.py --preset pv --jobs 8 --out $OUT/bmm_pv.json
"""

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute import batched, dispatch, gemm
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.timing import TimingPlan, n_sets_for
from detgemm_cute.gemm import stage_k_major
from sweep_common import (candidate_layer, no_gpu, policy_replaced, staged_a_rows,
                          time_candidates, write_records)

BF16 = torch.bfloat16
# (name, query heads, head_dim): public configs; "/tpN": heads sharded N ways.
MODELS = [("llama3-8b", 32, 128), ("qwen2.5-7b", 28, 128), ("gemma2-9b", 16, 256),
          ("phi3-mini", 32, 96), ("gpt2", 12, 64), ("bert-large", 16, 64),
          ("mistral-7b/tp2", 16, 128), ("llama3-70b/tp8", 8, 128)]
SEQS = (128, 333, 512, 777, 1024, 1500, 2048, 3000, 4096)
TOKENS = 8192  # batch x sequence of a prefill batch (the batch at most 64)
CANDIDATES = [
    {"tile": t, "cluster": c, "stages": s, "persistent": p, "pingpong": pp}
    for t, c, s, p, pp in (
        ((64, 64, 64), (1, 1), 4, True, False), ((64, 128, 64), (1, 1), 4, False, False),
        ((64, 128, 64), (1, 1), 4, True, False), ((64, 256, 64), (1, 1), 4, True, False),
        ((128, 64, 64), (1, 1), 6, True, False), ((128, 128, 64), (1, 1), 4, False, False),
        ((128, 128, 64), (1, 1), 4, True, False), ((128, 128, 64), (1, 1), 4, True, True),
        ((128, 128, 64), (2, 1), 4, True, False), ((128, 192, 64), (1, 1), 4, True, False),
        ((128, 256, 64), (1, 1), 3, False, False), ((64, 64, 128), (1, 1), 4, False, False),
        # Output-bound q @ k^T reads about twice the bytes it writes (from L2) on a 128x128
        # tile: wider tiles and multicast clusters read fewer per output.
        ((128, 256, 64), (1, 1), 3, True, False), ((128, 256, 64), (2, 1), 3, True, False),
        ((128, 128, 64), (2, 2), 4, True, False), ((128, 192, 64), (2, 1), 4, True, False),
        # Wider still (H200, 2026-11-28: 128x256 on a 2x1 cluster was the fastest on 13 of
        # the 25 aligned q @ k^T rows at S >= 512, within 2% on 20): 256-row tiles (two
        # warpgroups of 128 rows) read 1.17-1.5x the bytes they write.
        ((128, 256, 64), (2, 1), 4, True, False), ((128, 256, 64), (1, 2), 3, True, False),
        ((256, 128, 64), (1, 1), 3, True, False), ((256, 128, 64), (1, 2), 3, True, False),
        ((256, 128, 64), (2, 1), 3, True, False), ((256, 192, 64), (1, 1), 3, True, False),
        ((256, 192, 64), (1, 2), 3, True, False))]


# The broad sweep (`--preset broad`): (label, query heads, head_dim) at the sequence lengths
# below, both GEMMs, tokens (batch x sequence) about TOKENS; the slow classes of the last
# bench (p @ v and q @ k^T at S = 1500 and 2500) first, so a time box cuts the least
# informative rows; then aligned lengths (rows TMA stores: what a bucket's own tile serves,
# while the odd ones above mostly run its `direct` kernel). BROAD_BATCHES adds the same
# head_dim-128 problems at other batch sizes.
BROAD_HEADS = [("llama3-8b", 32, 128), ("gpt2", 12, 64), ("phi2", 32, 80), ("phi3-mini", 32, 96),
               ("llama3-70b/tp8", 8, 128)]
BROAD_SEQS = (1500, 2500, 333, 1000, 2047, 3000, 777, 4000, 2048, 1024, 4096, 512)
BROAD_BATCHES = ((1500, (1, 16)), (3000, (1, 8)), (333, (4, 64)))
BROAD_ONLY = ("64x64x64_c1x1_s4_p", "64x128x64_c1x1_s4", "64x256x64_c1x1_s4_p",
              "128x64x64_c1x1_s6_p", "128x128x64_c1x1_s4_p", "128x128x64_c2x1_s4_p",
              "128x192x64_c1x1_s4_p", "128x256x64_c1x1_s3", "128x256x64_c2x1_s3_p",
              "128x128x64_c2x2_s4_p")


# `--preset pv`: p @ v at S of 4 mod 8 (rows 8 bytes off 16) and odd S, head_dim 64..128, the
# table's buckets bmm_m1025_n65_128, bmm_m65_1024_n65_128 and bmm_n1_64; (label, L, S, d).
PV_PROBLEMS = [("llama3-8b", 160, 1500, 128), ("llama3-70b/tp8", 40, 1500, 128),
               ("phi2", 160, 1500, 80), ("gpt2", 60, 1500, 64), ("llama3-8b", 96, 2500, 128),
               ("llama3-8b", 128, 2047, 128), ("llama3-8b", 320, 777, 128),
               ("llama3-8b", 768, 333, 128)]
PV_ONLY = ("64x64x64_c1x1_s4_p", "64x128x64_c1x1_s4", "128x64x64_c1x1_s6_p",
           "128x128x64_c1x1_s4_p", "128x128x64_c2x1_s4_p")
# Stored in the records' meta: the `table` column is unforced dg.bmm on the built-in table
# (records without it timed the candidate layer's first tile there; `fit_bmm` drops those).
TABLE_TIMING = "built-in table"


def broad_problems():
    """(label, L, S, head_dim) of the broad sweep, in the order they run."""
    out = [(name, min(64, max(1, TOKENS // s)) * heads, s, d)
           for s in BROAD_SEQS for name, heads, d in BROAD_HEADS]
    out += [(f"{name}/b{b}", b * heads, s, d) for s, batches in BROAD_BATCHES
            for b in batches for name, heads, d in BROAD_HEADS if d == 128]
    return out


def problems(models, seqs):
    """(model, L, S, head_dim): three sequence lengths per model (a short, a middle and a long
    one), rotating over SEQS."""
    third = len(seqs) // 3
    for i, (name, heads, d) in enumerate(models):
        for j in range(3):
            s = seqs[(i + j * third) % len(seqs)]
            yield name, min(64, max(1, TOKENS // s)) * heads, s, d


def shapes_of(lb, s, d):
    """The two GEMMs: (kind, M, K, N)."""
    return (("qk", s, d, s), ("pv", s, s, d))


def operands(kind, lb, m, k, n):
    """Fresh random (a, b) as attention makes them: b = k^T (a view) for q @ k^T; for p @ v,
    a = softmax rows."""
    a = torch.randn(lb, m, k, device="cuda", dtype=BF16)
    if kind == "qk":
        return a, torch.randn(lb, n, k, device="cuda", dtype=BF16).transpose(1, 2)
    return a.softmax(-1), torch.randn(lb, k, n, device="cuda", dtype=BF16)


def make_sets(kind, lb, m, k, n, l2):
    nbytes = 2 * lb * (m * k + k * n + m * n)
    return [operands(kind, lb, m, k, n) for _ in range(min(8, n_sets_for(nbytes, l2, PLAN)))]


DIRECT = "+direct"


def direct_store(on: bool):
    """Within: every bmm output is stored by the kernel's threads where the tile allows it
    (as if no row could be addressed by TMA); plans made inside are dropped on exit."""
    if not on:
        return contextlib.nullcontext()
    return policy_replaced(gemm, "padded_width", lambda n, dt: n)


def forced(name):
    bucket, direct = name.removesuffix(DIRECT), name.endswith(DIRECT)

    def run(s):
        with direct_store(direct), dg.force_bucket(bucket):
            return dg.bmm(s[0], s[1])
    return run


def aligned_gemm():
    """The table's GEMM on an aligned copy of A (K padded to a multiple of 8): the staged
    call's kernel time without the copy (the copy is made once, outside the timed call)."""
    cache = {}

    def run(s):
        a = cache.get(id(s[0]))
        if a is None:
            a = cache[id(s[0])] = stage_k_major(s[0], True)
        return dg.bmm(a[:, :, :s[0].shape[2]], s[1])
    return run


def staged(s):
    """The whole staging path in one call: A copied into padded rows, then the table's
    GEMM on them by TMA (what `dg.bmm` runs where the producer warpgroup does not read A)."""
    with staged_a_rows():
        return dg.bmm(s[0], s[1])


def timed_calls(kind, k, names) -> dict:
    """{name: fn(set)} of one problem: the candidates forced by name, torch.bmm, the table's
    own choice (unforced dg.bmm) and, for p @ v of unaligned rows, the staging path."""
    fns = {nm: forced(nm) for nm in names}
    fns["torch_bmm"] = lambda st: torch.bmm(*st)
    fns["table"] = lambda st: dg.bmm(*st)
    if kind == "pv" and k % 8:
        fns["stage_copy"] = lambda st: stage_k_major(st[0], True)
        fns["aligned_gemm"] = aligned_gemm()
        fns["staged"] = staged
    return fns


def check_bits(names, s, others=()) -> bool:
    """Every candidate's output (and every call of `others`) has the bits of the first
    candidate's, and entry 0 the bits of `dg.mm` on it."""
    a, b = s
    outs = [forced(nm)(s) for nm in names] + [fn(s) for fn in others]
    same = all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    ref = dg.mm(a[0], b[0])
    return same and torch.equal(outs[0][0].view(torch.int16), ref.view(torch.int16))


def precompile(names, probs, kinds, jobs, log):
    """Every candidate's kernel (and the table's own) for every layout the sweep meets, in
    `jobs` processes."""
    from detgemm_cute import aot_cache
    from detgemm_cute.parallel_compile import compile_all

    directory = aot_cache.cache_dir() or tempfile.mkdtemp(prefix="detgemm-sweep-aot-")
    aot_cache.os.environ[aot_cache.ENV_VAR] = str(directory)
    keys = {}
    for _, lb, s, d in probs:
        for kind, m, k, n in shapes_of(lb, s, d):
            if kind not in kinds:
                continue
            a, b = operands(kind, 2, m, k, n)
            for nm in names:
                with direct_store(nm.endswith(DIRECT)):
                    bucket = dispatch.bucket_by_name("sm90", nm.removesuffix(DIRECT))
                    keys[batched.kernel_layout(a, b, None, BF16, bucket)[0]] = None
            bucket = dispatch.lookup("bmm", "bf16", "sm90", m, n, k)
            keys[batched.kernel_layout(a, b, None, BF16, bucket)[0]] = None
            if kind == "pv" and k % 8:  # the staging path's GEMM (P copied, TMA)
                with staged_a_rows():
                    keys[batched.kernel_layout(a, b, None, BF16, bucket)[0]] = None
    log(f"compiling {len(keys)} kernels in {jobs} processes")
    failed = compile_all(list(keys), directory, jobs, log=log)
    for key, why in failed.items():
        log(f"could not build {key}: {why}")


def table_layout(a, b, bucket_name) -> dict:
    """How the table's bucket runs these operands: the output stored by the tile's threads
    (`c_direct`; `c_align` 8: 8 bytes a store), P's rows read by the producer warpgroup
    (`a_loads`, with the raw ring's k tiles), copies, and the kernel's tile, stages and
    schedule."""
    from detgemm_cute.kernels.sm90_a_rows import raw_stages

    bucket = dispatch.bucket_by_name("sm90", bucket_name)
    key, stage_a, stage_b, _ = batched.kernel_layout(a, b, None, BF16, bucket)
    out = {"c_direct": bool(key.c_direct), "c_align": key.c_align, "a_loads": bool(key.a_loads),
           "stage_a": stage_a, "stage_b": stage_b, "cluster": list(key.cluster),
           "tile": list(key.tile), "stages": key.stages, "persistent": bool(key.persistent)}
    if key.a_loads:
        out["raw_stages"] = raw_stages(key.tile, key.stages)
    return out


def measure(model, kind, lb, m, k, n, names, table_bucket, l2, cap) -> dict:
    """One problem: every candidate, the table's own choice and torch.bmm timed together,
    the candidates' bits checked; the record row (also printed)."""
    sets = make_sets(kind, lb, m, k, n, l2)
    fns = timed_calls(kind, k, names)
    us, errors, best = time_candidates(fns, sets, PLAN, cap, names)
    ok = check_bits(names, sets[0], [fns[nm] for nm in ("table", "staged") if nm in fns])
    row = {"model": model, "kind": kind, "L": lb, "M": m, "K": k, "N": n, "us": us,
           "bits_ok": ok, "table": table_bucket, "errors": errors,
           "layout": table_layout(*sets[0], table_bucket)}
    peer = us.get("torch_bmm") or float("nan")
    split_us = (f"  copy {us.get('stage_copy') or 0:.1f} aligned "
                f"{us.get('aligned_gemm') or 0:.1f} staged {us.get('staged') or 0:.1f}"
                if "stage_copy" in us else "")
    print(f"{model:16s} {kind} L={lb:5d} M={m:5d} K={k:5d} N={n:5d} best "
          f"{best[1].split('.', 1)[1]:30s} {best[0]:8.1f} us  torch {peer:8.1f}  "
          f"{peer / best[0]:.2f}x  table {table_bucket} "
          f"{us.get('table') or float('nan'):8.1f}  bits {ok}"
          f"{split_us}", flush=True)
    print("    torch.bmm / call: " + speeds_text(us, names), flush=True)
    return row


def speeds_text(us, names) -> str:
    """torch.bmm's time over each call's: the table, every candidate, the staging path."""
    peer = us.get("torch_bmm")
    calls = ["table", *names, "staged"]
    return ", ".join(f"{nm.split('.', 1)[-1]} {peer / us[nm]:.2f}x" for nm in calls
                     if peer and us.get(nm))


PLAN = TimingPlan(target_ms=0.5, reps=7, min_reps=3, budget_ms=20.0, warm_rounds=1,
                  warm_replays=1, est_min_ms=0.3)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=420.0)
    p.add_argument("--problems", help="L,S,d;... instead of the models' problems")
    p.add_argument("--kinds", default="qk,pv")
    p.add_argument("--direct", action="store_true", help="add direct-store twins")
    p.add_argument("--direct-only", action="store_true",
                   help="time the direct-store twins only (rows the threads store anyway)")
    p.add_argument("--seqs", help="comma-separated sequence lengths: keep the problems at "
                   "these S only (e.g. the aligned ones TMA stores)")
    p.add_argument("--only", help="comma-separated substrings: keep the candidates whose "
                   "names contain one (e.g. 128x256x64_c2x1,128x128x64_c1x1_s4_p)")
    p.add_argument("--preset", choices=("models", "broad", "pv"), default="models",
                   help="broad: the broad attention sweep (BROAD_*) and its candidates; pv: "
                   "p @ v at unaligned S (PV_PROBLEMS, PV_ONLY)")
    args = p.parse_args(argv)
    if args.preset != "models" and args.problems:
        p.error(f"--preset {args.preset} and --problems are two problem lists: give one")
    if args.seqs:
        try:
            args.seqs = {int(v) for v in args.seqs.split(",")}
        except ValueError:
            p.error(f"--seqs: expected comma-separated integers, got {args.seqs!r}")
    return args


def problem_list(args) -> list:
    """(label, L, S, head_dim) of the run, in order (with `--seqs`, those at its S only)."""
    if args.preset == "broad":
        out = broad_problems()
    elif args.preset == "pv":
        out = list(PV_PROBLEMS)
    elif args.problems:
        out = [("given", *map(int, t.split(","))) for t in args.problems.split(";")]
    else:
        out = list(problems(MODELS[::3] if args.quick else MODELS, SEQS))
    return [pr for pr in out if not args.seqs or pr[2] in args.seqs]


def candidate_names(args, names) -> list[str]:
    """The candidates the run times: `--only` substrings, or the preset's exact names (a
    prefix would also keep the pingpong twin), plus the direct-store twins."""
    exact = {"broad": BROAD_ONLY, "pv": PV_ONLY}.get(args.preset)
    if args.only:
        names = [nm for nm in names if any(o in nm for o in args.only.split(","))]
    elif exact:
        names = [nm for nm in names if nm.split(".", 1)[1] in exact]
    if args.direct or args.direct_only:
        twins = [nm + DIRECT for nm in names if gemm.stores_direct(
            "sm90", dispatch.bucket_by_name("sm90", nm), True)]
        names = twins if args.direct_only else names + twins
    return names


def main(argv=None) -> int:
    args = parse_args(argv)
    if no_gpu():
        return 1
    t0 = time.time()
    probs = problem_list(args)
    kinds = ["pv"] if args.preset == "pv" else args.kinds.split(",")
    table = {(m, n, k): dispatch.lookup("bmm", "bf16", "sm90", m, n, k).name
             for _, lb, s, d in probs for _, m, k, n in shapes_of(lb, s, d)}
    with tempfile.TemporaryDirectory() as tmp:
        names = candidate_names(args, candidate_layer(Path(tmp) / "candidates.yaml", "bmm",
                                                      "bcand", CANDIDATES))
    if args.jobs > 1:
        precompile(names, probs, kinds, args.jobs, lambda m: print(m, flush=True))
    l2 = gpu.l2_bytes()
    cap = torch.cuda.Stream()
    rows = []
    todo = [(model, lb, shape) for model, lb, s, d in probs for shape in shapes_of(lb, s, d)
            if shape[0] in kinds]
    for model, lb, (kind, m, k, n) in todo:
        if time.time() - t0 > args.max_seconds:
            print(f"time box reached after {len(rows)} of {len(todo)} problems", flush=True)
            break
        rows.append(measure(model, kind, lb, m, k, n, names, table[(m, n, k)], l2, cap))
        # a run cut off later keeps these rows
        write_records(args.out, names, rows, table_timing=TABLE_TIMING)
    write_records(args.out, names, rows, table_timing=TABLE_TIMING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
