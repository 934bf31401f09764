"""CPU checks of the MoE tooling: bench/moe_layers.py (layers, passes, peers, the contract
check), bench/sweep_grouped.py and bench/bench_moe.py end to end with a fake CUDA
(tests/fake_cuda.py; detgemm runs its CPU reference), and bench/fit_grouped.py on the stored
sweep record (deterministic, a valid complete table, no worse than the current one there).
Times measured here mean nothing."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import shutil

import pytest
import torch

import fake_cuda
from detgemm_cute import registry
from detgemm_cute.benchlib import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
RECORD = os.path.join(BENCH, "results", "tune", "grouped_sweep_pingpong_nvidia-h200.json.xz")
GROUPED_BUCKETS = 7  # the --max-buckets the table's grouped block was fitted with
TINY = ("tiny", 3, 2, 32, 16, True)  # (name, experts, top-k, hidden, ffn, fused)


@pytest.fixture
def bench(monkeypatch):
    """The bench directory importable (the scripts import their neighbours by name)."""
    monkeypatch.syspath_prepend(BENCH)
    yield lambda name: importlib.import_module(name)
    registry.reset_user_configs()


def test_layer_dims_and_gemm_dims(bench):
    ml = bench("moe_layers")
    assert ml.layer_dims(ml.MODEL_BY_NAME["mixtral-8x7b"]) == [("up", 4096, 28672),
                                                               ("down", 14336, 4096)]
    assert ml.layer_dims(ml.MODEL_BY_NAME["mixtral-8x7b/unfused"])[0] == ("up", 4096, 14336)
    assert ml.gemm_dims("fwd", 4096, 14336, 1024, 8) == (128, 14336, 4096)
    assert ml.gemm_dims("dx", 4096, 14336, 1024, 8) == (128, 4096, 14336)
    assert ml.gemm_dims("dw", 4096, 14336, 1025, 8) == (4096, 14336, 129)
    assert len({m[0] for m in ml.MODELS}) == len(ml.MODELS)


@pytest.mark.parametrize("pass_", ["fwd", "dx", "dw"])
def test_sets_loop_and_contract_check(bench, monkeypatch, pass_):
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    ml = bench("moe_layers")
    gen = torch.Generator().manual_seed(1)
    s = ml.make_set(pass_, 3, 20, 32, 16, gen)
    a, b, offs, ends = s
    assert ends[-1] == 20 and offs.tolist() == ends and offs.dtype == torch.int32
    out = ml.detgemm(s)
    assert out.shape == ((3, 32, 16) if pass_ == "dw" else (20, 32 if pass_ == "dx" else 16))
    loop = ml.torch_loop(s)
    assert loop.shape == out.shape
    assert torch.allclose(loop.float(), out.float(), rtol=2e-2, atol=2e-2)
    assert ml.group_bits_equal_mm(out, s)
    g, start, end = ml.largest_group(ends)
    bad = out.clone()
    (bad[g] if pass_ == "dw" else bad[start:end]).view(torch.int16)[0, 0] ^= 1
    assert end > start and not ml.group_bits_equal_mm(bad, s)


def test_sweep_problem_order_and_args(bench):
    sg = bench("sweep_grouped")
    args = sg.parse_args(["--out", "x"])
    probs = list(sg.problems(args.models, args.tokens, args.passes))
    assert len(probs) == len(set((m[0], t, p, q) for m, t, p, q in probs))
    assert len(probs) == len(args.models) * len(args.tokens) * 2 * 2
    assert probs[0][:2] == (sg.MODEL_BY_NAME["mixtral-8x7b/unfused"], 512)
    assert sg.gemm_kn(sg.MODEL_BY_NAME["narrow-128e"], "down", "dx") == (7168, 256)
    for bad in (["--passes", "dz"], ["--models", "nope"], ["--candidates", "0"]):
        with pytest.raises(SystemExit):
            sg.parse_args(["--out", "x"] + bad)


def test_sweep_candidates_are_valid_grouped_buckets(bench, tmp_path):
    sg = bench("sweep_grouped")
    names = sg.candidate_layer(tmp_path / "c.yaml", "grouped", "gcand", sg.CANDIDATES)
    assert len(names) == len(sg.CANDIDATES)
    fields = sg.candidate_fields(names)
    assert [(tuple(f["tile"]), tuple(f["cluster"]), f["stages"]) for f in fields.values()] == [
        (c["tile"], c["cluster"], c["stages"]) for c in sg.CANDIDATES]


def test_sweep_candidates_k_are_valid_grouped_k_buckets(bench, tmp_path):
    sg = bench("sweep_grouped")
    names = sg.candidate_layer(tmp_path / "k.yaml", "grouped_k", "gkcand", sg.CANDIDATES_K)
    assert len(names) == len(sg.CANDIDATES_K)
    assert {registry.get_registry("sm90").bucket(nm).op for nm in names} == {"grouped_k"}


def _fake_sweep(bench, monkeypatch, tmp_path, *extra) -> dict:
    """sweep_grouped.py's main on a fake GPU over the tiny model (8 tokens, 2 candidates):
    its record."""
    fake_cuda.install(monkeypatch)
    sg = bench("sweep_grouped")
    monkeypatch.setattr(sg, "MODEL_BY_NAME", {"tiny": TINY})
    monkeypatch.setattr(sg, "PRIORITY", (("tiny", 8),))
    out = tmp_path / "sweep.json"
    assert sg.main(["--out", str(out), "--models", "tiny", "--tokens", "8", "--candidates",
                    "2", *extra]) == 0
    return json.loads(out.read_text())


def test_sweep_dw_pass_on_fake_gpu(bench, monkeypatch, tmp_path, capsys):
    """The dw pass times the grouped_k candidates and records its table key (K, N, m_avg)."""
    rec = _fake_sweep(bench, monkeypatch, tmp_path, "--passes", "dw")
    assert len(rec["rows"]) == 2 and all(nm.startswith("gkcand.") for nm in rec["candidates"])
    assert {tuple(r["table_key"]) for r in rec["rows"]} == {(32, 32, 6), (16, 32, 6)}
    assert all(r["bits_ok"] is True for r in rec["rows"])
    capsys.readouterr()


def test_sweep_main_on_fake_gpu(bench, monkeypatch, tmp_path, capsys):
    rec = _fake_sweep(bench, monkeypatch, tmp_path)
    assert len(rec["rows"]) == 4 and len(rec["candidates"]) == 2
    assert {(r["proj"], r["pass"]) for r in rec["rows"]} == {
        (p, q) for p in ("up", "down") for q in ("fwd", "dx")}
    for r in rec["rows"]:
        assert r["bits_ok"] is True and r["m_avg"] == 6
        assert all(r["us"][nm] > 0 for nm in rec["candidates"]), r
    assert set(rec["candidate_fields"]) == set(rec["candidates"])
    capsys.readouterr()


def test_bench_moe_on_fake_gpu(bench, monkeypatch, tmp_path, capsys):
    fake_cuda.install(monkeypatch)
    bm = bench("bench_moe")
    monkeypatch.setattr(bm, "MODEL_BY_NAME", {"tiny": TINY})
    assert bm.main(["--out", str(tmp_path), "--models", "tiny", "--tokens", "8",
                    "--tag", "t"]) == 0
    stem = tmp_path / "moe_nvidia-h100-80gb-hbm3_t"
    with gzip.open(f"{stem}.json.gz", "rt") as f:
        rep = json.load(f)
    assert len(rep["rows"]) == 6 and set(rep["summary"]) <= {"fwd", "dx", "dw"}
    for r in rep["rows"]:
        assert r["group_bits_equal_mm"] is True, r
        assert r["us"]["detgemm"] > 0 and r["us"]["torch_loop"] > 0
        assert r["method"] == "graphs"
        assert r["bucket"].startswith("grouped_k_" if r["pass"] == "dw" else "grouped_")
    md = (tmp_path / "moe_nvidia-h100-80gb-hbm3_t.md").read_text()
    assert "| tiny | 8 | up | dw |" in md and "geomean speed" in md
    capsys.readouterr()


def test_bench_moe_without_gpu_exits_2(bench, monkeypatch, capsys):
    monkeypatch.setattr(gpu, "gpu_check", lambda: ("no CUDA device", None))
    assert bench("bench_moe").main(["--out", "unused"]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_fit_on_the_stored_record_is_deterministic_and_valid(bench, tmp_path):
    fg = bench("fit_grouped")
    report, block = fg.fit([RECORD], leave_out=False)
    assert fg.fit([RECORD], leave_out=False) == (report, block)
    begin, end = fg.markers("grouped")
    assert block[0].strip().startswith(begin) and block[-1].strip() == end
    table = tmp_path / "sm90.yaml"
    shutil.copy(os.path.join(ROOT, "configs", "sm90.yaml"), table)
    table.write_text(fg.replace_block(table.read_text(), block))
    f = registry.load_config(table, arch="sm90", complete=True)  # covers every (M, N, K)
    fitted = [b for b in f.buckets if b.op == "grouped"]
    assert 2 <= len(fitted) <= 8
    # the record's ping-pong kernels win from 225 rows per expert, 2x1 clusters at narrow N
    assert any(b.pingpong and b.m[0] == 225 for b in fitted)
    assert any(b.cluster == (2, 1) and b.n[1] is not None and b.n[1] <= 896 for b in fitted)
    # the rest of the table is untouched
    old = registry.load_config(os.path.join(ROOT, "configs", "sm90.yaml"), complete=True)
    assert ([b.name for b in f.buckets if b.op != "grouped"]
            == [b.name for b in old.buckets if b.op != "grouped"])
    # on the record it was fitted on, the fit is no worse than the current table
    _meta, names, fields, rows = fg.read_records([RECORD])
    pts = fg.points_of(rows, names)
    boxes_pick = fg.table_picker(names, fields, table)
    cur = fg.speeds(pts, fg.table_picker(names, fields))
    new = fg.speeds(pts, boxes_pick)
    assert None not in cur and None not in new and len(pts) == len(rows) > 0
    geo = lambda xs: torch.tensor(xs).log().mean().exp().item()  # noqa: E731
    assert geo(new) >= geo(cur) - 1e-9
    layer = tmp_path / "layer.yaml"
    layer.write_text(fg.layer_text(block))
    assert len(registry.load_config(layer, arch="sm90").buckets) == len(fitted)


def test_fit_refuses_other_files(bench, tmp_path):
    fg = bench("fit_grouped")
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a sweep_grouped.py record"):
        fg.fit([str(p)])
    assert fg.fields_of_name("gcand.128x256x64_c1x2_s4_p") == {
        "tile": [128, 256, 64], "cluster": [1, 2], "stages": 4, "persistent": True,
        "pingpong": False}
    assert fg.fields_of_name("gcand.128x192x64_c1x2_s5_p_pingpong")["pingpong"] is True
    with pytest.raises(ValueError, match="kernel fields"):
        fg.fields_of_name("gcand.odd")


def test_grouped_block_of_the_table_is_the_fit_of_its_record(bench):
    """configs/sm90.yaml's grouped block is exactly what fit_grouped.py writes from the
    committed fwd/dX sweep record with GROUPED_BUCKETS boxes."""
    fg = bench("fit_grouped")
    _report, block = fg.fit([RECORD], max_buckets=GROUPED_BUCKETS)
    with open(os.path.join(ROOT, "configs", "sm90.yaml"), encoding="utf-8") as f:
        text = f.read()
    assert fg.replace_block(text, block) == text


def test_grouped_k_block_of_the_table_is_the_fit_of_its_record(bench):
    """configs/sm90.yaml's grouped_k block is exactly what fit_grouped.py writes from the
    committed dW sweep record: the table is data from that record, not edited by hand."""
    fg = bench("fit_grouped")
    record = os.path.join(BENCH, "results", "tune",
                          "grouped_k_sweep_nvidia-h100-80gb-hbm3.json.gz")
    _report, block = fg.fit([record], op="grouped_k")
    with open(os.path.join(ROOT, "configs", "sm90.yaml"), encoding="utf-8") as f:
        text = f.read()
    assert fg.replace_block(text, block, "grouped_k") == text



def test_compare_moe_on_the_stored_ab_records(bench, capsys, tmp_path):
    """bench/compare_moe.py on the committed A/B pair: every layer of both runs in the
    table, the per-pass summaries; a refusal for a file that is no bench_moe record and for
    two records with no layer in common."""
    import compare_moe

    stem = os.path.join(BENCH, "results", "grouped-half-tile-ab_nvidia-h100-80gb-hbm3")
    old, new = stem + "_old.json.gz", stem + "_new.json.gz"
    rows = compare_moe.compare(compare_moe.load(old), compare_moe.load(new))
    assert len(rows) == 96 and all(r["bits"] for r in rows)
    assert compare_moe.main([old, new, "--title", "t"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# t") and "| fwd, all | 48 |" in text and "| dx, all | 48 |" in text
    assert text.count("\n| ") == 1 + 8 + 1 + 96  # header, summaries, header, layers
    assert compare_moe.main([old, os.path.join(BENCH, "results", "moe_nvidia-h100-80gb-hbm3"
                                                ".json.gz").replace("moe_", "pdl_")]) == 1
    other = compare_moe.load(new)  # the same layers under other model names: none in common
    for r in other:
        r["model"] = "x-" + r["model"]
    renamed = tmp_path / "other.json.gz"
    with gzip.open(renamed, "wt") as f:
        json.dump({"rows": other}, f)
    assert compare_moe.main([old, str(renamed)]) == 1
    assert "no layer is in both records" in capsys.readouterr().err
