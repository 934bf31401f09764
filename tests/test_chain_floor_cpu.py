"""CPU checks of the chain-floor probe (it cross-compiles for sm_90a with the MMA the form
names, in a loop, with no global loads), the floor arithmetic of `benchlib.floor`, and the
command lines of bench/bench_chain_floor.py and bench_gemm.py's --floor."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re

import pytest

from detgemm_cute.benchlib import floor

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test",
                                                  os.path.join(_BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("form,n,steps,mma", [
    ("wgmma", 16, 8, r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.bf16\.bf16"),
    ("wgmma", 256, 4, r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16"),
    ("wgmma_tf32", 32, 8, r"wgmma\.mma_async\.sync\.aligned\.m64n32k8\.f32\.tf32\.tf32"),
    ("mma_sync", 32, 8, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"),
])
def test_probe_compiles_to_the_named_mma_chain(form, n, steps, mma, tmp_path):
    from detgemm_cute.benchlib.chain_kernel import ChainProbe, compile_probe

    fn = compile_probe(ChainProbe(form, n, steps), "sm_90a",
                       f"--keep-ptx --dump-dir={tmp_path}")
    ptx = fn.__ptx__ or ""
    issued = len(re.findall(mma, ptx))
    per_step = n // 8 if form == "mma_sync" else 1  # mma.sync: one m16n8 per 8 columns
    assert issued == steps * per_step, (issued, steps, per_step)
    shapes = set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)[\w.]*", ptx))
    assert len(shapes) == 1 and re.fullmatch(mma, shapes.pop())  # no other MMA issued
    assert "ld.global" not in ptx and "cp.async" not in ptx  # operands stay on chip
    assert re.search(r"bra(\.uni)?\s+\$L__BB", ptx)  # the chain is a runtime loop
    if form != "mma_sync":
        assert "wgmma.commit_group" in ptx and "wgmma.wait_group" in ptx


@pytest.mark.parametrize("kw,arg", [
    (dict(form="hmma", n=16), "form"), (dict(form="wgmma", n=12), "n"),
    (dict(form="wgmma", n=264), "n"), (dict(form="mma_sync", n=4), "n"),
    (dict(form="wgmma", n=16, steps=0), "steps"), (dict(form="wgmma", n=16, depth=2), "depth"),
    (dict(form="mma_sync", n=8, warps=33), "warps"),
])
def test_probe_rejects_bad_settings(kw, arg):
    from detgemm_cute.benchlib.chain_kernel import ChainProbe

    with pytest.raises(ValueError, match=arg):
        ChainProbe(**kw)


def test_fit_line_recovers_slope_and_intercept():
    xs = [1024, 2048, 4096, 8192]
    b, a = floor.fit_line(xs, [3.5 + 0.021 * x for x in xs])
    assert b == pytest.approx(3.5) and a == pytest.approx(0.021)
    with pytest.raises(ValueError):
        floor.fit_line([5, 5], [1.0, 2.0])


def _floor_data(copy=3.0, launch=2.0):
    probes = [{"form": "wgmma", "n": w, "steps": 8, "depth": 1, "ctas": 132, "t_step_ns": t}
              for w, t in ((16, 20.0), (32, 21.0), (128, 40.0))]
    probes.append({"form": "wgmma", "n": 16, "steps": 8, "depth": 1, "ctas": 1,
                   "t_step_ns": 5.0})  # one CTA: not the floor's number
    return {"bandwidth": {"copy_tbs": copy, "read_tbs": 3.2, "bytes": 1 << 30},
            "launch_us": launch, "sms": 132, "probes": probes, "date": "2026-11-27"}


def _row(m, k, n, det, cub=None, bucket="fwd_decode 16x32x128 s8 p"):
    return {"op": "fwd", "M": m, "K": k, "N": n, "bucket": bucket,
            "bytes": 2 * (m * k + n * k + m * n),
            "peers": {"detgemm": {"us": det}, "cublas": {"us": cub} if cub else {}}}


def test_floor_model_step_and_row_floor():
    model = floor.FloorModel(_floor_data())
    assert model.step_ns(16) == 20.0 and model.step_ns(24) == 21.0  # next wider measured
    assert model.step_ns(256) == 40.0  # widest when none is wider
    assert model.step_ns(16, steps=4) is None
    # chain-bound: K = 16384, N = 16 -> 1024 steps x 21 ns (BN 32) = 21.5 us
    r = _row(1, 16384, 16, det=30.0)
    f = model.row_floor(r)
    assert f["bound"] == "chain" and f["chain_us"] == pytest.approx(1024 * 0.021)
    assert f["floor_us"] == pytest.approx(1024 * 0.021 + 2.0)
    assert f["ratio"] == pytest.approx(30.0 / f["floor_us"])
    # bandwidth-bound: K = 8192, N = 28672 (470 MB) at 3 TB/s
    r = _row(1, 8192, 28672, det=170.0, bucket="x 16x112x128 s4 p")
    f = model.row_floor(r)
    assert f["bound"] == "bandwidth"
    assert f["floor_us"] == pytest.approx(r["bytes"] / 3e6 + 2.0)
    assert model.row_floor(_row(1, 64, 64, 1.0, bucket="?")) is None


def test_attach_summary_render_and_plot(tmp_path):
    model = floor.FloorModel(_floor_data())
    rows = [_row(1, 16384, 16, 24.0, cub=12.0), _row(1, 8192, 28672, 170.0, cub=180.0,
                                                     bucket="b 16x112x128 s4 p"),
            _row(64, 4096, 4096, 14.0, cub=15.0), dict(_row(64, 4096, 4096, 9.0), op="dx")]
    assert floor.attach(rows, model) == 3 and rows[3]["floor"] is None
    s = floor.summary(rows)
    assert s["all"]["rows"] == 3 and s["chain"]["rows"] + s["bandwidth"]["rows"] == 3
    assert s["all"]["within"] == sum(r["floor"]["ratio"] <= floor.WITHIN for r in rows[:3])
    md = floor.render(rows, model)
    assert "## Against the floor" in md and "| 1 | 16384 | 16 |" in md
    assert "| chain-bound | 1 |" in md and "| bandwidth-bound | 2 |" in md
    note = floor.write_plot(rows, str(tmp_path / "f.png"), "t")
    if note is None:
        assert (tmp_path / "f.png").stat().st_size > 0
    else:
        assert note.startswith("no floor plot: matplotlib unavailable")
    assert floor.write_plot([], str(tmp_path / "g.png"), "t") is not None


def test_floor_cli_renders_a_stored_report(tmp_path, capsys):
    rep = tmp_path / "r.json.gz"
    with gzip.open(rep, "wt") as f:
        json.dump({"rows": [_row(1, 16384, 16, 24.0)]}, f)
    fl = tmp_path / "fl.json"
    fl.write_text(json.dumps(_floor_data()))
    assert floor.main([str(rep), str(fl)]) == 0
    out = capsys.readouterr().out
    assert "chain" in out
    flz = tmp_path / "fl.json.gz"  # stored records are compressed: both may be
    with gzip.open(flz, "wt") as f:
        json.dump(_floor_data(), f)
    assert floor.main([str(rep), str(flz)]) == 0
    assert capsys.readouterr().out == out
    assert floor.main([str(rep)]) == 2


def test_bench_chain_floor_cli_and_render():
    mod = _load("bench_chain_floor")
    args = mod.parse_args(["--quick", "--max-steps", "4096"])
    assert args.quick and args.max_steps == 4096
    with pytest.raises(SystemExit):
        mod.parse_args(["--max-steps", "8"])
    assert mod.lengths(65536, 8) == [1024, 2048, 4096, 8192]
    assert all(len(set(mod.lengths(s, 8))) >= 2 for s in (64, 4096, 65536))
    data = dict(_floor_data(), device="H100", date="d", torch="2", cuda="13", sms=132)
    data["probes"] = [dict(p, label="wgmma m64n16k16 x8/batch depth 1", warps=1,
                           t_step_ns_longest=p["t_step_ns"], fixed_us=3.0, compile_s=0.2)
                      for p in data["probes"]] + [
        {"form": "mma_sync", "n": 8, "steps": 8, "depth": 1, "warps": 1, "ctas": 1,
         "error": "boom"}]
    md = mod.render(data)
    assert "3.000 TB/s" in md and "error: boom" in md and "m64n16k16" in md


def test_bench_chain_floor_without_gpu_exits_2(monkeypatch, capsys):
    mod = _load("bench_chain_floor")
    import detgemm_cute.benchlib.gpu as gpu

    monkeypatch.setattr(gpu, "gpu_check", lambda: ("no CUDA device", None))
    assert mod.main(["--quick"]) == 2
    assert "Nothing was run" in capsys.readouterr().out


def test_bench_gemm_floor_option(tmp_path):
    bg = _load("bench_gemm")
    with pytest.raises(SystemExit):
        bg.parse_args(["--suite", "decode-models", "--floor", str(tmp_path / "none.json")])
    fl = tmp_path / "fl.json"
    fl.write_text(json.dumps(_floor_data()))
    args = bg.parse_args(["--suite", "decode-models", "--floor", str(fl), "--limit", "3"])
    assert args.floor == str(fl) and len(args.problems) == 3
    report = {"meta": {"device": "H100"}, "rows": [_row(1, 16384, 16, 24.0)]}
    model = bg.attach_floor(report, str(fl))
    assert report["floor"]["rows"] == 1 and report["rows"][0]["floor"]["bound"] == "chain"
    base = str(tmp_path / "gemm_x")
    open(base + ".md", "w").write("# head\n")
    notes = []
    md = bg.append_floor(report, model, base, "# head\n", notes)
    assert "Against the floor" in md and "Against the floor" in open(base + ".md").read()


def test_profile_shapes_cli():
    mod = _load("profile_shapes")
    args = mod.parse_args(["--shapes", "777x4096x11008", "4000x8192x1280", "--op", "dx"])
    assert [(q.op, q.m, q.k, q.n) for q in args.problems] == [
        ("dx", 777, 4096, 11008), ("dx", 4000, 8192, 1280)]
    assert args.peer_list == ["detgemm", "cublaslt", "cublas"]
    for bad in (["--shapes", "7x7"], ["--shapes", "8x8x8", "--peers", "mkl"],
                ["--shapes", "8x8x8", "--peers", ","]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)


def test_profile_shapes_without_gpu_exits_2(monkeypatch, capsys):
    mod = _load("profile_shapes")
    import detgemm_cute.benchlib.gpu as gpu

    monkeypatch.setattr(gpu, "gpu_check", lambda: ("no CUDA device", None))
    assert mod.main(["--shapes", "8x8x8"]) == 2
    assert "Nothing was run" in capsys.readouterr().out
