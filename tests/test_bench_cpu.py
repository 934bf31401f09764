"""CPU-only checks of bench/bench_gemm.py: summary math, rendering, the no-GPU exit path.

Benchmark timings are never asserted here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import types

import pytest
import torch

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "bench", "bench_gemm.py")


@pytest.fixture(scope="module")
def bg():
    spec = importlib.util.spec_from_file_location("bench_gemm_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(bg, m, k=4096, n=4096, det=None, cub=None, ped=None, **extra):
    row = {"M": m, "K": k, "N": n, "bucket": "b64 64x64x128 s5 c1x1", "notes": [],
           "detgemm": {}, "cublas": {}, "pedantic": {},
           "err_det": 3e-3, "ok_det": True, "err_ped": 3e-3, "ok_ped": True,
           "bits_eq_cublas": True, "bits_eq_pedantic": False}
    for peer, us in (("detgemm", det), ("cublas", cub), ("pedantic", ped)):
        if us is not None:
            row[peer] = {"us": us, "tflops": bg.tflops(m, n, k, us), "method": "graph",
                         "R": 10, "n_sets": 4}
    row["ratio_cublas"] = bg.speed_ratio(det, cub)
    row["ratio_pedantic"] = bg.speed_ratio(det, ped)
    row.update(extra)
    return row


def _report(bg, rows, device="NVIDIA H100 80GB HBM3"):
    return {
        "meta": {"device": device, "capability": "90", "sm_count": 132, "l2_mb": 52.4,
                 "torch": "2.11.0+cu130", "cuda": "13.0", "cublas_version": 130100,
                 "cupy": "14.2.0", "detgemm": "0.1.0", "cutlass_dsl": "4.8.1",
                 "dtype": "bf16", "date": "2026-11-22 12:00 UTC", "timing": "graphs",
                 "notes": ["example note"]},
        "rows": rows,
        "summary": bg.summarize(rows),
        "probe": [{"K": 4096, "N": 4096, "ms": list(bg.PROBE_MS),
                   "breaks": {"cublas": [16], "pedantic": [1, 2], "detgemm": []},
                   "errors": {}, "rerun_same": {"cublas": True, "pedantic": True,
                                                "detgemm": True}},
                  {"K": 14336, "N": 4096, "ms": list(bg.PROBE_MS),
                   "breaks": {"cublas": [1, 2, 3], "detgemm": []},
                   "errors": {"pedantic": "CUBLASError: CUBLAS_STATUS_NOT_SUPPORTED"},
                   "rerun_same": {"cublas": True, "detgemm": True}}],
        "overhead": {"shape": [64, 64, 64], "calls": 2000, "repeats": 5,
                     "detgemm": {"us_per_call": 7.1, "reps_us": [7.0, 7.1, 7.2, 7.1, 7.3],
                                 "enqueue_us": 7.05, "device_us": 2.25},
                     "cublas": {"us_per_call": 4.2, "reps_us": [4.1, 4.2, 4.2, 4.3, 4.2]}},
    }


def test_geomean(bg):
    assert bg.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert bg.geomean([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert bg.geomean([0.5, 2.0]) == pytest.approx(1.0)
    # None, non-positive and non-finite values are ignored; nothing left -> None
    assert bg.geomean([4.0, None, 0.0, -1.0, float("nan"), float("inf")]) == pytest.approx(4.0)
    assert bg.geomean([]) is None
    assert bg.geomean([None]) is None


def test_speed_ratio_and_tflops(bg):
    # detgemm 10 us, peer 20 us -> detgemm twice as fast
    assert bg.speed_ratio(10.0, 20.0) == pytest.approx(2.0)
    assert bg.speed_ratio(20.0, 10.0) == pytest.approx(0.5)
    assert bg.speed_ratio(None, 10.0) is None
    assert bg.speed_ratio(10.0, None) is None
    assert bg.speed_ratio(0.0, 10.0) is None
    # 2*M*N*K flops: 8192^3 in 1375 us -> ~800 TFLOP/s
    assert bg.tflops(8192, 8192, 8192, 1375.0) == pytest.approx(2 * 8192**3 / 1375e-6 / 1e12)
    assert bg.tflops(1, 1, 1, None) is None
    assert bg.tflops(1, 1, 1, 0.0) is None


def test_summary_groups(bg):
    rows = [
        _row(bg, 1, det=10.0, cub=5.0, ped=20.0),        # ratios 0.5 / 2.0
        _row(bg, 16, det=10.0, cub=20.0, ped=40.0),      # ratios 2.0 / 4.0
        _row(bg, 128, det=10.0, cub=None, ped=10.0),     # no cuBLAS time: left out there
        _row(bg, 512, det=100.0, cub=100.0, ped=50.0),   # 1.0 / 0.5
        _row(bg, 2048, det=100.0, cub=400.0, ped=200.0), # 4.0 / 2.0
        _row(bg, 16384, det=None, cub=400.0, ped=None),  # detgemm failed: no ratio
    ]
    s = bg.summarize(rows)
    small, big = s["cublas"]["M<=128"], s["cublas"]["M>=512"]
    assert small["geomean"] == pytest.approx(1.0)        # sqrt(0.5 * 2)
    assert small["n"] == 2 and small["rows"] == 3
    assert big["geomean"] == pytest.approx(2.0)          # sqrt(1 * 4)
    assert big["n"] == 2 and big["rows"] == 3
    assert big["min"] == pytest.approx(1.0) and big["max"] == pytest.approx(4.0)
    ps, pb = s["pedantic"]["M<=128"], s["pedantic"]["M>=512"]
    assert ps["geomean"] == pytest.approx((2.0 * 4.0 * 1.0) ** (1 / 3))
    assert ps["n"] == 3
    assert pb["geomean"] == pytest.approx(1.0)           # sqrt(0.5 * 2)
    assert s["cublas"]["all"]["n"] == 4
    empty = bg.summarize([])
    assert empty["cublas"]["M>=512"]["geomean"] is None
    assert empty["pedantic"]["M<=128"]["n"] == 0


def test_render_markdown_has_device_and_columns(bg):
    rows = [
        _row(bg, 1, det=12.5, cub=11.0, ped=30.0),
        _row(bg, 2048, det=200.0, cub=190.0, ped=400.0),
        _row(bg, 16, det=None, cub=9.0, ped=None, ok_det=False, err_det=0.5),
    ]
    rows[2]["detgemm"] = {"error": "wrong result (rel err 5.0e-01)"}
    rows[2]["pedantic"] = {"error": "CUBLASError: CUBLAS_STATUS_NOT_SUPPORTED | x"}
    rows[1]["pedantic"]["method"] = "events-loop"
    rep = _report(bg, rows)
    md = bg.render_markdown(rep)
    assert "NVIDIA H100 80GB HBM3" in md
    header = "| " + " | ".join(bg.MAIN_COLUMNS) + " |"
    assert header in md
    for col in bg.MAIN_COLUMNS:
        assert col in md
    for word in ("Summary", "Batch invariance", "Host overhead", "M>=512", "M<=128",
                 "2.11.0+cu130", "14.2.0", "0.1.0", "example note"):
        assert word in md
    # every main-table line has the same number of cells as the header
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and ln.count("|") > 12]
    n_cells = header.count("|")
    body = [ln for ln in table if not ln.startswith("| M |")]
    assert len(body) == 3
    assert all(ln.count("|") == n_cells for ln in table)
    # a wrong result shows no speed and is flagged
    wrong = [ln for ln in body if ln.startswith("| 16 |")][0]
    assert "WRONG" in wrong
    cells = [c.strip() for c in wrong.strip("|").split("|")]
    assert cells[bg.MAIN_COLUMNS.index("detgemm us")] == "-"
    assert cells[bg.MAIN_COLUMNS.index("det/cuBLAS")] == "-"
    assert "PED timed by events-loop" in md
    # probe: lists of M, 'none', and errors
    assert "| 4096 | 4096 | 16 | 1, 2 | none |" in md
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in md
    assert "| detgemm_cute.mm(x, w.t()) | 7.10 | 7.05 | 2.25 |" in md
    assert "| torch.mm(x, w.t()) | 4.20 | - | - |" in md
    assert len(md.encode()) < 200_000


def test_render_handles_missing_parts(bg):
    rep = {"meta": {"device": "Some GPU"}, "rows": [], "summary": bg.summarize([]),
           "probe": None, "overhead": None}
    md = bg.render_markdown(rep)
    assert "Some GPU" in md and "(not run)" in md


def test_report_is_strict_json(bg):
    rows = [_row(bg, 64, det=5.0, cub=4.0, ped=6.0, err_ped=float("nan"))]
    text = json.dumps(bg.json_clean(_report(bg, rows)), default=bg.json_default,
                      allow_nan=False)
    back = json.loads(text)
    assert back["rows"][0]["err_ped"] is None
    assert back["meta"]["device"] == "NVIDIA H100 80GB HBM3"


def test_helpers(bg):
    assert bg.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bg.device_slug("NVIDIA H200") == "nvidia-h200"
    assert bg.device_slug("  ") == "unknown-device"
    assert bg.parse_shape("2048x4096x14336") == (2048, 4096, 14336)
    assert bg.parse_shape("1,768,3072") == (1, 768, 3072)
    with pytest.raises(ValueError):
        bg.parse_shape("2048x4096")
    with pytest.raises(ValueError):
        bg.parse_shape("0x4096x4096")
    full = bg.suite_shapes(False)
    assert len(full) == len(bg.SUITE_MS) * len(bg.SUITE_KN) == 48
    assert (16384, 14336, 4096) in full and (1, 768, 3072) in full
    quick = bg.suite_shapes(True)
    assert 0 < len(quick) < len(full) and set(quick) <= set(full)
    assert bg.distinct_kn([(1, 2, 3), (4, 2, 3), (1, 5, 6)]) == [(2, 3), (5, 6)]
    b = types.SimpleNamespace(name="m64_n128", tile=(64, 128, 64), stages=6, cluster=(1, 1))
    assert bg.fmt_bucket(b) == "m64_n128 64x128x64 s6 c1x1"
    assert bg.fmt_bucket(types.SimpleNamespace(name="x")) == "x"
    assert bg.fmt_bucket(None) == "?"


def test_rows_equal_bitwise_cpu(bg):
    torch.manual_seed(0)
    full = torch.randn(8, 5).to(torch.bfloat16)
    assert bg.rows_equal_bitwise(full, full[:3].clone())
    part = full[:3].clone()
    bits = part.view(torch.int16)
    bits[1, 2] ^= 1                       # flip the lowest mantissa bit of one element
    assert not bg.rows_equal_bitwise(full, part)
    # -0.0 vs +0.0 differ in bits although they compare equal as numbers
    z = torch.zeros(2, 2, dtype=torch.bfloat16)
    nz = -z
    assert torch.equal(z, nz)
    assert not bg.rows_equal_bitwise(z, nz)
    h = torch.randn(6, 3).half()
    assert bg.rows_equal_bitwise(h, h[:4].clone())
    assert not bg.rows_equal_bitwise(h, h[:4].float())   # dtype mismatch is not "equal"


def test_parse_args_defaults(bg):
    a = bg.parse_args([])
    assert a.dtype == "bf16" and not a.quick and len(a.shape_list) == 48 and a.reps == 20
    q = bg.parse_args(["--quick", "--dtype", "fp16", "--out", "/tmp/x"])
    assert q.quick and q.dtype == "fp16" and q.out == "/tmp/x" and q.reps < 20
    s = bg.parse_args(["--shapes", "1x4096x4096", "16x768x3072"])
    assert s.shape_list == [(1, 4096, 4096), (16, 768, 3072)]


def test_main_without_gpu_returns_2(bg, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = bg.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 2
    assert "SM90" in out and "needs" in out
    assert not any(tmp_path.iterdir())


def test_main_on_non_sm90_gpu_returns_2(bg, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100")
    assert bg.main([]) == 2
    out = capsys.readouterr().out
    assert "SM90" in out and "A100" in out and "sm_80" in out


def test_plot_when_matplotlib_present(bg, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(bg, m, k, n, det=10.0 * m ** 0.5, cub=9.0 * m ** 0.5, ped=12.0 * m ** 0.5)
            for (k, n) in ((4096, 4096), (14336, 4096)) for m in (1, 16, 512, 2048)]
    path = tmp_path / "p.png"
    assert bg.write_plot(rows, str(path), "title") is None
    assert 0 < path.stat().st_size < 200_000


def test_import_touches_no_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("CUDA touched at import time")
    for name in ("is_available", "get_device_capability", "get_device_name",
                 "current_stream", "synchronize", "init"):
        monkeypatch.setattr(torch.cuda, name, boom)
    spec = importlib.util.spec_from_file_location("bench_gemm_import_check", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert math.isclose(mod.geomean([3.0]), 3.0)
