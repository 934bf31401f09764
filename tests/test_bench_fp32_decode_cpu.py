"""CPU checks of bench/bench_fp32_decode.py (the fp32 tier at decode sizes, split into its
parts): its decode candidate tiles load as a valid fp32 layer, and the report renders from
rows shaped like a GPU run's."""

from __future__ import annotations


import pytest

from bench_path import bench_on_path
from detgemm_cute import registry

@pytest.fixture(scope="module")
def bd():
    with bench_on_path():
        import bench_fp32_decode
        yield bench_fp32_decode


def test_decode_candidates_are_valid_fp32_buckets(bd, tmp_path):
    path = tmp_path / "decode.yaml"
    bd.candidate_layer(path, bd.DECODE_CANDIDATES)
    f = registry.load_config(path, arch="sm90")  # ConfigError names a bad tile or stage count
    assert [b.name for b in f.buckets] == [bd.cand_name(i, bd.DECODE_CANDIDATES)
                                           for i in range(len(bd.DECODE_CANDIDATES))]
    assert all(b.tile[2] == 96 and b.dtypes == ("fp32",) for b in f.buckets)


def test_report_renders(bd):
    us = {"detgemm_fp32": 144.0, "cublas_sgemm": 34.0, "split_w": 75.0, "split_x": 3.0,
          "copy_w": 45.0, "gemm_parts": 60.0, "cand_64x32_s10_np": 38.0,
          "cand_64x16_s10_np": None}
    lines = bd.report([{"M": 1, "K": 4096, "N": 4096, "us": us}], {"device": "TEST GPU"})
    row = lines[-1]
    assert row.startswith("| 1 | 4096 | 4096 | 144.0 | 75.0 | 3.0 | 60.0 |")
    assert "cand_64x32_s10_np 38.0" in row and "| 0.24 |" in row
    assert row.endswith(f"| {34.0 / (75.0 + 3.0 + 38.0):.2f} |")
