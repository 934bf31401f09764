"""CPU checks of bench/fit_bmm.py (the bmm buckets fitted from sweep records) and of
bench/sweep_bmm.py: the fit's choices on synthetic records, the layer it writes loading as a
valid table that shadows the right buckets, the stored records fitting without a GPU; the
sweep's candidate layer leaving unforced calls to the built-in table (so its `table` column
times the table), a forced candidate building the kernel the table builds for the same
tile, and the broad and p @ v presets."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from bench_path import bench_on_path
from detgemm_cute import batched, dispatch, registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fb():
    with bench_on_path():
        import fit_bmm
        yield fit_bmm


@pytest.fixture(scope="module")
def sb():
    with bench_on_path():
        import sweep_bmm
        yield sweep_bmm


@pytest.fixture(autouse=True)
def _no_user_layers():
    registry.reset_user_configs()
    yield
    registry.reset_user_configs()


A, B = "bcand.64x64x64_c1x1_s4_p", "bcand.128x128x64_c2x1_s4_p_pingpong"


def row(m, us, kind="qk", k=128, n=None, bits=True):
    return {"kind": kind, "L": 8, "M": m, "K": k, "N": m if n is None else n, "bits_ok": bits,
            "us": {"torch_bmm": 100.0, **us}, "errors": {}}


def write(tmp_path, rows, name="r.json.gz", table_timing="built-in table"):
    path = tmp_path / name
    meta = {"device": "TEST GPU", **({"table_timing": table_timing} if table_timing else {})}
    with gzip.open(path, "wt") as f:
        json.dump({"meta": meta, "candidates": [A, B], "rows": rows}, f)
    return path


def test_kernel_fields(fb):
    assert fb.kernel_fields(A) == {"tile": [64, 64, 64], "cluster": [1, 1], "stages": 4,
                                   "persistent": True}
    assert fb.kernel_fields(B)["pingpong"] is True
    assert fb.kernel_fields("x.128x256x64_c1x1_s3")["persistent"] is False
    with pytest.raises(ValueError, match="not a candidate name"):
        fb.kernel_fields("table")


def test_fit_cuts_the_bucket_where_the_best_tile_changes(fb, tmp_path):
    # bmm_m513_wide_n1024 serves M >= 513, N >= 1024, K 113..128: A wins below M 2500, D above
    # (B, ping-pong, faster still there, cannot keep the bucket's `direct` kernel)
    d = "bcand.128x128x64_c1x1_s4_p"
    rows = [row(m, {A: 80.0, B: 130.0, d: 131.0, "table": 120.0}) for m in (1024, 1500, 2048)]
    rows += [row(m, {A: 140.0, B: 80.0, d: 85.0, "table": 120.0}) for m in (3000, 4096)]
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
    assert not dispatch.lookup("bmm", "bf16", "sm90", 3000, 3000, 128).pingpong
    assert dispatch.lookup("bmm", "bf16", "sm90", 3000, 3000, 128).direct is not None  # kept
    # outside the fitted bucket the built-in table still decides
    assert dispatch.lookup("bmm", "bf16", "sm90", 64, 64, 64).layer == 0
    assert any("below" in p for p in printed)


C = "bcand.128x128x64_c2x1_s4_p"
QK = "bmm_m513_wide_n1024"  # q @ k^T, S >= 1024, head_dim 113..128: has a built-in `direct`


def _threads(r):
    return {**r, "layout": {"c_direct": True}}


def _fit_layer(fb, tmp_path, rows, **kw):
    printed = []
    lines = fb.fit(fb.read_rows([write(tmp_path, rows)]), device="TEST GPU",
                   out=printed.append, **kw)
    layer = tmp_path / "layer.yaml"
    layer.write_text("\n".join(lines) + "\n")
    return registry.add_config(layer, arch="sm90").buckets, printed


def test_thread_stored_rows_get_the_buckets_direct_kernel(fb, tmp_path):
    """Where a bucket's rows are of both kinds, the rows the threads store get their own pick
    (`direct`, never a ping-pong tile: its threads store nothing), the TMA-stored rows decide
    the bucket's tile (then not ping-pong either), and the layer loads."""
    rows = [row(m, {A: 130.0, B: 90.0, C: 80.0, "table": 120.0}) for m in (1024, 2048, 4096)]
    rows += [_threads(row(m, {A: 80.0, B: 78.0, C: 130.0, "table": 120.0}))
             for m in (1500, 2500, 3000)]  # B is fastest here, but a ping-pong tile
    (b,), printed = _fit_layer(fb, tmp_path, rows, splits=2)
    assert b.name == QK and not b.pingpong and (b.tile, b.cluster) == ((128, 128, 64), (2, 1))
    assert b.direct.tile == (64, 64, 64) and b.direct.persistent
    assert any(p.startswith("  direct (outputs the threads store): 64x64x64") for p in printed)
    # without a table timing, the table's speeds come per row from the kernel it runs there
    old = fb.read_rows([write(tmp_path, rows, "old.json.gz", table_timing=None)])
    got, how = fb.current_speeds(old, b)
    assert got == [100.0 / 80.0] * 6 and how == " + ".join(sorted((A, C)))


def test_a_bucket_keeps_its_direct_where_no_row_is_thread_stored(fb, tmp_path):
    rows = [row(m, {A: 130.0, B: 60.0, C: 80.0, "table": 120.0}) for m in (1024, 2048, 4096)]
    (b,), printed = _fit_layer(fb, tmp_path, rows)
    own = dispatch.bucket_by_name("sm90", QK).direct
    assert b.tile == (128, 128, 64) and not b.pingpong  # B (ping-pong) would lose the direct
    assert (b.direct.tile, b.direct.stages, b.direct.persistent) == (
        own.tile, own.stages, own.persistent)


def test_thread_stored_rows_alone_refit_only_the_direct_kernel(fb, tmp_path):
    rows = [_threads(row(m, {A: 80.0, C: 130.0, "table": 120.0})) for m in (1500, 2500, 3000)]
    (b,), printed = _fit_layer(fb, tmp_path, rows)
    own = dispatch.bucket_by_name("sm90", QK)
    assert (b.tile, b.cluster, b.stages) == (own.tile, own.cluster, own.stages)
    assert b.direct.tile == (64, 64, 64)
    assert any("no rows TMA stores: kept" in p for p in printed)


def _vector(r):
    return {**r, "layout": {"c_direct": True, "c_align": 8}}


def test_rows_of_one_store_width_refit_only_that_widths_kernel(fb, tmp_path):
    """Thread-stored rows all stored 8 bytes at a time pick `direct_vector`; the element-
    stored rows, not timed, keep the kernel they ran (the bucket's `direct`), and the other
    way round (the 8-byte rows keep theirs, which was `direct` too)."""
    fam = dispatch.bucket_by_name("sm90", QK)
    tma = [row(m, {A: 130.0, C: 80.0, "table": 120.0}) for m in (1024, 2048, 4096)]
    vec = [_vector(row(m, {A: 80.0, C: 130.0, "table": 120.0})) for m in (1500, 2500, 3000)]
    (b,), printed = _fit_layer(fb, tmp_path, tma + vec)
    assert b.direct_vector.tile == (64, 64, 64)
    assert (b.direct.tile, b.direct.stages) == (fam.direct.tile, fam.direct.stages)
    assert any("direct (outputs the threads store): the bucket's own (no such rows timed"
               in p for p in printed)
    registry.reset_user_configs()
    elem = [_threads(row(m, {A: 80.0, C: 130.0, "table": 120.0})) for m in (1501, 2047, 3001)]
    (b,), _ = _fit_layer(fb, tmp_path, tma + elem)
    assert b.direct.tile == (64, 64, 64)
    assert (b.direct_vector.tile, b.direct_vector.stages) == (fam.direct.tile, fam.direct.stages)


def test_store_widths_that_want_different_kernels_get_one_each(fb, tmp_path):
    tma = [row(m, {A: 130.0, C: 80.0, "table": 120.0}) for m in (1024, 2048, 4096)]
    vec = [_vector(row(m, {A: 90.0, C: 60.0, "table": 120.0})) for m in (1500, 2500, 3000)]
    elem = [_threads(row(m, {A: 60.0, C: 90.0, "table": 120.0})) for m in (1501, 2047, 3001)]
    (b,), printed = _fit_layer(fb, tmp_path, tma + vec + elem)
    assert b.direct.tile == (64, 64, 64) and b.direct_vector.tile == (128, 128, 64)
    assert b.direct_vector.cluster == (1, 1)  # thread-stored rows run without one
    assert b.direct_kernel(8) is b.direct_vector and b.direct_kernel(0) is b.direct
    registry.reset_user_configs()
    same = [_vector(row(m, {A: 60.0, C: 90.0, "table": 120.0})) for m in (1500, 2500, 3000)]
    (b,), _ = _fit_layer(fb, tmp_path, tma + same + elem)  # one kernel serves both widths
    assert b.direct.tile == (64, 64, 64) and b.direct_vector is None


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


def test_an_older_records_table_column_is_not_the_table(fb, tmp_path):
    """Records without `table_timing` timed the candidate layer's first tile as `table` (the
    layer shadowed the built-in table): the fit takes the candidate with the table's kernel
    instead. bmm_m1025_n65_128 is 128x128x64 persistent, 4 stages, a 2x1 cluster."""
    c128 = "bcand.128x128x64_c2x1_s4_p"
    rows = [row(m, {A: 200.0, c128: 110.0, "table": 200.0}, kind="pv", k=m, n=128)
            for m in (1500, 2500)]
    assert {dispatch.lookup("bmm", "bf16", "sm90", m, 128, m).name
            for m in (1500, 2500)} == {"bmm_m1025_n65_128"}
    old = fb.read_rows([write(tmp_path, rows, "old.json.gz", table_timing=None)])
    assert all("table" not in r["us"] for r in old)
    assert fb.current_speeds(old, dispatch.bucket_by_name("sm90", "bmm_m1025_n65_128")) == (
        [100.0 / 110.0] * 2, c128)
    new = fb.read_rows([write(tmp_path, rows, "new.json.gz")])
    assert fb.current_speeds(new, None) == ([0.5, 0.5], "table")


def test_rows_with_bad_bits_or_no_peer_are_dropped(fb, tmp_path):
    rows = [row(1024, {A: 80.0}), row(2048, {A: 80.0}, bits=False)]
    rows.append({**row(3000, {A: 80.0}), "us": {A: 80.0}})
    assert [r["M"] for r in fb.read_rows([write(tmp_path, rows)])] == [1024]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="no 'rows' list"):
        fb.read_rows([bad])


def test_a_table_without_timing_is_not_replaced(fb, tmp_path):
    # p @ v rows of bmm_m1025_n65_128; the table's tile is not among the candidates timed
    rows = [row(m, {B: 90.0}, kind="pv", k=m, n=128) for m in (1500, 2500)]
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


def test_broad_sweep_problems(sb):
    sweep_bmm = sb
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


def _layer(sb, tmp_path):
    with bench_on_path():
        from sweep_common import candidate_layer
    return candidate_layer(tmp_path / "candidates.yaml", "bmm", "bcand", sb.CANDIDATES)


def _sm90(monkeypatch):
    """`batched.kernel_layout` as on an H100, on CPU tensors."""
    monkeypatch.setattr(batched, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(batched, "_gpu_arch", lambda arch, device: "sm_90a")


def _pv(lb, s, d):
    """p @ v operands: softmax rows [L, S, S] (a row pitch of 2S bytes), v [L, S, d]."""
    return (torch.randn(lb, s, s, dtype=torch.bfloat16).softmax(-1),
            torch.randn(lb, s, d, dtype=torch.bfloat16))


PV_SHAPES = [(2, 1500, 128), (2, 2500, 80), (2, 2047, 128), (2, 1500, 64), (2, 777, 128),
             (2, 3000, 128)]


@pytest.mark.parametrize("lb, s, d", PV_SHAPES)
def test_candidate_layer_leaves_unforced_calls_to_the_table(sb, tmp_path, lb, s, d):
    """With the sweep's candidates added, an unforced bmm still gets the built-in bucket
    (the layer once served every M: the broad sweep's `table` timed its 64x64 tile), and
    every candidate can still be forced by name."""
    for m, n, k in ((s, d, s), (s, s, d)):  # p @ v and q @ k^T
        want = dispatch.lookup("bmm", "bf16", "sm90", m, n, k)
        names = _layer(sb, tmp_path)
        got = dispatch.lookup("bmm", "bf16", "sm90", m, n, k)
        assert got.name == want.name and got.layer == 0, (m, n, k, got.name)
        for nm in names:
            assert dispatch.bucket_by_name("sm90", nm).name == nm
        registry.reset_user_configs()


@pytest.mark.parametrize("lb, s, d", PV_SHAPES)
def test_forced_candidate_builds_the_tables_kernel(sb, tmp_path, monkeypatch, lb, s, d):
    """The table's p @ v bucket and the sweep's candidate of the same tile build one kernel
    key and one layout for these operands (P read by the producer warpgroup where its rows
    are not 16-byte aligned): the table runs what the sweep times as that candidate."""
    _sm90(monkeypatch)
    p, v = _pv(lb, s, d)
    table = dispatch.lookup("bmm", "bf16", "sm90", s, d, s)
    got = batched.kernel_layout(p, v, None, torch.bfloat16, table)
    names = _layer(sb, tmp_path)
    label = "{}x{}x{}_c{}x{}_s{}".format(*table.tile, *table.cluster, table.stages)
    # P read by the threads runs the persistent kernel whatever the bucket says
    labels = {label + "_p"} | ({label} if not (table.persistent or got[0].a_loads) else set())
    twin = [nm for nm in names if nm.split(".", 1)[1] in labels]
    if not twin:
        pytest.skip(f"no sweep candidate has the tile of {table.name} ({label})")
    forced = batched.kernel_layout(p, v, None, torch.bfloat16,
                                   dispatch.bucket_by_name("sm90", twin[0]))
    assert got == forced
    key = got[0]
    assert key.a_loads == bool(s % 8) and not got[1] and not got[2]  # no staging copy
    if key.a_loads:
        assert key.persistent and key.stages == min(table.stages, 3) and key.cluster[1] == 1


def test_preset_pv_parses_and_lists_its_calls(sb, tmp_path):
    args = sb.parse_args(["--preset", "pv", "--out", str(tmp_path / "r.json")])
    probs = sb.problem_list(args)
    assert probs == sb.PV_PROBLEMS and len(probs) == 8
    assert all(s % 8 for _, _, s, _ in probs)  # rows TMA cannot address
    names = sb.candidate_names(args, _layer(sb, tmp_path))
    assert sorted(nm.split(".", 1)[1] for nm in names) == sorted(sb.PV_ONLY)  # no twins
    for _, lb, s, d in probs:  # each problem's table tile is among the forced ones
        b = dispatch.lookup("bmm", "bf16", "sm90", s, d, s)
        assert any(dispatch.bucket_by_name("sm90", nm).tile == b.tile for nm in names), b.name
    fns = sb.timed_calls("pv", 1500, names)
    assert {"torch_bmm", "table", "stage_copy", "aligned_gemm", "staged"} <= set(fns)
    assert "staged" not in sb.timed_calls("pv", 1504, names)  # aligned rows: no staging
    us = {"torch_bmm": 450.0, "table": 600.0, names[0]: 900.0, "staged": 1000.0}
    assert sb.speeds_text(us, names) == (
        f"table 0.75x, {names[0].split('.', 1)[1]} 0.50x, staged 0.45x")
    with pytest.raises(SystemExit):
        sb.parse_args(["--preset", "pv", "--problems", "1,2,3", "--out", "x"])


def test_direct_twins_count_as_the_candidate_on_thread_stored_rows(fb, tmp_path):
    """`sweep_bmm.py --direct-only` times "X+direct": on a row the threads store anyway that
    is kernel X; on a TMA-stored row it is another kernel and stays apart."""
    threads = {**row(1000, {A + "+direct": 70.0, "table": 90.0}), "layout": {"c_direct": True}}
    tma = {**row(1024, {A + "+direct": 150.0, B: 80.0, "table": 90.0}),
           "layout": {"c_direct": False}}
    got = {r["M"]: r["us"] for r in fb.read_rows([write(tmp_path, [threads, tma])])}
    assert got[1000][A] == 70.0 and A + "+direct" in got[1000]
    assert A not in got[1024] and got[1024][B] == 80.0
    assert fb.candidates_of([{"us": got[1000], "M": 1000}]) == [A]


def test_the_h200_device_table_is_the_fit_of_its_records(fb, monkeypatch, tmp_path):
    """configs/devices/nvidia-h200/sm90.yaml: `fit_bmm.py --splits 0` on the committed H200
    sweep records picks each bucket's kernels (the records' rows ran the family table, which
    is what the fit groups by), with the two exceptions its notes give: bmm_m257_512_wide's
    element-stored rows keep the family's 64x128 (2.26x torch.bmm against the fit's 128x128,
    2.18x), and bmm_k1_64 keeps the family's tile (the fit's was within 1% on the rows TMA
    stores; the box also serves other bmm with K <= 64, not timed) and takes only the fit's
    `direct_vector`. The n1024 buckets split their thread-stored rows by store width: the
    fit's 128x256 for 8-byte stores, the family's 64x256 for one-element stores."""
    monkeypatch.setenv("DETGEMM_CUTE_DEVICE_TABLE", "off")  # the fit groups by the family's
    tune = ROOT / "bench" / "results" / "tune"
    rows = fb.read_rows([tune / "bmm_qk_tma_nvidia-h200.json.gz",
                         tune / "bmm_qk_direct_nvidia-h200.json.gz"])
    layer = tmp_path / "fit.yaml"
    layer.write_text("\n".join(fb.fit(rows, splits=0, device="NVIDIA H200",
                                      out=lambda *_: None)) + "\n")
    fitted = {b.name: b for b in registry.load_config(layer).buckets}
    family = {b.name: b for b in registry.load_builtin("sm90").buckets}
    shipped = registry.load_config(ROOT / "configs" / "devices" / "nvidia-h200" / "sm90.yaml")
    shipped = [b for b in shipped.buckets if b.op == "bmm"]
    assert {b.name for b in shipped} == set(fitted)
    kernel = lambda b: b and (b.tile, b.cluster, b.stages, b.persistent)  # noqa: E731
    stored = lambda b: (b.tile, b.stages, b.persistent)  # noqa: E731  (thread-stored: no cluster)
    for b in shipped:
        f, fam = fitted[b.name], family[b.name]
        assert kernel(b) == kernel(fam if b.name == "bmm_k1_64" else f), b.name
        for width in (0, 8):  # the kernel each store width of thread-stored rows runs
            want = {"bmm_m257_512_wide": fam.direct_kernel(width) or fam,
                    "bmm_k1_64": (f if width == 8 else fam).direct_kernel(width) or fam}.get(
                b.name, f.direct_kernel(width) or f)
            assert stored(b.direct_kernel(width) or b) == stored(want), (b.name, width)
    n1024 = fitted["bmm_m513_wide_n1024"]
    assert n1024.direct.tile == (64, 256, 64) and n1024.direct_vector.tile == (128, 256, 64)
