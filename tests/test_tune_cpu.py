"""`detgemm-cute tune` on CPU: candidate generation from the kernel limits, the bucket table
built from timings (coverage, merging, YAML the registry loads), the candidate layer that
`force_bucket` reaches, the resume file, the command line (dry run, no-GPU exit), a whole run
on CPU tensors with a fake CUDA, and `warmup --jobs`."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

import fake_cuda
from detgemm_cute import cli, dispatch, registry
from detgemm_cute import compile as kcompile
from detgemm_cute.kernels import sm90_limits
from detgemm_cute.tune import candidates as C
from detgemm_cute.tune import command, layer, store, summary, table


# ---------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------

def test_space_is_read_from_the_limits_module(monkeypatch):
    sp = C.space_for("sm90")
    assert sp.tile_m == tuple(sm90_limits.TILE_M) and sp.tile_n == tuple(sm90_limits.TILE_N)
    assert (2, 1) in sp.clusters and (1, 2) in sp.clusters
    monkeypatch.setattr(sm90_limits, "TILE_N", tuple(sm90_limits.TILE_N) + (40,), raising=True)
    assert 40 in C.space_for("sm90").tile_n                       # read at run time
    sp80 = C.space_for("sm80")
    assert sp80.clusters == ()
    cands = C.candidates_for(1000, 5120, 5120, sp80)
    assert cands and all(not c.persistent and c.cluster == (1, 1) for c in cands)


@pytest.mark.parametrize("mnk", [(1, 4096, 4096), (48, 1280, 8192), (1000, 5120, 5120),
                                 (16384, 4096, 4096), (128, 1280, 8192), (777, 11008, 4096),
                                 (3, 8, 16)])
def test_candidates_are_valid_budgeted_and_start_with_the_incumbent(mnk):
    m, n, k = mnk
    sp = C.space_for("sm90")
    inc = C.Candidate.from_bucket(dispatch.lookup("fwd", "bf16", "sm90", m, n, k))
    cands = C.candidates_for(m, n, k, sp, incumbent=inc)
    assert cands[0] == inc and 8 <= len(cands) <= 16
    assert len(set(cands)) == len(cands)
    for c in cands:
        assert sm90_limits.check_config(c.tile, c.cluster, c.stages, c.persistent,
                                        **dict(c.extra)) == [], c
    assert len({c.name for c in cands}) == len(cands)


def test_wave_arithmetic():
    assert C.wave_stats(1000, 5120, 128, 160, 132) == {"tiles": 8 * 32, "waves": 2,
                                                        "last_wave_util": (256 - 132) / 132}
    sp, mach = C.space_for("sm90"), C.Machine()
    # one 64-row tile per 64 columns at M=1: 64 tiles, half the SMs idle; thin tiles fill them
    wide, _ = C.predict_us(1, 4096, 4096, 64, 64, sp, mach)
    assert wide >= (2 * (4096 + 4096 * 4096) + 2 * 4096) / mach.dram_bytes_per_us
    tiles = C.rank_tiles(16384, 4096, 4096, sp, mach)
    assert tiles[0][0] >= 128 and tiles[0][0] * tiles[0][1] >= 128 * 192  # big tiles at big M
    assert all(sp.check((bm, bn, 64), (1, 1), 2, True) for bm, bn, _ in tiles)
    small = C.rank_tiles(1, 4096, 4096, sp, mach)
    assert all(bm <= 64 for bm, _, _ in small)


def test_row_tiles_also_get_the_depth_of_a_64_row_stage():
    """A row tile's variants: the most stages that fit, then (persistent, 1x1) the stages a
    64-row A stage would leave (16x32x128: 16, then 8); a 64-row tile has no such variant."""
    sp, mach = C.space_for("sm90"), C.Machine()

    def plain(cands):  # the persistent 1x1 variants without extra options, their stages
        return [c.stages for c in cands if c.persistent and c.cluster == (1, 1) and not c.extra]

    assert plain(C.tile_variants(1, 4096, 16, 32, 128, sp, mach)) == [16, 8]
    assert plain(C.tile_variants(64, 4096, 64, 32, 128, sp, mach)) == [8]


def test_extra_options_pass_through():
    # A key the limits do not know (a layer's own kernel field) passes through as it is.
    sp = C.space_for("sm90", {"a_rows": (16, 8)})
    cands = C.candidates_for(8, 4096, 4096, sp, max_candidates=64)
    extra = [c for c in cands if dict(c.extra).get("a_rows") == 8]
    assert extra and all(c.persistent for c in extra)
    assert "a_rows-8" in extra[0].name and extra[0].fields()["a_rows"] == 8
    assert C.Candidate.from_fields(extra[0].fields()) == extra[0]
    assert C.parse_option("swap_ab=false,true") == ("swap_ab", (False, True))
    assert C.parse_option("a_rows=16,8") == ("a_rows", (16, 8))
    with pytest.raises(ValueError):
        C.parse_option("swap_ab")
    bucket = types.SimpleNamespace(name="x", op="fwd", dtypes=("bf16",), m=(1, 2), n=(1, None),
                                   k=(1, None), tile=(64, 32, 128), cluster=(1, 1), stages=8,
                                   persistent=True, note="", source=None, line=1, layer=0)
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class NewBucket:
        name: str
        tile: tuple
        cluster: tuple
        stages: int
        persistent: bool
        swap_ab: bool
        note: str = ""

    c = C.Candidate.from_bucket(NewBucket("b", (64, 32, 128), (1, 1), 8, True, True))
    assert dict(c.extra) == {"swap_ab": True}
    plain = C.Candidate.from_bucket(NewBucket("b", (64, 32, 128), (1, 1), 8, True, False))
    assert plain == C.Candidate((64, 32, 128), (1, 1), 8, True)   # unset == default
    assert bucket  # SimpleNamespace is not a dataclass bucket: from_bucket needs fields


# ---------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------

def _points(seed=0):
    import random

    rnd = random.Random(seed)
    pts = []
    for m in (1, 8, 64, 128, 512, 777, 2048, 8192):
        for n in (1024, 4096, 14336):
            for k in (4096, 8192):
                t = {"A": 10 * (1 if m <= 64 else 1.3), "B": 10 * (1 if 128 <= m <= 777 else 1.25),
                     "C": 10 * (1 if m >= 2048 else 1.2),
                     "D": 10 * (0.9 if (n == 1024 and m >= 128) else 1.5)}
                pts.append(table.Point(m, n, k, {c: v * (1 + rnd.uniform(0, 0.004))
                                                 for c, v in t.items()},
                                       {"cublas": 10.0, "cublaslt": 12.0}))
    return pts


def _covered_once(boxes):
    edges = [sorted({1} | {b.ranges[d][0] for b in boxes} |
                    {b.ranges[d][1] + 1 for b in boxes if b.ranges[d][1] is not None})
             for d in range(3)]
    for m in edges[0]:
        for n in edges[1]:
            for k in edges[2]:
                hits = [b for b in boxes if all(lo <= v and (hi is None or v <= hi)
                                                for (lo, hi), v in zip(b.ranges, (m, n, k)))]
                assert len(hits) == 1, ((m, n, k), [b.ranges for b in hits])


def test_boxes_cover_everything_and_follow_the_winners():
    pts = _points()
    boxes = table.build_boxes(pts, tol=0.02, max_buckets=12)
    _covered_once(boxes)
    assert 3 <= len(boxes) <= 12
    for b in boxes:   # every box's choice is within tolerance of each of its points' best
        assert table.worst_slowdown(b.choice, b.points) <= 1.02
    assert {b.choice for b in boxes} == {"A", "B", "C", "D"}
    # cuts sit at midpoints between measured values
    m_edges = {b.ranges[0][1] for b in boxes if b.ranges[0][1] is not None}
    assert m_edges <= {(a + c) // 2 for a, c in ((1, 8), (8, 64), (64, 128), (128, 512),
                                                 (512, 777), (777, 2048), (2048, 8192))}


def test_boxes_respect_the_budget_and_tolerance():
    pts = _points()
    assert len(table.build_boxes(pts, max_buckets=2)) <= 2
    one = table.build_boxes(pts, tol=0.6)          # everything within 60%: one bucket
    assert len(one) == 1 and one[0].ranges == [(1, None), (1, None), (1, None)]
    single = table.build_boxes([table.Point(5, 5, 5, {"X": 1.0})])
    assert single[0].choice == "X" and single[0].ranges[0] == (1, None)
    assert table.build_boxes([]) == []


def test_missing_measurements_are_penalised():
    p1 = table.Point(1, 64, 64, {"A": 1.0, "B": 1.01})
    p2 = table.Point(1000, 64, 64, {"B": 1.0})
    choice, loss = table.choose([p1, p2], ["A", "B"])
    assert choice == "B" and loss == pytest.approx(math.log(1.01))
    assert table.cost("A", p2) == table.MISSING_COST


def test_tuned_yaml_loads_audits_and_explains(tmp_path, capsys):
    pts = _points()
    boxes = table.build_boxes(pts)
    for b in boxes:
        b.note = table.box_note(b, "NVIDIA H100", "2026-01-01")
    fields = {"A": {"tile": [64, 32, 128], "cluster": [1, 1], "stages": 8, "persistent": True},
              "B": {"tile": [128, 64, 64], "cluster": [1, 1], "stages": 8, "persistent": True},
              "C": {"tile": [128, 256, 64], "cluster": [2, 1], "stages": 4, "persistent": True},
              "D": {"tile": [64, 64, 128], "cluster": [1, 1], "stages": 5, "persistent": False}}
    text = table.buckets_yaml("sm90", {("fwd", ("bf16", "fp16")): boxes}, fields, "a header")
    path = tmp_path / "tuned.yaml"
    path.write_text(text)
    f = registry.load_config(path, arch="sm90")
    assert len(f.buckets) == len(boxes)
    for dt in ("bf16", "fp16"):
        assert registry.coverage_gaps([b for b in f.buckets if dt in b.dtypes]) == []
    assert all("tune on NVIDIA H100" in b.note and "x cuBLAS" in b.note for b in f.buckets)
    assert all(b.name.startswith("tuned_fwd_m") for b in f.buckets)
    assert cli.main(["audit", "--arch", "sm90", "--config", str(path)]) == 0
    assert cli.main(["explain", "--config", str(path), "1", "1024", "4096"]) == 0
    out = capsys.readouterr().out
    assert "audit: OK" in out and "tuned_fwd_m1_" in out and "64x32x128" in out


def test_summary_compare_and_check():
    recs = []
    for m, inc, best in ((1, 12.0, 10.0), (512, 10.0, 10.0), (4096, 100.0, 80.0)):
        recs.append({"op": "fwd", "m": m, "k": 4096, "n": 4096, "gemm": [m, 4096, 4096],
                     "incumbent": "I", "cands": {"I": inc, "W": best, "X": None},
                     "bad_bits": [], "peers": {"cublas": 10.0, "cublaslt": 20.0}})
    recs.append({"op": "fwd", "m": 9, "k": 8, "n": 8, "gemm": [9, 8, 8], "incumbent": "I",
                 "cands": {"I": 1.0, "Z": 0.1}, "bad_bits": ["Z"], "peers": {}})
    tables = summary.build_tables(recs, ["fwd", "dx"], "GPU", "today", 0.02, 12)
    assert list(tables) == ["fwd"]
    assert {b.choice for b in tables["fwd"]} <= {"W", "I"}      # Z's bits differed: never
    comp = summary.compare(recs, tables)["fwd"]
    assert comp["all"]["n"] == 4
    assert comp["M>=512"]["inc_vs_cublas"] == pytest.approx(math.sqrt(1.0 * 0.1))
    assert comp["M>=512"]["best_vs_cublas"] == pytest.approx(math.sqrt(1.0 * 0.125))
    rows = summary.check_report(recs, 0.05)
    assert [(r["m"], round(r["gain"], 2)) for r in rows] == [(4096, 0.25), (1, 0.2)]
    text = "\n".join(summary.render_check(rows, 0.05, len(recs)) + summary.render_compare(comp and
                     {"fwd": comp}) + summary.render_tables(tables))
    assert "2 of 4 problems" in text and "+25%" in text


# ---------------------------------------------------------------------------------------
# the candidate layer, the resume file
# ---------------------------------------------------------------------------------------

def test_candidate_layer_is_forceable_and_unreachable(tmp_path):
    good = C.Candidate((64, 32, 128), (1, 1), 8, True)
    bad = C.Candidate((64, 33, 128), (1, 1), 8, True)          # BN 33 is not allowed
    logs = []
    accepted, rejected = layer.install("sm90", [good, bad, good], tmp_path / "c.yaml",
                                       logs.append)
    assert accepted == [good] and list(rejected) == [bad.name] and "tile" in logs[0]
    b = dispatch.bucket_by_name("sm90", layer.bucket_name(good))
    assert b.tile == (64, 32, 128) and b.stages == 8 and b.persistent is True
    for m in (1, 64, 2**31 - 1):   # dispatch never lands on a candidate
        assert not dispatch.lookup("fwd", "bf16", "sm90", m, 4096, 4096).name.startswith("tune_")
    assert C.Candidate.from_bucket(b) == good


def test_resume_file(tmp_path):
    path = tmp_path / "r.jsonl"
    assert store.load(path) == []
    rec = {"device": "G", "arch": "sm90", "dtype": "bf16", "op": "fwd", "m": 1, "k": 2, "n": 3,
           "cands": {"a": 1.0}, "errors": {"b": "compile failed"}}
    store.append(path, rec)
    store.append(path, dict(rec, cands={"a": 0.9}, incumbent_err=float("nan")))
    with open(path, "a") as f:
        f.write('{"device": "G", "op": "fw')                    # killed mid-write
    recs = store.load(path)
    assert len(recs) == 2 and "time" in recs[0]
    latest = store.latest(recs)
    assert len(latest) == 1 and list(latest.values())[0]["cands"] == {"a": 0.9}
    assert recs[1]["incumbent_err"] is None                      # strict JSON
    assert store.covers(recs[0], ["a", "b"]) and not store.covers(recs[0], ["a", "c"])


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------

def test_dry_run_needs_no_gpu(capsys):
    assert cli.main(["tune", "--preset", "prefill-models", "--ops", "fwd,dw", "--limit", "4",
                     "--dry-run", "--jobs", "4", "--in-order"]) == 0
    out = capsys.readouterr().out
    assert "4 problems" in out and "kernels to compile" in out and "table " in out
    assert cli.main(["tune", "--shapes", "1x4096x4096", "--dry-run", "--arch", "sm80"]) == 0
    assert "64x" in capsys.readouterr().out


def test_tune_without_gpu_says_why(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--shapes", "16x64x48"]) == 1
    err = capsys.readouterr().err
    assert "tune needs a CUDA GPU" in err and "Traceback" not in err
    assert cli.main(["tune"]) == 1
    assert "--preset" in capsys.readouterr().err
    assert cli.main(["tune", "--shapes", "1x2"]) == 1


def test_kernel_keys_follow_the_candidate_and_the_call(tmp_path):
    from detgemm_cute.benchlib.shapes import Problem

    c = C.Candidate((128, 256, 64), (2, 1), 4, True)
    _acc, _rej, buckets = layer.prepare("sm90", [c], tmp_path / "c.yaml")
    b = buckets[c.name]
    k_fwd = command.kernel_key(b, Problem("fwd", 512, 4096, 4096), "bf16", "sm_90a")
    k_dw = command.kernel_key(b, Problem("dw", 512, 4096, 4096), "bf16", "sm_90a")
    assert k_fwd.tile == (128, 256, 64) and k_fwd.cluster == (2, 1) and k_fwd.persistent
    assert (k_fwd.b_form, k_fwd.b_contig, k_fwd.out_dtype) == ("kn", "first", "bf16")
    assert (k_dw.a_major, k_dw.out_dtype, k_dw.accumulate) == ("m", "fp32", False)
    assert isinstance(k_fwd, kcompile.KernelKey)


def test_tune_end_to_end_on_cpu_and_resume(monkeypatch, tmp_path, capsys):
    fake_cuda.install(monkeypatch, l2=1 << 14)
    from detgemm_cute.benchlib import timing
    from detgemm_cute.tune import measure

    plan = timing.TimingPlan(target_ms=0.2, reps=2, min_reps=2, budget_ms=2.0, warm_rounds=1,
                             warm_replays=1, est_min_ms=0.1, max_sets=2, max_r=4)
    monkeypatch.setattr(measure, "TUNE_PLAN", plan)
    monkeypatch.setenv("DETGEMM_CUTE_AOT_DIR", "off")
    out, js, res = tmp_path / "t.yaml", tmp_path / "t.json", tmp_path / "t.jsonl"
    argv = ["tune", "--shapes", "16x64x48", "200x64x40", "--ops", "fwd,dw", "--jobs", "1",
            "--max-candidates", "3", "--out", str(out), "--json", str(js), "--resume",
            str(res), "--aot-dir", str(tmp_path / "aot")]
    assert cli.main(argv) == 0, capsys.readouterr()
    text = capsys.readouterr().out
    assert "wrote" in text and "covering every (M, N, K)" in text
    f = registry.load_config(out, arch="sm90")
    assert {b.op for b in f.buckets} == {"fwd", "dw"}
    data = json.loads(js.read_text())
    assert len(data["records"]) == 4 and set(data["tables"]) == {"fwd", "dw"}
    for rec in data["records"]:
        assert len(rec["cands"]) == 3 and rec["bad_bits"] == [] and rec["incumbent"]
        if rec["op"] == "fwd":
            assert rec["peers"]["cublas"] > 0 and rec["peers"]["cublaslt"] > 0
    assert "tuned_fwd_m1_up" in out.read_text() or "tuned_fwd_m1_" in out.read_text()
    assert len(store.load(res)) == 4
    # a second run with the same resume file measures nothing again
    from detgemm_cute.tune import run_gpu

    monkeypatch.setattr(run_gpu, "measure_problem", lambda *a, **k: pytest.fail("re-measured"),
                        raising=False)
    monkeypatch.setattr(measure, "measure_problem", lambda *a, **k: pytest.fail("re-measured"))
    assert cli.main(argv) == 0
    assert "resume: 4 problems" in capsys.readouterr().out
    monkeypatch.undo()
    fake_cuda.install(monkeypatch, l2=1 << 14)
    monkeypatch.setattr(measure, "TUNE_PLAN", plan)
    monkeypatch.setenv("DETGEMM_CUTE_AOT_DIR", "off")
    assert cli.main(["tune", "--shapes", "16x64x48", "--jobs", "1", "--max-candidates", "2",
                     "--check", str(out), "--check-threshold", "0", "--aot-dir",
                     str(tmp_path / "aot")]) == 0
    text = capsys.readouterr().out
    assert "check:" in text and "problems have a candidate" in text
    assert not list(tmp_path.glob("tuned_*.yaml"))     # --check writes a table only with --out


def test_the_time_box_does_not_project_the_first_problems_compiles():
    """The first problem waits for the run's compiles (48.7 s on an H100 for 18 kernels in 14
    workers): projecting it onto the next problem stopped a 120 s box after one of 24."""
    from detgemm_cute.tune.run_gpu import next_problem_seconds

    assert next_problem_seconds([]) == 0.0
    assert next_problem_seconds([48.7]) == 0.0
    assert next_problem_seconds([48.7, 0.4]) == 0.4
    assert next_problem_seconds([48.7, 0.4, 2.5]) == 2.5


def test_warmup_jobs_compiles_in_processes(tmp_path, capsys):
    pytest.importorskip("cutlass")
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler to link the libraries")
    from detgemm_cute import aot, aot_cache

    argv = ["warmup", "--ops", "fwd", "--dtypes", "bf16", "--bucket", "fwd_decode_m33_64_n1_1536",
            "--jobs", "2", "--aot-dir", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 0
    assert "warmup: 2 kernels ready" in capsys.readouterr().out
    keys = [k for _, k in aot.warmup_keys("sm_90a", ("fwd",), ("bf16",),
                                          ("fwd_decode_m33_64_n1_1536",))]
    assert all(aot_cache.path_for(k, tmp_path).exists() for k in keys)


def test_a_kernel_that_breaks_the_gpu_stops_the_run_with_what_was_measured(monkeypatch,
                                                                          tmp_path, capsys):
    fake_cuda.install(monkeypatch, l2=1 << 14)
    from detgemm_cute.benchlib import timing
    from detgemm_cute.tune import measure

    monkeypatch.setattr(measure, "TUNE_PLAN", timing.TimingPlan(
        target_ms=0.2, reps=2, min_reps=2, budget_ms=2.0, warm_rounds=1, warm_replays=1,
        est_min_ms=0.1, max_sets=2, max_r=4))
    monkeypatch.setenv("DETGEMM_CUTE_AOT_DIR", "off")
    calls = {"n": 0}
    real = measure.P.detgemm_call

    def call(op, dg, bucket=None):
        fn = real(op, dg, bucket)

        def wrapped(s):
            if bucket and bucket != layer.PREFIX + "x" and calls["n"] >= 1 and s.a.shape[0] == 9:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return fn(s)
        return wrapped

    monkeypatch.setattr(measure.P, "detgemm_call", call)
    orig_measure = measure.measure_problem

    def counting(*a, **k):
        rec = orig_measure(*a, **k)
        calls["n"] += 1
        return rec

    from detgemm_cute.tune import run_gpu

    monkeypatch.setattr(measure, "measure_problem", counting)
    out = tmp_path / "t.yaml"
    rc = cli.main(["tune", "--shapes", "8x64x48", "9x64x48", "--jobs", "1", "--in-order",
                   "--max-candidates", "2", "--out", str(out), "--resume",
                   str(tmp_path / "r.jsonl"), "--aot-dir", str(tmp_path / "aot")])
    text = capsys.readouterr().out
    assert rc == 0 and "stopped: candidate" in text and "illegal memory access" in text
    assert len(store.load(tmp_path / "r.jsonl")) == 1 and out.exists()
    assert run_gpu is not None


@pytest.mark.parametrize("all_fail", [False, True])
def test_compile_pool_path_with_worker_failures(monkeypatch, tmp_path, capsys, all_fail):
    fake_cuda.install(monkeypatch, l2=1 << 14)
    from detgemm_cute.benchlib import timing
    from detgemm_cute import parallel_compile as compile_pool
    from detgemm_cute.tune import measure

    monkeypatch.setattr(measure, "TUNE_PLAN", timing.TimingPlan(
        target_ms=0.2, reps=2, min_reps=2, budget_ms=2.0, warm_rounds=1, warm_replays=1,
        est_min_ms=0.1, max_sets=2, max_r=4))
    monkeypatch.setenv("DETGEMM_CUTE_AOT_DIR", "off")
    seen = {}

    class FakePool:
        def __init__(self, jobs, directory, log=print):
            seen["jobs"], seen["dir"], self.closed = jobs, directory, False
            self.keys = []

        def submit(self, keys):
            self.keys += list(keys)
            return len(keys)

        def wait(self, keys, timeout=None):
            return {k: "boom" for k in keys if all_fail or k is keys[-1]}

        def stats(self):
            return {"compiled": 0, "cached": 0, "failed": 1}

        def close(self, cancel=False):
            seen["closed"] = cancel

    monkeypatch.setattr(compile_pool, "CompilePool", FakePool)
    rc = cli.main(["tune", "--shapes", "8x64x48", "16x64x48", "--jobs", "3", "--in-order",
                   "--max-candidates", "3", "--out", str(tmp_path / "t.yaml"), "--aot-dir",
                   str(tmp_path / "aot"), "--json", str(tmp_path / "t.json")])
    text = capsys.readouterr().out
    assert rc == 0 and seen["jobs"] == 3 and seen["closed"] is True
    assert "worker could not build" in text and "boom" in text
    if all_fail:
        assert "compiling in this process from now on" in text
    recs = json.loads((tmp_path / "t.json").read_text())["records"]
    assert all(len(r["cands"]) == 3 for r in recs)     # built here instead: still timed


def test_an_unbuildable_candidate_is_tried_once(monkeypatch, tmp_path, capsys):
    fake_cuda.install(monkeypatch, l2=1 << 14)
    from detgemm_cute.benchlib import timing
    from detgemm_cute.tune import measure

    monkeypatch.setattr(measure, "TUNE_PLAN", timing.TimingPlan(
        target_ms=0.2, reps=2, min_reps=2, budget_ms=2.0, warm_rounds=1, warm_replays=1,
        est_min_ms=0.1, max_sets=2, max_r=4))
    monkeypatch.setenv("DETGEMM_CUTE_AOT_DIR", "off")
    real = measure.P.detgemm_call
    tried = []

    def call(op, dg, bucket=None):
        fn = real(op, dg, bucket)
        if bucket and "_16x32x128_" in bucket:    # these "fail to compile"
            def broken(s):
                tried.append(bucket)
                raise RuntimeError("DSLRuntimeError: cannot build this tile")
            return broken
        return fn

    monkeypatch.setattr(measure.P, "detgemm_call", call)
    monkeypatch.setattr(kcompile, "cached_keys", lambda: [])
    rc = cli.main(["tune", "--shapes", "8x64x48", "9x64x48", "10x64x48", "--jobs", "1",
                   "--max-candidates", "12", "--out", str(tmp_path / "t.yaml"), "--aot-dir",
                   str(tmp_path / "aot")])
    text = capsys.readouterr().out
    assert rc == 0 and "could not be built" in text
    assert tried and len(tried) == len(set(tried))       # each failing one tried on one problem


def test_pingpong_and_swapped_candidates():
    """The sm90 limits' options: ping-pong variants pass its limits (persistent, BN cap) with
    the stages its smaller epilogue buffer allows; swapped candidates rank tiles on (N, M)."""
    sp = C.space_for("sm90")
    cands = C.candidates_for(777, 9472, 3584, sp, max_candidates=64)
    pp = [c for c in cands if dict(c.extra).get("pingpong")]
    sw = [c for c in cands if dict(c.extra).get("swap_ab")]
    assert pp and sw and any(dict(c.extra) == {"pingpong": True, "swap_ab": True} for c in cands)
    for c in pp:
        assert c.persistent and c.tile[1] <= sm90_limits.PINGPONG_TILE_N_MAX[c.tile[0]]
        assert c.stages == sm90_limits.max_stages(c.tile, pingpong=True)
    for c in cands:
        assert sm90_limits.check_config(c.tile, c.cluster, c.stages, c.persistent,
                                        **dict(c.extra)) == [], c
    # Swapped: the tile's M runs along N = 9472 and its N along M = 777.
    assert {c.tile[:2] for c in sw} == {(bm, bn) for bm, bn, _ in C.rank_tiles(
        9472, 777, 3584, sp, C.Machine())}
