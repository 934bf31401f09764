"""CPU checks of bench/bench_fp32_decode.py (the fp32 tier at decode sizes): its forced
launch shapes are valid ones, and the report renders from rows shaped like a GPU run's."""

from __future__ import annotations

import pytest

from bench_path import bench_on_path


@pytest.fixture(scope="module")
def bd():
    with bench_on_path():
        import bench_fp32_decode
        yield bench_fp32_decode


def test_sweep_shapes_fit_or_are_skipped(bd):
    from detgemm_cute import split_decode

    for m in bd.DECODE_M:
        for rows, group, stages, per_sm, x_fp32 in bd.SWEEP:
            fn = bd.forced(m, 4096, rows, group, stages, per_sm, 132, x_fp32)
            if m > split_decode.MAX_M:
                assert fn is None
                continue
            smem = split_decode.smem_bytes(split_decode.m_rows_for(m), rows, group, stages,
                                           x_fp32)
            assert (fn is None) == (smem * per_sm > split_decode.SMEM_LIMIT)


def test_guess_sweep_shapes_fit_or_are_skipped(bd):
    from detgemm_cute import split_decode

    for m in bd.DECODE_M:
        for rows, group, stages, per_sm in bd.GUESS_SWEEP:
            fn = bd.forced_guess(m, 4096, rows, group, stages, per_sm, 132)
            m_rows = split_decode.m_rows_for(m)
            inline = m_rows <= split_decode.X_INLINE_M
            smem = split_decode.smem_bytes(m_rows, rows, group, stages,
                                           inline or m_rows >= split_decode.X_FP32_M, inline,
                                           True)
            assert (fn is None) == (smem * per_sm > split_decode.SMEM_LIMIT)


def test_report_renders(bd):
    us = {"detgemm_fp32": 30.0, "split_path": 140.0, "cublas_sgemm": 28.0, "read_w": 24.0,
          "stream": 41.0, "cluster": 30.2, "cluster_3_48_4": 29.5, "fused_r4_g2_s3_c1": None,
          "stream_twopass": 45.1, "stream_cold": 20.0}
    rows = [{"M": 1, "K": 4096, "N": 4096, "fused": True, "cluster": True,
             "launch_shape": [1, 3, 48, 4],
             "us": us, "bits_equal_split_path": {"detgemm_fp32": True}},
            {"M": 16, "K": 4096, "N": 4096, "fused": True, "launch_shape": [16, 8, 1, 2, 264],
             "us": dict(us, cluster=None), "bits_equal_split_path": {"detgemm_fp32": True}}]
    lines = bd.report(rows, {"device": "TEST GPU"})
    row = lines[-2]
    assert row.startswith("| 1 | 4096 | 4096 | 30.0 | cluster (1, 3, 48, 4) | 41.0 | 45.1 | "
                          "20.0 | 30.2 | 140.0 | 28.0 | 24.0 |")
    assert "| 0.93 | 0.20 |" in row and row.endswith("cluster_3_48_4 29.5 |")
    assert lines[-1].startswith("| 16 | 4096 | 4096 | 30.0 | stream (16, 8, 1, 2, 264) | 41.0 | "
                                "45.1 | 20.0 | - |")
    assert any("geomean 0.93x over 2 problems" in line and "0 below 0.8x" in line
               for line in lines)
    # the cold unit (every guess wrong) is a worst case, never the best forced shape
    assert any("1.100x the speed over 2 problems" in line and "2.255x" in line
               for line in lines)


def test_dx_report_renders(bd):
    us = {"detgemm_fp32": 20.0, "split_path": 48.0, "via_copy": 30.0, "transpose": 9.0,
          "cublas_sgemm": 21.0, "read_w": 5.0, "kn_8_2_2_2": 19.5, "kn_16_1_2_1": None}
    rows = [{"M": 16, "K": 4096, "N": 1024, "fused": True, "in_place": True, "us": us,
             "bits_equal_split_path": {"detgemm_fp32": True, "via_copy": True}},
            {"M": 64, "K": 100, "N": 1000, "fused": False, "us": dict(us, transpose=None),
             "bits_equal_split_path": {"detgemm_fp32": True, "via_copy": False}}]
    lines = bd.report_dx(rows, {"device": "TEST GPU"})
    assert lines[-2] == ("| 16 | 4096 -> 1024 | in place | 20.0 | 48.0 | 30.0 | 9.0 | 21.0 | "
                         "5.0 | 1.05 | 0.44 | kn_8_2_2_2 19.5 |")
    assert lines[-1].startswith("| 64 | 100 -> 1000 | no | 20.0 | 48.0 | 30.0 | - |")
    head = "\n".join(lines[:6])
    assert "detgemm 1.05x (min 1.05x, 0 below 0.8x), the split path 0.44x (2 below" in head
    assert "2.40x the split path's speed" in head and "1.50x via the copy's" in head
    assert "every problem: False" in head


def test_kn_sweep_forces_the_shape_it_names(bd, monkeypatch):
    """A `kn_*` unit runs the in-place kernel at its rows, chunks per round and stages, on
    a persistent grid of per_sm CTAs per SM (the blocks where fewer), X's form the guessing
    launch's; shapes whose shared memory exceeds per_sm CTAs are left out."""
    from detgemm_cute import split_decode

    seen = []
    monkeypatch.setattr(split_decode, "decode_gemm_kn", lambda *a: seen.append(a[4]))
    s = (None, None)
    bd.forced_kn(1, 4096, 4096, 16, 2, 2, 1, 132)(s)
    bd.forced_kn(8, 1024, 4096, 8, 2, 2, 2, 132)(s)
    one, two = seen
    assert (one.rows, one.group, one.stages, one.ctas) == (16, 2, 2, 132)
    assert one.w_guess and one.x_fp32 and one.x_inline and one.m_rows == 1
    assert (two.rows, two.group, two.stages, two.ctas) == (8, 2, 2, 128)
    assert two.x_fp32 and not two.x_inline and two.m_rows == 8
    assert bd.forced_kn(64, 4096, 4096, 16, 1, 4, 1, 132) is None  # 64 rows of X, 4 stages
    assert bd.forced_kn(8, 4096, 4096, 8, 2, 3, 2, 132) is None  # two such CTAs per SM


def test_tile_guess_sweep_shapes_fit_or_are_skipped(bd):
    """``--sweep tile_guess``: a shape runs exactly where it fits M (one n8 block and an m16
    tile per warp) and its CTAs' shared memory, fwd and in place (dX)."""
    from detgemm_cute import split_decode

    for kn in (False, True):
        for m in (*bd.DECODE_M, 65):
            units = bd.tile_guess_units(m, 4096, 132, kn)
            assert len(units) == len(bd.TILE_GUESS_SWEEP)
            m_rows = max(16, split_decode.m_rows_for(m))
            for (rows, group, stages, per_sm), fn in zip(bd.TILE_GUESS_SWEEP, units.values()):
                fits = (m <= split_decode.MAX_M and (m_rows // 16) * (rows // 8) >= 8
                        and split_decode.tile_smem_bytes(m_rows, rows, group, stages, True, kn)
                        * per_sm <= split_decode.SMEM_LIMIT)
                assert (fn is not None) == fits, (m, rows, group, stages, per_sm, kn)


def test_tile_guess_sweep_forces_the_shape_it_names(bd, monkeypatch):
    """A `tileg_*` unit runs the guessing tile kernel at its rows, chunks per round and
    stages on per_sm CTAs per SM (the blocks where fewer): through `decode_gemm` for the
    forward, in place through `decode_gemm_kn` (never via the copy) for dX."""
    from detgemm_cute import split_decode

    seen = []
    monkeypatch.setattr(split_decode, "decode_gemm",
                        lambda a, b, bias, shape: seen.append(("fwd", shape)))
    monkeypatch.setattr(split_decode, "decode_gemm_kn",
                        lambda a, b, bias, via_copy, shape: seen.append(("kn", via_copy, shape)))
    s = (None, None)
    bd.tile_guess_units(32, 4096, 132, False)["tileg_32_4_2_1"](s)
    bd.tile_guess_units(64, 9000, 132, True)["tileg_64_2_2_2"](s)
    (op1, fwd), (op2, via_copy, dx) = seen
    assert op1 == "fwd" and fwd == split_decode.TileShape(32, 32, 4, 2, 128, True)
    assert op2 == "kn" and via_copy is False
    assert dx == split_decode.TileShape(64, 64, 2, 2, 141, True)
