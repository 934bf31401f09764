"""GEMM benchmark: detgemm_cute against cuBLAS (default and PEDANTIC math mode).

Problem: Y[M, N] = X[M, K] @ W[N, K]^T (the F.linear layout; W is a row-major weight and
the GEMM reads it through the transposed view ``W.t()``, no copy).

Peers, on the same inputs in the same run:
  detgemm   ``detgemm_cute.mm(x, w.t())``
  cuBLAS    ``torch.mm(x, w.t())`` (PyTorch's cuBLAS handle, default math mode)
  PEDANTIC  ``cublasGemmEx`` on a cuBLAS handle of our own in ``CUBLAS_PEDANTIC_MATH``, fp32
            compute, default algorithm. CuPy's binding refuses to run during CUDA-graph
            capture, so by default the same call is made through ctypes on the libcublas
            torch has loaded, after checking it gives the same bits as CuPy's binding
            (``--pedantic-backend cupy`` forces CuPy, timed by an event-timed loop).

Timing: per shape, each peer is one CUDA graph of the same R back-to-back GEMMs (R chosen
so one replay takes about ``--target-ms``), inputs rotated over several sets so the working
set is several times L2; replays of the peers are interleaved round-robin and timed with
CUDA events; time = median replay / R. See bench/README.md.

Usage (on an SM90 GPU machine, from the repository root):
    python bench/bench_gemm.py [--quick] [--dtype bf16|fp16] [--out DIR] [--shapes MxKxN ...]

Importing this module touches no CUDA state; the helpers above ``# GPU part`` are pure
functions (tested on CPU by tests/test_bench_cpu.py).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)

SUITE_MS = (1, 16, 64, 128, 512, 2048, 8192, 16384)
SUITE_KN = ((768, 3072), (3072, 768), (4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192))
DECODE_MS = (1, 8, 16, 32, 64)
DECODE_KN = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (8192, 8192))
QUICK_MS = (1, 128, 2048)
QUICK_KN = ((4096, 4096), (14336, 4096))
PROBE_MS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PROBE_ROWS = 8192

PEERS = ("detgemm", "cublas", "pedantic")
PEER_LABELS = {
    "detgemm": "detgemm",
    "cublas": "cuBLAS default",
    "pedantic": "cuBLAS PEDANTIC",
}
PEER_HOWTO = {
    "detgemm": "detgemm_cute.mm(x, w.t())",
    "cublas": "torch.mm(x, w.t())",
    "pedantic": "cublasGemmEx on a handle of our own: CUBLAS_PEDANTIC_MATH, CUBLAS_COMPUTE_32F, "
                "CUBLAS_GEMM_DEFAULT",
}

DET_TOL = 2e-2        # detgemm vs torch.mm, relative Frobenius error in fp32
PED_TOL = 1e-2        # PEDANTIC vs torch.mm
MAIN_COLUMNS = (
    "M", "K", "N", "bucket",
    "detgemm us", "cuBLAS us", "PEDANTIC us",
    "detgemm TFLOP/s", "cuBLAS TFLOP/s", "PEDANTIC TFLOP/s", "detgemm TB/s", "cuBLAS TB/s",
    "det/cuBLAS", "det/PEDANTIC", "det err", "same bits", "notes",
)

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_PEDANTIC_MATH = 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUDA_R_16F, CUDA_R_16BF = 2, 14


# ---------------------------------------------------------------------------------------
# Pure helpers (no CUDA): shapes, arithmetic, summary, rendering
# ---------------------------------------------------------------------------------------

def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (safe for file names)."""
    s = re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")
    return s or "unknown-device"


def parse_shape(text: str) -> tuple[int, int, int]:
    """'MxKxN' (also ',' or ':' as separator) -> (M, K, N)."""
    parts = re.split(r"[x,:X*]", text.strip())
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape {text!r}: expected MxKxN, e.g. 2048x4096x14336")
    m, k, n = (int(p) for p in parts)
    if min(m, k, n) <= 0:
        raise ValueError(f"shape {text!r}: all dims must be positive")
    return m, k, n


def suite_shapes(quick: bool = False, suite: str = "core") -> list[tuple[int, int, int]]:
    """(M, K, N) rows of the suite, grouped by (K, N), M ascending. `decode`: the
    memory-bound small-M rows (M <= 64 on LLM-sized weights)."""
    if suite == "decode":
        ms, kns = DECODE_MS, DECODE_KN
    else:
        ms, kns = (QUICK_MS, QUICK_KN) if quick else (SUITE_MS, SUITE_KN)
    return [(m, k, n) for (k, n) in kns for m in ms]


def distinct_kn(shapes) -> list[tuple[int, int]]:
    seen, out = set(), []
    for (_m, k, n) in shapes:
        if (k, n) not in seen:
            seen.add((k, n))
            out.append((k, n))
    return out


def tbytes_per_s(nbytes, us) -> float | None:
    """Achieved DRAM traffic (X, W read once, Y written once) in TB/s."""
    if not nbytes or not us:
        return None
    return nbytes / (us * 1e-6) / 1e12


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def tflops(m: int, n: int, k: int, us: float | None) -> float | None:
    if us is None or not (us > 0) or not math.isfinite(us):
        return None
    return gemm_flops(m, n, k) / (us * 1e-6) / 1e12


def speed_ratio(t_det_us: float | None, t_peer_us: float | None) -> float | None:
    """detgemm speed / peer speed = t_peer / t_det (> 1 means detgemm is faster)."""
    if t_det_us is None or t_peer_us is None:
        return None
    if not (t_det_us > 0 and t_peer_us > 0):
        return None
    return t_peer_us / t_det_us


def geomean(values) -> float | None:
    """Geometric mean of the positive finite values; None when there are none."""
    vals = [float(v) for v in values
            if v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


SUMMARY_GROUPS = (
    ("M>=512", lambda m: m >= 512),
    ("128<=M<=1024", lambda m: 128 <= m <= 1024),
    ("M<=128", lambda m: m <= 128),
    ("M<=64", lambda m: m <= 64),
    ("all", lambda m: True),
)


def summarize(rows) -> dict:
    """Geomean of the speed ratios per peer over row groups (rows with a ratio only)."""
    out = {}
    for peer in ("cublas", "pedantic"):
        key = f"ratio_{peer}"
        per = {}
        for label, pred in SUMMARY_GROUPS:
            in_group = [r for r in rows if pred(r["M"])]
            vals = [r.get(key) for r in in_group if r.get(key) is not None]
            per[label] = {
                "geomean": geomean(vals),
                "n": len(vals),
                "rows": len(in_group),
                "min": min(vals) if vals else None,
                "max": max(vals) if vals else None,
            }
        out[peer] = per
    return out


def fmt_num(v, fmt: str = "{:.1f}", none: str = "-") -> str:
    if v is None:
        return none
    try:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return fmt.format(v)
    except (TypeError, ValueError):
        return str(v)


def fmt_us(us) -> str:
    if us is None:
        return "-"
    return fmt_num(us, "{:.2f}" if us < 100 else "{:.1f}" if us < 10000 else "{:.0f}")


def fmt_bucket(b) -> str:
    """Bucket object (name, tile, stages, cluster) -> short string; robust to missing attrs."""
    if b is None:
        return "?"
    if isinstance(b, str):
        return b

    def dims(v):
        if isinstance(v, (tuple, list)):
            return "x".join(str(x) for x in v)
        return str(v)

    parts = [str(getattr(b, "name", b))]
    tile = getattr(b, "tile", None)
    if tile is not None:
        parts.append(dims(tile))
    stages = getattr(b, "stages", None)
    if stages is not None:
        parts.append(f"s{stages}")
    cluster = getattr(b, "cluster", None)
    if cluster is not None:
        parts.append(f"c{dims(cluster)}")
    return " ".join(parts)


def _cell(text) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _short(text, n: int = 60) -> str:
    text = _cell(text)
    return text if len(text) <= n else text[: n - 3] + "..."


def row_notes(row) -> list[str]:
    """Human notes for a row: wrong results, errors, non-graph timing."""
    notes = list(row.get("notes") or [])
    for peer in PEERS:
        p = row.get(peer) or {}
        lab = {"detgemm": "det", "cublas": "cuB", "pedantic": "PED"}[peer]
        if p.get("error"):
            notes.append(f"{lab}: {p['error']}")
        elif p.get("method") and p["method"] != "graph":
            notes.append(f"{lab} timed by {p['method']}")
    if row.get("ok_ped") is False:
        notes.append(f"PED err {fmt_num(row.get('err_ped'), '{:.1e}')}")
    return notes


def same_bits_cell(row) -> str:
    marks = []
    if row.get("bits_eq_cublas"):
        marks.append("cuB")
    if row.get("bits_eq_pedantic"):
        marks.append("PED")
    if marks:
        return ",".join(marks)
    if row.get("bits_eq_cublas") is None and row.get("bits_eq_pedantic") is None:
        return "-"
    return "no"


def render_main_table(rows) -> str:
    head = "| " + " | ".join(MAIN_COLUMNS) + " |"
    sep = "|" + "|".join("---:" if c not in ("bucket", "notes", "same bits") else "---"
                         for c in MAIN_COLUMNS) + "|"
    lines = [head, sep]
    for r in rows:
        d, c, p = (r.get(k) or {} for k in PEERS)
        det_err = fmt_num(r.get("err_det"), "{:.1e}")
        if r.get("ok_det") is False:
            det_err += " WRONG"
        cells = [
            r["M"], r["K"], r["N"], _short(r.get("bucket") or "?", 40),
            fmt_us(d.get("us")), fmt_us(c.get("us")), fmt_us(p.get("us")),
            fmt_num(d.get("tflops")), fmt_num(c.get("tflops")), fmt_num(p.get("tflops")),
            fmt_num(tbytes_per_s(r.get("set_bytes"), d.get("us")), "{:.2f}"),
            fmt_num(tbytes_per_s(r.get("set_bytes"), c.get("us")), "{:.2f}"),
            fmt_num(r.get("ratio_cublas"), "{:.2f}"), fmt_num(r.get("ratio_pedantic"), "{:.2f}"),
            det_err, same_bits_cell(r), _short("; ".join(row_notes(r)), 90),
        ]
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return "\n".join(lines)


def render_summary(summary) -> str:
    lines = [
        "| detgemm speed / peer speed | rows | geomean | min | max | time ratio (geomean) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for peer in ("cublas", "pedantic"):
        for label, _pred in SUMMARY_GROUPS:
            s = (summary.get(peer) or {}).get(label) or {}
            g = s.get("geomean")
            lines.append(
                f"| vs {PEER_LABELS[peer]} | {label} ({s.get('n', 0)} of {s.get('rows', 0)}) | "
                f"{fmt_num(g, '{:.3f}')} | {fmt_num(s.get('min'), '{:.2f}')} | "
                f"{fmt_num(s.get('max'), '{:.2f}')} | {fmt_num(1 / g if g else None, '{:.3f}')}x |")
    return "\n".join(lines)


def _ms_list(ms) -> str:
    if ms is None:
        return "n/a"
    if not ms:
        return "none"
    return ", ".join(str(m) for m in ms)


def render_probe(probe) -> str:
    if not probe:
        return "(not run)"
    lines = [
        "| K | N | cuBLAS default: M that differ | PEDANTIC: M that differ | "
        "detgemm: M that differ | run-to-run identical (cuB/PED/det) |",
        "|---:|---:|---|---|---|---|",
    ]
    for e in probe:
        br = e.get("breaks") or {}
        errs = e.get("errors") or {}
        rr = e.get("rerun_same") or {}

        def cell(peer):
            if peer in errs:
                return "error: " + _short(errs[peer], 50)
            return _ms_list(br.get(peer))

        rerun = "/".join({True: "yes", False: "NO", None: "-"}[rr.get(p)]
                         for p in ("cublas", "pedantic", "detgemm"))
        lines.append(f"| {e['K']} | {e['N']} | {cell('cublas')} | {cell('pedantic')} | "
                     f"{cell('detgemm')} | {rerun} |")
    return "\n".join(lines)


def render_overhead(overhead) -> str:
    if not overhead:
        return "(not run)"
    shape = overhead.get("shape", (64, 64, 64))
    lines = [
        f"Each op on a {shape[0]}x{shape[1]}x{shape[2]} (MxKxN) problem, "
        f"{overhead.get('calls', '?')} calls then one synchronize, wall time per call "
        f"(time.perf_counter), median of {overhead.get('repeats', '?')} repetitions.",
        "",
        "`enqueue` is the host time of the 2000 calls before the synchronize; `GPU` is the "
        "device time of one such GEMM (CUDA graph of 200). A per-call time near `GPU` is "
        "device-bound, near `enqueue` host-bound.",
        "",
        "| op | us per call | enqueue us | GPU us | all repetitions (us) |",
        "|---|---:|---:|---:|---|",
    ]
    for peer in ("detgemm", "cublas"):
        o = overhead.get(peer) or {}
        if o.get("error"):
            lines.append(f"| {PEER_HOWTO[peer]} | - | - | - | error: {_short(o['error'], 60)} |")
            continue
        reps = ", ".join(fmt_num(v, "{:.2f}") for v in (o.get("reps_us") or []))
        lines.append(f"| {PEER_HOWTO[peer]} | {fmt_num(o.get('us_per_call'), '{:.2f}')} | "
                     f"{fmt_num(o.get('enqueue_us'), '{:.2f}')} | "
                     f"{fmt_num(o.get('device_us'), '{:.2f}')} | {reps} |")
    return "\n".join(lines)


def render_markdown(report) -> str:
    meta = report.get("meta") or {}
    dev = meta.get("device", "unknown device")
    lines = [
        f"# GEMM benchmark: detgemm_cute vs cuBLAS on {dev}",
        "",
        f"- device: {dev} (sm_{meta.get('capability', '?')}, {meta.get('sm_count', '?')} SMs, "
        f"L2 {fmt_num(meta.get('l2_mb'), '{:.0f}')} MB)",
        f"- torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}, "
        f"cuBLAS {meta.get('cublas_version', '?')} (PEDANTIC handle), "
        f"CuPy {meta.get('cupy', '?')}; PEDANTIC called through "
        f"{meta.get('pedantic_backend') or 'n/a'}",
        f"- detgemm_cute {meta.get('detgemm', '?')}, nvidia-cutlass-dsl "
        f"{meta.get('cutlass_dsl', '?')}; dtype {meta.get('dtype', '?')}; "
        f"date {meta.get('date', '?')}",
        f"- problem: Y[M,N] = X[M,K] @ W[N,K]^T; X = randn, W = randn/sqrt(K), fresh per shape",
        f"- timing: {meta.get('timing', '?')}",
        f"- peers: " + "; ".join(f"{PEER_LABELS[p]} = `{PEER_HOWTO[p]}`" for p in PEERS),
    ]
    for note in meta.get("notes") or []:
        lines.append(f"- note: {note}")
    lines += [
        "",
        "## Speed (per GEMM; ratios are detgemm speed / peer speed, > 1 = detgemm faster)",
        "",
        render_main_table(report.get("rows") or []),
        "",
        f"`det err`: norm(detgemm - torch.mm) / norm(torch.mm) in fp32 (must be < {DET_TOL:g}; "
        f"a WRONG row gets no speed). `same bits`: detgemm output bit-identical to "
        f"cuBLAS default (cuB) / PEDANTIC (PED).",
        "",
        "## Summary (geometric mean over rows that have both times)",
        "",
        render_summary(report.get("summary") or {}),
        "",
        f"## Batch invariance (row bits of op(X[:M]) vs op(X[{PROBE_ROWS}])[:M], "
        f"M in {{{', '.join(str(m) for m in PROBE_MS)}}})",
        "",
        render_probe(report.get("probe")),
        "",
        "## Host overhead",
        "",
        render_overhead(report.get("overhead")),
        "",
    ]
    return "\n".join(lines)


def rows_equal_bitwise(full: torch.Tensor, part: torch.Tensor) -> bool:
    """True when `part` equals the first part.shape[0] rows of `full` bit for bit."""
    m = part.shape[0]
    a = full[:m]
    if a.shape != part.shape or a.dtype != part.dtype:
        return False
    if a.element_size() == 2:
        return torch.equal(a.contiguous().view(torch.int16), part.contiguous().view(torch.int16))
    if a.element_size() == 4:
        return torch.equal(a.contiguous().view(torch.int32), part.contiguous().view(torch.int32))
    return torch.equal(a, part)


def json_clean(o):
    """Non-finite floats -> None (strict JSON), tuples -> lists, recursively."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): json_clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_clean(v) for v in o]
    return o


def json_default(o):
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, torch.dtype):
        return str(o)
    return str(o)


def write_plot(rows, path: str, title: str) -> str | None:
    """Ratio vs M per (K, N), vs cuBLAS default and vs PEDANTIC. Returns None or a note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"no plot: matplotlib unavailable ({type(e).__name__})"
    kns = distinct_kn([(r["M"], r["K"], r["N"]) for r in rows])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, label in zip(axes, ("ratio_cublas", "ratio_pedantic"),
                              ("vs cuBLAS default", "vs cuBLAS PEDANTIC")):
        drew = False
        for (k, n) in kns:
            pts = sorted((r["M"], r[key]) for r in rows
                         if r["K"] == k and r["N"] == n and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4,
                        label=f"K={k}, N={n}")
                drew = True
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("M (rows of X)")
        ax.set_ylabel("detgemm speed / peer speed")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
        if drew:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="detgemm_cute vs cuBLAS (default, PEDANTIC): speed, correctness, batch "
                    "invariance, host overhead. Needs an SM90 GPU.")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: M in {QUICK_MS} x (K,N) in {QUICK_KN}")
    p.add_argument("--suite", choices=("core", "decode"), default="core",
                   help="core: M 1..16384 on six (K, N); decode: M in "
                        f"{DECODE_MS} x (K, N) in {DECODE_KN} (results file gets a _decode suffix)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"),
                   help="output directory (default: bench/results of this checkout)")
    p.add_argument("--shapes", nargs="+", metavar="MxKxN",
                   help="replace the suite with these shapes, e.g. 1x4096x4096 2048x14336x4096")
    p.add_argument("--target-ms", type=float, default=1.0,
                   help="aim for one graph replay to take at least this long (default 1 ms)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed graph replays per (peer, shape) (default 20, --quick 7)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-pedantic", action="store_true", help="skip the PEDANTIC peer")
    p.add_argument("--pedantic-backend", choices=("auto", "ctypes", "cupy"), default="auto",
                   help="how cublasGemmEx is called for PEDANTIC: 'ctypes' on torch's libcublas "
                        "(graph-capturable), 'cupy' (CuPy's binding; cannot be captured, so "
                        "timed by an event loop), 'auto' = ctypes checked against CuPy")
    p.add_argument("--no-probe", action="store_true", help="skip the batch-invariance probe")
    p.add_argument("--no-overhead", action="store_true", help="skip the host-overhead test")
    args = p.parse_args(argv)
    if args.shapes:
        args.shape_list = [parse_shape(s) for s in args.shapes]
    else:
        args.shape_list = suite_shapes(args.quick, args.suite)
    if args.reps is None:
        args.reps = 7 if args.quick else 20
    return args


# ---------------------------------------------------------------------------------------
# GPU part (nothing below runs at import time)
# ---------------------------------------------------------------------------------------

MAX_R = 2000            # GEMMs per graph, at most
MAX_SETS = 64           # rotated input sets, at most
WARM_REPLAYS = 2        # per peer, after capture
WARM_ROUNDS = 3         # untimed interleaved rounds before the timed ones
OVERHEAD_CALLS = 2000
OVERHEAD_REPEATS = 5


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def err_str(e: BaseException, n: int = 200) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def gpu_check() -> str | None:
    """None when an SM90 GPU is usable, else the reason."""
    try:
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        major, minor = torch.cuda.get_device_capability(0)
        if major != 9:
            return f"found {torch.cuda.get_device_name(0)} (sm_{major}{minor})"
    except Exception as e:  # noqa: BLE001
        return f"CUDA not usable ({err_str(e)})"
    return None


class _StreamRef:
    """Minimal CUDA stream protocol object for a raw stream pointer."""

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


class Pedantic:
    """Common part of the two PEDANTIC backends: y[M,N] = x[M,K] @ w[N,K]^T.

    Row-major Y[M,N] = X W^T is column-major Y^T[N,M] = W X^T, so the call is
    gemmEx(transa=T, transb=N, m=N, n=M, k=K, A=W (lda K), B=X (ldb K), C=Y (ldc N)),
    alpha = 1 and beta = 0 as host fp32 scalars (default host pointer mode)."""

    backend = "?"
    graph_capturable = False

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        return self.gemm(x, w, y)

    def describe(self) -> str:
        return f"{self.backend}, cuBLAS {self.version}, math mode {self.math_mode}"


class PedanticCupy(Pedantic):
    """Through CuPy's binding (cupy_backends.cuda.libs.cublas) on a handle of our own.

    CuPy's gemmEx re-sets the handle's stream to CuPy's *current* stream on every call,
    so each call runs inside a CuPy wrapper of torch's current stream. CuPy refuses cuBLAS
    calls while a stream is being captured ("calling cuBLAS API during stream capture is
    currently unsupported"), so this backend can only be timed by an event-timed loop."""

    backend = "CuPy cublas.gemmEx"

    def __init__(self, dtype: torch.dtype):
        import numpy as np
        import cupy
        from cupy_backends.cuda.libs import cublas

        self.np, self.cupy, self.cublas = np, cupy, cublas
        self.dt = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}[dtype]
        self.dtype = dtype
        self.h = cublas.create()
        cublas.setMathMode(self.h, CUBLAS_PEDANTIC_MATH)
        cublas.setStream(self.h, torch.cuda.current_stream().cuda_stream)
        self.math_mode = cublas.getMathMode(self.h)
        try:
            self.version = cublas.getVersion(self.h)
        except Exception:  # noqa: BLE001
            self.version = None
        self.cupy_version = getattr(cupy, "__version__", "?")
        self.lib_path = None
        # host scalars; kept alive as long as this object
        self.alpha = np.array(1.0, dtype=np.float32)
        self.beta = np.array(0.0, dtype=np.float32)
        self._streams = {}

    def _cupy_stream(self, ptr: int):
        s = self._streams.get(ptr)
        if s is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ext = getattr(self.cupy.cuda, "ExternalStream", None)
                if ext is not None:
                    # never destroys the stream (deprecated in CuPy 14, still there)
                    s = ext(ptr, torch.cuda.current_device())
                else:
                    # Stream.from_external: kept referenced for the whole run, so it is
                    # only collected at interpreter shutdown (when CuPy skips destroying)
                    s = self.cupy.cuda.Stream.from_external(_StreamRef(ptr))
            self._streams[ptr] = s   # kept for the whole run
        return s

    def gemm(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        ptr = torch.cuda.current_stream().cuda_stream
        with self._cupy_stream(ptr):
            self.cublas.setStream(self.h, ptr)
            self.cublas.gemmEx(
                self.h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k,
                self.alpha.ctypes.data,
                w.data_ptr(), self.dt, k,
                x.data_ptr(), self.dt, k,
                self.beta.ctypes.data,
                y.data_ptr(), self.dt, n,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        return y


def loaded_cublas_path() -> str | None:
    """Path of the libcublas that this process (torch) has loaded, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                base = os.path.basename(path)
                if base.startswith("libcublas.so") and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


class PedanticCtypes(Pedantic):
    """The same cublasGemmEx call made through ctypes on the libcublas torch has loaded.

    Nothing stands between the call and cuBLAS, so it can be captured in a CUDA graph like
    torch.mm. The handle is our own (PEDANTIC math mode; torch resets the math mode of its
    own handle on every call). After each cublasSetStream (which resets the workspace to
    cuBLAS's default pool) the handle gets a fixed 32 MiB workspace, so cuBLAS allocates
    nothing while a graph is being captured."""

    backend = "ctypes cublasGemmEx (torch's libcublas)"
    graph_capturable = True
    WORKSPACE_BYTES = 32 * 2**20

    def __init__(self, dtype: torch.dtype):
        import ctypes
        import numpy as np

        # make sure torch has loaded cuBLAS (and created its context) before looking for it
        torch.mm(torch.ones(8, 8, device="cuda", dtype=dtype),
                 torch.ones(8, 8, device="cuda", dtype=dtype))
        torch.cuda.synchronize()
        path = loaded_cublas_path()
        if path is None:
            raise RuntimeError("libcublas.so is not loaded in this process")
        lib = ctypes.CDLL(path)
        c_int, vp = ctypes.c_int, ctypes.c_void_p
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetMathMode.argtypes = [vp, c_int]
        lib.cublasGetMathMode.argtypes = [vp, ctypes.POINTER(c_int)]
        lib.cublasGetVersion_v2.argtypes = [vp, ctypes.POINTER(c_int)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [
            vp, c_int, c_int, c_int, c_int, c_int,
            vp, vp, c_int, c_int, vp, c_int, c_int,
            vp, vp, c_int, c_int, c_int, c_int]
        for fn in (lib.cublasCreate_v2, lib.cublasSetMathMode, lib.cublasGetMathMode,
                   lib.cublasGetVersion_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
                   lib.cublasGemmEx):
            fn.restype = c_int
        self.lib, self.lib_path, self.dtype = lib, path, dtype
        self.dt = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}[dtype]
        h = vp()
        self._check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.h = h
        self._check(lib.cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode")
        mode, ver = c_int(), c_int()
        self._check(lib.cublasGetMathMode(h, ctypes.byref(mode)), "cublasGetMathMode")
        self._check(lib.cublasGetVersion_v2(h, ctypes.byref(ver)), "cublasGetVersion")
        self.math_mode, self.version = mode.value, ver.value
        self.workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.alpha = np.array(1.0, dtype=np.float32)
        self.beta = np.array(0.0, dtype=np.float32)
        self._alpha_p, self._beta_p = self.alpha.ctypes.data, self.beta.ctypes.data
        self._stream = None

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned cuBLAS status {status}")

    def gemm(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        ptr = torch.cuda.current_stream().cuda_stream
        if ptr != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.h, ptr), "cublasSetStream")
            self._check(self.lib.cublasSetWorkspace_v2(self.h, self.workspace.data_ptr(),
                                                       self.WORKSPACE_BYTES),
                        "cublasSetWorkspace")
            self._stream = ptr
        self._check(self.lib.cublasGemmEx(
            self.h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k,
            self._alpha_p,
            w.data_ptr(), self.dt, k,
            x.data_ptr(), self.dt, k,
            self._beta_p,
            y.data_ptr(), self.dt, n,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmEx")
        return y


def make_pedantic(dtype: torch.dtype, which: str):
    """-> (backend or None, reason or None, notes). 'auto': ctypes (graph-capturable),
    checked bit-for-bit against CuPy's binding where CuPy is there; else CuPy."""
    notes, errors = [], []
    cupy_b = ctypes_b = None
    if which in ("auto", "cupy"):
        try:
            cupy_b = PedanticCupy(dtype)
        except Exception as e:  # noqa: BLE001
            errors.append("CuPy binding: " + err_str(e, 100))
    if which in ("auto", "ctypes"):
        try:
            ctypes_b = PedanticCtypes(dtype)
        except Exception as e:  # noqa: BLE001
            errors.append("ctypes: " + err_str(e, 100))
    if which == "auto" and ctypes_b is not None and cupy_b is not None:
        try:
            g = torch.Generator(device="cuda").manual_seed(7)
            x = torch.randn(256, 4096, device="cuda", dtype=dtype, generator=g)
            w = torch.randn(4096, 4096, device="cuda", dtype=dtype, generator=g) / 64
            a, b = ctypes_b.mm(x, w), cupy_b.mm(x, w)
            torch.cuda.synchronize()
            same = rows_equal_bitwise(a, b)
            notes.append(f"PEDANTIC via ctypes gave {'the same bits as' if same else 'DIFFERENT bits from'}"
                         f" CuPy's gemmEx binding on a 256x4096x4096 check")
            if not same:
                ctypes_b = None
                errors.append("ctypes backend disagrees with CuPy's binding")
        except Exception as e:  # noqa: BLE001
            notes.append("ctypes vs CuPy cross-check failed: " + err_str(e, 80))
    chosen = ctypes_b if ctypes_b is not None else cupy_b
    if chosen is None:
        return None, "; ".join(errors) or "no backend", notes
    if chosen is cupy_b and which == "auto":
        notes.append("PEDANTIC through CuPy's binding, which cannot be graph-captured: "
                     "timed by an event-timed loop (includes host launch cost)")
    chosen.cupy_version = getattr(cupy_b, "cupy_version", None)
    for e in errors:
        notes.append("PEDANTIC " + e)
    return chosen, None, notes


class InputSet:
    __slots__ = ("x", "w", "wt", "y")

    def __init__(self, x, w, y):
        self.x, self.w, self.wt, self.y = x, w, w.t(), y


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a32, r32 = a.float(), ref.float()
    den = torch.linalg.vector_norm(r32).item()
    num = torch.linalg.vector_norm(a32 - r32).item()
    if not math.isfinite(num) or not math.isfinite(den):
        return float("nan")
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all().item())


def make_sets(m, k, n, dtype, l2_bytes):
    el = torch.empty((), dtype=dtype).element_size()
    set_bytes = (m * k + n * k + m * n) * el
    target = 4 * l2_bytes
    n_sets = max(1, min(MAX_SETS, -(-target // set_bytes)))
    sets = []
    for _ in range(n_sets):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype).mul_(k ** -0.5)
        y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        sets.append(InputSet(x, w, y))
    return sets, set_bytes


def _estimate_ms(fn, sets) -> float:
    n = 3
    while True:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fn(sets[i % len(sets)])
        e.record()
        e.synchronize()
        ms = s.elapsed_time(e)
        if ms >= 2.0 or n > 1000:
            return ms / n
        n *= 8


def _capture(fn, sets, r, cap_stream, mode):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=cap_stream, capture_error_mode=mode):
        for i in range(r):
            fn(sets[i % len(sets)])
    return g


def _replay_ms(g, n) -> list[float]:
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(n)]
    for s, e in evs:
        s.record()
        g.replay()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in evs]


def _safe_sync() -> None:
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def _warm(fn, sets, cap_stream) -> None:
    """Compile / create handles / allocate workspaces, on the default and capture streams."""
    for i in range(min(len(sets), 3)):
        fn(sets[i])
    torch.cuda.synchronize()
    cap_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap_stream):
        fn(sets[0])
    torch.cuda.current_stream().wait_stream(cap_stream)
    torch.cuda.synchronize()


class _Unit:
    """One peer's timed unit for one shape: a graph of R GEMMs, or R eager calls."""

    def __init__(self, peer, fn, est_ms):
        self.peer, self.fn, self.est_ms = peer, fn, est_ms
        self.graph, self.method, self.cap_err, self.error = None, None, None, None

    def capture(self, sets, r, cap_stream) -> None:
        self.graph = None
        for mode in ("global", "relaxed"):
            try:
                self.graph = _capture(self.fn, sets, r, cap_stream, mode)
                self.method = "graph" if mode == "global" else "graph (relaxed capture)"
                return
            except Exception as e:  # noqa: BLE001
                self.cap_err = err_str(e, 120)
                _safe_sync()
        self.method = "events-loop"

    def run(self, sets, r) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            for i in range(r):
                self.fn(sets[i % len(sets)])


def time_shape(fns: dict, sets, target_ms: float, reps: int, cap_stream) -> dict:
    """Per-peer median time per GEMM on one shape.

    Every peer runs the same R GEMMs over the same rotated input sets (R chosen so the
    fastest peer's replay takes >= target_ms). Each peer is captured in a CUDA graph (an
    event-timed eager loop of R calls where capture fails). The timed replays are
    interleaved round-robin, the order rotating each round, after WARM_ROUNDS untimed
    rounds, so clock and power drift (an H100 under sustained GEMM load slows down within
    tens of ms) falls on all peers alike instead of on whichever is timed last."""
    n_sets = len(sets)
    out = {p: {} for p in fns}
    units = []
    for peer, fn in fns.items():
        try:
            _warm(fn, sets, cap_stream)
            units.append(_Unit(peer, fn, _estimate_ms(fn, sets)))
        except Exception as e:  # noqa: BLE001
            out[peer]["error"] = err_str(e, 80)
            _safe_sync()
    if not units:
        return out
    r = max(n_sets, min(MAX_R, math.ceil(target_ms / max(min(u.est_ms for u in units), 1e-4))))

    def build(r_):
        for u in units:
            if u.error is None:
                u.capture(sets, r_, cap_stream)
        once = {}
        for u in units:
            if u.error is not None:
                continue
            try:
                for _ in range(WARM_REPLAYS):
                    u.run(sets, r_)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                u.run(sets, r_)
                e.record()
                e.synchronize()
                once[u.peer] = s.elapsed_time(e)
            except Exception as ex:  # noqa: BLE001
                u.error = err_str(ex, 80)
                u.graph = None
                _safe_sync()
        return once

    once = build(r)
    if once and min(once.values()) < 0.5 * target_ms and r < MAX_R:
        # the eager estimate included launch gaps; scale R to the measured replay
        r = max(r + 1, min(MAX_R, math.ceil(r * target_ms / max(min(once.values()), 1e-3))))
        for u in units:
            u.graph = None
        _safe_sync()
        build(r)

    live = [u for u in units if u.error is None]
    records = []
    for rnd in range(WARM_ROUNDS + reps):
        k = rnd % max(1, len(live))
        for u in live[k:] + live[:k]:
            if u.error is not None:
                continue
            try:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                u.run(sets, r)
                e.record()
                if rnd >= WARM_ROUNDS:
                    records.append((u, s, e))
            except Exception as ex:  # noqa: BLE001
                u.error = err_str(ex, 80)
                _safe_sync()
    torch.cuda.synchronize()
    times = {}
    for u, s, e in records:
        times.setdefault(u.peer, []).append(s.elapsed_time(e))
    for u in units:
        res = out[u.peer]
        res.update({"n_sets": n_sets, "est_ms": u.est_ms, "R": r, "method": u.method})
        if u.cap_err and u.method != "graph":
            res["capture_error"] = u.cap_err
        if u.error is not None:
            res["error"] = u.error
            continue
        t = times.get(u.peer) or []
        if not t:
            res["error"] = "no timings"
            continue
        med = statistics.median(t)
        res.update({"us": med / r * 1000.0, "replay_ms_median": med,
                    "replay_ms_min": min(t), "replay_ms_max": max(t), "reps": len(t)})
        u.graph = None
    del units, live, records
    return out


def bucket_for(dg, dtype_name, arch, m, n, k) -> str:
    try:
        import importlib
        disp = importlib.import_module("detgemm_cute.dispatch")
        return fmt_bucket(disp.lookup("fwd", dtype_name, arch, m, n, k))
    except Exception as e:  # noqa: BLE001
        return "? (" + _short(err_str(e), 30) + ")"


def bench_shape(m, k, n, ctx) -> dict:
    dtype, args = ctx["dtype"], ctx["args"]
    row = {"M": m, "K": k, "N": n, "bucket": None, "notes": [],
           "detgemm": {}, "cublas": {}, "pedantic": {},
           "err_det": None, "ok_det": None, "err_ped": None, "ok_ped": None,
           "bits_eq_cublas": None, "bits_eq_pedantic": None,
           "ratio_cublas": None, "ratio_pedantic": None}
    if ctx["dg"] is not None:
        row["bucket"] = bucket_for(ctx["dg"], ctx["dtype_name"], ctx["arch"], m, n, k)
    try:
        sets, set_bytes = make_sets(m, k, n, dtype, ctx["l2_bytes"])
    except Exception as e:  # noqa: BLE001
        row["notes"].append("inputs: " + err_str(e, 80))
        return row
    row["set_bytes"] = set_bytes
    s0 = sets[0]
    dg, ped = ctx["dg"], ctx["ped"]

    fns = {"cublas": lambda s: torch.mm(s.x, s.wt)}
    if dg is not None:
        fns["detgemm"] = lambda s: dg.mm(s.x, s.wt)
    else:
        row["detgemm"]["error"] = "detgemm_cute not importable"
    if ped is not None:
        fns["pedantic"] = lambda s: ped.gemm(s.x, s.w, s.y)
    else:
        row["pedantic"]["error"] = ctx["ped_reason"]

    # ---- correctness, once per shape, on set 0
    ref = None
    try:
        ref = torch.mm(s0.x, s0.wt)
        torch.cuda.synchronize()
        if not all_finite(ref):
            row["notes"].append("torch.mm output not finite")
    except Exception as e:  # noqa: BLE001
        row["cublas"]["error"] = err_str(e, 80)
        fns.pop("cublas", None)
    if "detgemm" in fns:
        try:
            y = dg.mm(s0.x, s0.wt)
            torch.cuda.synchronize()
            if ref is not None:
                row["err_det"] = rel_err(y, ref)
                row["ok_det"] = all_finite(y) and row["err_det"] < DET_TOL
                row["bits_eq_cublas"] = rows_equal_bitwise(ref, y)
            del y
        except Exception as e:  # noqa: BLE001
            row["detgemm"]["error"] = err_str(e, 80)
            fns.pop("detgemm")
    if "pedantic" in fns:
        try:
            s0.y.fill_(float("nan"))
            ped.gemm(s0.x, s0.w, s0.y)
            torch.cuda.synchronize()
            if ref is not None:
                row["err_ped"] = rel_err(s0.y, ref)
                row["ok_ped"] = all_finite(s0.y) and row["err_ped"] < PED_TOL
                if "detgemm" in fns:
                    yd = dg.mm(s0.x, s0.wt)
                    row["bits_eq_pedantic"] = rows_equal_bitwise(s0.y, yd)
                    del yd
        except Exception as e:  # noqa: BLE001
            row["pedantic"]["error"] = err_str(e, 80)
            fns.pop("pedantic")
    del ref
    # never time a wrong (or unchecked) result
    if "detgemm" in fns and row["ok_det"] is not True:
        row["detgemm"]["error"] = (f"wrong result (rel err {fmt_num(row['err_det'], '{:.1e}')})"
                                   if row["ok_det"] is False else "unchecked (no reference)")
        fns.pop("detgemm")
    if "pedantic" in fns and row["ok_ped"] is not True:
        row["pedantic"]["error"] = (f"wrong result (rel err {fmt_num(row['err_ped'], '{:.1e}')})"
                                    if row["ok_ped"] is False else "unchecked (no reference)")
        fns.pop("pedantic")

    # ---- timing (all peers of this shape together, interleaved)
    order = {p: fns[p] for p in PEERS if p in fns}
    try:
        timed = time_shape(order, sets, args.target_ms, args.reps, ctx["cap_stream"])
    except Exception as e:  # noqa: BLE001
        timed = {p: {"error": err_str(e, 80)} for p in order}
        _safe_sync()
    for peer, res in timed.items():
        if res.get("us") is not None:
            res["tflops"] = tflops(m, n, k, res["us"])
        row[peer].update(res)
    row["ratio_cublas"] = speed_ratio(row["detgemm"].get("us"), row["cublas"].get("us"))
    row["ratio_pedantic"] = speed_ratio(row["detgemm"].get("us"), row["pedantic"].get("us"))
    del sets, s0
    torch.cuda.empty_cache()
    return row


def run_probe(kn_list, ctx) -> list[dict]:
    dtype, dg, ped = ctx["dtype"], ctx["dg"], ctx["ped"]
    ops = {"cublas": lambda x, w: torch.mm(x, w.t())}
    if ped is not None:
        ops["pedantic"] = lambda x, w: ped.mm(x, w)
    if dg is not None:
        ops["detgemm"] = lambda x, w: dg.mm(x, w.t())
    out = []
    for (k, n) in kn_list:
        entry = {"K": k, "N": n, "rows": PROBE_ROWS, "ms": list(PROBE_MS),
                 "breaks": {}, "errors": {}, "rerun_same": {}}
        if dg is None:
            entry["errors"]["detgemm"] = "detgemm_cute not importable"
        if ped is None:
            entry["errors"]["pedantic"] = ctx["ped_reason"]
        try:
            x = torch.randn(PROBE_ROWS, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype).mul_(k ** -0.5)
        except Exception as e:  # noqa: BLE001
            entry["errors"] = {p: "inputs: " + err_str(e, 60) for p in PEERS}
            out.append(entry)
            continue
        for peer, op in ops.items():
            try:
                full = op(x, w)
                again = op(x, w)
                torch.cuda.synchronize()
                entry["rerun_same"][peer] = rows_equal_bitwise(full, again)
                del again
                breaks = []
                for m in PROBE_MS:
                    part = op(x[:m].clone(), w)
                    if not rows_equal_bitwise(full, part):
                        breaks.append(m)
                entry["breaks"][peer] = breaks
                del full
            except Exception as e:  # noqa: BLE001
                entry["errors"][peer] = err_str(e, 80)
        log(f"probe K={k} N={n}: " + "; ".join(
            f"{PEER_LABELS[p]}: {_ms_list(entry['breaks'].get(p)) if p not in entry['errors'] else 'error'}"
            for p in ("cublas", "pedantic", "detgemm")))
        del x, w
        torch.cuda.empty_cache()
        out.append(entry)
    return out


def run_overhead(ctx) -> dict:
    dtype, dg = ctx["dtype"], ctx["dg"]
    x = torch.randn(64, 64, device="cuda", dtype=dtype)
    w = torch.randn(64, 64, device="cuda", dtype=dtype)
    wt = w.t()
    res = {"shape": [64, 64, 64], "calls": OVERHEAD_CALLS, "repeats": OVERHEAD_REPEATS}
    fns = {"cublas": lambda: torch.mm(x, wt)}
    if dg is not None:
        fns["detgemm"] = lambda: dg.mm(x, wt)
    else:
        res["detgemm"] = {"error": "detgemm_cute not importable"}
    for peer in ("detgemm", "cublas"):
        if peer not in fns:
            continue
        fn = fns[peer]
        try:
            for _ in range(OVERHEAD_CALLS):   # one untimed repetition
                fn()
            torch.cuda.synchronize()
            reps, enq = [], []
            for _ in range(OVERHEAD_REPEATS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(OVERHEAD_CALLS):
                    fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                reps.append((t2 - t0) / OVERHEAD_CALLS * 1e6)
                enq.append((t1 - t0) / OVERHEAD_CALLS * 1e6)
            # device time of one such GEMM, for telling host-bound from device-bound
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=ctx["cap_stream"]):
                    for _ in range(200):
                        fn()
                g.replay()
                dev_us = statistics.median(_replay_ms(g, 5)) / 200 * 1000.0
                del g
            except Exception:  # noqa: BLE001
                dev_us = None
                torch.cuda.synchronize()
            res[peer] = {"us_per_call": statistics.median(reps), "reps_us": reps,
                         "enqueue_us": statistics.median(enq), "device_us": dev_us}
        except Exception as e:  # noqa: BLE001
            res[peer] = {"error": err_str(e, 100)}
    return res


def collect_meta(ctx, args) -> dict:
    props = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability(0)
    meta = {
        "device": torch.cuda.get_device_name(0),
        "capability": f"{major}{minor}",
        "sm_count": getattr(props, "multi_processor_count", None),
        "l2_mb": ctx["l2_bytes"] / 1e6,
        "memory_gb": getattr(props, "total_memory", 0) / 1e9,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": args.dtype,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "detgemm": getattr(ctx["dg"], "__version__", None) if ctx["dg"] is not None else
        f"not importable ({ctx['dg_reason']})",
        "cupy": getattr(ctx["ped"], "cupy_version", None),
        "pedantic_backend": ctx["ped"].backend if ctx["ped"] is not None else None,
        "pedantic_lib": getattr(ctx["ped"], "lib_path", None),
        "cublas_version": ctx["ped"].version if ctx["ped"] is not None else None,
        "pedantic_math_mode": ctx["ped"].math_mode if ctx["ped"] is not None else None,
        "pedantic": "ok" if ctx["ped"] is not None else ctx["ped_reason"],
        "allow_bf16_reduced_precision_reduction":
            getattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", None),
        "allow_fp16_reduced_precision_reduction":
            getattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", None),
        "arch": ctx["arch"],
        "quick": bool(args.quick),
        "shapes": [list(s) for s in args.shape_list],
        "target_ms": args.target_ms,
        "reps": args.reps,
        "seed": args.seed,
        "argv": sys.argv[1:],
        "timing": (f"per shape, each peer captured as one CUDA graph of the same R GEMMs "
                   f"(R set so the fastest peer's replay takes >= {args.target_ms:g} ms); "
                   f"replays interleaved round-robin across peers (order rotating), "
                   f"{WARM_ROUNDS} untimed rounds then {args.reps} timed, each replay timed "
                   f"with CUDA events; time = median replay / R. Inputs rotate over n sets "
                   f"inside the graph, n = ceil(4 x L2 / set bytes) capped at {MAX_SETS}, so "
                   f"weights are not served from L2"),
        "notes": [],
    }
    try:
        import cutlass
        meta["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except Exception:  # noqa: BLE001
        meta["cutlass_dsl"] = None
    if ctx["ped"] is None:
        meta["notes"].append(f"PEDANTIC column skipped: {ctx['ped_reason']}")
    elif ctx["ped"].math_mode != CUBLAS_PEDANTIC_MATH:
        meta["notes"].append(f"PEDANTIC handle reports math mode {ctx['ped'].math_mode}")
    return meta


def main(argv=None) -> int:
    args = parse_args(argv)
    why = gpu_check()
    if why is not None:
        print(f"bench_gemm: this benchmark needs an SM90 GPU (H100/H200) with CUDA: {why}. "
              f"Nothing was run.", flush=True)
        return 2

    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    ctx = {"args": args, "dtype": dtype, "dtype_name": args.dtype, "l2_bytes": l2,
           "dg": None, "dg_reason": None, "ped": None, "ped_reason": None, "arch": "sm90"}
    try:
        import detgemm_cute as dg
        ctx["dg"] = dg
        try:
            from detgemm_cute.gemm import arch_of
            ctx["arch"] = arch_of(torch.device("cuda", 0))
        except Exception:  # noqa: BLE001
            pass
    except Exception as e:  # noqa: BLE001
        ctx["dg_reason"] = err_str(e, 120)
        log(f"detgemm_cute import failed: {ctx['dg_reason']}")
    ped_notes = []
    if args.no_pedantic:
        ctx["ped_reason"] = "--no-pedantic"
    else:
        try:
            ctx["ped"], ctx["ped_reason"], ped_notes = make_pedantic(dtype, args.pedantic_backend)
        except Exception as e:  # noqa: BLE001
            ctx["ped"], ctx["ped_reason"] = None, err_str(e, 100)
        if ctx["ped"] is None:
            log(f"NOTE: skipping the PEDANTIC column ({ctx['ped_reason']})")
        else:
            log(f"PEDANTIC backend: {ctx['ped'].describe()}")
        for n_ in ped_notes:
            log(n_)
    ctx["cap_stream"] = torch.cuda.Stream()
    torch.manual_seed(args.seed)

    meta = collect_meta(ctx, args)
    meta["notes"].extend(ped_notes)
    log(f"{meta['device']} sm_{meta['capability']}, torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"detgemm {meta['detgemm']}, cuBLAS {meta['cublas_version']}, CuPy {meta['cupy']}, "
        f"L2 {l2 / 1e6:.0f} MB, dtype {args.dtype}, {len(args.shape_list)} shapes")

    rows = []
    t_start = time.time()
    with torch.no_grad():
        for i, (m, k, n) in enumerate(args.shape_list):
            t0 = time.time()
            try:
                row = bench_shape(m, k, n, ctx)
            except Exception as e:  # noqa: BLE001
                row = {"M": m, "K": k, "N": n, "bucket": None, "notes": ["row: " + err_str(e)],
                       "detgemm": {}, "cublas": {}, "pedantic": {},
                       "ratio_cublas": None, "ratio_pedantic": None}
            rows.append(row)
            d, c, p = (row.get(x) or {} for x in PEERS)
            log(f"{i + 1}/{len(args.shape_list)} M={m} K={k} N={n} [{row.get('bucket')}] "
                f"det {fmt_us(d.get('us'))} us, cuB {fmt_us(c.get('us'))} us, "
                f"PED {fmt_us(p.get('us'))} us, det/cuB {fmt_num(row.get('ratio_cublas'), '{:.2f}')}, "
                f"err {fmt_num(row.get('err_det'), '{:.1e}')}"
                + (f" | {'; '.join(row_notes(row))}" if row_notes(row) else "")
                + f" ({time.time() - t0:.1f} s)")

        probe = None
        if not args.no_probe:
            log("batch-invariance probe")
            try:
                probe = run_probe(distinct_kn(args.shape_list), ctx)
            except Exception as e:  # noqa: BLE001
                probe = []
                meta["notes"].append("probe failed: " + err_str(e))
        overhead = None
        if not args.no_overhead:
            log("host overhead")
            try:
                overhead = run_overhead(ctx)
            except Exception as e:  # noqa: BLE001
                meta["notes"].append("host overhead failed: " + err_str(e))

    meta["elapsed_s"] = round(time.time() - t_start, 1)
    if any((r.get(p) or {}).get("method") not in (None, "graph") for r in rows for p in PEERS):
        meta["notes"].append("some cells were not timed from a strict-mode CUDA graph: "
                             "see the notes column")
    report = {"meta": meta, "rows": rows, "summary": summarize(rows), "probe": probe,
              "overhead": overhead}
    md = render_markdown(report)

    slug = device_slug(meta["device"])
    os.makedirs(args.out, exist_ok=True)
    suffix = "_decode" if args.suite == "decode" and not args.shapes else ""
    base = os.path.join(args.out, f"gemm_{slug}{suffix}")
    with open(base + ".md", "w") as f:
        f.write(md)
    with open(base + ".json", "w") as f:
        json.dump(json_clean(report), f, indent=1, default=json_default)
    try:
        note = write_plot(rows, base + ".png",
                          f"detgemm_cute vs cuBLAS, {meta['device']}, {args.dtype}")
    except Exception as e:  # noqa: BLE001
        note = "plot failed: " + err_str(e)
    if note:
        log(note)
    log(f"wrote {base}.md, {base}.json" + ("" if note else f", {base}.png")
        + f" in {meta['elapsed_s']} s")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
