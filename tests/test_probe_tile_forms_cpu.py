"""CPU checks of bench/probe_tile_forms.py (the tile kernel's mainloop forms A/B): which
problems it runs and at which launch, that a form's calls build their kernels in that form
from their own cache, and the report from rows shaped like a GPU run's."""

from __future__ import annotations

import pytest

from bench_path import bench_on_path


@pytest.fixture(scope="module")
def pf():
    with bench_on_path():
        import probe_tile_forms
        yield probe_tile_forms


def test_launch_is_the_path_tile_or_the_128_row_tile(pf):
    from detgemm_cute import split_decode

    assert pf.launch("fwd", 64, 4096, 4096, 132) == split_decode.tile_shape(64, 4096, 132, True)
    assert pf.launch("dx", 33, 4096, 14336, 132) == split_decode.kn_shape(33, 4096, 14336, 132)
    assert pf.launch("fwd", 64, 4096, 1024, 132) is None  # the streaming kernel's width
    wide = pf.launch("dx", 80, 4096, 14336, 132)
    assert wide == split_decode.TileShape(128, 32, 2, 2, 128, True)
    assert split_decode.tile_smem_bytes(128, 32, 2, 2, True, True) <= split_decode.SMEM_LIMIT


def test_a_form_builds_from_its_own_cache(pf):
    """Each form's calls see that form's class switches and their own kernel cache; the
    switches and the cache are the tree's again after every call."""
    from detgemm_cute import split
    from detgemm_cute.kernels.split_tile import SplitTileFp32

    outer, defaults = split._kernels, (SplitTileFp32.ROW_CHECK, SplitTileFp32.INTERLEAVE)
    seen = []

    def call(_):
        seen.append((SplitTileFp32.ROW_CHECK, SplitTileFp32.INTERLEAVE, split._kernels))
        split.compiled_once("k", lambda: "built")
        return "y"

    runs = {form: pf.in_form(form, call) for form in pf.FORMS}
    for form, run in runs.items():
        assert run(None) == "y" and split._kernels is outer
        assert (SplitTileFp32.ROW_CHECK, SplitTileFp32.INTERLEAVE) == defaults
        flags = seen[-1][:2]
        assert flags == pf.FORMS[form] and seen[-1][2] is not outer
        assert seen[-1][2] == {"k": "built"}
    assert len({id(s[2]) for s in seen}) == len(pf.FORMS)


def test_report_renders(pf):
    us = {"today": 60.0, "cublas_sgemm": 54.0, "v1": 66.0, "lean": 64.0, "lean_il": 60.0}
    rows = [{"op": "dx", "M": 64, "K": 4096, "N": 4096, "shape": [64, 32, 4, 2, 128, True],
             "us": us, "bits_equal_split_path": {"today": True, "v1": True, "lean": True,
                                                 "lean_il": True}},
            {"op": "dx", "M": 64, "K": 8192, "N": 8192, "shape": [64, 64, 4, 2, 128, True],
             "us": dict(us, today=40.0, lean_il=40.0), "bits_equal_split_path": {"v1": False}}]
    lines = pf.report(rows, {"device": "TEST GPU"})
    summary = next(line for line in lines if line.startswith("| dx | 64 | 2 |"))
    assert summary.endswith("| 1/2 |")  # the second row's bits differ
    assert summary.split(" | ")[-3] == "1.347"  # lean_il / v1: geomean of 66/60 and 66/40
    assert lines[-1].startswith("| dx | 64 | 8192 | 8192 | [64, 64, 4, 2, 128, True] | 40.0 |")
