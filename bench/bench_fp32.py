"""The fp32 tier vs cuBLAS, in one run (needs an SM90 GPU):

1. Speed: `dg.linear` on fp32 inputs (the split tier: split + one chunked bf16 GEMM) vs
   cuBLAS SGEMM with TF32 off and cuBLAS with TF32 on (`F.linear`), CUDA-graph timed,
   medians, fresh random inputs per set; over prefill/training shapes of public models.
   `split_us` is the time of splitting both operands alone (part of detgemm's time).
2. Accuracy: relative error (Frobenius) vs an fp64 product on the same inputs, K 256..16384,
   for detgemm fp32, SGEMM and TF32.
3. `--candidates`: every candidate fp32 tile (`CANDIDATES`) forced onto a subset of shapes,
   to choose the fp32 buckets.

    python bench/bench_fp32.py --out bench/results [--quick] [--candidates]

Writes markdown + JSON (+ a plot when matplotlib is installed), device named.
"""

import argparse
import contextlib
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import detgemm_cute as dg
from detgemm_cute import gemm, registry, split, staging
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.fmt import device_slug, json_default
from detgemm_cute.benchlib.timing import QUICK_PLAN, n_sets_for, time_units
from sweep_common import policy_replaced

F32 = torch.float32
# (K, N) of public models' linear layers (hidden -> qkv / mlp and back), some TP shards.
MODEL_KN = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144), (5120, 5120),
            (3584, 18944), (8192, 1280), (2048, 8192), (768, 3072), (3072, 768), (1024, 1024),
            (4096, 11008 // 2), (5120, 13824 // 4), (8192, 7168 // 8)]
M_LIST = [128, 512, 777, 1000, 2048, 4096, 8192]
ACC_K = [256, 1024, 4096, 16384]
# (tile, stages, persistent, cluster)
CANDIDATES = [((128, 128, 96), 4, True, (1, 1)), ((128, 128, 96), 4, False, (1, 1)),
              ((128, 128, 96), 4, True, (2, 1)), ((128, 64, 96), 5, True, (1, 1)),
              ((64, 128, 96), 5, True, (1, 1)), ((64, 128, 96), 5, False, (1, 1)),
              ((128, 96, 96), 4, True, (1, 1)), ((64, 64, 96), 8, False, (1, 1))]


def shapes(quick):
    rows = [(m, k, n) for (k, n) in MODEL_KN for m in M_LIST]
    return rows[::5] if quick else rows


def sgemm(x, w, tf32):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def tf32_linear(x, w):
    with dg.fp32_precision("tf32"):
        return dg.linear(x, w)


def split_both(x, w):
    """What the fp32 tier does before its GEMM: row scales and the fp16 parts of both."""
    return split.scaled_operand_cuda(x, "a"), split.scaled_operand_cuda(w, "b")


def make_sets(m, k, n, l2):
    """(x [M, K], w [N, K], dy [M, N]) sets, fresh random numbers."""
    nbytes = 4 * (m * k + n * k + 2 * m * n)
    return [(torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"),
             torch.randn(m, n, device="cuda")) for _ in range(n_sets_for(nbytes, l2, QUICK_PLAN))]


def tf32_input_grad(dy, w):
    with dg.fp32_precision("tf32"):
        return dg.input_grad(dy, w)


def tf32_input_grad_staged(dy, w):
    """dX as the TF32 kernels ran it before they read an M-major weight through registers:
    the weight copied K-major by the transpose kernel, then the fwd GEMM on the copy."""
    with dg.fp32_precision("tf32"):
        return dg.linear(dy, staging.transposed(w, w.shape[0]))


def tf32_mm(a, b, staged=False):
    """`dg.mm(a, b)` at "tf32": the mode's dX (dY @ W, W N-major as aten passes it), which
    runs swapped with W read through registers; `staged`: in the table's orientation with W
    staged K-major (`gemm.tf32_orientation` off), the path it replaced."""
    with dg.fp32_precision("tf32"), (policy_replaced(gemm, "tf32_orientation",
                                                     lambda *args: args[2])
                                     if staged else contextlib.nullcontext()):
        return dg.mm(a, b)


def same_tf32_bits(s):
    """detgemm "tf32" vs cuBLAS TF32 on one set: (fwd same bits, dx same bits)."""
    fwd = torch.equal(tf32_linear(s[0], s[1]).view(torch.int32),
                      sgemm(s[0], s[1], True).view(torch.int32))
    dx = torch.equal(tf32_input_grad(s[2], s[1]).view(torch.int32),
                     mm_tf32(s[2], s[1], True).view(torch.int32))
    return fwd, dx


TF32_UNITS = {"detgemm_tf32": lambda s: tf32_linear(s[0], s[1]),
              "cublas_tf32": lambda s: sgemm(s[0], s[1], True),
              "detgemm_tf32_dx": lambda s: tf32_input_grad(s[2], s[1]),
              "cublas_tf32_dx": lambda s: mm_tf32(s[2], s[1], True)}
IEEE_UNITS = {"detgemm_fp32": lambda s: dg.linear(s[0], s[1]),
              "cublas_sgemm": lambda s: sgemm(s[0], s[1], False),
              "split_only": lambda s: split_both(s[0], s[1])}


def run_speed(rows, cap_stream, log, tf32_only=False, dx_staged=False):
    """Per (M, K, N): both precisions and their cuBLAS peers (`tf32_only`: the tf32 ones;
    `dx_staged`: and dX through the staged copy of the weight, the path it replaces)."""
    out = []
    l2 = gpu.l2_bytes()
    units = dict(TF32_UNITS) if tf32_only else {**IEEE_UNITS, **TF32_UNITS}
    if dx_staged:
        units["detgemm_tf32_dx_staged"] = lambda s: tf32_input_grad_staged(s[2], s[1])
        units["detgemm_tf32_mm_dx"] = lambda s: tf32_mm(s[2], s[1])
        units["detgemm_tf32_mm_dx_staged"] = lambda s: tf32_mm(s[2], s[1], staged=True)
    for m, k, n in rows:
        sets = make_sets(m, k, n, l2)
        t = time_units(units, sets, QUICK_PLAN, cap_stream)
        us = {name: r.get("us") for name, r in t.items()}
        row = {"M": m, "K": k, "N": n, **{f"{kk}_us": v for kk, v in us.items()}}
        row["tf32_same_bits_fwd"], row["tf32_same_bits_dx"] = same_tf32_bits(sets[0])
        if dx_staged:
            row["tf32_dx_same_bits_as_staged"] = torch.equal(
                tf32_input_grad(sets[0][2], sets[0][1]).view(torch.int32),
                tf32_input_grad_staged(sets[0][2], sets[0][1]).view(torch.int32))
            if us["detgemm_tf32_dx"] and us["detgemm_tf32_dx_staged"]:
                row["tf32_dx_vs_staged"] = us["detgemm_tf32_dx_staged"] / us["detgemm_tf32_dx"]
            if us["detgemm_tf32_mm_dx"] and us["detgemm_tf32_mm_dx_staged"]:
                row["tf32_mm_dx_vs_staged"] = (us["detgemm_tf32_mm_dx_staged"]
                                               / us["detgemm_tf32_mm_dx"])
                row["tf32_mm_dx_same_bits_as_staged"] = torch.equal(
                    tf32_mm(sets[0][2], sets[0][1]).view(torch.int32),
                    tf32_mm(sets[0][2], sets[0][1], staged=True).view(torch.int32))
        if us["detgemm_tf32_dx"] and us["cublas_tf32_dx"]:
            row["tf32_dx_vs_cublas_tf32"] = us["cublas_tf32_dx"] / us["detgemm_tf32_dx"]
        flops = 2.0 * m * n * k
        if us.get("detgemm_fp32"):
            row["detgemm_tflops"] = flops / us["detgemm_fp32"] / 1e6
            for peer in ("cublas_sgemm", "cublas_tf32"):
                if us[peer]:
                    row[f"vs_{peer}"] = us[peer] / us["detgemm_fp32"]
        if us["detgemm_tf32"] and us["cublas_tf32"]:
            row["tf32_vs_cublas_tf32"] = us["cublas_tf32"] / us["detgemm_tf32"]
        log(f"{m}x{k}x{n}: fp32 {us.get('detgemm_fp32')} us, sgemm {us.get('cublas_sgemm')} us; "
            f"tf32 {us['detgemm_tf32']} vs cuBLAS {us['cublas_tf32']} us, dx "
            f"{us['detgemm_tf32_dx']} vs {us['cublas_tf32_dx']} us")
        out.append(row)
        del sets
    return out


DW_SHAPES = [(2048, 4096, 4096), (8192, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336),
             (8192, 1024, 1024), (2048, 3072, 768)]  # (tokens, N out, K in)


def run_dw(cap_stream, log):
    """dW = dY^T X over tokens: detgemm's fp32 weight_grad vs SGEMM / TF32 on dY.t() @ X."""
    out = []
    l2 = gpu.l2_bytes()
    for t, n, k in DW_SHAPES:
        nbytes = 4 * (t * n + t * k + n * k)
        sets = [(torch.randn(t, n, device="cuda"), torch.randn(t, k, device="cuda"))
                for _ in range(n_sets_for(nbytes, l2, QUICK_PLAN))]
        units = {"detgemm_fp32": lambda s: dg.weight_grad(*s),
                 "cublas_sgemm": lambda s: mm_tf32(s[0].t(), s[1], False),
                 "cublas_tf32": lambda s: mm_tf32(s[0].t(), s[1], True)}
        res = time_units(units, sets, QUICK_PLAN, cap_stream)
        us = {name: r.get("us") for name, r in res.items()}
        row = {"T": t, "N": n, "K": k, **{f"{a}_us": b for a, b in us.items()}}
        if us["detgemm_fp32"] and us["cublas_sgemm"]:
            row["vs_cublas_sgemm"] = us["cublas_sgemm"] / us["detgemm_fp32"]
        log(f"dW T={t} N={n} K={k}: detgemm {us['detgemm_fp32']} us, sgemm "
            f"{us['cublas_sgemm']} us -> {row.get('vs_cublas_sgemm', 0):.2f}x")
        out.append(row)
        del sets
    return out


def mm_tf32(a, b, tf32):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        return a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def run_accuracy(log):
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for k in ACC_K:
        x = torch.randn(512, k, device="cuda", generator=g)
        w = torch.randn(512, k, device="cuda", generator=g)
        ref = x.double() @ w.double().t()
        errs = {}
        for name, y in (("detgemm_fp32", dg.linear(x, w)), ("cublas_sgemm", sgemm(x, w, False)),
                        ("detgemm_tf32", tf32_linear(x, w)), ("cublas_tf32", sgemm(x, w, True))):
            errs[name] = ((y.double() - ref).norm() / ref.norm()).item()
        log(f"accuracy K={k}: " + ", ".join(f"{a} {b:.2e}" for a, b in errs.items()))
        out.append({"K": k, **errs})
    return out


def candidate_layer(path, cands=None):
    """A user layer with every candidate (`CANDIDATES` by default) as its own bucket (M ranges
    nobody calls with)."""
    cands = CANDIDATES if cands is None else cands
    lines = ["arch: sm90", "buckets:"]
    for i, (tile, stages, pers, cl) in enumerate(cands):
        lo = 10**9 + i
        lines += [f"  - name: {cand_name(i, cands)}", "    op: fwd", "    dtypes: [fp32]",
                  f"    m: [{lo}, {lo}]", f"    tile: {list(tile)}", f"    stages: {stages}",
                  f"    persistent: {str(pers).lower()}", f"    cluster: {list(cl)}"]
    Path(path).write_text("\n".join(lines) + "\n")


def cand_name(i, cands=None):
    tile, stages, pers, cl = (CANDIDATES if cands is None else cands)[i]
    return (f"cand_{tile[0]}x{tile[1]}_s{stages}_{'p' if pers else 'np'}"
            f"{'_c' + str(cl[0]) + str(cl[1]) if cl != (1, 1) else ''}")


def run_candidates(rows, cap_stream, log):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cands.yaml"
        candidate_layer(path)
        registry.add_config(path)
        out = []
        l2 = gpu.l2_bytes()
        for m, k, n in rows:
            sets = make_sets(m, k, n, l2)
            units = {}
            for i in range(len(CANDIDATES)):
                name = cand_name(i)

                def fn(s, name=name):
                    with dg.force_bucket(name):
                        return dg.linear(*s)
                units[name] = fn
            units["cublas_sgemm"] = lambda s: sgemm(*s, False)
            t = time_units(units, sets, QUICK_PLAN, cap_stream)
            us = {name: r.get("us") for name, r in t.items()}
            ok = {name: v for name, v in us.items() if v and name.startswith("cand")}
            best = min(ok, key=ok.get) if ok else None
            log(f"candidates {m}x{k}x{n}: best {best} {ok.get(best)} us; "
                + ", ".join(f"{a}={b and round(b, 1)}" for a, b in us.items()))
            out.append({"M": m, "K": k, "N": n, "us": us, "best": best,
                        "errors": {a: r["error"] for a, r in t.items() if "error" in r}})
            del sets
        registry.reset_user_configs()
    return out


def geomean(vals):
    vals = [v for v in vals if v]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def tf32_section(speed, f) -> list[str]:
    """Markdown of precision "tf32" (the TF32 kernels) vs cuBLAS TF32, fwd and dx."""
    big = [r for r in speed if r["M"] >= 512]

    def g(rows, key):
        v = geomean([r.get(key) for r in rows])
        return "-" if v is None else f"{v:.3f}x"

    def same(key):
        rows = [r for r in speed if key in r]
        return f"{sum(bool(r[key]) for r in rows)}/{len(rows)}"

    lines = ["", "## Precision \"tf32\" (TF32 kernels) vs cuBLAS TF32", "",
             "fwd = `F.linear(x, w)`, dx = `dY @ W` (sm90: W read in place; else staged K-major "
             "inside detgemm, timed); "
             "`same bits`: detgemm's output equals cuBLAS TF32's bit for bit on the first "
             "input set.", "",
             f"Geomean: fwd {g(speed, 'tf32_vs_cublas_tf32')} (M >= 512: "
             f"{g(big, 'tf32_vs_cublas_tf32')}); dx {g(speed, 'tf32_dx_vs_cublas_tf32')} "
             f"(M >= 512: {g(big, 'tf32_dx_vs_cublas_tf32')}). Same bits as cuBLAS TF32: "
             f"fwd {same('tf32_same_bits_fwd')}, dx {same('tf32_same_bits_dx')} rows.", "",
             "| M | K | N | fwd | cuBLAS TF32 | speed | same bits | dx | cuBLAS TF32 dx | speed "
             "| same bits |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    yn = {True: "yes", False: "no", None: "-"}
    for r in speed:
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {f(r.get('detgemm_tf32_us'))} | "
                     f"{f(r.get('cublas_tf32_us'))} | "
                     f"{f(r.get('tf32_vs_cublas_tf32'), '{:.2f}')} | "
                     f"{yn[r.get('tf32_same_bits_fwd')]} | {f(r.get('detgemm_tf32_dx_us'))} | "
                     f"{f(r.get('cublas_tf32_dx_us'))} | "
                     f"{f(r.get('tf32_dx_vs_cublas_tf32'), '{:.2f}')} | "
                     f"{yn[r.get('tf32_same_bits_dx')]} |")
    return lines


def write_report(out_dir, meta, speed, acc, cands, dw=()):
    slug = device_slug(meta["device"])
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"fp32_{slug}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"device": meta, "speed": speed, "accuracy": acc, "candidates": cands, "dw": dw},
        indent=1, default=json_default))
    g_s = geomean([r.get("vs_cublas_sgemm") for r in speed])
    g_t = geomean([r.get("vs_cublas_tf32") for r in speed])
    big = [r for r in speed if r["M"] >= 512]
    lines = [f"# fp32 tier vs cuBLAS ({meta['device']})", "",
             f"torch {torch.__version__}; one run; CUDA-graph medians; times in us.", "",
             f"Geomean speed vs SGEMM (TF32 off): {g_s:.2f}x over {len(speed)} shapes; "
             f"M >= 512: {geomean([r.get('vs_cublas_sgemm') for r in big]):.2f}x. "
             f"vs cuBLAS TF32: {g_t:.2f}x.", "",
             "## Precision \"ieee\" (full precision) vs cuBLAS SGEMM (TF32 off)", "",
             "| M | K | N | detgemm fp32 | split alone | SGEMM | TF32 | TFLOP/s | vs SGEMM "
             "| vs TF32 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, p="{:.1f}": "-" if v is None else p.format(v)  # noqa: E731
    for r in speed:
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {f(r.get('detgemm_fp32_us'))} | "
                     f"{f(r.get('split_only_us'))} | {f(r.get('cublas_sgemm_us'))} | "
                     f"{f(r.get('cublas_tf32_us'))} | {f(r.get('detgemm_tflops'))} | "
                     f"{f(r.get('vs_cublas_sgemm'), '{:.2f}')} | "
                     f"{f(r.get('vs_cublas_tf32'), '{:.2f}')} |")
    lines += tf32_section(speed, f)
    lines += ["", "## Accuracy: relative error vs fp64 (512 x K x 512, randn)", "",
              "| K | detgemm fp32 | SGEMM (TF32 off) | detgemm tf32 | cuBLAS TF32 |",
              "|---|---|---|---|---|"]
    for r in acc:
        lines.append(f"| {r['K']} | {r['detgemm_fp32']:.2e} | {r['cublas_sgemm']:.2e} | "
                     f"{r['detgemm_tf32']:.2e} | {r['cublas_tf32']:.2e} |")
    if dw:
        lines += ["", "## dW = dY^T X (exact bf16 parts), fp32 out", "",
                  f"Geomean vs SGEMM: {geomean([r.get('vs_cublas_sgemm') for r in dw]):.2f}x.",
                  "", "| tokens | N | K | detgemm fp32 | SGEMM | TF32 | vs SGEMM |",
                  "|---|---|---|---|---|---|---|"]
        for r in dw:
            lines.append(f"| {r['T']} | {r['N']} | {r['K']} | {f(r.get('detgemm_fp32_us'))} | "
                         f"{f(r.get('cublas_sgemm_us'))} | {f(r.get('cublas_tf32_us'))} | "
                         f"{f(r.get('vs_cublas_sgemm'), '{:.2f}')} |")
    if cands:
        lines += ["", "## Candidate tiles (forced)", "",
                  "| M | K | N | best | " + " | ".join(cand_name(i) for i in
                                                       range(len(CANDIDATES))) + " |",
                  "|---|---|---|---|" + "---|" * len(CANDIDATES)]
        for r in cands:
            lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['best']} | " + " | ".join(
                f(r["us"].get(cand_name(i))) for i in range(len(CANDIDATES))) + " |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        ax.plot([r.get("vs_cublas_sgemm") for r in speed], "o", label="vs SGEMM (TF32 off)")
        ax.plot([r.get("vs_cublas_tf32") for r in speed], "x", label="vs cuBLAS TF32")
        ax.plot([r.get("tf32_vs_cublas_tf32") for r in speed], "+",
                label="precision tf32 vs cuBLAS TF32 (fwd)")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set_xlabel("shape (table order)")
        ax.set_ylabel("speed-up (>1: detgemm faster)")
        ax.set_title(f"detgemm fp32 tier, {meta['device']}")
        ax.legend()
        fig.savefig(stem.with_suffix(".png"), dpi=100, bbox_inches="tight")
    except ImportError:
        pass
    return stem


def heldout_shapes():
    """(M, K, N) of the prefill-heldout suite (one M per public model weight, M 200..14000)."""
    from detgemm_cute.benchlib.suites import suite_problems

    return [(p.m, p.k, p.n) for p in suite_problems("prefill-heldout", ("fwd",))]


def staged_section(speed, f) -> list[str]:
    """Markdown of dX with the weight read in place (through registers) against dX through
    its staged K-major copy, the path it replaced, timed in the same run: `input_grad` (the
    dx table) and the mode's `mm(dY, W)` (the fwd table, run swapped)."""
    rows = [r for r in speed if r.get("tf32_dx_vs_staged")]
    if not rows:
        return []

    def summary(key, same_key):
        ratios = [r[key] for r in rows if r.get(key)]
        same = sum(bool(r.get(same_key)) for r in rows)
        big = geomean([r[key] for r in rows if r.get(key) and r["M"] >= 512])
        return (f"geomean {geomean(ratios):.3f}x (M >= 512: {big:.3f}x), "
                f"{min(ratios):.2f}-{max(ratios):.2f}x; bits equal on {same}/{len(rows)} rows")

    lines = ["", "## dX: the weight read in place vs its staged K-major copy", "",
             "`staged` = the transpose kernel's K-major copy of W, then the GEMM on it (the "
             "path dX took before; timed in the same run). `input_grad` (the dx table, "
             f"swapped): {summary('tf32_dx_vs_staged', 'tf32_dx_same_bits_as_staged')}. "
             "The mode's `mm(dY, W)` (the fwd table's pick for the transposed problem, "
             f"swapped): {summary('tf32_mm_dx_vs_staged', 'tf32_mm_dx_same_bits_as_staged')}.",
             "", "| M | K | N | input_grad | staged | speed | mm(dY, W) | staged | speed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {f(r.get('detgemm_tf32_dx_us'))} | "
                     f"{f(r.get('detgemm_tf32_dx_staged_us'))} | "
                     f"{f(r['tf32_dx_vs_staged'], '{:.2f}')} | "
                     f"{f(r.get('detgemm_tf32_mm_dx_us'))} | "
                     f"{f(r.get('detgemm_tf32_mm_dx_staged_us'))} | "
                     f"{f(r.get('tf32_mm_dx_vs_staged'), '{:.2f}')} |")
    return lines


def write_heldout(out_dir, meta, speed):
    stem = out_dir / f"fp32-tf32-heldout_{device_slug(meta['device'])}"
    stem.with_suffix(".json").write_text(json.dumps({"device": meta, "speed": speed}, indent=1,
                                                    default=json_default))
    f = lambda v, p="{:.1f}": "-" if v is None else p.format(v)  # noqa: E731
    lines = [f"# precision \"tf32\" vs cuBLAS TF32 on held-out shapes ({meta['device']})", "",
             f"torch {torch.__version__}; one run; CUDA-graph medians; times in us. Shapes: the "
             "prefill-heldout suite (83 public model weights, M 200..14000), which the tf32 "
             "buckets' fit did not see."] + tf32_section(speed, f) + staged_section(speed, f)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--candidates", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--tf32-heldout", action="store_true",
                    help="also time precision tf32 (fwd, dx) on the prefill-heldout suite's "
                         "shapes (M the tf32 buckets were not fitted on) -> "
                         "fp32-tf32-heldout_<gpu>.md/.json")
    args = ap.parse_args()
    err, _ = gpu.gpu_check()
    if err:
        sys.exit(f"bench_fp32: {err}")
    log = gpu.log
    cap = torch.cuda.Stream()
    meta = gpu.device_meta()
    acc = run_accuracy(log)
    rows = shapes(args.quick)
    cands = run_candidates(shapes(False)[::6], cap, log) if args.candidates else []
    speed = [] if args.no_speed else run_speed(rows, cap, log)
    dw = [] if args.no_speed else run_dw(cap, log)
    stem = write_report(Path(args.out), meta, speed, acc, cands, dw)
    log(f"wrote {stem}.md/.json")
    if args.tf32_heldout:
        held = run_speed(heldout_shapes(), cap, log, tf32_only=True, dx_staged=True)
        log(f"wrote {write_heldout(Path(args.out), meta, held)}.md/.json")
    if speed:
        log(f"geomean vs SGEMM {geomean([r.get('vs_cublas_sgemm') for r in speed]):.3f}, "
            f"vs TF32 {geomean([r.get('vs_cublas_tf32') for r in speed]):.3f}; tf32 vs "
            f"TF32 {geomean([r.get('tf32_vs_cublas_tf32') for r in speed]):.3f} (M >= 512: "
            f"{geomean([r.get('tf32_vs_cublas_tf32') for r in speed if r['M'] >= 512]):.3f})")


if __name__ == "__main__":
    main()
