"""Time grouped-kernel candidates on mixture-of-experts layers of public models (needs an
SM90 GPU): the data the ``op: grouped`` and ``op: grouped_k`` buckets of configs/sm90.yaml
are fitted from (`fit_grouped.py`).

For every (model, token count, projection, pass) the candidates (`CANDIDATES`, declared as
the alternatives of one user bucket and forced by name), `torch._grouped_mm`, a per-expert
`torch.mm` loop and that loop under cuBLASLt with split-K off run on the same inputs in one
`time_units` call (CUDA graphs, interleaved rounds, medians). Passes (`moe_layers.py`): the
forward (expert weights as nn.Linear's [E, N, K], passed as the [E, K, N] view) and dX
(autograd's grouped call with the row-major [E, N, K] weight); both run the grouped kernel,
whose table is keyed by (ceil(T / E), N, K) of the pass's own GEMM, which a row records as
m_avg, N, K. The dw pass (a = x^T, b = dY: the 2-D x 2-D form) runs the grouped-K kernel
with its own candidates (`CANDIDATES_K`); its table is keyed by (K, N, ceil(T / E)), which a
row records as `table_key`. Every candidate's output must have the bits of the first one, and
the largest group's rows (dw: entry) the bits of `dg.mm` on them.

Problems run in priority order (issue 41's layers first, then every model at one token count
before the next count), so a run cut by --max-seconds still spans every model.

    python bench/sweep_grouped.py --out "$OUT/grouped_sweep.json" --jobs 14 --max-seconds 270
    python bench/sweep_grouped.py ... --only 128x256x64_c1x2_s4_p,128x192x64_c1x2_s5_p_pingpong

`--only` keeps the named candidates: exact bucket names without the `gcand.` (fwd, dx) or
`gkcand.` (dw) prefix, unlike `sweep_bmm.py --only`, which takes substrings.
"""

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute import dispatch, grouped, grouped_k
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.timing import QUICK_PLAN, TimingPlan, n_sets_for
from moe_layers import (MODEL_BY_NAME, MODELS, group_bits_equal_mm, layer_dims, lt_loop,
                        make_set, set_bytes, torch_grouped, torch_loop)
from sweep_common import candidate_layer, no_gpu, time_candidates, write_records

# Token counts, in the order they are run (the time box cuts the last ones).
TOKENS = (1024, 4096, 256, 16384, 2048, 128, 8192, 512)
# Issue 41's layers (model, tokens): run first.
PRIORITY = (("mixtral-8x7b/unfused", 512), ("mixtral-8x7b/unfused", 4096),
            ("narrow-128e", 1024), ("qwen1.5-moe-a2.7b", 2048), ("deepseek-v2-lite", 8192))
# Candidates of the 2026-11-27 sweep. Kept from the two sweeps before (records
# grouped_sweep*.json.gz): the 13 kernels within 2% of a problem's best on more than 10 of
# their 171 / 158 problems, or a table's pick. New: clusters along M, which multicast the
# expert's weight tile (each group's row tiles padded to a multiple of CM).
CANDIDATES = [  # persistent, cooperative: tile, cluster [CM, CN], stages
    {"tile": t, "cluster": c, "stages": s, "persistent": True} for t, c, s in (
        ((64, 256, 64), (1, 1), 5), ((64, 256, 64), (1, 2), 5), ((64, 128, 64), (1, 1), 8),
        ((128, 256, 64), (1, 2), 4), ((128, 256, 64), (1, 1), 4), ((128, 192, 64), (1, 2), 4),
        ((128, 128, 64), (1, 2), 6), ((128, 256, 64), (1, 4), 4), ((128, 224, 64), (1, 2), 4),
        ((128, 160, 64), (1, 2), 5),
        ((128, 256, 64), (2, 1), 4), ((128, 256, 64), (2, 2), 4), ((128, 192, 64), (2, 1), 4),
        ((128, 224, 64), (2, 1), 4), ((128, 160, 64), (2, 1), 5), ((256, 128, 64), (2, 1), 4),
        ((128, 128, 64), (2, 2), 6), ((64, 256, 64), (2, 1), 5), ((128, 256, 64), (4, 1), 4))
] + [  # ping-pong consumers (one warpgroup per tile): the dense fwd table's ping-pong tiles;
    # the last two since their WGMMAs no longer serialize (C7518: 2026-11-29)
    {"tile": t, "cluster": c, "stages": s, "persistent": True, "pingpong": True}
    for t, c, s in (((128, 128, 64), (1, 2), 6), ((128, 144, 64), (1, 2), 5),
                    ((64, 256, 64), (1, 2), 5), ((128, 192, 64), (2, 1), 5),
                    ((128, 128, 64), (2, 2), 6), ((128, 192, 64), (1, 2), 5),
                    ((128, 160, 64), (1, 2), 5))]
# The grouped-K kernel (dw pass): persistent, cooperative; clusters of either shape.
CANDIDATES_K = [
    {"tile": t, "cluster": c, "stages": s, "persistent": True} for t, c, s in (
        ((128, 256, 64), (1, 2), 4), ((128, 256, 64), (1, 1), 4), ((128, 256, 64), (2, 1), 4),
        ((128, 128, 64), (1, 1), 6), ((128, 128, 64), (1, 2), 6), ((128, 192, 64), (1, 2), 4),
        ((64, 256, 64), (1, 1), 5), ((256, 128, 64), (1, 2), 4))]
PEERS = ("torch_grouped_mm", "torch_loop", "lt_loop")


def problems(models, tokens, passes):
    """(model, tokens, projection, pass) in run order: PRIORITY first, then each token count
    over every model; no problem twice."""
    order = [(MODEL_BY_NAME[m], t) for m, t in PRIORITY
             if m in {x[0] for x in models} and t in tokens]
    order += [(m, t) for t in tokens for m in models]
    seen = set()
    for model, t in order:
        for proj, _k, _n in layer_dims(model):
            for pass_ in passes:
                key = (model[0], t, proj, pass_)
                if key not in seen:
                    seen.add(key)
                    yield model, t, proj, pass_


def gemm_kn(model, proj, pass_) -> tuple[int, int]:
    """(K, N) of the pass's own GEMM (dx swaps the layer's K and N)."""
    k, n = next((k, n) for p, k, n in layer_dims(model) if p == proj)
    return (n, k) if pass_ == "dx" else (k, n)


def forced(name):
    def run(s):
        with dg.force_bucket(name):
            return dg.grouped_mm(s[0], s[1], s[2])
    return run


def check_bits(names, s) -> bool:
    """All candidates give the first one's bits, and the largest group's rows (dw: entry)
    are dg.mm's."""
    outs = [forced(nm)(s) for nm in names]
    same = all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    return same and group_bits_equal_mm(outs[0], s)


def prebuild(names, sample_sets, jobs: int, log=print) -> None:
    """Compile every candidate's kernel for the weight layouts of `sample_sets` in `jobs`
    processes (into the AOT cache; a temporary one when it is off)."""
    from detgemm_cute import aot_cache
    from detgemm_cute.parallel_compile import compile_all

    keys = [(grouped_k.kernel_key if s[1].dim() == 2 else grouped.kernel_key)(
                dispatch.bucket_by_name("sm90", nm), s[0], s[1], s[0].dtype)
            for nm in names for s in sample_sets if _serves(nm, s)]
    directory = aot_cache.cache_dir()
    if directory is None:
        directory = tempfile.mkdtemp(prefix="detgemm-sweep-aot-")
        os.environ[aot_cache.ENV_VAR] = directory
    keys = list(dict.fromkeys(keys))
    log(f"compiling {len(keys)} kernels in {jobs} processes into {directory}")
    for key, why in compile_all(keys, directory, jobs).items():
        log(f"could not prebuild {key.tile} c{key.cluster}: {why} (compiled on first use)")


def _serves(name, s) -> bool:
    """Whether candidate `name` runs the form of set `s` (grouped_k: the 2-D x 2-D one)."""
    return (dispatch.bucket_by_name("sm90", name).op == "grouped_k") == (s[1].dim() == 2)


def candidate_fields(names) -> dict:
    """{candidate name: its kernel fields}, as the registry holds them (for the fit)."""
    out = {}
    for nm in names:
        b = dispatch.bucket_by_name("sm90", nm)
        out[nm] = {"tile": list(b.tile), "cluster": list(b.cluster), "stages": b.stages,
                   "persistent": b.persistent, "pingpong": b.pingpong}
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="every third model, two token counts")
    p.add_argument("--models", default="", help="comma-separated model names (default: all)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--passes", default="fwd,dx", help="fwd, dx and/or dw")
    p.add_argument("--candidates", type=int, default=len(CANDIDATES),
                   help="the first N candidates only")
    p.add_argument("--only", default="",
                   help="comma-separated candidates to keep, by exact name without the "
                        "prefix (e.g. 128x192x64_c1x2_s5_p_pingpong); default: all")
    p.add_argument("--jobs", type=int, default=0, help="prebuild the kernels in N processes")
    p.add_argument("--max-seconds", type=float, default=480.0)
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODEL_BY_NAME]
    if unknown:
        p.error(f"--models: unknown {unknown}; known: {', '.join(MODEL_BY_NAME)}")
    args.models = [MODEL_BY_NAME[m] for m in names] or list(MODELS)
    args.tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    args.passes = tuple(x for x in args.passes.split(",") if x)
    if not set(args.passes) <= {"fwd", "dx", "dw"} or not args.passes:
        p.error(f"--passes takes fwd, dx and/or dw, got {','.join(args.passes)}")
    if args.quick:
        args.models, args.tokens = args.models[::3], args.tokens[:2]
    if not 1 <= args.candidates <= len(CANDIDATES):
        p.error(f"--candidates must be 1..{len(CANDIDATES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if no_gpu():
        return 1
    t0 = time.time()
    by_pass = {}
    with tempfile.TemporaryDirectory() as tmp:
        if {"fwd", "dx"} & set(args.passes):
            by_pass["fwd"] = by_pass["dx"] = candidate_layer(
                Path(tmp) / "candidates.yaml", "grouped", "gcand", CANDIDATES[:args.candidates])
        if "dw" in args.passes:
            by_pass["dw"] = candidate_layer(Path(tmp) / "candidates_k.yaml", "grouped_k",
                                            "gkcand", CANDIDATES_K[:args.candidates])
    if args.only:
        keep = set(args.only.split(","))
        known = {nm.split(".", 1)[1] for v in by_pass.values() for nm in v}
        by_pass = {p: [nm for nm in v if nm.split(".", 1)[1] in keep] for p, v in by_pass.items()}
        if keep - known or not all(by_pass.values()):
            print(f"--only: unknown {sorted(keep - known)} or no candidate of a pass left; "
                  f"known: {', '.join(sorted(known))}", file=sys.stderr)
            return 2
    names = list(dict.fromkeys(nm for p in args.passes for nm in by_pass[p]))
    plan = TimingPlan(target_ms=0.5, reps=7, min_reps=3, budget_ms=20.0, warm_rounds=1,
                      warm_replays=1, est_min_ms=0.3)
    gen = torch.Generator().manual_seed(0)
    if args.jobs > 0:
        prebuild(names, [make_set(p, 2, 16, 64, 64, gen) for p in args.passes], args.jobs)
    l2 = gpu.l2_bytes()
    cap = torch.cuda.Stream()
    rows = []
    for model, tokens, proj, pass_ in problems(args.models, args.tokens, args.passes):
        if time.time() - t0 > args.max_seconds:
            print(f"time box reached after {len(rows)} problems", flush=True)
            break
        name, experts, topk = model[:3]
        k, n = gemm_kn(model, proj, pass_)
        lk, ln = (n, k) if pass_ == "dx" else (k, n)  # the layer's K -> N
        n_rows = tokens * topk
        count = min(4, n_sets_for(set_bytes(pass_, experts, n_rows, lk, ln), l2, QUICK_PLAN))
        sets = [make_set(pass_, experts, n_rows, lk, ln, gen) for _ in range(count)]
        fns = {nm: forced(nm) for nm in by_pass[pass_]}
        fns.update(torch_grouped_mm=torch_grouped, torch_loop=torch_loop, lt_loop=lt_loop)
        us, errors, best = time_candidates(fns, sets, plan, cap, by_pass[pass_])
        ok = check_bits(by_pass[pass_], sets[0])
        row = {"model": name, "experts": experts, "topk": topk, "tokens": tokens,
               "rows": n_rows, "proj": proj, "pass": pass_, "K": k, "N": n,
               "m_avg": math.ceil(n_rows / experts), "us": us, "bits_ok": ok,
               "errors": errors}
        if pass_ == "dw":
            row["table_key"] = [k, n, row["m_avg"]]
        peer = min((v for nm, v in us.items() if v and nm in PEERS), default=None)
        print(f"{name:22s} T={tokens:6d} {proj:4s} {pass_:3s} m_avg={row['m_avg']:5d} K={k:5d} "
              f"N={n:5d} best {best[1].split('.', 1)[1]:24s} {best[0]:8.1f} us  torch best "
              + (f"{peer:8.1f}  {peer / best[0]:.2f}x" if peer else "-") + f"  bits {ok}",
              flush=True)
        rows.append(row)
        del sets
        # a run stopped from outside keeps what it measured
        write_records(args.out, names, rows, candidate_fields(names),
                      seconds=round(time.time() - t0, 1))
    write_records(args.out, names, rows, candidate_fields(names),
                  seconds=round(time.time() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
