"""`detgemm-cute`: audit the dispatch tables, explain a choice, compile, warm up, tune, demo,
bench.

User mistakes (a bad config file, an unknown bucket, an arch without kernels) end with a
message on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from . import registry as reg
from . import tables
from .tables import USER_ERRORS as _USER_ERRORS
_BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_gemm.py"
def cmd_audit(args, out) -> int:
    return tables.audit(args.arch, args.config or [], out, _err)


def cmd_explain(args, out) -> int:
    out(tables.explain(args.op, args.dtype, args.arch, args.M, args.N, args.K,
                       args.config or []))
    return 0


def _registry_arch(gpu_arch: str) -> str:
    """The kernel family a --gpu-arch builds: 'sm_90a' -> 'sm90'; 'sm_80', 'sm_86', 'sm_90'
    (no 'a': the SM80 family built for an H100) -> 'sm80'."""
    from .compile import family_of

    return family_of(gpu_arch)


def cmd_compile(args, out) -> int:
    try:
        arch = _registry_arch(args.arch)
    except ValueError as e:
        _err(str(e))
        return 1
    for p in args.config or []:
        reg.add_config(p, arch=arch)
    from .aot import compile_buckets

    return compile_buckets(args.arch, args.bucket or None, out=out, variants=args.variants)


def _progress_bar(done: int, total: int, label: str, seconds: float) -> None:
    width = 30
    fill = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} "
                     f"{label[:48]:48s} {seconds:5.1f}s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_warmup(args, out) -> int:
    import time

    from . import aot

    try:
        arch = _registry_arch(args.arch)
    except ValueError as e:
        _err(str(e))
        return 1
    for p in args.config or []:
        reg.add_config(p, arch=arch)
    split = lambda s: tuple(s.split(",")) if s else None  # noqa: E731
    t0 = time.time()
    aot_dir = args.aot_dir
    if args.jobs > 1:
        aot_dir = _compile_in_parallel(args, split, out)
    n = aot.warmup(args.arch, ops=split(args.ops), dtypes=split(args.dtypes),
                   bucket_names=args.bucket or None, variants=args.variants,
                   aot_dir=aot_dir, progress=None if args.quiet else _progress_bar)
    where = f", libraries in {args.aot_dir}" if args.aot_dir else ""
    out(f"warmup: {n} kernels ready for {args.arch} in {time.time() - t0:.1f}s{where}")
    return 0


def _compile_in_parallel(args, split, out):
    """warmup --jobs N: compile the kernels in N processes into the AOT cache first (warmup
    then loads them); returns the directory used."""
    from . import aot, aot_cache
    from .parallel_compile import compile_all

    directory = args.aot_dir or aot_cache.cache_dir()
    if directory is None:
        out("warmup: the AOT cache is off, so --jobs cannot share kernels; compiling here")
        return None
    keys = [k for _, k in aot.warmup_keys(args.arch, split(args.ops), split(args.dtypes),
                                          args.bucket or None, args.variants)]
    failed = compile_all(keys, directory, args.jobs,
                         progress=None if args.quiet else _progress_bar)
    for key, why in failed.items():
        out(f"warmup: {key.tile} {key.dtype}->{key.out_dtype} failed in a worker ({why}); "
            f"compiling it here")
    return str(directory)


def cmd_tune(args, out) -> int:
    from .tune.command import run

    return run(args, out)


def cmd_tune_fit(args, out) -> int:
    from .tune.fit_command import run

    return run(args, out)


def cmd_verify(args, out) -> int:
    import torch

    from . import reference

    load = lambda p: torch.load(p, map_location="cpu", weights_only=True)  # noqa: E731
    r = reference.verify(load(args.x), load(args.weight), load(args.result),
                         load(args.bias) if args.bias else None)
    out(str(r))
    return 0 if r.ok else 1


def cmd_demo(args, out) -> int:
    from .demo import main as demo_main

    return demo_main((["--quick"] if args.quick else []) + list(args.rest))


def cmd_bench(args, out) -> int:
    if not _BENCH.is_file():
        out("bench/ ships with the source tree (git checkout of detgemm_cute), not with the "
            "installed package; run `python bench/bench_gemm.py` there.")
        return 1
    spec = importlib.util.spec_from_file_location("detgemm_cute_bench_gemm", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        return mod.main(list(args.rest))
    except SystemExit as e:  # the script's own --help or usage error
        return e.code if isinstance(e.code, int) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="detgemm-cute",
                                description="Deterministic, batch-invariant GEMMs: tools.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    a = sub.add_parser("audit", help="validate the dispatch tables and print them")
    a.add_argument("--arch", help="only this arch (default: every kernel family)")
    a.add_argument("--config", action="append", metavar="FILE",
                   help="also validate this user config as a layer (repeatable)")
    a.set_defaults(func=cmd_audit)

    e = sub.add_parser("explain", help="which bucket serves a problem, and why")
    e.add_argument("--op", default="fwd", choices=reg.OPS)
    e.add_argument("--dtype", default="bf16", choices=reg.DTYPES)
    e.add_argument("--arch", default="sm90")
    e.add_argument("--config", action="append", metavar="FILE",
                   help="user config layered on top (repeatable; the last is highest)")
    for dim in "MNK":
        e.add_argument(dim, type=int)
    e.set_defaults(func=cmd_explain)

    c = sub.add_parser("compile", help="compile every bucket's kernels ahead of time (no GPU)")
    c.add_argument("--arch", default="sm_90a",
                   help="GPU arch to compile for (default sm_90a: the SM90 TMA + WGMMA "
                        "family; sm_80, sm_86, sm_90, ...: the SM80 cp.async + mma.sync family)")
    c.add_argument("--bucket", action="append", metavar="NAME",
                   help="only this bucket (repeatable; default: all)")
    c.add_argument("--config", action="append", metavar="FILE",
                   help="user config to add before compiling (repeatable)")
    c.add_argument("--variants", choices=("core", "all"), default="core",
                   help="core: one key per bucket and dtype plus bf16 [K,N]->fp32 (default); "
                        "all: every dtype x output x layout x bias combination")
    c.set_defaults(func=cmd_compile)

    w = sub.add_parser("warmup", help="compile chosen buckets now (and export them for "
                                      "later processes with --aot-dir)")
    w.add_argument("--arch", default="sm_90a",
                   help="GPU arch to compile for (default sm_90a: SM90 family; sm_80, sm_86, "
                        "sm_90, ...: SM80 family)")
    w.add_argument("--ops", help="comma-separated ops (fwd,dx,dw; default all)")
    w.add_argument("--dtypes", help="comma-separated input dtypes (bf16,fp16; default all)")
    w.add_argument("--bucket", action="append", metavar="NAME", help="only this bucket")
    w.add_argument("--variants", choices=("core", "all"), default="core",
                   help="core: the layout each op's calls use; all: every layout, output "
                        "dtype and bias form, with the direct-store kernels of unaligned widths")
    w.add_argument("--config", action="append", metavar="FILE",
                   help="user config to add first (repeatable)")
    w.add_argument("--aot-dir", metavar="DIR",
                   help="export each kernel as a shared library here (what DETGEMM_CUTE_AOT_DIR "
                        "points later processes to); cached ones are loaded, not rebuilt")
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    w.add_argument("--jobs", type=int, default=1,
                   help="compile in this many processes into the AOT cache first (default 1)")
    w.set_defaults(func=cmd_warmup)

    from .tune.command import add_arguments as tune_arguments

    t = sub.add_parser("tune", help="time candidate buckets on this GPU and write a tuned "
                                    "table (a YAML layer)")
    tune_arguments(t)
    t.set_defaults(func=cmd_tune)

    from .tune.fit_command import add_arguments as fit_arguments

    f = sub.add_parser("tune-fit", help="turn tune records into buckets with alternatives "
                                        "(per-shape choice by a fitted cost model; no GPU)")
    fit_arguments(f)
    f.set_defaults(func=cmd_tune_fit)

    d = sub.add_parser("demo", help="show determinism and batch invariance on this GPU")
    d.add_argument("--quick", action="store_true")
    d.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    d.set_defaults(func=cmd_demo)

    v = sub.add_parser("verify", help="check a GPU result against the bit-exact CPU reference")
    v.add_argument("x", help="input [.., K] saved with torch.save")
    v.add_argument("weight", help="weight [N, K] saved with torch.save")
    v.add_argument("result", help="the result to check, saved with torch.save")
    v.add_argument("--bias", help="bias [N] saved with torch.save")
    v.set_defaults(func=cmd_verify)

    from .fuzz import add_arguments as fuzz_arguments
    from .fuzz import command as cmd_fuzz

    z = sub.add_parser("fuzz", help="random problems on the GPU vs the CPU reference, bit "
                                    "for bit (or the reference vs itself: --device cpu)")
    fuzz_arguments(z)
    z.set_defaults(func=cmd_fuzz)

    b = sub.add_parser("bench", help="benchmark against cuBLAS (source tree only)")
    b.add_argument("rest", nargs=argparse.REMAINDER,
                   help="arguments for bench/bench_gemm.py (`bench --help` lists them)")
    b.set_defaults(func=cmd_bench)
    return p


def _err(msg: str) -> None:
    for line in msg.splitlines():
        print(f"detgemm-cute: {line}", file=sys.stderr)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["bench"]:
            # Everything after `bench` belongs to the script (its --help included).
            args = argparse.Namespace(func=cmd_bench, rest=argv[1:])
        else:
            args = _parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error (argparse printed it)
        return e.code if isinstance(e.code, int) else 1
    try:
        return int(args.func(args, print) or 0)
    except _USER_ERRORS as e:
        _err(str(e))
        return 1
    except ValueError as e:  # an unknown arch or a bad dimension given to audit/explain
        if args.func not in (cmd_audit, cmd_explain):
            raise
        _err(str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
