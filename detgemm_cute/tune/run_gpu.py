"""The GPU part of `detgemm-cute tune`: compile in parallel, time, resume, write the layer."""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
from pathlib import Path

from . import store
from .command import log, write_json
from .progress import Progress


def _setup(args, arch, aot_dir, problems):
    """Torch, detgemm, the peers' status, the timing context."""
    import torch

    from .. import aot_cache
    from ..benchlib import peers as P
    from ..benchlib.gpu import device_meta, l2_bytes
    from . import measure

    os.environ[aot_cache.ENV_VAR] = aot_dir  # this process loads what the workers export
    meta = device_meta()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    ctx = measure.TuneContext(dtype=dtype, dtype_name=args.dtype, arch=arch, device=meta["device"],
                      l2=l2_bytes(), cap_stream=torch.cuda.Stream(), dg=P.detgemm_api(),
                              plan=measure.TUNE_PLAN, log=log)
    ctx.lt_reason = P.lt_nosplit_status()
    if ctx.lt_reason:
        log(f"cuBLASLt split-K-off peer not run: {ctx.lt_reason}")
    if any(p.op == "dw" for p in problems):
        ctx.dw_reason = P.mm_out_dtype_status()
        if ctx.dw_reason:
            log(ctx.dw_reason)
    torch.manual_seed(args.seed)
    return ctx, meta


def _header(meta, args, arch) -> str:
    cmd = "detgemm-cute tune " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["tune"] else
                                          sys.argv[1:])
    return "\n".join([
        f"Tuned by `detgemm-cute tune` on {meta['device']} ({arch}, {meta['sm_count']} SMs), "
        f"{meta['date']}, torch {meta['torch']}, CUDA {meta['cuda']}.",
        f"Command: {cmd}",
        "Each note: the measured problems in the bucket, the chosen kernel's time, its speed",
        "over cuBLAS default and over cuBLASLt with split-K off (> 1 = faster), geomean (range).",
        "Use: DETGEMM_CUTE_CONFIG=<this file> or detgemm_cute.registry.add_config(<this file>);",
        "validate: detgemm-cute audit --config <this file>.",
    ])


def _validate(path, arch, ops) -> list[str]:
    """Problems with the written layer: registry errors or (M, N, K) it does not cover."""
    from .. import registry

    try:
        f = registry.load_config(path, arch=arch)
    except registry.ConfigError as e:
        return list(e.problems)
    problems = []
    for op in ops:
        for dtype in {d for b in f.buckets if b.op == op for d in b.dtypes}:
            gaps = registry.coverage_gaps([b for b in f.buckets if b.op == op
                                           and dtype in b.dtypes])
            if gaps:
                problems.append(f"op {op} dtype {dtype}: {len(gaps)} uncovered boxes, e.g. "
                                f"{gaps[0]}")
    return problems


def _check_keys_once(problem, keys, seen_ops) -> None:
    """Warn (once per op) when the kernels the calls compiled are not the predicted keys."""
    from .. import compile as kcompile

    if problem.op in seen_ops:
        return
    seen_ops.add(problem.op)
    have = set(kcompile.cached_keys())
    missing = [k for k in keys if k not in have]
    if missing:
        log(f"WARNING: op {problem.op}: {len(missing)} of {len(keys)} predicted kernel keys were "
            f"not used by the calls (e.g. {missing[0]}); the calls compiled their own in this "
            f"process, so --jobs does not help this op (benchlib.peers.detgemm_layout is out "
            f"of date with gemm.py)")
    else:
        log(f"op {problem.op}: the calls used the predicted kernel keys (loaded from the cache)")


def _note_unbuildable(op, cands, keys, rec, dead) -> None:
    """Candidates whose kernel could not be built (an error at first call and no compiled
    kernel): left out of the later problems instead of failing to compile again each time."""
    from .. import compile as kcompile

    have = set(kcompile.cached_keys())
    for c, k in zip(cands, keys):
        why = rec["errors"].get(c.name)
        if why and c.name not in rec["bad_bits"] and k not in have and (op, c.name) not in dead:
            dead[(op, c.name)] = why
            log(f"{op} candidate {c.name} could not be built ({why[:200]}); left out from now on")


def next_problem_seconds(durations: list) -> float:
    """What the time box expects the next problem to take: the last problem's time, but not
    the first one's, which carries the run's compiles (waiting for the compile workers, or
    compiling in this process)."""
    return durations[-1] if len(durations) > 1 else 0.0


def tune_on_gpu(args, problems, plan, keys, arch, gpu_arch, jobs, aot_dir, out,
                rejected=None) -> int:
    import torch

    from .. import aot_cache
    from ..parallel_compile import CompilePool
    from .measure import FatalGpuError, measure_problem
    from .summary import (build_tables, check_report, compare, render_check, render_compare,
                          render_tables)
    from .table import buckets_yaml

    t_start = time.time()
    ctx, meta = _setup(args, arch, aot_dir, problems)
    log(f"{meta['device']} ({arch}, {gpu_arch}), torch {meta['torch']}, {len(problems)} "
        f"problems, dtype {args.dtype}, kernel cache {aot_dir}, {jobs} compile jobs")
    done = store.latest(store.load(args.resume))
    records, todo = [], []
    for p in problems:
        key = (meta["device"], arch, args.dtype, p.op, p.m, p.k, p.n)
        rec = done.get(key)
        if rec is not None and store.covers(rec, [c.name for c in plan[p]]):
            records.append(rec)
        else:
            todo.append(p)
    if records:
        log(f"resume: {len(records)} problems already measured in {args.resume}")

    pool = None
    if jobs > 1 and todo:
        pool = CompilePool(jobs, aot_dir, log)
        queued = sum(pool.submit(keys[p]) for p in todo)
        log(f"compiling {queued} kernels in {jobs} processes (cached: "
            f"{pool.stats()['cached']})")
    bar = Progress(len(todo), "problems")
    seen_ops, durations, stopped, worker_failures, dead = set(), [], None, {}, {}
    try:
        with torch.no_grad():
            for i, p in enumerate(todo):
                elapsed = time.time() - t_start
                if (args.max_seconds is not None
                        and elapsed + 1.5 * next_problem_seconds(durations) > args.max_seconds):
                    stopped = f"time box ({args.max_seconds:g} s) reached: {i} of {len(todo)} " \
                              f"problems timed in this run"
                    break
                t0 = time.time()
                cands = [c for c in plan[p] if (p.op, c.name) not in dead or c is plan[p][0]]
                if pool is not None:
                    # A kernel a worker could not build is compiled here on first use (its
                    # error, if it is the kernel's own, is then recorded for that candidate).
                    left = (None if args.max_seconds is None
                            else max(1.0, args.max_seconds - (time.time() - t_start)))
                    failed = pool.wait(keys[p], timeout=left)
                    if any(why == "not finished in time" for why in failed.values()):
                        stopped = (f"time box ({args.max_seconds:g} s) reached while kernels "
                                   f"were compiling: {i} of {len(todo)} problems timed")
                        break
                    for k, why in failed.items():
                        if k not in worker_failures:
                            worker_failures[k] = why
                            log(f"worker could not build {k.tile} c{k.cluster} s{k.stages}"
                                f"{' p' if k.persistent else ''}: {why}")
                    if i == 0 and keys[p] and len(failed) == len(set(keys[p])):
                        log("WARNING: the compile workers built none of the first problem's "
                            "kernels; compiling in this process from now on")
                        pool.close(cancel=True)
                        pool = None
                    elif i == 0 and keys[p] and keys[p][0] not in failed:
                        if aot_cache.load(keys[p][0], Path(aot_dir)) is None:
                            log("WARNING: a kernel compiled by a worker could not be loaded "
                                "from the cache; kernels will be compiled in this process")
                try:
                    rec = measure_problem(p, cands, ctx)
                except FatalGpuError as e:
                    stopped = (f"stopped: {e}. The CUDA context is unusable; run again with "
                               f"--resume and --skip-candidate for that configuration")
                    break
                except Exception as e:  # noqa: BLE001 - one problem must not end the run
                    log(f"{p.text}: failed: {type(e).__name__}: {e}")
                    try:
                        torch.cuda.synchronize()
                    except Exception as e2:  # noqa: BLE001
                        stopped = f"stopped after {p.text}: the GPU is unusable ({e2})"
                        break
                    continue
                _check_keys_once(p, [k for c, k in zip(plan[p], keys[p]) if c.name in
                                     rec["cands"]], seen_ops)
                _note_unbuildable(p.op, plan[p], keys[p], rec, dead)
                store.append(args.resume, rec)
                records.append(rec)
                durations.append(time.time() - t0)
                best = min(rec["cands"], key=rec["cands"].get) if rec["cands"] else None
                bar.update(i + 1, f"{p.text} best {best} ({durations[-1]:.1f}s)")
                torch.cuda.empty_cache()
    finally:
        if pool is not None:
            st = pool.stats()
            pool.close(cancel=True)
            log(f"compile pool: {st}")
        elif worker_failures:
            log(f"compile workers failed on {len(worker_failures)} kernels")
    if stopped:
        log(stopped)

    ops = list(dict.fromkeys(p.op for p in problems))
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    tables = build_tables(records, ops, meta["device"], date, args.tolerance, args.max_buckets)
    comp = compare(records, tables)
    checked = check_report(records, args.check_threshold / 100.0) if args.check else None
    for line in render_tables(tables) + render_compare(comp):
        out(line)
    for op, boxes in tables.items():
        low = min(p.m for b in boxes for p in b.points)
        if low > 1:
            log(f"NOTE: op {op}: no problem with GEMM M < {low} was measured; the bucket "
                f"covering M 1..{low - 1} was chosen from larger M (tune decode and prefill "
                f"problems together, e.g. --preset decode-models prefill-models, or one "
                f"--resume file, so each M range is chosen from its own measurements)")
    if checked is not None:
        for line in render_check(checked, args.check_threshold / 100.0, len(records)):
            out(line)

    rc = 0
    out_path = args.out
    if out_path is None and not args.check:
        from ..benchlib.fmt import device_slug

        out_path = f"tuned_{device_slug(meta['device'])}_{args.dtype}.yaml"
    if out_path and tables:
        from .summary import all_fields

        dtypes = tuple((args.bucket_dtypes or args.dtype).split(","))
        text = buckets_yaml(arch, {(op, dtypes): boxes for op, boxes in tables.items()},
                            all_fields(records), _header(meta, args, arch))
        Path(out_path).write_text(text)
        problems_found = _validate(out_path, arch, list(tables))
        if problems_found:
            rc = 1
            log(f"ERROR: the written layer {out_path} does not validate:")
            for line in problems_found:
                log("  " + line)
        else:
            log(f"wrote {out_path}: {sum(len(b) for b in tables.values())} buckets, covering "
                f"every (M, N, K) for {', '.join(tables)} ({', '.join(dtypes)}); check it with "
                f"`detgemm-cute audit --config {out_path}`")
    elif not tables:
        log("nothing measured: no table written")
        rc = 1
    if args.json:
        write_json(args.json, {
            "meta": {**meta, "arch": arch, "gpu_arch": gpu_arch, "dtype": args.dtype,
                     "unbuildable_candidates": {f"{o} {n}": w for (o, n), w in dead.items()},
                     "jobs": jobs, "aot_dir": aot_dir, "stopped": stopped,
                     "rejected_candidates": rejected, "elapsed_s": round(time.time() - t_start, 1),
                     "tolerance": args.tolerance, "max_buckets": args.max_buckets},
            "records": records,
            "tables": {op: [{"ranges": b.ranges, "choice": b.choice, "note": b.note,
                             "points": len(b.points)} for b in boxes]
                       for op, boxes in tables.items()},
            "compare": comp, "check": checked})
        log(f"wrote {args.json}")
    log(f"done in {time.time() - t_start:.0f} s")
    return rc
