"""The tile kernel's mainloop forms, A/B in one run (fp32 "ieee", sm_90):

    python bench/probe_tile_forms.py --out DIR [--max-seconds S]

`SplitTileFp32` built in each form of `FORMS` (its class switches ``ROW_CHECK``: A's rows
past M predicated to zeros; ``INTERLEAVE``: a warp's m16 tiles' chains step by step), each
form with its own kernel cache, and timed on the same inputs in one interleaved CUDA-graph
run (`time_units`) beside cuBLAS SGEMM (TF32 off) and the call as it runs today (`dg.linear`
/ `dg.input_grad`). Problems, in the order of `ORDER_M`: fwd and dX (W's columns in place)
of 12 public weights at M = 33..64 where `tile_shape` / `kn_shape` give the tile launch, and
at M = 80, 96, 128 a 128-row tile (`tile_128`) against today's call there (the split path).
Bits: every form against the split path. Writes tile-forms_<device>.{md,json.gz}. Record:
bench/results/tune/tile-forms_*.md.
"""
import argparse
import sys
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute import split, split_decode
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.fmt import device_slug
from detgemm_cute.benchlib.runner import run_time_boxed
from detgemm_cute.benchlib.stats import geomean
from detgemm_cute.benchlib.timing import n_sets_for, time_units
from detgemm_cute.kernels.split_tile import SplitTileFp32
from bench_fp32 import mm_tf32, sgemm
from bench_fp32_decode import DECODE_KN, PLAN

FORMS = {"v1": (True, False), "lean": (False, False), "lean_il": (False, True)}
ORDER_M = (64, 128, 48, 80, 33, 96)  # M = 33..64: the tile launch; above: `tile_128`


def tile_128(n: int, sms: int, kn: bool) -> split_decode.TileShape:
    """128 rows of X: 32 rows of W per block (wm = 4 tiles a warp), two chunks a round."""
    return split_decode.TileShape(128, 32, 2, 2, min(-(-n // 32), sms), True)


def in_form(form: str, call):
    """`call` with `SplitTileFp32` built in `form`, from that form's own kernel cache."""
    cache: dict = {}

    def run(s):
        saved = split._kernels, SplitTileFp32.ROW_CHECK, SplitTileFp32.INTERLEAVE
        split._kernels = cache
        SplitTileFp32.ROW_CHECK, SplitTileFp32.INTERLEAVE = FORMS[form]
        try:
            return call(s)
        finally:
            split._kernels, SplitTileFp32.ROW_CHECK, SplitTileFp32.INTERLEAVE = saved
    return run


def launch(op: str, m: int, k: int, n: int, sms: int):
    """The tile launch of one problem, or None where the path runs the streaming kernel."""
    out_n, red = (n, k) if op == "fwd" else (k, n)
    if m > split_decode.MAX_M:
        return tile_128(out_n, sms, op == "dx")
    shape = (split_decode.tile_shape(m, out_n, sms, True) if op == "fwd"
             else split_decode.kn_shape(m, out_n, red, sms))
    return shape if isinstance(shape, split_decode.TileShape) else None


def measure(op: str, m: int, k: int, n: int, l2, cap, sms) -> dict:
    """One problem: `op` fwd (X [M, K] @ W [N, K]^T) or dx (dY [M, N] @ W [N, K])."""
    out_n, red = (n, k) if op == "fwd" else (k, n)
    shape = launch(op, m, k, n, sms)
    sets = []
    for _ in range(min(8, n_sets_for(4 * (m + out_n) * red, l2, PLAN))):
        w = torch.randn(n, k, device="cuda")
        if op == "fwd":
            split_decode.guesses(w)
            sets.append((torch.randn(m, k, device="cuda"), w))
        else:
            split_decode.guesses(w.t(), of=w)
            sets.append((torch.randn(m, n, device="cuda"), w))
    if op == "fwd":
        units = {"today": lambda s: dg.linear(s[0], s[1]),
                 "cublas_sgemm": lambda s: sgemm(s[0], s[1], False)}
        tile = lambda s: split_decode.decode_gemm(s[0], s[1], None, shape)  # noqa: E731
    else:
        units = {"today": lambda s: dg.input_grad(s[0], s[1]),
                 "cublas_sgemm": lambda s: mm_tf32(s[0], s[1], False)}
        tile = lambda s: split_decode.decode_gemm_kn(s[0], s[1], None, False, shape)  # noqa
    for form in FORMS:
        units[form] = in_form(form, tile)
    res = time_units(units, sets, PLAN, cap)
    us = {nm: r.get("us") for nm, r in res.items()}
    with split_decode.fused(False), split_decode.fused_kn(False):
        ref = (dg.linear if op == "fwd" else dg.input_grad)(*sets[0]).view(torch.int32)
    same = {nm: torch.equal(units[nm](sets[0]).view(torch.int32), ref)
            for nm in units if nm != "cublas_sgemm"}
    gpu.log(f"{op} {m}x{k}x{n} {tuple(shape)}: " + " ".join(f"{nm}={v}" for nm, v in us.items())
            + f" bits {same}")
    return {"op": op, "M": m, "K": k, "N": n, "shape": list(shape), "us": us,
            "bits_equal_split_path": same,
            "errors": {nm: r["error"] for nm, r in res.items() if "error" in r}}


def report(rows, meta) -> list[str]:
    lines = [f"# The tile kernel's mainloop forms, one run ({meta['device']})", "",
             "Speed = SGEMM time / time (> 1: faster than cuBLAS SGEMM, TF32 off). `today`: "
             "the call as the tree runs it (the class's default form where it takes the "
             "tile kernel). Generated by "
             "bench/probe_tile_forms.py.", "",
             "| op | M | n | " + " | ".join(f"{f} vs SGEMM" for f in ("today", *FORMS))
             + " | lean_il / v1 | below 0.8x (today -> lean_il) | bits |",
             "|---|---|---:|" + "---:|" * (len(FORMS) + 3) + "---|"]
    groups = {}
    for r in rows:
        if "us" in r and r["us"].get("lean_il"):
            groups.setdefault((r["op"], r["M"]), []).append(r)
    for (op, m), rs in sorted(groups.items()):
        sp = {f: geomean([r["us"]["cublas_sgemm"] / r["us"][f] for r in rs])
              for f in ("today", *FORMS)}
        gain = geomean([r["us"]["v1"] / r["us"]["lean_il"] for r in rs])
        below = (sum(r["us"]["cublas_sgemm"] / r["us"]["today"] < 0.8 for r in rs),
                 sum(r["us"]["cublas_sgemm"] / r["us"]["lean_il"] < 0.8 for r in rs))
        bits = sum(all(r["bits_equal_split_path"].values()) for r in rs)
        lines.append(f"| {op} | {m} | {len(rs)} | "
                     + " | ".join(f"{sp[f]:.2f}" for f in ("today", *FORMS))
                     + f" | {gain:.3f} | {below[0]} -> {below[1]} | {bits}/{len(rs)} |")
    lines += ["", "| op | M | K | N | launch | " + " | ".join(("today", *FORMS))
              + " | SGEMM us |", "|---|---:|---:|---:|---|" + "---:|" * (len(FORMS) + 2)]
    for r in rows:
        if "us" in r:
            lines.append(f"| {r['op']} | {r['M']} | {r['K']} | {r['N']} | {r['shape']} | "
                         + " | ".join(f"{r['us'].get(f) or '-'}" for f in ("today", *FORMS))
                         + f" | {r['us']['cublas_sgemm']} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--ms", help="comma-separated M (default: ORDER_M)")
    args = ap.parse_args()
    err, _ = gpu.gpu_check()
    if err:
        print(f"probe_tile_forms: {err}", file=sys.stderr)
        return 1
    ms = [int(v) for v in args.ms.split(",")] if args.ms else ORDER_M
    meta, l2, cap = gpu.device_meta(), gpu.l2_bytes(), torch.cuda.Stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    probs = [(op, m, k, n) for m in ms for op in ("fwd", "dx") for k, n in DECODE_KN
             if launch(op, m, k, n, sms) is not None]
    run_time_boxed(probs, lambda p: measure(*p, l2, cap, sms),
                   Path(args.out) / f"tile-forms_{device_slug(meta['device'])}", meta,
                   args.max_seconds, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
