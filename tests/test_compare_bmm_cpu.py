"""bench/compare_bmm.py: two tables' `sweep_bmm.py` records as one A/B table (CPU only)."""

from __future__ import annotations

import gzip
import json

import pytest

from bench_path import bench_on_path


@pytest.fixture(scope="module")
def cb():
    with bench_on_path():
        import compare_bmm
        yield compare_bmm


def record(tmp_path, name, table_us, torch_us=100.0, bits=True):
    rows = [{"kind": kind, "L": 8, "M": m, "K": 128 if kind == "qk" else m,
             "N": m if kind == "qk" else 128, "table": f"bucket_{kind}", "bits_ok": bits,
             "us": {"torch_bmm": torch_us, "table": t}}
            for (kind, m), t in table_us.items()]
    path = tmp_path / name
    with gzip.open(path, "wt") as f:
        json.dump({"meta": {"device": "TEST GPU", "torch": "x", "date": "d"}, "rows": rows}, f)
    return str(path)


def test_ab_table_combines_runs_and_counts_rows_below_the_floor(cb, tmp_path, capsys):
    a1 = record(tmp_path, "a1.json.gz", {("qk", 1000): 125.0, ("pv", 1000): 80.0})
    a2 = record(tmp_path, "a2.json.gz", {("qk", 1000): 125.0, ("pv", 1000): 80.0})
    b = record(tmp_path, "b.json.gz", {("qk", 1000): 100.0, ("pv", 1000): 80.0}, torch_us=101.0)
    assert cb.main(["--a", a1, a2, "--b", b, "--labels", "old", "new"]) == 0
    out = capsys.readouterr().out
    assert "| all | 2 |" in out and "| 1 -> 0 | 0.80 -> 1.01 |" in out
    assert "| qk | 1 | 0.800x | 1.010x | 1.250x |" in out  # time ratio 125 / 100
    assert "on every row of both sides: True" in out


def test_records_without_rows_and_disjoint_problems_fail_clearly(cb, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cb.main(["--a", str(bad), "--b", str(bad)]) == 1
    assert "not a bench/sweep_bmm.py record" in capsys.readouterr().err
    a = record(tmp_path, "a.json.gz", {("qk", 1000): 1.0})
    b = record(tmp_path, "b.json.gz", {("qk", 2000): 1.0})
    assert cb.main(["--a", a, "--b", b]) == 1
    assert "share no problem" in capsys.readouterr().err


def test_same_as_a_takes_side_a_times_on_the_named_rows(cb, tmp_path, capsys):
    a = record(tmp_path, "a.json.gz", {("qk", 1000): 125.0, ("pv", 1000): 80.0})
    b = record(tmp_path, "b.json.gz", {("qk", 1000): 100.0, ("pv", 1000): 40.0})
    assert cb.main(["--a", a, "--b", b, "--same-as-a", "bucket_pv"]) == 0
    out = capsys.readouterr().out
    assert "| pv | 1 | 1.250x | 1.250x | 1.000x |" in out  # side A's 80 us on both sides
    assert "| qk | 1 | 0.800x | 1.000x | 1.250x |" in out
    assert cb.main(["--a", a, "--b", b, "--same-as-a", "bucket_pv:direct"]) == 1
    assert "no such rows" in capsys.readouterr().err  # no pv row was stored by the threads
