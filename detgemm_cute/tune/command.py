"""`detgemm-cute tune`: time candidate buckets on this GPU and write a YAML layer.

    detgemm-cute tune --preset prefill-models --ops fwd --jobs 14 --max-seconds 420 \\
        --out tuned.yaml --json tune.json --resume tune.jsonl

Steps: the problems (a preset suite, `--shapes`, `--shapes-file`); for each, the table's
current bucket plus candidates from the kernel family's limits (`candidates`); the candidates
installed as an unreachable user layer so `force_bucket` runs each (`layer`); their kernels
compiled by `--jobs` processes into the AOT cache (`parallel_compile`) while the GPU times the
problems whose kernels are ready (`measure`, cuBLAS default and split-K-off cuBLASLt in the
same run); each result appended to `--resume FILE`; finally per op the winners turned into
buckets covering every (M, N, K) (`table`), written as a layer that `DETGEMM_CUTE_CONFIG` /
`registry.add_config` loads and `detgemm-cute audit --config` validates.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..benchlib import suites
    from ..cli_args import at_least, family_type, positive_int

    src = p.add_argument_group("problems")
    src.add_argument("--preset", choices=suites.SUITES, nargs="+",
                     help="one or more suites of problems: " + "; ".join(
                         f"{k}: {v}" for k, v in suites.DESCRIPTIONS.items()))
    src.add_argument("--shapes", nargs="+", metavar="MxKxN",
                     help="problems as M tokens x K inputs x N outputs, e.g. 1000x5120x5120")
    src.add_argument("--shapes-file", metavar="FILE", help="'MxKxN [label]' per line")
    src.add_argument("--ops", help="comma-separated fwd,dx,dw (default: the preset's, or fwd)")
    src.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    src.add_argument("--every", type=positive_int, default=1, help="keep every N-th problem of each op")
    src.add_argument("--limit", type=at_least(int, 0), default=None, help="keep at most N problems")
    src.add_argument("--in-order", action="store_true",
                     help="time problems in suite order (default: a fixed shuffle, so a "
                          "time-boxed run still spreads over the suite)")
    src.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("candidates")
    c.add_argument("--max-candidates", type=positive_int, default=16,
                   help="candidates per problem, the table's current bucket included")
    c.add_argument("--max-tiles", type=positive_int, default=5, help="tile shapes per problem")
    c.add_argument("--option", action="append", default=[], metavar="KEY=V1,V2",
                   help="an extra bucket key to try (first value = default), repeatable")
    c.add_argument("--skip-candidate", action="append", default=[], metavar="TEXT",
                   help="leave out candidates whose name contains TEXT, e.g. 8x16x128_c1x2 "
                        "(repeatable; the table's own bucket is always timed)")
    c.add_argument("--tiles", metavar="BMxBN,...",
                   help="time these tile shapes instead of the ones the wave arithmetic ranks "
                        "first, e.g. 128x192,128x128,64x256")
    c.add_argument("--only-candidate", action="append", default=[], metavar="TEXT",
                   help="time only candidates whose name contains TEXT, e.g. pingpong-true "
                        "(repeatable: any of them; the table's own bucket is always timed)")
    c.add_argument("--alternatives", action="store_true",
                   help="where the table's bucket has alternatives, time every one of them "
                        "too (the data `detgemm_cute.tune.choice` fits their costs to)")
    r = p.add_argument_group("run")
    r.add_argument("--jobs", type=positive_int, default=None,
                   help="compile processes (default: CPU cores - 2; 1 = compile in-process)")
    r.add_argument("--aot-dir", metavar="DIR",
                   help="kernel library cache (default: the AOT cache; a temporary directory "
                        "when the cache is off)")
    r.add_argument("--max-seconds", type=at_least(float, 0.0), default=None,
                   help="stop timing new problems after this many seconds (then write)")
    r.add_argument("--resume", metavar="FILE",
                   help="JSON lines of measured problems: read first (those done are "
                        "skipped), appended as the run goes")
    r.add_argument("--dry-run", action="store_true",
                   help="list problems, candidates and kernel counts; no GPU needed")
    r.add_argument("--arch", type=family_type,
                   help="kernel family for --dry-run: sm90 (also sm_90, sm_90a) or sm80 (also "
                        "sm_80); default sm90 (a GPU run uses the GPU's family)")
    r.add_argument("--sms", type=positive_int, default=None, help="SM count for --dry-run (default 132)")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="FILE.yaml", help="the tuned layer (default: "
                   "tuned_<device>_<dtype>.yaml; with --check only when given)")
    o.add_argument("--json", metavar="FILE", help="every measurement, the tables, summaries")
    o.add_argument("--bucket-dtypes", help="dtypes the written buckets serve "
                                           "(default: --dtype), e.g. bf16,fp16")
    o.add_argument("--tolerance", type=at_least(float, 0.0), default=0.02,
                   help="split a bucket only where its choice is more than this much slower "
                        "than a problem's best (default 0.02)")
    o.add_argument("--max-buckets", type=positive_int, default=12, help="buckets per op, at most")
    o.add_argument("--check", metavar="FILE.yaml",
                   help="time the buckets of this table (layered on the built-in one) as the "
                        "incumbents and report problems a candidate beats by > "
                        "--check-threshold")
    o.add_argument("--check-threshold", type=at_least(float, 0.0), default=5.0, help="percent (default 5)")


def log(msg: str) -> None:
    print(f"[tune] {msg}", flush=True)


def _err(msg: str) -> None:
    for line in str(msg).splitlines():
        print(f"detgemm-cute: {line}", file=sys.stderr)


def select_problems(args):
    from ..benchlib import suites
    from ..benchlib.shapes import (dedup, parse_ops, parse_shape, problems_for,
                                   read_shapes_file, subsample)

    ops = parse_ops(args.ops) if args.ops else None
    probs = []
    for preset in args.preset or []:
        probs += suites.suite_problems(preset, ops)
    shapes = [parse_shape(s) for s in args.shapes or []]
    if args.shapes_file:
        shapes += read_shapes_file(args.shapes_file)
    if shapes:
        probs += problems_for(shapes, ops or ("fwd",))
    if not probs:
        raise ValueError("tune: give problems with --preset, --shapes or --shapes-file")
    probs = subsample(dedup(probs), args.every, args.limit, key=lambda q: q.op)
    if not args.in_order:
        random.Random(args.seed).shuffle(probs)
    return probs


def kernel_key(bucket, problem, dtype_name: str, gpu_arch: str):
    """The KernelKey `detgemm_call(problem.op)` compiles for this (candidate) bucket."""
    from ..benchlib.peers import detgemm_layout
    from ..compile import KernelKey

    out = "fp32" if problem.op == "dw" else dtype_name
    return KernelKey.for_bucket(bucket, dtype=dtype_name, out_dtype=out, arch=gpu_arch,
                                **detgemm_layout(problem.op, problem.m, problem.k, problem.n,
                                                 getattr(bucket, "swap_ab", False)))


def plan_candidates(problems, arch: str, dtype_name: str, sms: int, args, reg):
    """{problem: [Candidate]}, the table's bucket first."""
    from .candidates import Candidate, Machine, candidates_for, parse_option, space_for

    options = dict(parse_option(o) for o in args.option)
    space = space_for(arch, options)
    machine = Machine(sms=sms)
    tiles = None
    if args.tiles:
        try:
            tiles = [tuple(int(v) for v in t.lower().split("x")) for t in args.tiles.split(",")]
        except ValueError:
            tiles = []
        if not tiles or any(len(t) != 2 for t in tiles):
            raise ValueError(f"--tiles {args.tiles!r}: expected BMxBN[,BMxBN...], "
                             f"e.g. 128x192,64x256")
    plan = {}
    for p in problems:
        m, n, k = p.gemm_mnk
        bucket = reg.lookup(p.op, dtype_name, m, n, k)
        inc = Candidate.from_bucket(bucket)
        cands = candidates_for(m, n, k, space, machine, out_bytes=4 if p.op == "dw" else 2,
                               max_candidates=args.max_candidates, max_tiles=args.max_tiles,
                               incumbent=inc, tiles=tiles)
        keep = cands[:1] + [c for c in cands[1:]
                            if not any(t in c.name for t in args.skip_candidate)
                            and (not args.only_candidate
                                 or any(t in c.name for t in args.only_candidate))]
        if args.alternatives:
            keep += [c for c in map(Candidate.from_bucket, reg.alternatives(bucket))
                     if c not in keep]
        plan[p] = keep
    return plan


def incumbent_registry(arch: str, check_file):
    from .. import registry

    if not check_file:
        return registry.get_registry(arch)
    env = [registry.load_config(p, origin=registry.ENV_VAR) for p in registry.env_config_paths()]
    return registry.build_registry(arch, [f for f in env if f.arch == arch] + [
        registry.load_config(check_file, arch=arch, origin="--check")])


def dry_run(problems, plan, keys, jobs, out) -> int:
    cands = {c for cs in plan.values() for c in cs}
    all_keys = {k for ks in keys.values() for k in ks}
    for p in problems:
        cs = plan[p]
        out(f"{p.text:28s} table {cs[0].name:26s} +{len(cs) - 1}: "
            + ", ".join(c.name for c in cs[1:]))
    units = sum(len(cs) + 2 for cs in plan.values())
    out(f"{len(problems)} problems, {len(cands)} distinct candidates, {len(all_keys)} kernels "
        f"to compile (~{1.5 * len(all_keys) / max(1, jobs):.0f} s at 1.5 s each over {jobs} "
        f"processes), {units} timed units (~{0.015 * units:.0f} s of GPU timing at ~15 ms "
        f"each; long GEMMs take longer)")
    return 0


def _aot_dir(args):
    from .. import aot_cache

    if args.aot_dir:
        return os.path.expanduser(args.aot_dir)
    d = aot_cache.cache_dir()
    return str(d) if d is not None else tempfile.mkdtemp(prefix="detgemm-tune-aot-")


def run(args, out=print) -> int:
    from .. import compile as kcompile
    from .. import registry
    from ..parallel_compile import default_jobs

    try:
        problems = select_problems(args)
    except FileNotFoundError as e:
        _err(f"tune: {e.filename}: no such file")
        return 1
    except (ValueError, OSError) as e:
        _err(str(e) if str(e).startswith("tune:") else f"tune: {e}")
        return 1
    dry_only = [f"--{n}" for n in ("arch", "sms") if getattr(args, n) is not None]
    if dry_only and not args.dry_run:
        verb = "apply" if len(dry_only) > 1 else "applies"
        _err(f"tune: {' and '.join(dry_only)} {verb} to --dry-run only (a GPU run uses the "
             f"GPU's kernel family and SM count)")
        return 2
    jobs = args.jobs if args.jobs is not None else default_jobs()
    dtype_name = args.dtype
    if args.dry_run:
        arch = args.arch or "sm90"
        gpu_arch = kcompile.gpu_arch_for(arch, (9, 0) if arch == "sm90" else (8, 0))
        sms = args.sms or 132
    else:
        from ..benchlib.gpu import gpu_check

        why, arch = gpu_check()
        if why is not None:
            _err(f"tune needs a CUDA GPU with a detgemm_cute kernel family: {why}. "
                 f"(--dry-run lists the problems and candidates without one.)")
            return 1
        import torch

        gpu_arch = kcompile.gpu_arch_for(arch, torch.cuda.get_device_capability(0))
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        reg = incumbent_registry(arch, args.check)
        plan = plan_candidates(problems, arch, dtype_name, sms, args, reg)
    except (registry.ConfigError, registry.NoBucketError, ValueError) as e:
        _err(f"tune: {e}")
        return 1
    from . import layer

    layer_path = Path(tempfile.mkdtemp(prefix="detgemm-tune-")) / "candidates.yaml"
    accepted, rejected, buckets = layer.prepare(
        arch, [c for cs in plan.values() for c in cs], layer_path, log)
    for p in problems:
        plan[p] = [c for c in plan[p] if c.name in buckets]
    keys = {p: [kernel_key(buckets[c.name], p, dtype_name, gpu_arch) for c in plan[p]]
            for p in problems}
    if args.dry_run:
        return dry_run(problems, plan, keys, jobs, out)
    from .run_gpu import tune_on_gpu

    log(f"{len(accepted)} candidate buckets in {layer_path}; {len(rejected)} rejected")
    layer.activate(arch, layer_path)
    return tune_on_gpu(args, problems, plan, keys, arch, gpu_arch, jobs, _aot_dir(args),
                       out, rejected)


def write_json(path, payload) -> None:
    from ..benchlib.fmt import json_clean, json_default

    with open(path, "w") as f:
        json.dump(json_clean(payload), f, indent=1, default=json_default, allow_nan=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="detgemm-cute tune", description=__doc__.splitlines()[0])
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return run(args)


__all__ = ["add_arguments", "run", "main", "select_problems", "plan_candidates", "kernel_key"]
