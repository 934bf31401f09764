"""Every kernel family and bucket at its tile edges, for compute-sanitizer.

    python tests/sanitize.py --precompile --dedupe                  # no sanitizer: fill
                                                                    # the AOT cache first
    compute-sanitizer --tool memcheck --report-api-errors no python tests/sanitize.py --dedupe
    compute-sanitizer --tool racecheck python tests/sanitize.py --dedupe --quick
    compute-sanitizer --tool synccheck python tests/sanitize.py --dedupe --quick
    python tests/sanitize.py --list --dedupe                        # the plan; no GPU needed

(`--report-api-errors no`: the DSL probes driver entry points with cuGetProcAddress at
compile time, which the tool otherwise lists as API errors.)

The plan (tests/sanitize_cases.py): each bucket of each kernel family this GPU runs (sm90
and sm80 on an H100; `--families`) is forced (`force_bucket`) onto shapes at its tile edges:
1, tile-1, tile, tile+1 and a ragged multi-tile shape in each of M, N, K, plus an empty one
(no launch); swapped buckets get the edges along the kernel's rows. fwd runs `linear` with
a bias (odd N: the direct-store epilogue or padded rows; odd K: the row-copy staging) and
once with an M-major X; dx `input_grad`; dw `weight_grad` from zero and continuing a buffer
and the bias gradient with and without one. bmm buckets run 3-entry batches with and
without a bias and a K-major A of an odd row pitch (K >= 256: the a-rows producer). grouped
buckets run offs with empty groups, groups of 1, tile-1, tile, tile+1 and many tiles, all
groups empty with trailing rows, many tiny groups and one long group, both weight layouts.
fp32 buckets run the split tier (fp16 parts; dW's exact bf16 parts), tf32 buckets the TF32
kernels (dX's weight through the transpose kernel).

`--dedupe` keeps one bucket per kernel signature (op, dtypes, row tile / BM, BN a multiple
of 64 or not, cluster, persistent, ping-pong, swapped, raster_n) and one dtype per bucket;
`--only TEXT` keeps buckets whose name contains TEXT; `--quick` takes 3 shapes (and 3 offs
plans) instead of 6 (5). Outputs land in NaN-poisoned memory and are checked for NaN, so an
unwritten element fails even where the sanitizer is silent. At the end: kernel launches by
kind (GEMM kernels by path; split, transpose and row-copy helpers), the GEMM launches the
plan expects, and output failures; exit 1 on any failure or a launch count that differs from
the plan (the sanitizer's own exit code reports its findings). `--max-seconds` stops starting
items after that long (sections are interleaved, so a cut run still reaches each one).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sanitize_cases as sc  # noqa: E402


def _poison():
    import torch

    blocks = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 16, 1 << 20)]
    del blocks


def gemm_kind(key) -> list:
    """The tags of a GEMM kernel key: what the launch counts are grouped by."""
    from detgemm_cute.compile import family_of

    size = key.cluster[0] * key.cluster[1]
    tags = [family_of(key.arch)]
    for tag, on in (("row-tile", key.tile[0] < 64), ("persistent", key.persistent),
                    ("pingpong", key.pingpong), ("swap", key.swap_ab), ("bmm", key.batched),
                    ("grouped", key.grouped), ("grouped-k", key.grouped_k),
                    ("a-rows", key.a_loads),
                    ("direct-store", key.c_direct), ("split", key.split),
                    ("tf32", key.dtype == "tf32"), (f"cluster{size}", size > 1),
                    ("m-major-a", key.a_major == "m"), ("accumulate", key.accumulate),
                    ("a-registers", key.dtype == "tf32" and key.a_major == "m"
                     and family_of(key.arch) == "sm90")):
        if on:
            tags.append(tag)
    return tags


class Counter:
    """Counts kernel launches: GEMM kernels (`compile.get` wrapped) by tag, helper kernels
    (`split.compiled_once` wrapped: the split parts, transpose, row copy) by name. With
    `record`, GEMM kernels are not built or launched: their keys are collected."""

    def __init__(self, record=False):
        self.gemm = collections.Counter()
        self.helpers = collections.Counter()
        self.keys = []
        self.record = record

    def install(self):
        from detgemm_cute import compile as kcompile
        from detgemm_cute import split

        real_get, real_once = kcompile.get, split.compiled_once

        def get(key):
            if self.record:
                self.keys.append(key)
                fn = _noop
            else:
                fn = real_get(key)
            tags = gemm_kind(key)

            def counted(*args):
                self.gemm["all"] += 1
                for t in tags:
                    self.gemm[t] += 1
                return fn(*args)

            return counted

        def compiled_once(name, build):
            fn = real_once(name, build)
            if getattr(fn, "counted", False):
                return fn
            label = {"scaled": "split parts (fp16, scaled)", "exact": "split parts (bf16, "
                     "exact)", "transpose32": "transpose (fp32)", "rows16": "row copy",
                     "columns": "split parts (fp16, columns)", "unscale": "unscale (fp32)"}
            tag = label.get(name[0], str(name[0]))

            def counted(*args):
                self.helpers[tag] += 1
                return fn(*args)

            counted.counted = True
            split._kernels[name] = counted
            return counted

        kcompile.get = get
        split.compiled_once = compiled_once


def _noop(*args):
    return None


def run_item(item, check=True) -> list:
    """Run one item's calls; the failures (NaN left in an output)."""
    import torch

    import detgemm_cute as dg

    bad = []
    with dg.use_family(item.family), dg.force_bucket(item.bucket.name), \
            dg.fp32_precision("tf32" if item.dtype == "tf32" else "ieee"):
        for call in item.calls:
            _poison()
            outs = sc.run_call(call, item.dtype)
            torch.cuda.synchronize()
            if check and any(torch.isnan(o).any() for o in outs):
                bad.append(f"{item.label} {call.kind} {dict(call.dims)} "
                           f"{dict(call.opts) or ''}: NaN in output (unwritten?)")
    return bad


def print_plan(plan, out=print) -> None:
    tags = collections.Counter(t for it in plan for t in it.tags)
    calls = sum(len(it.calls) for it in plan)
    launches = sum(c.launches() for it in plan for c in it.calls)
    out(f"plan: {len(plan)} items ({len({(i.family, i.bucket.name) for i in plan})} buckets), "
        f"{calls} calls, {launches} GEMM launches expected")
    out("  covers: " + ", ".join(f"{t} {n}" for t, n in sorted(tags.items())))


def _precompile(plan, jobs, out) -> int:
    """Collect the plan's kernel keys (GEMM launches skipped) and compile them into the AOT
    cache in `jobs` processes, so the sanitizer runs load them instead of compiling."""
    from detgemm_cute import aot_cache
    from detgemm_cute.parallel_compile import compile_all

    directory = aot_cache.cache_dir()
    if directory is None:
        out("precompile: the AOT cache is off (DETGEMM_CUTE_AOT_DIR=off); nothing to do")
        return 1
    counter = Counter(record=True)
    counter.install()
    for item in plan:
        run_item(item, check=False)
    keys = list(dict.fromkeys(counter.keys))
    t0 = time.time()
    failed = compile_all(keys, directory, jobs, log=out)
    out(f"precompile: {len(keys)} kernels into {directory} in {time.time() - t0:.0f} s, "
        f"{len(failed)} failed")
    for key, why in failed.items():
        out(f"  {key}: {why}")
    return 1 if failed else 0


def main(argv=None, out=print) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", help="kernel families (default: every family this GPU "
                    "runs: sm90,sm80 on an H100)")
    ap.add_argument("--sections", default=",".join(sc.SECTIONS),
                    help=f"which kinds of bucket (default {','.join(sc.SECTIONS)})")
    ap.add_argument("--dtypes", default="bf16,fp32,tf32",
                    help="bucket dtypes to run (default bf16,fp32,tf32; also fp16)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="only buckets whose name contains TEXT (repeatable: any of them)")
    ap.add_argument("--quick", action="store_true", help="3 shapes per bucket instead of 6")
    ap.add_argument("--dedupe", action="store_true",
                    help="one bucket per kernel signature, one dtype per bucket")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no item after this many seconds")
    ap.add_argument("--list", action="store_true", help="print the plan and stop (no GPU)")
    ap.add_argument("--precompile", action="store_true",
                    help="compile the plan's kernels into the AOT cache in parallel, then stop")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                    help="processes for --precompile")
    args = ap.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if args.families:
        families = args.families.split(",")
    elif gpu:
        families = ["sm90", "sm80"] if torch.cuda.get_device_capability() >= (9, 0) \
            else ["sm80"]
    else:
        families = ["sm90", "sm80"]
    plan = sc.items(families, args.sections.split(","), tuple(args.dtypes.split(",")),
                    args.only, args.quick, args.dedupe)
    print_plan(plan, out)
    if args.list:
        for it in plan:
            out(f"  {it.label:58s} {len(it.calls):3d} calls  {' '.join(sorted(it.tags))}")
        return 0
    if not gpu:
        out("sanitize: needs a CUDA GPU (--list shows the plan without one)")
        return 0
    if args.precompile:
        return _precompile(plan, args.jobs, out)
    counter = Counter()
    counter.install()
    failures, done, t0 = [], 0, time.time()
    for item in plan:
        if args.max_seconds is not None and time.time() - t0 > args.max_seconds:
            break
        failures += run_item(item)
        done += 1
    expected = sum(c.launches() for it in plan[:done] for c in it.calls)
    reached = collections.Counter(f"{it.family} {it.section}" for it in plan[:done])
    cut = (f"; stopped by --max-seconds after {done} of {len(plan)} items ("
           + ", ".join(f"{k} {n}" for k, n in sorted(reached.items())) + ")") \
        if done < len(plan) else ""
    out(f"sanitize: {counter.gemm['all']} GEMM kernel launches ({expected} expected) and "
        f"{sum(counter.helpers.values())} helper launches over {done} items in "
        f"{time.time() - t0:.0f} s{cut}; {len(failures)} output failures")
    out("  GEMM launches by kind: " + ", ".join(
        f"{t} {n}" for t, n in sorted(counter.gemm.items()) if t != "all"))
    out("  helper launches: " + (", ".join(f"{t} {n}" for t, n in sorted(
        counter.helpers.items())) or "none"))
    for f in failures:
        out("  " + f)
    return 1 if failures or counter.gemm["all"] != expected else 0


if __name__ == "__main__":
    sys.exit(main())
