"""bench/sweep_fp32.py and bench/compare_fp32.py without a GPU: the sweep's problems and
candidates, and the committed A/B record rendered again from its JSON."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench_path import bench_on_path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
AB = RESULTS / "fp32-small-m-ab_nvidia-h200"


@pytest.fixture(scope="module")
def mods():
    with bench_on_path():
        import compare_fp32
        import sweep_fp32
        yield sweep_fp32, compare_fp32


def test_committed_ab_record_is_what_compare_fp32_renders(mods):
    _, cf = mods
    with gzip.open(f"{AB}.json.gz", "rt") as f:
        ab = json.load(f)
    assert cf.render(ab) == Path(f"{AB}.md").read_text()
    # both sides ran the same problems, and the record's claims hold on them
    for op in ("fwd", "dx"):
        pairs = list(cf.paired(ab, op).values())
        assert len(pairs) == len(ab["old"][op]) == len(ab["new"][op]) > 0
        assert all(a["out_sha1"] == b["out_sha1"] for a, b in pairs)


def test_committed_tier_ab_sections_are_what_compare_fp32_renders(mods):
    """Each of the three A/Bs in fp32-tier-ab_nvidia-h200.md is its JSON rendered (headings one
    level down), and each JSON's old and new outputs have the same bits on every problem."""
    _, cf = mods
    stem = RESULTS / "fp32-tier-ab_nvidia-h200"
    text = Path(f"{stem}.md").read_text()
    for tag in ("g4", "g8", "unscale"):
        with gzip.open(f"{stem}_{tag}.json.gz", "rt") as f:
            ab = json.load(f)
        assert "#" + cf.render(ab) in text, tag  # its title one level down: "## ..."
        for op in ("fwd", "dx"):
            pairs = cf.paired(ab, op)
            assert len(pairs) == 44
            assert all(a["out_sha1"] == b["out_sha1"] for a, b in pairs.values())


def test_compare_fp32_counts_rows_and_bits(mods):
    _, cf = mods

    def rec(m, table_us, sha):
        return {"gemm": [m, 256, 512], "label": "W 512->256", "table": f"fwd_x.t{m}",
                "table_us": table_us, "sgemm_us": 100.0, "out_sha1": sha}

    ab = {"old": {"fwd": [rec(80, 200.0, "a"), rec(160, 100.0, "b")]},
          "new": {"fwd": [rec(80, 100.0, "a"), rec(160, 100.0, "c")]}}
    row = cf.summary_row("fwd", list(cf.paired(ab, "fwd").values()))
    assert "| fwd | 2 | 1.414x (1.00-2.00) |" in row and "| 1 -> 0 | 1/2 |" in row


def test_sweep_problems_and_candidates(mods):
    sw, _ = mods
    from detgemm_cute.kernels import sm90_limits

    probs = sw.problems(sw.WEIGHTS, sw.M_LIST, ("fwd", "dx"))
    assert len(probs) == len(set(probs)) == 2 * len(sw.WEIGHTS) * len(sw.M_LIST)
    assert probs == sw.problems(sw.WEIGHTS, sw.M_LIST, ("fwd", "dx"))  # a fixed order
    assert sw.gemm_dims("fwd", 65, 4096, 1280) == (65, 1280, 4096)
    assert sw.gemm_dims("dx", 65, 4096, 1280) == (65, 4096, 1280)  # reduces over W's N
    for c in sw.CANDIDATES:
        assert not sm90_limits.check_config(c["tile"], c["cluster"], c["stages"],
                                            c["persistent"], dtypes=("fp32",))
    assert sw.parse_args(["--out", "x", "--ops", "dx", "--m-list", "16"]).m_list == (16,)
    with pytest.raises(SystemExit):  # fwd at M <= 64 is the fused decode kernels' range
        sw.parse_args(["--out", "x", "--m-list", "16"])
