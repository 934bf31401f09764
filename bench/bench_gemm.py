"""GEMM benchmark: detgemm_cute against cuBLAS (default, PEDANTIC, cuBLASLt with split-K off).

A thin script over `detgemm_cute.benchlib` (timing, peers, suites, report), which
`detgemm-cute tune` uses too. Per problem (op, M, K, N) of a suite: fresh inputs, every peer's
result checked against cuBLAS and compared bit for bit with detgemm's, then all peers timed
as CUDA graphs, interleaved. See bench/README.md.

Usage (on a GPU machine, from the repository root):
    python bench/bench_gemm.py [--suite core|quick|decode|decode-models|prefill-models]
        [--ops fwd,dx,dw] [--shapes MxKxN ... | --shapes-file F] [--limit N] [--every N]
        [--max-seconds S] [--dtype bf16|fp16] [--out DIR]

Importing this module touches no CUDA state.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from detgemm_cute.benchlib import peers as P  # noqa: E402
from detgemm_cute.benchlib import suites  # noqa: E402
from detgemm_cute.benchlib.fmt import device_slug, err_str, fmt_num, fmt_us  # noqa: E402
from detgemm_cute.benchlib.shapes import (dedup, distinct_weights, parse_ops,  # noqa: E402
                                          parse_shape, problems_for, read_shapes_file,
                                          subsample)
from detgemm_cute.benchlib.stats import summarize  # noqa: E402
from detgemm_cute.benchlib.timing import BENCH_PLAN, QUICK_PLAN  # noqa: E402

SUITE_CHOICES = suites.SUITES


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def parse_args(argv=None, prog=None):
    p = argparse.ArgumentParser(
        prog=prog,
        description="detgemm_cute vs cuBLAS (default, PEDANTIC, cuBLASLt with split-K off): "
                    "speed, correctness, same bits, batch invariance, host overhead.")
    p.add_argument("--suite", choices=SUITE_CHOICES, default="core",
                   help="; ".join(f"{k}: {v}" for k, v in suites.DESCRIPTIONS.items()))
    p.add_argument("--quick", action="store_true", help="the quick suite, fewer replays")
    p.add_argument("--ops", help="comma-separated ops (fwd,dx,dw; default: the suite's)")
    p.add_argument("--shapes", nargs="+", metavar="MxKxN",
                   help="replace the suite with these shapes (M tokens, K inputs, N outputs)")
    p.add_argument("--shapes-file", metavar="FILE",
                   help="replace the suite with the shapes in FILE ('MxKxN [label]' per line)")
    p.add_argument("--every", type=int, default=1,
                   help="keep every N-th problem of each op")
    p.add_argument("--limit", type=int, default=None, help="keep at most N problems")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new problem after this many seconds (report what was run; "
                        "SIGTERM, e.g. from `timeout`, also stops after the current problem)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"),
                   help="output directory (default: bench/results of this checkout)")
    p.add_argument("--target-ms", type=float, default=None,
                   help="aim for one graph replay to take at least this long (default 1 ms)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed graph replays per peer and problem, at most (default 20, "
                        "--quick 7; fewer for long GEMMs)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-pedantic", action="store_true", help="skip the PEDANTIC peer")
    p.add_argument("--no-cublaslt", action="store_true",
                   help="skip the cuBLASLt split-K-off peer")
    p.add_argument("--pedantic-backend", choices=("auto", "ctypes", "cupy"), default="auto",
                   help="how cublasGemmEx is called for PEDANTIC: 'ctypes' on torch's libcublas "
                        "(graph-capturable), 'cupy' (CuPy's binding; cannot be captured, so "
                        "timed by an event loop), 'auto' = ctypes checked against CuPy")
    p.add_argument("--no-probe", action="store_true", help="skip the batch-invariance probe")
    p.add_argument("--probe-limit", type=int, default=12,
                   help="probe at most this many distinct fwd weights (spread over the suite)")
    p.add_argument("--no-overhead", action="store_true", help="skip the host-overhead test")
    p.add_argument("--floor", metavar="FILE.json",
                   help="chain_floor_*.json of bench/bench_chain_floor.py (same machine, same "
                        "command): every fwd row gets its floor max(bytes / copy bandwidth, "
                        "K/16 x t_step) + launch and the ratio; an extra report section and "
                        "<base>_floor.png")
    p.add_argument("--jobs", type=int, default=1,
                   help="compile the kernels the run needs in this many processes first "
                        "(into the AOT cache; default 1: each compiles on first use)")
    args = p.parse_args(argv)
    if args.floor and not os.path.isfile(args.floor):
        p.error(f"--floor: no such file: {args.floor}")
    if args.quick and args.suite == "core":
        args.suite = "quick"
    try:
        ops = parse_ops(args.ops) if args.ops else None
        if args.shapes or args.shapes_file:
            shapes = [parse_shape(s) for s in args.shapes or []]
            if args.shapes_file:
                shapes += read_shapes_file(args.shapes_file)
            probs = dedup(problems_for(shapes, ops or ("fwd",)))
        else:
            probs = suites.suite_problems(args.suite, ops)
        args.problems = subsample(probs, args.every, args.limit, key=lambda q: q.op)
    except (ValueError, OSError) as e:
        p.error(str(e))
    args.shape_list = [(q.m, q.k, q.n) for q in args.problems]
    base = QUICK_PLAN if args.suite == "quick" else BENCH_PLAN
    args.plan = dataclasses.replace(
        base, **{k: v for k, v in (("target_ms", args.target_ms), ("reps", args.reps))
                 if v is not None})
    args.reps = args.plan.reps
    return args


def results_suffix(args, arch: str) -> str:
    suffix = "_shapes" if args.shapes or args.shapes_file else (
        "" if args.suite == "core" else f"_{args.suite}")
    if os.environ.get("DETGEMM_CUTE_FAMILY"):
        suffix += f"_{arch}-family"
    if args.dtype != "bf16":
        suffix += f"_{args.dtype}"
    return suffix


def build_context(args, arch):
    from detgemm_cute.benchlib.pedantic import make_pedantic
    from detgemm_cute.benchlib.runner import BenchContext

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    from detgemm_cute.benchlib.gpu import l2_bytes

    peers = tuple(p for p in P.PEERS if not (p == "pedantic" and args.no_pedantic)
                  and not (p == "cublaslt" and args.no_cublaslt))
    ctx = BenchContext(dtype=dtype, dtype_name=args.dtype, arch=arch, l2=l2_bytes(),
                       cap_stream=torch.cuda.Stream(), plan=args.plan, peers=peers)
    notes = []
    try:
        ctx.dg = P.detgemm_api()
    except Exception as e:  # noqa: BLE001
        ctx.dg_reason = err_str(e, 120)
        log(f"detgemm_cute import failed: {ctx.dg_reason}")
    if args.no_pedantic:
        ctx.ped_reason = "--no-pedantic"
    else:
        try:
            ctx.ped, ctx.ped_reason, ped_notes = make_pedantic(
                dtype, args.pedantic_backend, err=lambda e: err_str(e, 100))
            notes += ped_notes
        except Exception as e:  # noqa: BLE001
            ctx.ped, ctx.ped_reason = None, err_str(e, 100)
        log(f"PEDANTIC: {ctx.ped.describe() if ctx.ped else 'skipped (' + ctx.ped_reason + ')'}")
    if args.no_cublaslt:
        ctx.lt_reason = "--no-cublaslt"
    else:
        ctx.lt_reason = P.lt_nosplit_status()
        log(f"cuBLASLt no split-K: {ctx.lt_reason or 'settings accepted and restored'}")
        if ctx.lt_reason:
            notes.append(f"cuBLASLt split-K-off column skipped: {ctx.lt_reason}")
    if any(q.op == "dw" for q in args.problems):
        ctx.dw_reason = P.mm_out_dtype_status()
        if ctx.dw_reason:
            notes.append(ctx.dw_reason)
    return ctx, notes


def collect_meta(args, ctx, notes) -> dict:
    from detgemm_cute.benchlib.gpu import device_meta

    meta = device_meta()
    ped = ctx.ped
    plan = args.plan
    meta.update({
        "dtype": args.dtype, "arch": ctx.arch, "suite": args.suite if not (
            args.shapes or args.shapes_file) else "shapes",
        "peers": list(ctx.peers), "problems": len(args.problems),
        "cupy": getattr(ped, "cupy_version", None),
        "pedantic_backend": ped.backend if ped else None,
        "pedantic_lib": getattr(ped, "lib_path", None),
        "cublas_version": ped.version if ped else None,
        "pedantic_math_mode": ped.math_mode if ped else None,
        "pedantic": "ok" if ped else ctx.ped_reason,
        "cublaslt_nosplit": ctx.lt_reason or "ok",
        "allow_bf16_reduced_precision_reduction":
            getattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", None),
        "plan": dataclasses.asdict(plan), "seed": args.seed,
        "timing": (f"per problem, each peer captured as one CUDA graph of the same R calls "
                   f"(R set so the fastest peer's replay takes >= {plan.target_ms:g} ms); "
                   f"replays interleaved round-robin across peers (order rotating), "
                   f"{plan.warm_rounds} untimed rounds then up to {plan.reps} timed (at least "
                   f"{plan.min_reps}, about {plan.budget_ms:g} ms of replays per peer), each "
                   f"replay timed with CUDA events; time = median replay / R. Inputs rotate "
                   f"over n sets inside the graph, n = ceil({plan.l2_factor} x L2 / set bytes) "
                   f"capped at {plan.max_sets}, so weights are not served from L2"),
        "notes": list(notes),
    })
    return meta


def run(args, ctx, meta) -> dict:
    from detgemm_cute.benchlib.probe import run_overhead, run_probe
    from detgemm_cute.benchlib.runner import bench_problem, new_row, row_notes, stop_on_sigterm

    rows, t_start = [], time.time()
    total = len(args.problems)
    with torch.no_grad(), stop_on_sigterm() as stopped:
        for i, prob in enumerate(args.problems):
            if args.max_seconds is not None and time.time() - t_start > args.max_seconds:
                meta["notes"].append(f"time box ({args.max_seconds:g} s) reached: {i} of "
                                     f"{total} problems run")
                log(meta["notes"][-1])
                break
            if stopped:
                meta["notes"].append(f"stopped by SIGTERM: {i} of {total} problems run")
                log(meta["notes"][-1])
                break
            t0 = time.time()
            try:
                row = bench_problem(prob, ctx)
            except Exception as e:  # noqa: BLE001
                row = new_row(prob)
                row["notes"].append("row: " + err_str(e))
                torch.cuda.synchronize()
            rows.append(row)
            us = {p: (row["peers"].get(p) or {}).get("us") for p in P.PEERS}
            log(f"{i + 1}/{total} {prob.text} [{row.get('bucket')}] "
                + ", ".join(f"{P.SHORT[p]} {fmt_us(us[p])}" for p in ctx.peers) + " us; "
                + ", ".join(f"det/{P.SHORT[p]} {fmt_num(row['ratio'].get(p), '{:.2f}')}"
                            for p in ctx.peers if p != "detgemm")
                + (f" | {'; '.join(row_notes(row))}" if row_notes(row) else "")
                + f" ({time.time() - t0:.1f} s)")
        over = bool(stopped) or (args.max_seconds is not None
                                 and time.time() - t_start > args.max_seconds)
        probe = overhead = None
        fwd = [q for q in args.problems if q.op == "fwd"]
        if not args.no_probe and fwd and not over:
            log("batch-invariance probe")
            kns = distinct_weights(fwd)
            every = max(1, -(-len(kns) // max(1, args.probe_limit)))
            try:
                probe = run_probe(kns[::every][: args.probe_limit], ctx, log)
            except Exception as e:  # noqa: BLE001
                probe = []
                meta["notes"].append("probe failed: " + err_str(e))
        if not args.no_overhead and not over:
            log("host overhead")
            try:
                overhead = run_overhead(ctx)
            except Exception as e:  # noqa: BLE001
                meta["notes"].append("host overhead failed: " + err_str(e))
    meta["elapsed_s"] = round(time.time() - t_start, 1)
    if any((r["peers"].get(p) or {}).get("method") not in (None, "graph")
           for r in rows for p in P.PEERS):
        meta["notes"].append("some cells were not timed from a strict-mode CUDA graph: "
                             "see the notes column")
    return {"meta": meta, "rows": rows, "summary": summarize(rows), "probe": probe,
            "overhead": overhead}


def attach_floor(report, path: str):
    """Put every fwd row against its floor (`benchlib.floor`); returns the model."""
    from detgemm_cute.benchlib import floor

    model = floor.FloorModel.load(path)
    n = floor.attach(report["rows"], model)
    report["floor"] = {"file": os.path.basename(path), "copy_tbs": model.copy_tbs,
                       "launch_us": model.launch_us, "date": model.data.get("date"),
                       "rows": n, "summary": floor.summary(report["rows"])}
    return model


def append_floor(report, model, base: str, md: str, notes: list) -> str:
    """Add the floor section to base.md (and the returned markdown) and write
    base_floor.png."""
    from detgemm_cute.benchlib import floor

    section = floor.render(report["rows"], model)
    with open(base + ".md", "a") as f:
        f.write("\n" + section + "\n")
    note = floor.write_plot(report["rows"], base + "_floor.png",
                            f"detgemm time / floor, {report['meta'].get('device')}")
    if note:
        notes.append(note)
    return md + "\n" + section + "\n"


def main(argv=None, prog=None) -> int:
    """`prog`: the command name usage lines show (`detgemm-cute bench` from the CLI)."""
    args = parse_args(argv, prog)
    from detgemm_cute.benchlib.gpu import gpu_check

    why, arch = gpu_check()
    if why is not None:
        print(f"bench_gemm: this benchmark needs a CUDA GPU that detgemm_cute has kernels for "
              f"(SM90: H100/H200; SM80 family: A100 and newer): {why}. Nothing was run.",
              flush=True)
        return 2
    torch.manual_seed(args.seed)
    if args.jobs > 1:
        from detgemm_cute.benchlib.precompile import precompile
        from detgemm_cute.compile import gpu_arch_for

        t0 = time.time()
        try:
            precompile(args.problems, args.dtype, arch,
                       gpu_arch_for(arch, torch.cuda.get_device_capability(0)), args.jobs, log)
        except Exception as e:  # noqa: BLE001 - compiling on first use still works
            log(f"parallel compile failed ({err_str(e)}); kernels compile on first use")
        log(f"parallel compile: {time.time() - t0:.1f} s")
    ctx, notes = build_context(args, arch)
    meta = collect_meta(args, ctx, notes)
    log(f"{meta['device']} sm_{meta['capability']}, torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"detgemm {meta['detgemm']} ({arch}), dtype {args.dtype}, {len(args.problems)} "
        f"problems, peers {', '.join(ctx.peers)}")
    report = run(args, ctx, meta)

    from detgemm_cute.benchlib.report import write_report

    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"gemm_{device_slug(meta['device'])}{results_suffix(args, arch)}")
    floor_model = attach_floor(report, args.floor) if args.floor else None
    md, plot_notes = write_report(report, base, f"detgemm_cute vs cuBLAS, {meta['device']}, "
                                                f"{args.dtype}, {meta['suite']}")
    if floor_model is not None:
        md = append_floor(report, floor_model, base, md, plot_notes)
    for n in plot_notes:
        log(n)
    log(f"wrote {base}.md, {base}.json" + ("" if plot_notes else f", {base}.png")
        + f" in {meta['elapsed_s']} s")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
