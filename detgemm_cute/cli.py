"""`detgemm-cute`: audit the dispatch tables, explain a choice, compile, warm up, tune, demo,
verify, bench.

Every argument is checked before any work starts (`cli_args`: one `--arch` spelling rule
for every subcommand, bucket base names, comma lists). A user mistake (a bad argument or
config file, an unknown bucket, an unreadable input) ends with a one-line message on stderr
and a non-zero exit status, never a traceback; `DETGEMM_CUTE_TRACEBACK=1` shows the
traceback behind such a message. Usage errors exit 2 (argparse), other failures 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from . import registry as reg
from . import tables
from .cli_args import (ARCH_HELP, ArgError, arch_type, argparse_type, comma_list, family_type,
                       positive_int, resolve_buckets, with_target)
from .tables import USER_ERRORS as _USER_ERRORS

_BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_gemm.py"
# Exceptions that carry a message meant for the user (checked input, files, config).
_MESSAGE_ERRORS = _USER_ERRORS + (ValueError, TypeError, OSError, RuntimeError)


def cmd_audit(args, out) -> int:
    return tables.audit(args.arch, args.config or [], out, _err)


def cmd_explain(args, out) -> int:
    out(tables.explain(args.op, args.dtype, args.arch, args.M, args.N, args.K,
                       args.config or []))
    return 0


def _layers_and_buckets(args, family: str):
    """Add the --config layers (to `family`'s table), then resolve --bucket names."""
    for p in args.config or []:
        reg.add_config(p, arch=family)
    if not args.bucket:
        return None
    return resolve_buckets(args.bucket, reg.get_registry(family).buckets, family)


def cmd_compile(args, out) -> int:
    arch = with_target(args.arch, args.target)
    names = _layers_and_buckets(args, arch.family)
    from .aot import compile_buckets

    return compile_buckets(arch.target, names, out=out, variants=args.variants, jobs=args.jobs,
                           ptxas=args.ptxas)


def cmd_warmup(args, out) -> int:
    import time

    from . import aot
    from .tune.progress import Progress

    arch = with_target(args.arch, args.target)
    names = _layers_and_buckets(args, arch.family)
    selection = dict(ops=args.ops, dtypes=args.dtypes, bucket_names=names,
                     variants=args.variants)
    keys = aot.warmup_keys(arch.target, **selection)  # ValueError when nothing is selected
    t0 = time.time()
    aot_dir = args.aot_dir
    if args.jobs > 1:
        aot_dir = _compile_in_parallel(args, [k for _, k in keys], out)
    bar = None if args.quiet else Progress(len(keys), "kernels")
    n = aot.warmup(arch.target, **selection, aot_dir=aot_dir,
                   progress=None if bar is None else lambda i, _n, label, _s: bar.update(i, label))
    where = f", libraries in {args.aot_dir}" if args.aot_dir else ""
    out(f"warmup: {n} kernels ready for {arch.target} ({arch.family} family) in "
        f"{time.time() - t0:.1f}s{where}")
    return 0


def _compile_in_parallel(args, keys, out):
    """warmup --jobs N: compile the kernels in N processes into the AOT cache first (warmup
    then loads them); returns the directory used."""
    from . import aot_cache
    from .parallel_compile import compile_all
    from .tune.progress import Progress

    directory = args.aot_dir or aot_cache.cache_dir()
    if directory is None:
        out("warmup: the AOT cache is off, so --jobs cannot share kernels; compiling here")
        return None
    bar = None if args.quiet else Progress(len(keys), f"kernels in {args.jobs} processes")
    failed = compile_all(keys, directory, args.jobs, progress=None if bar is None else
                         lambda i, _n, label, _s: bar.update(i, label))
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


def _load_tensor(path: str, what: str):
    """A tensor saved with torch.save, or ArgError naming the file."""
    import torch

    if not Path(path).is_file():
        raise ArgError(f"{what} {path}: no such file")
    try:
        t = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise ArgError(f"{what} {path}: not a tensor file written by torch.save, or it holds "
                       f"objects other than tensors ({type(e).__name__})") from None
    if not isinstance(t, torch.Tensor):
        raise ArgError(f"{what} {path}: holds a {type(t).__name__}, not a tensor")
    return t


def cmd_verify(args, out) -> int:
    from . import reference

    x, w = _load_tensor(args.x, "x"), _load_tensor(args.weight, "weight")
    y = _load_tensor(args.result, "result")
    b = _load_tensor(args.bias, "--bias") if args.bias else None
    r = reference.verify(x, w, y, b)
    out(str(r))
    return 0 if r.ok else 1


def cmd_demo(args, out) -> int:
    from .demo import main as demo_main

    return demo_main((["--quick"] if args.quick else []) + (["--audit"] if args.audit else []))


def cmd_bench(args, out) -> int:
    if not _BENCH.is_file():
        out("bench/ ships with the source tree (git checkout of detgemm_cute), not with the "
            "installed package; run `python bench/bench_gemm.py` there.")
        return 1
    spec = importlib.util.spec_from_file_location("detgemm_cute_bench_gemm", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        return mod.main(list(args.rest), prog="detgemm-cute bench")
    except SystemExit as e:  # the script's own --help or usage error
        return e.code if isinstance(e.code, int) else 1


def _arch_arguments(p, default: str) -> None:
    p.add_argument("--arch", type=arch_type, default=default,
                   help=f"{ARCH_HELP}; sm_86, sm_89, ...: the SM80 family built for that GPU "
                        f"(default {default})")
    p.add_argument("--target", metavar="SM",
                   help="the GPU an SM80-family build is for (default sm_80; e.g. sm_90 for an "
                        "H100 running DETGEMM_CUTE_FAMILY=sm80)")


def _add_compile(sub) -> None:
    c = sub.add_parser("compile", help="compile every bucket's kernels ahead of time (no GPU)")
    _arch_arguments(c, "sm90")
    c.add_argument("--bucket", action="append", metavar="NAME",
                   help="only this bucket (repeatable; a base name such as fwd_prefill selects "
                        "all its alternatives; default: all)")
    c.add_argument("--config", action="append", metavar="FILE",
                   help="user config to add before compiling (repeatable)")
    c.add_argument("--variants", choices=("core", "all"), default="core",
                   help="core: one key per bucket and dtype plus bf16 [K,N]->fp32 (default); "
                        "all: every dtype x output x layout x bias combination")
    c.add_argument("--jobs", type=positive_int, default=1,
                   help="compile in this many processes (default 1; each takes a CPU core "
                        "and about 1 GB of memory)")
    c.add_argument("--ptxas", action="store_true",
                   help="also assemble each kernel with ptxas -v (on PATH) and print its "
                        "performance warnings (WGMMAs issued one at a time) and spills")
    c.set_defaults(func=cmd_compile)


def _add_warmup(sub) -> None:
    w = sub.add_parser("warmup", help="compile chosen buckets now (and export them for "
                                      "later processes with --aot-dir)")
    _arch_arguments(w, "sm90")
    w.add_argument("--ops", type=_list_type(reg.OPS),
                   help=f"comma-separated ops ({','.join(reg.OPS)}; default all)")
    w.add_argument("--dtypes", type=_list_type(reg.DTYPES),
                   help=f"comma-separated input dtypes ({','.join(reg.DTYPES)}; default all)")
    w.add_argument("--bucket", action="append", metavar="NAME",
                   help="only this bucket (repeatable; a base name selects its alternatives)")
    w.add_argument("--variants", choices=("core", "all"), default="core",
                   help="core: the layout each op's calls use; all: every layout, output "
                        "dtype and bias form, with the direct-store kernels of unaligned widths")
    w.add_argument("--config", action="append", metavar="FILE",
                   help="user config to add first (repeatable)")
    w.add_argument("--aot-dir", metavar="DIR",
                   help="export each kernel as a shared library here (what DETGEMM_CUTE_AOT_DIR "
                        "points later processes to); cached ones are loaded, not rebuilt")
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    w.add_argument("--jobs", type=positive_int, default=1,
                   help="compile in this many processes into the AOT cache first (default 1)")
    w.set_defaults(func=cmd_warmup)


def _list_type(allowed):
    return argparse_type(lambda text: comma_list(text, allowed), "list")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="detgemm-cute",
                                description="Deterministic, batch-invariant GEMMs: tools.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    a = sub.add_parser("audit", help="validate the dispatch tables and print them")
    a.add_argument("--arch", type=family_type, help=f"only this {ARCH_HELP} (default: every "
                                                    f"kernel family)")
    a.add_argument("--config", action="append", metavar="FILE",
                   help="also validate this user config as a layer (repeatable)")
    a.set_defaults(func=cmd_audit)

    e = sub.add_parser("explain", help="which bucket serves a problem, and why")
    e.add_argument("--op", default="fwd", choices=reg.OPS)
    e.add_argument("--dtype", default="bf16", choices=reg.DTYPES)
    e.add_argument("--arch", type=family_type, default="sm90", help=f"{ARCH_HELP} (default sm90)")
    e.add_argument("--config", action="append", metavar="FILE",
                   help="user config layered on top (repeatable; the last is highest)")
    for dim in "MNK":
        e.add_argument(dim, type=int)
    e.set_defaults(func=cmd_explain)

    _add_compile(sub)
    _add_warmup(sub)

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

    d = sub.add_parser("demo", help="the contract, shown on this machine (GPU kernels, or the "
                                    "bit-exact CPU reference)")
    d.add_argument("--quick", action="store_true", help="one shape only (GPU)")
    d.add_argument("--audit", action="store_true",
                   help="also print the full audit of the dispatch tables")
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
    for line in str(msg).splitlines() or [""]:
        print(f"detgemm-cute: {line}", file=sys.stderr)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["bench"]:
            # Everything after `bench` belongs to the script (its --help included).
            args = argparse.Namespace(func=cmd_bench, rest=argv[1:], command="bench")
        else:
            args = _parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error (argparse printed it)
        return e.code if isinstance(e.code, int) else 1
    try:
        return int(args.func(args, print) or 0)
    except KeyboardInterrupt:
        _err(f"{args.command}: interrupted")
        return 130
    except _MESSAGE_ERRORS as e:
        if os.environ.get("DETGEMM_CUTE_TRACEBACK"):
            raise
        text = str(e) or type(e).__name__
        prefix = "" if text.startswith(f"{args.command}:") else f"{args.command}: "
        _err(prefix + text)
        return 1


if __name__ == "__main__":
    sys.exit(main())
