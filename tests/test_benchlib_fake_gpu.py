"""The bench's GPU code paths (timing, peers, PEDANTIC call mapping, correctness checks,
report) run end to end on CPU tensors with a fake CUDA (tests/fake_cuda.py). Times measured
here mean nothing; what is checked is that every path runs and reports what it should."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

import fake_cuda
from detgemm_cute import gemm as G
from detgemm_cute.benchlib import peers as P
from detgemm_cute.benchlib import pedantic, probe, timing
from detgemm_cute.benchlib.shapes import Problem

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "bench", "bench_gemm.py")
SMALL = timing.TimingPlan(target_ms=0.3, reps=3, min_reps=2, budget_ms=5.0, warm_rounds=1,
                          warm_replays=1, est_min_ms=0.2, max_sets=3, max_r=8)


@pytest.fixture
def fake(monkeypatch):
    return fake_cuda.install(monkeypatch)


def test_time_units_graphs_errors_and_eager_fallback(fake):
    sets, nbytes = timing.make_sets(Problem("fwd", 16, 64, 32), torch.bfloat16, 1 << 14, SMALL)
    assert 1 <= len(sets) <= SMALL.max_sets and nbytes == 2 * (16 * 64 + 32 * 64 + 16 * 32)
    assert torch.isnan(sets[0].out).all() and sets[0].a.abs().sum() > 0

    def broken(s):
        raise RuntimeError("no kernel")

    res = timing.time_units({"mm": lambda s: torch.mm(s.a, s.b.t()), "bad": broken,
                             "eager": lambda s: torch.mm(s.a, s.b.t())}, sets, SMALL,
                            torch.cuda.Stream(), not_capturable=("eager",))
    assert res["bad"]["error"].startswith("RuntimeError: no kernel")
    mm = res["mm"]
    assert mm["method"] == "graph" and mm["us"] > 0 and mm["R"] >= len(sets)
    assert SMALL.min_reps <= mm["reps"] <= SMALL.reps
    assert res["eager"]["method"] == "events-loop" and res["eager"]["us"] > 0


def test_capture_failure_falls_back(fake, monkeypatch):
    sets, _ = timing.make_sets(Problem("fwd", 8, 32, 16), torch.bfloat16, 1 << 12, SMALL)
    capturing = {"on": False}
    real_graph = torch.cuda.graph

    def graph(g, **kw):
        capturing["on"] = True
        return real_graph(g, **kw)

    monkeypatch.setattr(torch.cuda, "graph", graph)

    def refuses_capture(s):
        if capturing["on"]:
            capturing["on"] = False
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.mm(s.a, s.b.t())

    res = timing.time_units({"x": refuses_capture}, sets, SMALL, torch.cuda.Stream())
    assert res["x"]["method"] == "events-loop" and "capture_error" in res["x"]


@pytest.mark.parametrize("op", ["fwd", "dx", "dw"])
def test_pedantic_call_mapping(op):
    """The column-major gemmEx arguments of each op compute the row-major product."""
    lib = fake_cuda.FakeCublas()
    ped = pedantic.PedanticCtypes(lib, "fake", stream_ptr=lambda: 7)
    assert ped.math_mode == pedantic.CUBLAS_PEDANTIC_MATH and ped.version == 130100
    torch.manual_seed(0)
    m, k, n = 5, 24, 16
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    a, b, ref = {"fwd": (x, w, x.float() @ w.float().t()),
                 "dx": (dy, w, dy.float() @ w.float()),
                 "dw": (dy, x, dy.float().t() @ x.float())}[op]
    y = ped.run(op, a, b)
    assert y.dtype == (torch.float32 if op == "dw" else torch.bfloat16)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.float(), ref.to(y.dtype).float(), rtol=1e-2, atol=1e-2)
    gemm = [c for c in lib.calls if c[0] == "gemm"][0]
    assert gemm[-2:] == (pedantic.CUBLAS_COMPUTE_32F, pedantic.CUBLAS_GEMM_DEFAULT)
    assert ("stream", 7) in lib.calls


def test_detgemm_layout_matches_gemm_rules():
    """The layout `tune` predicts for each op is what gemm.py decides for such tensors."""
    def unit(t):
        u = G._unit_dim(t)
        return u

    for (m, k, n) in ((16, 64, 48), (1, 64, 48), (16, 60, 48), (16, 64, 44), (16, 64, 1)):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        w = torch.randn(n, k, dtype=torch.bfloat16)
        dy = torch.randn(m, n, dtype=torch.bfloat16)
        # fwd: mm(x, w.t()) -> B [K, N] as kn
        lay = P.detgemm_layout("fwd", m, k, n)
        b = w.t()
        ub = unit(b)
        exp = ("kn", ub) if ub is not None else ("nk", "last")
        assert (lay["b_form"], lay["b_contig"]) == exp, (m, k, n)
        assert lay["a_major"] == ("m" if unit(x) == "first" else "k")
        # dx: gemm(dy, w, "kn")
        lay = P.detgemm_layout("dx", m, k, n)
        ub = unit(w)
        assert (lay["b_form"], lay["b_contig"]) == (("kn", ub) if ub else ("nk", "last"))
        assert lay["a_major"] == ("m" if unit(dy) == "first" else "k")
        # dw: gemm(dy.t(), x, "kn")
        lay = P.detgemm_layout("dw", m, k, n)
        ua, ub = unit(dy.t()), unit(x)
        assert lay["a_major"] == ("m" if ua == "first" else "k"), (m, k, n)
        assert (lay["b_form"], lay["b_contig"]) == (("kn", ub) if ub else ("nk", "last"))
        # Swapped buckets: the kernel's A is op(B)^T, its B the caller's A ("nk").
        for op, a, b in (("fwd", x, w.t()), ("dx", dy, w), ("dw", dy.t(), x)):
            a2, b2, _ = G.swapped_operands(a, b, "kn")
            lay = P.detgemm_layout(op, m, k, n, swap_ab=True)
            assert lay["swap_ab"] is True and lay["b_form"] == "nk"
            assert lay["a_major"] == ("m" if unit(a2) == "first" else "k"), (op, m, k, n)
            assert lay["b_contig"] == (unit(b2) or "last"), (op, m, k, n)


def test_lt_nosplit_sets_and_restores(fake):
    m = torch.backends.cuda.matmul
    m.allow_bf16_reduced_precision_reduction = (True, True)
    m.allow_fp16_reduced_precision_reduction = (False, True)
    before = (torch.backends.cuda.preferred_blas_library(), P._get_reduction("bf16"),
              P._get_reduction("fp16"))
    with P.LtNoSplit():
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        assert P._get_reduction("bf16") == (False, False)
        assert P._get_reduction("fp16") == (False, False)
    assert (torch.backends.cuda.preferred_blas_library(), P._get_reduction("bf16"),
            P._get_reduction("fp16")) == before
    assert P.lt_nosplit_status() is None
    with pytest.raises(ZeroDivisionError):
        with P.LtNoSplit():
            1 / 0
    assert P._get_reduction("bf16") == (True, True)
    m.allow_bf16_reduced_precision_reduction = True
    m.allow_fp16_reduced_precision_reduction = True


def test_lt_status_names_a_torch_without_the_tuple_form(fake, monkeypatch):
    def old_setter(which, value):
        raise TypeError("expects a bool")

    monkeypatch.setattr(P, "_set_reduction", old_setter)
    why = P.lt_nosplit_status()
    assert "does not accept" in why and "(False, False)" in why
    assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublas


def test_bench_main_end_to_end_on_cpu(fake, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(pedantic.PedanticCtypes, "open", classmethod(
        lambda cls, dtype: cls(fake_cuda.FakeCublas(), "fake", stream_ptr=lambda: 1)))
    monkeypatch.setattr(probe, "PROBE_ROWS", 48)
    monkeypatch.setattr(probe, "PROBE_MS", (1, 3, 16))
    monkeypatch.setattr(probe, "OVERHEAD_CALLS", 20)
    monkeypatch.setattr(probe, "OVERHEAD_REPEATS", 2)
    spec = importlib.util.spec_from_file_location("bench_gemm_fake_gpu", _PATH)
    bg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bg)
    monkeypatch.setattr(bg, "BENCH_PLAN", timing.TimingPlan(est_min_ms=0.2, budget_ms=5.0,
                                                          warm_rounds=1, max_sets=3))
    rc = bg.main(["--shapes", "16x64x48", "5x64x40", "--ops", "fwd,dx,dw", "--target-ms", "0.3",
                  "--reps", "3", "--out", str(tmp_path), "--probe-limit", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    base = tmp_path / "gemm_nvidia-h100-80gb-hbm3_shapes"
    rep = json.loads(base.with_suffix(".json").read_text())
    md = base.with_suffix(".md").read_text()
    assert len(rep["rows"]) == 6 and "NVIDIA H100" in md
    for row in rep["rows"]:
        assert row["ok"]["detgemm"] is True, row
        assert row["peers"]["detgemm"]["us"] > 0
        assert row["peers"]["pedantic"]["us"] > 0 and row["ok"]["pedantic"] is True
        if row["op"] == "dw":   # this torch has no CPU mm(out_dtype=): cuBLAS columns empty
            assert "out_dtype" in row["peers"]["cublas"]["error"]
            assert row["ratio"]["cublas"] is None
        else:
            assert row["ratio"]["cublas"] > 0 and row["ratio"]["cublaslt"] > 0
            assert row["same_bits"]["cublaslt"] in (True, False)
        assert row["bucket"].startswith(row["op"])
    assert rep["probe"][0]["breaks"]["detgemm"] == []
    assert rep["overhead"]["detgemm"]["us_per_call"] > 0
    assert rep["meta"]["cublaslt_nosplit"] == "ok"
    assert any("PEDANTIC" in n for n in rep["meta"]["notes"]) or rep["meta"]["pedantic"] == "ok"
    assert "| dw | 16 | 64 | 48 |" in md
    assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublas


def test_bench_time_box(fake, monkeypatch, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_gemm_fake_gpu2", _PATH)
    bg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bg)
    rc = bg.main(["--shapes", "8x32x16", "9x32x16", "10x32x16", "--no-pedantic", "--no-probe",
                  "--no-overhead", "--max-seconds", "0", "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "gemm_nvidia-h100-80gb-hbm3_shapes.json").read_text())
    assert rep["rows"] == [] and any("time box" in n for n in rep["meta"]["notes"])
    capsys.readouterr()


def test_bench_sigterm_stops_between_rows_and_writes_them(fake, monkeypatch, tmp_path, capsys):
    """`timeout` sends SIGTERM: the bench finishes the row it is on, runs no other, and writes
    its JSON and markdown with the rows so far; SIGTERM's handler is restored afterwards."""
    import os
    import signal

    from detgemm_cute.benchlib import runner

    spec = importlib.util.spec_from_file_location("bench_gemm_fake_gpu4", _PATH)
    bg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bg)
    real = runner.bench_problem

    def first_then_term(prob, ctx):
        row = real(prob, ctx)
        os.kill(os.getpid(), signal.SIGTERM)
        return row

    monkeypatch.setattr(runner, "bench_problem", first_then_term)
    before = signal.getsignal(signal.SIGTERM)
    rc = bg.main(["--shapes", "8x32x16", "9x32x16", "10x32x16", "--no-pedantic",
                  "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "gemm_nvidia-h100-80gb-hbm3_shapes.json").read_text())
    assert [r["M"] for r in rep["rows"]] == [8]
    assert any("stopped by SIGTERM: 1 of 3" in n for n in rep["meta"]["notes"])
    assert rep["probe"] is None and rep["overhead"] is None
    assert signal.getsignal(signal.SIGTERM) is before
    capsys.readouterr()


def test_bench_jobs_prebuilds_the_table_kernels(fake, monkeypatch, tmp_path, capsys):
    from detgemm_cute import dispatch, parallel_compile

    seen = {}

    def compile_all(keys, directory, jobs, log=print, progress=None):
        seen.update(keys=list(keys), directory=directory, jobs=jobs)
        return {}

    monkeypatch.setattr(parallel_compile, "compile_all", compile_all)
    monkeypatch.setenv("DETGEMM_CUTE_AOT_DIR", "off")
    spec = importlib.util.spec_from_file_location("bench_gemm_fake_gpu3", _PATH)
    bg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bg)
    assert bg.main(["--shapes", "8x64x48", "--ops", "fwd,dw", "--jobs", "3", "--no-pedantic",
                    "--no-probe", "--no-overhead", "--out", str(tmp_path)]) == 0
    assert seen["jobs"] == 3 and len(seen["keys"]) == 2
    fwd = [k for k in seen["keys"] if k.out_dtype == "bf16"][0]
    b = dispatch.lookup("fwd", "bf16", "sm90", 8, 48, 64)
    assert (fwd.tile, fwd.stages, fwd.b_form, fwd.b_contig) == (b.tile, b.stages, "kn", "first")
    assert "compiling 2 kernels in 3 processes" in capsys.readouterr().out
