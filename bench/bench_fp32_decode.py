"""The fp32 "ieee" tier at decode sizes vs cuBLAS SGEMM, and where its time goes (needs an
SM90 GPU).

Per (M, K, N), in one interleaved CUDA-graph run (`time_units`, fresh random inputs):
- `detgemm_fp32`: `dg.linear` as the table runs it (split both operands, one chunked GEMM
  over 3x K on the 16-bit parts, unscale);
- `split_w` / `split_x`: the one-pass split of the weight / of the activations alone;
- `gemm_parts`: the chunked GEMM plus unscale on parts split once, outside the timing
  (the table's tile), and `cand_*`: the same on each decode candidate tile (`DECODE_CANDIDATES`,
  forced; the tile never changes the bits, checked against the table's on the first set);
- `cublas_sgemm`: `F.linear` with TF32 off; `copy_w`: a device copy of W (bandwidth).

So detgemm_fp32 ~ split_w + split_x + gemm_parts, and the rows show which part a faster
decode path must remove. `--m-list 1,2,...` replaces the decode M (e.g. 1..8192).

    python bench/bench_fp32_decode.py --out $OUT [--max-seconds 90]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute import registry, split
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.fmt import device_slug, json_default
from detgemm_cute.benchlib.timing import TimingPlan, n_sets_for, time_units
from detgemm_cute.gemm import gemm
from bench_fp32 import candidate_layer, cand_name, sgemm

DECODE_M = (1, 2, 4, 8, 16, 32, 64)
DECODE_KN = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 1280)]
# Narrow N tiles: at M <= 64 the table's 64x128 tile runs N / 128 CTAs (32 for N = 4096).
DECODE_CANDIDATES = [((64, 16, 96), 10, False, (1, 1)), ((64, 32, 96), 10, False, (1, 1)),
                     ((64, 64, 96), 8, False, (1, 1)), ((64, 128, 96), 5, False, (1, 1))]
PLAN = TimingPlan(target_ms=0.5, reps=7, min_reps=3, budget_ms=20.0, warm_rounds=1,
                  warm_replays=1, est_min_ms=0.3)


def chunked_gemm(bucket=None):
    """GEMM + unscale on pre-split parts (s = (x, w, a2, sa, b2, sb)), optionally forced."""
    def run(s):
        _, _, a2, sa, b2, sb = s
        if bucket is None:
            c = gemm(a2, b2, "nk", None, torch.float32, op="fwd", split_in=split.BLOCK_K)
        else:
            with dg.force_bucket(bucket):
                c = gemm(a2, b2, "nk", None, torch.float32, op="fwd", split_in=split.BLOCK_K)
        return split.unscale(c, sa, sb)
    return run


def make_sets(m, k, n, l2):
    nbytes = 4 * (m * k + n * k) + 6 * (m + n) * k
    out = []
    for _ in range(min(8, n_sets_for(nbytes, l2, PLAN))):
        x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        (a2, sa), (b2, sb) = split.scaled_operand_cuda(x, "a"), split.scaled_operand_cuda(w, "b")
        out.append((x, w, a2, sa, b2, sb))
    return out


def measure(m, k, n, names, l2, cap) -> dict:
    sets = make_sets(m, k, n, l2)
    units = {"detgemm_fp32": lambda s: dg.linear(s[0], s[1]),
             "cublas_sgemm": lambda s: sgemm(s[0], s[1], False),
             "split_w": lambda s: split.scaled_operand_cuda(s[1], "b"),
             "split_x": lambda s: split.scaled_operand_cuda(s[0], "a"),
             "copy_w": lambda s: s[1].clone(),
             "gemm_parts": chunked_gemm()}
    units.update({nm: chunked_gemm(nm) for nm in names})
    res = time_units(units, sets, PLAN, cap)
    us = {nm: r.get("us") for nm, r in res.items()}
    ref = dg.linear(sets[0][0], sets[0][1]).view(torch.int32)
    same = {nm: torch.equal(chunked_gemm(nm)(sets[0]).view(torch.int32), ref) for nm in names}
    row = {"M": m, "K": k, "N": n, "us": us, "bits_equal_table": same,
           "errors": {nm: r["error"] for nm, r in res.items() if "error" in r}}
    best = min((v, nm) for nm, v in us.items() if nm in names and v) if any(
        us.get(nm) for nm in names) else (None, None)
    gpu.log(f"{m}x{k}x{n}: fp32 {us['detgemm_fp32']} us = split_w {us['split_w']} + split_x "
            f"{us['split_x']} + gemm {us['gemm_parts']} (best tile {best[1]} {best[0]}); "
            f"sgemm {us['cublas_sgemm']}; copy W {us['copy_w']}; bits {same}")
    del sets
    return row


def report(rows, meta) -> list[str]:
    f = lambda v: "-" if not v else f"{v:.1f}"  # noqa: E731
    lines = [f"# fp32 \"ieee\" at decode sizes ({meta['device']})", "",
             f"torch {torch.__version__}; CUDA-graph medians, us. W read at copy speed: "
             "`copy W` (read + write of W's fp32 bytes).", "",
             "| M | K | N | detgemm fp32 | split W | split X | GEMM on parts | best tile | "
             "SGEMM | copy W | vs SGEMM | best tile's total vs SGEMM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = r["us"]
        cands = {nm: v for nm, v in us.items() if nm.startswith("cand_") and v}
        best = min(cands, key=cands.get) if cands else None
        tot = (us["split_w"] or 0) + (us["split_x"] or 0) + (cands.get(best) or 0)
        ratio = lambda t: "-" if not (t and us["cublas_sgemm"]) else f"{us['cublas_sgemm'] / t:.2f}"  # noqa: E731,E501
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {f(us['detgemm_fp32'])} | "
                     f"{f(us['split_w'])} | {f(us['split_x'])} | {f(us['gemm_parts'])} | "
                     f"{best} {f(cands.get(best))} | {f(us['cublas_sgemm'])} | "
                     f"{f(us['copy_w'])} | {ratio(us['detgemm_fp32'])} | {ratio(tot)} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--m-list", help="comma-separated M (default: 1..64 in powers of two)")
    ap.add_argument("--max-seconds", type=float, default=120.0)
    args = ap.parse_args()
    err, _ = gpu.gpu_check()
    if err:
        print(f"bench_fp32_decode: {err}", file=sys.stderr)
        return 1
    t0 = time.time()
    ms = [int(v) for v in args.m_list.split(",")] if args.m_list else DECODE_M
    meta, l2, cap = gpu.device_meta(), gpu.l2_bytes(), torch.cuda.Stream()
    names = [cand_name(i, DECODE_CANDIDATES) for i in range(len(DECODE_CANDIDATES))]
    rows = []
    stem = Path(args.out) / f"fp32-decode_{device_slug(meta['device'])}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        candidate_layer(Path(d) / "decode.yaml", DECODE_CANDIDATES)
        registry.add_config(Path(d) / "decode.yaml")
        for k, n, m in [(k, n, m) for k, n in DECODE_KN for m in ms]:
            if time.time() - t0 > args.max_seconds:
                gpu.log(f"time box reached after {len(rows)} problems")
                break
            rows.append(measure(m, k, n, names, l2, cap))
            stem.with_suffix(".json").write_text(json.dumps(
                {"device": meta, "rows": rows}, indent=1, default=json_default))
        registry.reset_user_configs()
    stem.with_suffix(".md").write_text("\n".join(report(rows, meta)) + "\n")
    gpu.log(f"wrote {stem}.md/.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
