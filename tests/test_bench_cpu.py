"""CPU-only checks of the bench: the pure parts of detgemm_cute.benchlib (arithmetic, shapes,
suites, model table, rendering, JSON) and bench/bench_gemm.py's command line and no-GPU exit.

Benchmark timings are never asserted here (tests/test_benchlib_fake_gpu.py runs the GPU code
paths on CPU tensors with a fake CUDA)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types

import pytest
import torch

from detgemm_cute.benchlib import fmt, models, report, stats, suites
from detgemm_cute.benchlib.checks import rows_equal_bitwise
from detgemm_cute.benchlib.shapes import (Problem, dedup, parse_ops, parse_shape,
                                          problems_for, read_shapes_file, subsample)

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "bench", "bench_gemm.py")


@pytest.fixture(scope="module")
def bg():
    spec = importlib.util.spec_from_file_location("bench_gemm_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(m, k=4096, n=4096, det=None, cub=None, ped=None, lt=None, op="fwd", **extra):
    row = {"op": op, "M": m, "K": k, "N": n, "label": "llama3-8b tp1 o",
           "bucket": "b64 64x64x128 s5 c1x1", "bytes": 2 * (m * k + n * k + m * n), "notes": [],
           "peers": {}, "err": {"detgemm": 3e-3, "pedantic": 3e-3}, "ok": {"detgemm": True},
           "same_bits": {"cublas": True, "pedantic": False, "cublaslt": True}, "ratio": {}}
    for peer, us in (("detgemm", det), ("cublas", cub), ("pedantic", ped), ("cublaslt", lt)):
        row["peers"][peer] = ({"us": us, "tflops": stats.tflops(m, n, k, us), "method": "graph",
                               "R": 10, "n_sets": 4} if us is not None else {})
    for peer in ("cublas", "pedantic", "cublaslt"):
        row["ratio"][peer] = stats.speed_ratio(det, row["peers"][peer].get("us"))
    row.update(extra)
    return row


def _report(rows, device="NVIDIA H100 80GB HBM3"):
    return {
        "meta": {"device": device, "capability": "90", "sm_count": 132, "l2_mb": 52.4,
                 "torch": "2.11.0+cu130", "cuda": "13.0", "cublas_version": 130100,
                 "cupy": "14.2.0", "detgemm": "0.1.0", "cutlass_dsl": "4.8.1", "arch": "sm90",
                 "dtype": "bf16", "date": "2026-11-22 12:00 UTC", "timing": "graphs",
                 "suite": "core", "peers": ["detgemm", "cublas", "pedantic", "cublaslt"],
                 "notes": ["example note"]},
        "rows": rows,
        "summary": stats.summarize(rows),
        "probe": [{"K": 4096, "N": 4096, "ms": [1, 2, 16],
                   "breaks": {"cublas": [16], "pedantic": [1, 2], "detgemm": [], "cublaslt": [1]},
                   "errors": {}, "rerun_same": {"cublas": True, "pedantic": True,
                                                "detgemm": True, "cublaslt": True}},
                  {"K": 14336, "N": 4096, "ms": [1, 2, 16],
                   "breaks": {"cublas": [1, 2, 3], "detgemm": [], "cublaslt": []},
                   "errors": {"pedantic": "CUBLASError: CUBLAS_STATUS_NOT_SUPPORTED"},
                   "rerun_same": {"cublas": True, "detgemm": True}}],
        "overhead": {"shape": [64, 64, 64], "calls": 2000, "repeats": 5,
                     "detgemm": {"us_per_call": 7.1, "reps_us": [7.0, 7.1, 7.2, 7.1, 7.3],
                                 "enqueue_us": 7.05, "device_us": 2.25},
                     "cublas": {"us_per_call": 4.2, "reps_us": [4.1, 4.2, 4.2, 4.3, 4.2]}},
    }


# ---------------------------------------------------------------------------------------
# stats, fmt
# ---------------------------------------------------------------------------------------

def test_geomean_and_ratios():
    assert stats.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert stats.geomean([0.5, 2.0]) == pytest.approx(1.0)
    assert stats.geomean([4.0, None, 0.0, -1.0, float("nan"), float("inf"), True]) == \
        pytest.approx(4.0)
    assert stats.geomean([]) is None and stats.geomean([None]) is None
    assert stats.speed_ratio(10.0, 20.0) == pytest.approx(2.0)
    assert stats.speed_ratio(None, 10.0) is None and stats.speed_ratio(0.0, 10.0) is None
    assert stats.tflops(8192, 8192, 8192, 1375.0) == pytest.approx(2 * 8192**3 / 1375e-6 / 1e12)
    assert stats.tflops(1, 1, 1, 0.0) is None
    assert stats.tbytes_per_s(3e6, 1.0) == pytest.approx(3.0)
    assert stats.tbytes_per_s(None, 1.0) is None


def test_bands_and_summary():
    assert [stats.band_of(m) for m in (1, 64, 65, 127, 128, 511, 512, 16384)] == [
        "M<=64", "M<=64", "64<M<128", "64<M<128", "128<=M<512", "128<=M<512", "M>=512",
        "M>=512"]
    rows = [
        _row(1, det=10.0, cub=5.0, ped=20.0, lt=40.0),         # 0.5 / 2 / 4
        _row(16, det=10.0, cub=20.0, ped=40.0, lt=10.0),       # 2 / 4 / 1
        _row(128, det=10.0, cub=None, ped=10.0, lt=10.0),      # no cuBLAS time
        _row(512, det=100.0, cub=100.0, ped=50.0, lt=100.0),   # 1 / 0.5 / 1
        _row(2048, det=100.0, cub=400.0, ped=200.0, lt=100.0, op="dx"),  # 4 / 2 / 1
        _row(16384, det=None, cub=400.0, ped=None, lt=None),   # detgemm failed
    ]
    s = stats.summarize(rows)
    small, big = s["cublas"]["M<=64"], s["cublas"]["M>=512"]
    assert small["geomean"] == pytest.approx(1.0) and small["n"] == 2 and small["rows"] == 2
    assert big["geomean"] == pytest.approx(2.0) and big["n"] == 2 and big["rows"] == 3
    assert big["min"] == pytest.approx(1.0) and big["max"] == pytest.approx(4.0)
    assert s["cublas"]["128<=M<512"]["n"] == 0 and s["cublas"]["128<=M<512"]["rows"] == 1
    assert "64<M<128" not in s["cublas"]                       # no rows: no group
    assert s["cublaslt"]["all"]["geomean"] == pytest.approx((4 * 1 * 1 * 1 * 1) ** (1 / 5))
    assert s["cublas"]["dx: all"]["geomean"] == pytest.approx(4.0)   # per op when several
    assert s["cublas"]["fwd: M>=512"]["n"] == 1
    worst = stats.worst_rows(rows, "cublas", 2)
    assert [r["M"] for r in worst] == [1, 512]
    assert stats.summarize([])["cublas"]["all"]["geomean"] is None


def test_fmt_helpers():
    assert fmt.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert fmt.device_slug("  ") == "unknown-device"
    b = types.SimpleNamespace(name="m64_n128", tile=(64, 128, 64), stages=6, cluster=(1, 1),
                              persistent=True)
    assert fmt.fmt_bucket(b) == "m64_n128 64x128x64 s6 c1x1 p"
    assert fmt.fmt_bucket(types.SimpleNamespace(name="x")) == "x" and fmt.fmt_bucket(None) == "?"
    assert fmt.fmt_us(12.345) == "12.35" and fmt.fmt_us(1234.5) == "1234.5"
    assert fmt.fmt_us(None) == "-"
    assert json.loads(json.dumps(fmt.json_clean({"a": (1.0, float("nan"))}), allow_nan=False)) \
        == {"a": [1.0, None]}


# ---------------------------------------------------------------------------------------
# shapes, models, suites
# ---------------------------------------------------------------------------------------

def test_problem_dims_and_bytes():
    p = Problem("fwd", 8, 4096, 1024)
    assert p.gemm_mnk == (8, 1024, 4096)
    assert p.nbytes() == 2 * (8 * 4096 + 1024 * 4096 + 8 * 1024)
    dx = Problem("dx", 8, 4096, 1024)
    assert dx.gemm_mnk == (8, 4096, 1024)
    assert dx.nbytes() == 2 * (8 * 1024 + 1024 * 4096 + 8 * 4096)
    dw = Problem("dw", 8, 4096, 1024)
    assert dw.gemm_mnk == (1024, 4096, 8) and dw.out_fp32
    assert dw.nbytes() == 2 * (8 * 1024 + 8 * 4096) + 4 * 1024 * 4096
    assert dw.flops() == 2 * 8 * 4096 * 1024
    with pytest.raises(ValueError):
        Problem("bwd", 1, 1, 1)
    with pytest.raises(ValueError):
        Problem("fwd", 0, 1, 1)


def test_parsers(tmp_path):
    assert parse_shape("2048x4096x14336") == (2048, 4096, 14336)
    assert parse_shape("1,768,3072") == (1, 768, 3072)
    for bad in ("2048x4096", "0x4096x4096", "axbxc"):
        with pytest.raises(ValueError):
            parse_shape(bad)
    assert parse_ops("fwd,dw") == ("fwd", "dw") and parse_ops(["dx"]) == ("dx",)
    with pytest.raises(ValueError):
        parse_ops("fwd,bwd")
    f = tmp_path / "shapes.txt"
    f.write_text("# model shapes\n1000x5120x5120  my layer\n\n777x4096x11008 # comment\n")
    assert read_shapes_file(f) == [((1000, 5120, 5120), "my layer"), ((777, 4096, 11008), "")]
    f.write_text("1000x5120\n")
    with pytest.raises(ValueError, match="shapes.txt:1"):
        read_shapes_file(f)


def test_dedup_and_subsample():
    probs = problems_for([((1, 2, 3), "a"), ((1, 2, 3), "b"), ((4, 5, 6), "c")], ("fwd", "dx"))
    d = dedup(probs)
    assert [p.key for p in d] == [("fwd", 1, 2, 3), ("dx", 1, 2, 3), ("fwd", 4, 5, 6),
                                  ("dx", 4, 5, 6)]
    assert d[0].label == "a / b"
    assert subsample(range(10), every=3) == [0, 3, 6, 9]
    assert subsample(range(10), every=2, limit=3) == [0, 2, 4]
    # Per op: a suite listing fwd, dx, dw per weight keeps the same weights of each op.
    from detgemm_cute.benchlib import suites
    probs = suites.suite_problems("prefill-heldout", ("fwd", "dx", "dw"))
    kept = subsample(probs, every=3, key=lambda q: q.op)
    by_op = {op: [(q.m, q.k, q.n) for q in kept if q.op == op] for op in ("fwd", "dx", "dw")}
    assert by_op["fwd"] and by_op["fwd"] == by_op["dx"] == by_op["dw"]
    assert len(kept) == 3 * len(by_op["fwd"]) == 3 * -(-len(probs) // 9)
    assert {q.op for q in subsample(probs, every=3)} == {"fwd"}  # the plain count: one op
    assert subsample("aAbBcC", every=2, offset=1, key=str.isupper) == ["b", "B"]
    with pytest.raises(ValueError):
        subsample(range(3), every=0)


def test_model_table_numbers():
    by = {m.name: m for m in models.MODELS}
    l8 = {w.layer: (w.k, w.n) for w in models.model_weights(by["llama3-8b"], 1)}
    assert l8 == {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                  "down": (14336, 4096), "lm_head": (4096, 128256)}
    l70_8 = {w.layer: (w.k, w.n) for w in models.model_weights(by["llama3-70b"], 8)}
    assert l70_8 == {"qkv": (8192, 1280), "o": (1024, 8192), "gate_up": (8192, 7168),
                     "down": (3584, 8192), "lm_head": (8192, 16032)}
    q7 = {w.layer: (w.k, w.n) for w in models.model_weights(by["qwen2.5-7b"], 1)}
    assert q7["qkv"] == (3584, 4608) and q7["down"] == (18944, 3584)
    assert q7["lm_head"] == (3584, 152064)
    assert models.model_weights(by["qwen2.5-7b"], 8) == []          # 28 heads / 8
    q7_4 = {w.layer: (w.k, w.n) for w in models.model_weights(by["qwen2.5-7b"], 4)}
    assert q7_4["qkv"] == (3584, (7 + 2) * 128) and "lm_head" not in q7_4
    q72 = {w.layer: (w.k, w.n) for w in models.model_weights(by["qwen2.5-72b"], 8)}
    assert q72["gate_up"] == (8192, 7392) and q72["down"] == (3696, 8192)
    g9 = {w.layer: (w.k, w.n) for w in models.model_weights(by["gemma2-9b"], 1)}
    assert g9["qkv"] == (3584, 8192) and g9["o"] == (4096, 3584)
    assert g9["lm_head"] == (3584, 256000)
    g9_8 = {w.layer: (w.k, w.n) for w in models.model_weights(by["gemma2-9b"], 8)}
    assert g9_8["qkv"] == (3584, (2 + 2) * 256)                      # 8 KV heads / 8
    gpt2 = {w.layer: (w.k, w.n) for w in models.model_weights(by["gpt2"], 1)}
    assert gpt2 == {"qkv": (768, 2304), "o": (768, 768), "up": (768, 3072),
                    "down": (3072, 768), "lm_head": (768, 50257)}
    assert models.model_weights(by["gpt2"], 8) == [] or 8 not in by["gpt2"].tps
    mix = {w.layer: (w.k, w.n) for w in models.model_weights(by["mixtral-8x7b"], 2)}
    assert mix["gate_up"] == (4096, 14336) and mix["down"] == (7168, 4096)
    # replicated KV heads: 8 heads of 70B at TP 8 -> 1 per rank; kv 4 at TP 8 -> replicated
    assert models.kv_heads_per_rank(by["llama3-70b"], 8) == 1
    assert models.kv_heads_per_rank(by["qwen2.5-7b"], 8) == 1
    ws = models.all_weights()
    assert all(w.tp in (1, 8) for w in ws if w.layer == "lm_head")


def test_suites():
    core = suites.suite_problems("core")
    assert len(core) == 48 and Problem("fwd", 16384, 14336, 4096) in core
    quick = suites.suite_problems("quick")
    assert 0 < len(quick) < len(core) and set(quick) <= set(core)
    assert len(suites.suite_problems("decode")) == 25
    dec = suites.suite_problems("decode-models")
    assert {p.m for p in dec} == set(suites.DECODE_MODEL_MS)
    assert len(dec) == len(set(p.key for p in dec))                  # deduplicated
    assert Problem("fwd", 1, 8192, 1280) in dec                       # 70B qkv at TP 8
    assert all(p.op == "fwd" for p in dec)
    pre = suites.suite_problems("prefill-models")
    shapes = {(p.m, p.k, p.n) for p in pre}
    assert len(shapes) >= 100
    assert {p.op for p in pre} == {"fwd", "dx", "dw"}
    ms = {p.m for p in pre}
    assert {777, 1000, 3000, 12000, 128, 16384} <= ms and max(ms) <= 16384 and min(ms) >= 128
    assert len(pre) == 3 * len(shapes)
    assert suites.prefill_ms_for(0) == (128, 2048)
    assert [p.op for p in suites.suite_problems("prefill-models", ("dw",))][:1] == ["dw"]
    held = suites.suite_problems("prefill-heldout")
    assert {p.m for p in held} == set(suites.HELDOUT_MS)
    assert not {p.m for p in held} & ms                               # M the tuning never saw
    assert {(p.k, p.n) for p in held} == {(p.k, p.n) for p in pre}    # on the same weights
    with pytest.raises(ValueError):
        suites.suite_problems("nope")


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------

def test_render_markdown_has_device_and_columns():
    rows = [
        _row(1, det=12.5, cub=11.0, ped=30.0, lt=40.0),
        _row(2048, det=200.0, cub=190.0, ped=400.0, lt=210.0),
        _row(16, det=None, cub=9.0, ped=None, lt=9.5),
    ]
    rows[2]["ok"]["detgemm"] = False
    rows[2]["err"]["detgemm"] = 0.5
    rows[2]["peers"]["detgemm"] = {"error": "wrong result (rel err 5.0e-01)"}
    rows[2]["peers"]["pedantic"] = {"error": "CUBLASError: CUBLAS_STATUS_NOT_SUPPORTED | x"}
    rows[1]["peers"]["pedantic"]["method"] = "events-loop"
    md = report.render_markdown(_report(rows))
    cols = report.main_columns()
    header = "| " + " | ".join(cols) + " |"
    assert header in md
    for word in ("NVIDIA H100 80GB HBM3", "Summary", "Batch invariance", "Host overhead",
                 "M>=512", "M<=64", "2.11.0+cu130", "14.2.0", "example note",
                 "Slowest rows", "cuBLASLt no split-K", "LtNoSplit", "Lt-nosplit us"):
        assert word in md, word
    table = [ln for ln in md.splitlines() if ln.startswith("| fwd |")]
    assert len(table) == 3 and all(ln.count("|") == header.count("|") for ln in table)
    wrong = [ln for ln in table if ln.startswith("| fwd | 16 |")][0]
    assert "WRONG" in wrong
    cells = [c.strip() for c in wrong.strip("|").split("|")]
    assert cells[cols.index("detgemm us")] == "-" and cells[cols.index("det/cuBLAS")] == "-"
    first = [c.strip() for c in table[0].strip("|").split("|")]
    assert first[cols.index("det/Lt")] == "3.20" and first[cols.index("same bits")] == "cuB,Lt"
    assert "PED timed by events-loop" in md
    assert "| 4096 | 4096 | 16 | 1, 2 | 1 | none |" in md
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in md
    assert "| detgemm_cute.mm(x, w.t()) | 7.10 | 7.05 | 2.25 |" in md
    assert len(md.encode()) < 200_000


def test_render_without_optional_peers_and_parts():
    rows = [_row(64, det=5.0, cub=4.0)]
    rep = _report(rows)
    rep["meta"]["peers"] = ["detgemm", "cublas"]
    rep["probe"] = rep["overhead"] = None
    md = report.render_markdown(rep)
    assert "PEDANTIC us" not in md and "Lt-nosplit us" not in md
    assert "Batch invariance" not in md and "Some GPU" not in md
    empty = {"meta": {"device": "Some GPU"}, "rows": [], "summary": stats.summarize([])}
    assert "Some GPU" in report.render_markdown(empty)


def test_report_files(tmp_path):
    rows = [_row(m, k, n, det=10.0 * m ** 0.5, cub=9.0 * m ** 0.5, lt=9.5 * m ** 0.5)
            for (k, n) in ((4096, 4096), (14336, 4096)) for m in (1, 16, 512, 2048)]
    rows[0]["err"]["pedantic"] = float("nan")
    md, notes = report.write_report(_report(rows), str(tmp_path / "g"), "title")
    back = json.loads((tmp_path / "g.json").read_text())
    assert back["rows"][0]["err"]["pedantic"] is None
    assert (tmp_path / "g.md").read_text() == md
    if not notes:
        assert 0 < (tmp_path / "g.png").stat().st_size < 300_000
    many = [_row(m, 1024 + 64 * i, 4096, det=10.0, cub=9.0, lt=11.0)
            for i in range(12) for m in (1, 8)]
    pytest.importorskip("matplotlib")
    assert report.write_plot(many, str(tmp_path / "many.png"), "t") is None


def test_run_time_boxed_stops_on_sigterm_and_writes_the_rows(tmp_path, capsys):
    """The time-boxed loop of bench_pdl / bench_fp32_decode: SIGTERM during a row ends the
    run after it, and the JSON and markdown hold the rows so far; the handler is restored."""
    import signal

    from detgemm_cute.benchlib.runner import run_time_boxed

    def measure(item):
        if item == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"item": item}

    before = signal.getsignal(signal.SIGTERM)
    rows = run_time_boxed([1, 2, 3, 4], measure, tmp_path / "r", {"device": "X"}, 1e9,
                          lambda rows, meta: [f"{len(rows)} rows"])
    assert rows == [{"item": 1}, {"item": 2}]
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == rows
    assert (tmp_path / "r.md").read_text() == "2 rows\n"
    assert "stopped by SIGTERM after 2 problems" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before


def test_rows_equal_bitwise_cpu():
    torch.manual_seed(0)
    full = torch.randn(8, 5).to(torch.bfloat16)
    assert rows_equal_bitwise(full, full[:3].clone())
    part = full[:3].clone()
    part.view(torch.int16)[1, 2] ^= 1
    assert not rows_equal_bitwise(full, part)
    z = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert not rows_equal_bitwise(z, -z)
    h = torch.randn(6, 3).half()
    assert not rows_equal_bitwise(h, h[:4].float())
    f = torch.randn(4, 4)
    assert rows_equal_bitwise(f, f[:2].clone())


# ---------------------------------------------------------------------------------------
# bench/bench_gemm.py
# ---------------------------------------------------------------------------------------

def test_parse_args(bg):
    a = bg.parse_args([])
    assert a.dtype == "bf16" and a.suite == "core" and len(a.problems) == 48 and a.reps == 20
    q = bg.parse_args(["--quick", "--dtype", "fp16", "--out", "/tmp/x"])
    assert q.suite == "quick" and q.dtype == "fp16" and q.out == "/tmp/x" and q.reps < 20
    s = bg.parse_args(["--shapes", "1x4096x4096", "16x768x3072", "--ops", "fwd,dw"])
    assert s.shape_list == [(1, 4096, 4096), (1, 4096, 4096), (16, 768, 3072), (16, 768, 3072)]
    assert [p.op for p in s.problems] == ["fwd", "dw", "fwd", "dw"]
    p = bg.parse_args(["--suite", "prefill-models", "--every", "3", "--limit", "7"])
    assert len(p.problems) == 7
    d = bg.parse_args(["--suite", "decode-models", "--reps", "9", "--target-ms", "2"])
    assert d.plan.reps == 9 and d.plan.target_ms == 2.0
    with pytest.raises(SystemExit):
        bg.parse_args(["--shapes", "1x2"])


def test_results_suffix(bg, monkeypatch):
    monkeypatch.delenv("DETGEMM_CUTE_FAMILY", raising=False)
    assert bg.results_suffix(bg.parse_args([]), "sm90") == ""
    assert bg.results_suffix(bg.parse_args(["--suite", "decode"]), "sm90") == "_decode"
    assert bg.results_suffix(bg.parse_args(["--shapes", "1x8x8"]), "sm90") == "_shapes"
    monkeypatch.setenv("DETGEMM_CUTE_FAMILY", "sm80")
    assert bg.results_suffix(bg.parse_args(["--suite", "prefill-models"]), "sm80") == \
        "_prefill-models_sm80-family"


def test_main_without_gpu_returns_2(bg, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = bg.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 2 and "SM90" in out and "needs" in out
    assert not any(tmp_path.iterdir())


def test_main_on_a_gpu_without_kernels_returns_2(bg, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Tesla T4")
    assert bg.main([]) == 2
    out = capsys.readouterr().out
    assert "T4" in out and "sm_75" in out and "8.0" in out


def test_import_touches_no_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("CUDA touched at import time")
    for name in ("is_available", "get_device_capability", "get_device_name",
                 "current_stream", "synchronize", "init", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, boom)
    for mod in [m for m in sys.modules if m.startswith("detgemm_cute.benchlib")
                or m.startswith("detgemm_cute.tune")]:
        monkeypatch.delitem(sys.modules, mod)
    import detgemm_cute.benchlib.probe  # noqa: F401
    import detgemm_cute.benchlib.report  # noqa: F401
    import detgemm_cute.benchlib.runner  # noqa: F401
    import detgemm_cute.tune.command  # noqa: F401
    import detgemm_cute.tune.run_gpu  # noqa: F401
    spec = importlib.util.spec_from_file_location("bench_gemm_import_check", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.suites.suite_problems("quick")


def test_compare_runs_renders_the_stored_decode_ab(capsys, tmp_path):
    """bench/compare_runs.py on the committed decode A/B pair gives the record's numbers (the
    speed ratio, the cuBLAS drift, the floor counts); it refuses a file that is no bench_gemm
    record and two records with no problem in common."""
    root = os.path.dirname(_PATH)
    spec = importlib.util.spec_from_file_location("compare_runs_under_test",
                                                  os.path.join(root, "compare_runs.py"))
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)
    stem = os.path.join(root, "results", "decode-row-tile-ab_nvidia-h100-80gb-hbm3")
    old, new = stem + "_old.json.gz", stem + "_new.json.gz"
    floor = os.path.join(root, "results", "chain_floor_nvidia-h100-80gb-hbm3.json.gz")
    assert cr.main([old, new, "--floor", floor, "--title", "t"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# t") and "320 problems in both runs" in text
    assert "new / old: **1.033x**" in text and "old: 1.002x" in text
    assert "| old | 320 | 1.337 | 2.160 | 104 |" in text
    assert "| new | 320 | 1.295 | 2.030 | 127 |" in text
    with open(stem + ".md", encoding="utf-8") as f:
        assert "| `fwd_decode_m1_16_n1_2112` | 50 | 1.066 |" in f.read()
    bogus = tmp_path / "x.json"
    bogus.write_text(json.dumps({"meta": {}}))
    assert cr.main([old, str(bogus)]) == 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [{"op": "fwd", "M": 3, "K": 5, "N": 7,
                                           "peers": {"detgemm": {"us": 1.0}}}]}))
    assert cr.main([old, str(other)]) == 1
    assert "no problem is in both records" in capsys.readouterr().err
