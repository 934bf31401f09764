"""CPU checks of bench/fit_bmm.py (the bmm buckets fitted from sweep records) and of
bench/sweep_bmm.py's broad preset: the fit's choices on synthetic records, the layer it
writes loading as a valid table that shadows the right buckets, and the stored records
fitting without a GPU."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench_path import bench_on_path
from detgemm_cute import dispatch, registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fb():
    with bench_on_path():
        import fit_bmm
        yield fit_bmm


@pytest.fixture(autouse=True)
def _no_user_layers():
    registry.reset_user_configs()
    yield
    registry.reset_user_configs()


A, B = "bcand.64x64x64_c1x1_s4_p", "bcand.128x128x64_c2x1_s4_p_pingpong"


def row(m, us, kind="qk", k=128, n=None, bits=True):
    return {"kind": kind, "L": 8, "M": m, "K": k, "N": m if n is None else n, "bits_ok": bits,
            "us": {"torch_bmm": 100.0, **us}, "errors": {}}


def write(tmp_path, rows, name="r.json.gz"):
    path = tmp_path / name
    with gzip.open(path, "wt") as f:
        json.dump({"meta": {"device": "TEST GPU"}, "candidates": [A, B], "rows": rows}, f)
    return path


def test_kernel_fields(fb):
    assert fb.kernel_fields(A) == {"tile": [64, 64, 64], "cluster": [1, 1], "stages": 4,
                                   "persistent": True}
    assert fb.kernel_fields(B)["pingpong"] is True
    assert fb.kernel_fields("x.128x256x64_c1x1_s3")["persistent"] is False
    with pytest.raises(ValueError, match="not a candidate name"):
        fb.kernel_fields("table")


def test_fit_cuts_the_bucket_where_the_best_tile_changes(fb, tmp_path):
    # bmm_m513_wide_n1024 serves M >= 513, N >= 1024, K 65..128: A wins below M 2500, B above
    rows = [row(m, {A: 80.0, B: 130.0, "table": 120.0}) for m in (1024, 1500, 2048)]
    rows += [row(m, {A: 140.0, B: 85.0, "table": 120.0}) for m in (3000, 4096)]
    assert {dispatch.lookup("bmm", "bf16", "sm90", r["M"], r["N"], r["K"]).name
            for r in rows} == {"bmm_m513_wide_n1024"}
    printed = []
    lines = fb.fit(fb.read_rows([write(tmp_path, rows)]), device="TEST GPU",
                   out=printed.append)
    layer = tmp_path / "layer.yaml"
    layer.write_text("\n".join(lines) + "\n")
    registry.add_config(layer, arch="sm90")
    for m, tile in ((1024, [64, 64, 64]), (2999, [64, 64, 64]), (3000, [128, 128, 64]),
                    (9000, [128, 128, 64])):
        b = dispatch.lookup("bmm", "bf16", "sm90", m, m, 128)
        assert list(b.tile) == tile and b.layer == 1, (m, b)
    assert dispatch.lookup("bmm", "bf16", "sm90", 3000, 3000, 128).pingpong  # the cut: at the
    assert not dispatch.lookup("bmm", "bf16", "sm90", 2999, 2999, 128).pingpong  # first M above
    # outside the fitted bucket the built-in table still decides
    assert dispatch.lookup("bmm", "bf16", "sm90", 64, 64, 64).layer == 0
    assert any("below" in p for p in printed)


def test_fit_keeps_a_bucket_it_cannot_improve(fb, tmp_path):
    rows = [row(m, {A: 100.0, B: 101.0, "table": 99.5}) for m in (1024, 2048, 4096)]
    printed = []
    lines = fb.fit(fb.read_rows([write(tmp_path, rows)]), out=printed.append)
    assert lines == ["arch: sm90", "buckets:"]
    assert any("kept: gain too small" in p for p in printed)


def test_rows_below_the_floor_are_reported_with_the_best_tile(fb, tmp_path):
    rows = [row(1500, {A: 140.0, B: 150.0, "table": 150.0}, kind="pv", k=1500, n=128),
            row(2500, {A: 90.0, B: 95.0, "table": 95.0}, kind="pv", k=2500, n=128)]
    rows[0]["layout"] = {"a_loads": True}
    printed = []
    fb.fit(fb.read_rows([write(tmp_path, rows)]), out=printed.append)
    low = [p for p in printed if "M=1500" in p]
    assert low and "0.71x" in low[0] and "a_loads" in low[0]


def test_rows_with_bad_bits_or_no_peer_are_dropped(fb, tmp_path):
    rows = [row(1024, {A: 80.0}), row(2048, {A: 80.0}, bits=False)]
    rows.append({**row(3000, {A: 80.0}), "us": {A: 80.0}})
    assert [r["M"] for r in fb.read_rows([write(tmp_path, rows)])] == [1024]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="no 'rows' list"):
        fb.read_rows([bad])


def test_a_table_without_timing_is_not_replaced(fb, tmp_path):
    rows = [row(m, {B: 90.0}) for m in (1024, 2048)]  # the table's tile is not among them
    printed = []
    assert fb.fit(fb.read_rows([write(tmp_path, rows)]), out=printed.append)[2:] == []
    assert any("not timed" in p for p in printed)


def test_stored_records_fit_to_a_valid_layer(fb, tmp_path, capsys):
    stored = sorted((ROOT / "bench/results/tune").glob("bmm_*.json.gz"))
    assert stored
    out = tmp_path / "layer.yaml"
    assert fb.main([*map(str, stored), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    if len(out.read_text().splitlines()) > 2:
        registry.load_config(out, arch="sm90")


def test_broad_sweep_problems():
    with bench_on_path():
        import sweep_bmm
    probs = sweep_bmm.broad_problems()
    assert len(probs) == len(set(probs))
    assert {d for *_, d in probs} == {64, 80, 96, 128}
    assert {s for _, _, s, _ in probs} >= {333, 1000, 1500, 2047, 3000}
    # the slow classes of the last bench first: S = 1500 at head_dim 64 and 128
    assert {(s, d) for _, _, s, d in probs[:5]} >= {(1500, 64), (1500, 128)}
    assert all(lb % heads == 0 for (name, lb, s, d) in probs
               for n2, heads, d2 in sweep_bmm.BROAD_HEADS if name.split("/b")[0] == n2)
    names = {c for c in sweep_bmm.BROAD_ONLY}
    labels = set()
    for c in sweep_bmm.CANDIDATES:
        from detgemm_cute.kernels.limits_common import config_label
        labels.add(config_label(c["tile"], c["cluster"], c["stages"], c["persistent"])
                   + ("_pingpong" if c["pingpong"] else ""))
    assert names <= labels, names - labels
