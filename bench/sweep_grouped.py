"""Time grouped-kernel candidates on mixture-of-experts layers of public models (needs an
SM90 GPU): the data the ``op: grouped`` buckets of configs/sm90.yaml are chosen from.

For every (model, token count, projection) the candidates (`CANDIDATES`, declared as the
alternatives of one user bucket and forced by name), `torch._grouped_mm` and a per-expert
`torch.mm` loop run on the same inputs in one `time_units` call (CUDA graphs, interleaved
rounds, medians; the loop also under cuBLASLt with split-K off; tokens routed top-k
uniformly at random, expert weights stored as
nn.Linear's [E, N, K]). Every candidate's output must have the bits of the first one, and
one group's rows the bits of `dg.mm` on them.

    python bench/sweep_grouped.py --out bench/results/tune/grouped_sweep.json [--quick]
"""

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.peers import LtNoSplit
from detgemm_cute.benchlib.timing import QUICK_PLAN, TimingPlan, n_sets_for
from sweep_common import candidate_layer, time_candidates, write_records

BF16 = torch.bfloat16
# (name, experts, top-k, hidden, expert ffn): public configs; "/tpN": ffn sharded N ways,
# "/epN": the experts one of N expert-parallel ranks holds.
MODELS = [("mixtral-8x7b", 8, 2, 4096, 14336), ("mixtral-8x7b/tp2", 8, 2, 4096, 7168),
          ("mixtral-8x22b", 8, 2, 6144, 16384), ("qwen1.5-moe-a2.7b", 60, 4, 2048, 1408),
          ("qwen3-30b-a3b", 128, 8, 2048, 768), ("deepseek-v2-lite", 64, 6, 2048, 1408),
          ("olmoe-1b-7b", 64, 8, 2048, 1024), ("gpt-oss-20b", 32, 4, 2880, 2880),
          ("qwen3-235b-a22b/ep4", 32, 8, 4096, 1536), ("deepseek-v3/ep8", 32, 8, 7168, 2048)]
TOKENS = (64, 256, 1000, 4096, 12000)
CANDIDATES = [  # persistent, cooperative (the grouped kernel)
    {"tile": t, "cluster": c, "stages": s, "persistent": True} for t, c, s in (
        ((64, 256, 64), (1, 1), 5), ((64, 256, 64), (1, 2), 5), ((64, 128, 64), (1, 1), 8),
        ((128, 256, 64), (1, 2), 4), ((128, 256, 64), (1, 1), 4), ((128, 192, 64), (1, 2), 4),
        ((128, 128, 64), (1, 2), 6), ((128, 128, 64), (1, 1), 6), ((256, 128, 64), (1, 2), 4))]


def problems(models, tokens):
    for name, experts, topk, hidden, ffn in models:
        for t in tokens:
            for proj, k, n in (("up", hidden, 2 * ffn), ("down", ffn, hidden)):
                yield name, experts, topk, t, proj, k, n


def make_sets(experts, topk, tokens, k, n, gen, l2):
    rows = tokens * topk
    nbytes = 2 * (rows * k + experts * k * n + rows * n)
    sets = []
    for _ in range(min(4, n_sets_for(nbytes, l2, QUICK_PLAN))):
        counts = torch.bincount(torch.randint(experts, (rows,), generator=gen),
                                minlength=experts)
        offs = counts.cumsum(0).to(torch.int32).cuda()
        x = torch.randn(rows, k, device="cuda", dtype=BF16)
        w = torch.randn(experts, n, k, device="cuda", dtype=BF16).mul_(k ** -0.5)
        sets.append((x, w.transpose(1, 2), offs, counts.cumsum(0).tolist()))
    return sets


def torch_loop(s):
    x, w, _, ends = s
    out = torch.empty(x.shape[0], w.shape[2], device="cuda", dtype=BF16)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            torch.mm(x[start:end], w[g], out=out[start:end])
        start = end
    return out


def lt_loop(s):
    """The per-expert loop under cuBLASLt with split-K off (the same chain as detgemm)."""
    with LtNoSplit():
        return torch_loop(s)


def forced(name):
    def run(s):
        with dg.force_bucket(name):
            return dg.grouped_mm(s[0], s[1], s[2])
    return run


def check_bits(names, s) -> bool:
    x, w, offs, ends = s
    outs = [forced(nm)(s) for nm in names]
    same = all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    g = max(range(len(ends)), key=lambda i: ends[i] - (ends[i - 1] if i else 0))
    start = ends[g - 1] if g else 0
    ref = dg.mm(x[start:ends[g]], w[g])
    return same and torch.equal(outs[0][start:ends[g]].view(torch.int16), ref.view(torch.int16))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-seconds", type=float, default=480.0)
    args = p.parse_args()
    err, _ = gpu.gpu_check()
    if err:
        print(err, file=sys.stderr)
        return 1
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        names = candidate_layer(Path(tmp) / "candidates.yaml", "grouped", "gcand", CANDIDATES)
    plan = TimingPlan(target_ms=0.5, reps=7, min_reps=3, budget_ms=20.0, warm_rounds=1,
                      warm_replays=1, est_min_ms=0.3)
    gen = torch.Generator().manual_seed(0)
    l2 = gpu.l2_bytes()
    cap = torch.cuda.Stream()
    models = MODELS[::3] if args.quick else MODELS
    rows = []
    for model, experts, topk, tokens, proj, k, n in problems(models, TOKENS):
        if time.time() - t0 > args.max_seconds:
            print(f"time box reached after {len(rows)} problems", flush=True)
            break
        sets = make_sets(experts, topk, tokens, k, n, gen, l2)
        fns = {nm: (lambda nm_: lambda s: forced(nm_)(s))(nm) for nm in names}
        fns["torch_grouped_mm"] = lambda s: torch._grouped_mm(s[0], s[1], s[2])
        fns["torch_loop"] = torch_loop
        fns["lt_loop"] = lt_loop
        us, errors, best = time_candidates(fns, sets, plan, cap, names)
        ok = check_bits(names, sets[0])
        row = {"model": model, "experts": experts, "topk": topk, "tokens": tokens,
               "rows": tokens * topk, "proj": proj, "K": k, "N": n,
               "m_avg": math.ceil(tokens * topk / experts), "us": us, "bits_ok": ok,
               "errors": errors}
        peer = min(v for nm, v in us.items() if v and nm not in names)
        print(f"{model:22s} T={tokens:6d} {proj:4s} m_avg={row['m_avg']:5d} K={k:5d} N={n:5d} "
              f"best {best[1].split('.', 1)[1]:24s} {best[0]:8.1f} us  torch best {peer:8.1f}"
              f"  {peer / best[0]:.2f}x  bits {ok}", flush=True)
        rows.append(row)
        del sets
    write_records(args.out, names, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
