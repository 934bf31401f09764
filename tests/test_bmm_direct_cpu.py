"""A bmm bucket's `direct` kernel: the tile its calls run where the tile's threads store the
outputs (rows TMA cannot address, or would store as half sectors). Checked on the CPU: the
field's rules in a config file, the kernel key a call gets (the very key the bmm sweep timed
and checked bits for as a forced candidate), the warmed twins and `explain`."""

from __future__ import annotations

import pytest
import torch

from bench_path import bench_on_path
from detgemm_cute import aot, batched, dispatch
from detgemm_cute import registry as R

QK_BUCKET = "bmm_m513_wide_n1024"  # q @ k^T, S >= 1024, head_dim 113..128
# head_dim 65..112: the same `direct` kernel, its own tile cluster
QK_BUCKETS = (QK_BUCKET, "bmm_m513_wide_n1024_k65_112")


@pytest.fixture(autouse=True)
def _no_user_layers():
    R.reset_user_configs()
    yield
    R.reset_user_configs()


def _sm90(monkeypatch):
    """`batched.kernel_layout` as on an H100, on CPU tensors."""
    monkeypatch.setattr(batched, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(batched, "_gpu_arch", lambda arch, device: "sm_90a")


def _qk(lb, s, d):
    """q @ k^T operands as attention makes them: q [L, S, d], k^T a transposed view."""
    return (torch.randn(lb, s, d, dtype=torch.bfloat16),
            torch.randn(lb, s, d, dtype=torch.bfloat16).transpose(1, 2))


def _bmm_bucket(extra: str, op: str = "bmm") -> str:
    return ("arch: sm90\nbuckets:\n  - name: q\n    op: " + op + "\n    dtypes: [bf16]\n"
            "    m: [1, null]\n    tile: [128, 128, 64]\n    cluster: [2, 1]\n    stages: 4\n"
            "    persistent: true\n" + extra)


def test_the_field_loads_as_a_kernel_of_the_buckets_box(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(_bmm_bucket("    direct: {tile: [64, 256, 64], stages: 4, "
                                "persistent: true}\n"))
    (b,) = R.add_config(path).buckets
    d = b.direct
    assert (d.tile, d.cluster, d.stages, d.persistent) == ((64, 256, 64), (1, 1), 4, True)
    assert "cluster" not in str(dispatch.explain("bmm", "bf16", "sm90", 100, 100, 100)).split(
        "direct:")[-1].split("\n")[0].replace("no cluster", "")
    assert (d.name, d.op, d.m, d.n, d.k, d.dtypes) == ("q.direct", "bmm", b.m, b.n, b.k, b.dtypes)
    assert d.direct is None and not d.note


@pytest.mark.parametrize("op, extra, words", [
    ("fwd", "    direct: {tile: [64, 256, 64], stages: 4}\n",
     "bucket 'q': field 'direct': direct .* belongs to an op bmm bucket"),
    ("bmm", "    direct: [64, 256, 64]\n",
     "bucket 'q': field 'direct': direct must be a mapping with keys tile, stages, persistent"),
    ("bmm", "    direct: {tile: [64, 256, 64], stages: 4, cluster: [2, 1]}\n",
     "bucket 'q' direct: field 'cluster': unknown key"),
    ("bmm", "    direct: {tile: [32, 256, 64], stages: 4}\n",
     r"bucket 'q' direct: field 'tile': direct tiles have BM >= 64 .*got \[32, 256, 64\]"),
    ("bmm", "    direct: {tile: [64, 256, 64], stages: 4, stages: 3}\n",
     "bucket 'q' direct: field 'stages': given more than once"),
    ("bmm", "    pingpong: true\n    direct: {tile: [64, 256, 64], stages: 4}\n",
     "bucket 'q': field 'direct': a ping-pong tile's threads store no outputs"),
    ("bmm", "    direct: {tile: [64, 256, 64], stages: 4, pingpong: true}\n",
     "bucket 'q' direct: field 'pingpong': unknown key"),
    ("bmm", "    direct: {tile: [64, 256, 64]}\n",
     "bucket 'q' direct: field 'stages': missing"),
    ("bmm", "    direct: {tile: [64, 256], stages: 4}\n",
     "bucket 'q' direct: field 'tile': tile"),
    ("bmm", "    direct: {tile: [256, 256, 64], stages: 9}\n",
     "bucket 'q' direct: field"),
    ("fwd", "    direct_vector: {tile: [128, 256, 64], stages: 3}\n",
     "bucket 'q': field 'direct_vector': direct_vector .*8 bytes at a time.* belongs to an op "
     "bmm bucket"),
    ("bmm", "    direct_vector: {tile: [32, 256, 64], stages: 4}\n",
     r"bucket 'q' direct_vector: field 'tile': direct_vector tiles have BM >= 64"),
    ("bmm", "    pingpong: true\n    direct_vector: {tile: [64, 256, 64], stages: 4}\n",
     "field 'direct_vector': a ping-pong tile's threads store no outputs .*so direct_vector "
     "would never run"),
    ("bmm", "    direct_vector: {tile: [64, 256, 64], stages: 4, cluster: [2, 1]}\n",
     "bucket 'q' direct_vector: field 'cluster': unknown key"),
])
def test_a_bad_direct_kernel_is_refused_naming_the_bucket_and_field(tmp_path, op, extra, words):
    path = tmp_path / "bad.yaml"
    path.write_text(_bmm_bucket(extra, op=op))
    with pytest.raises(R.ConfigError, match=words):
        R.add_config(path)
    assert R.user_configs() == ()


def test_a_family_without_direct_stores_refuses_it(tmp_path):
    path = tmp_path / "sm80.yaml"
    path.write_text(_bmm_bucket("    direct: {tile: [64, 128, 32], stages: 4}\n").replace(
        "arch: sm90", "arch: sm80").replace("[128, 128, 64]", "[64, 128, 32]").replace(
        "    cluster: [2, 1]\n", "").replace("    persistent: true\n", ""))
    with pytest.raises(R.ConfigError, match="field 'direct': this kernel family stores no "
                                            "output by the tile's threads"):
        R.add_config(path)


def test_a_user_layers_direct_carries_the_layer(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(_bmm_bucket("    direct: {tile: [64, 256, 64], stages: 4}\n"))
    R.add_config(path)
    b = dispatch.bucket_by_name("sm90", "q")
    assert b.layer == b.direct.layer == 1


@pytest.mark.parametrize("s, d", [(1500, 128), (2500, 80), (2047, 96), (3000, 128)])
def test_thread_stored_outputs_run_the_direct_kernel_the_sweep_timed(tmp_path, monkeypatch,
                                                                     s, d):
    """An unforced q @ k^T whose rows TMA cannot store runs the bucket's `direct` tile, and
    builds the same kernel key and layout as the sweep's forced candidate of that tile (the
    kernel `bench/sweep_bmm.py` timed and checked bits for on the GPU)."""
    _sm90(monkeypatch)
    q, kt = _qk(2, s, d)
    table = dispatch.lookup("bmm", "bf16", "sm90", s, s, d)
    assert table.name in QK_BUCKETS and table.direct is not None
    got = batched.kernel_layout(q, kt, None, torch.bfloat16, table)
    key = got[0]
    assert key.c_direct and key.tile == table.direct.tile and key.cluster == (1, 1)
    with bench_on_path():
        import sweep_bmm
        from sweep_common import candidate_layer
    names = candidate_layer(tmp_path / "c.yaml", "bmm", "bcand", sweep_bmm.CANDIDATES)
    twin = [nm for nm in names if nm.endswith(".64x256x64_c1x1_s4_p")]
    assert twin
    assert batched.kernel_layout(q, kt, None, torch.bfloat16,
                                 dispatch.bucket_by_name("sm90", twin[0])) == got


@pytest.mark.parametrize("s, align", [(3000, 8), (1000, 8), (1500, 8), (2500, 8), (1502, 0),
                                      (2047, 0), (777, 0)])
def test_thread_stored_rows_are_stored_8_bytes_at_once_where_their_pitch_allows(
        monkeypatch, s, align):
    """The plan's direct kernel stores 8 bytes at once where the fresh output's row pitch is
    a multiple of 8 bytes (`c_align`), element by element otherwise; the key builds the fake
    C the launch's output meets, and warmup covers both."""
    from detgemm_cute import compile as kcompile
    from detgemm_cute.kernels import tensor_needs as needs

    _sm90(monkeypatch)
    q, kt = _qk(2, s, 128)
    table = dispatch.lookup("bmm", "bf16", "sm90", s, s, 128)
    key = batched.kernel_layout(q, kt, None, torch.bfloat16, table)[0]
    assert key.c_direct and key.c_align == align
    out = torch.empty(2, s, s, dtype=torch.bfloat16)
    assert needs.c_direct(key.swap_ab, True, key.c_align).meets(out)
    rows_4b = torch.empty(2, 5, 1502, dtype=torch.bfloat16)  # a 3004-byte pitch
    assert not needs.c_direct(False, True, 8).meets(rows_4b)
    warm = {k for _, k in aot._bucket_keys(table, "sm_90a", "all")}
    assert key in warm
    with pytest.raises(ValueError, match="c_align"):
        kcompile._kernel_options(kcompile.KernelKey(**{**key.__dict__, "c_direct": False,
                                                       "c_align": 16}))
    with pytest.raises(ValueError, match="c_align"):
        kcompile._kernel_options(kcompile.KernelKey(**{**key.__dict__, "c_direct": True,
                                                       "c_align": 16}))


@pytest.mark.parametrize("s", [1024, 2048, 4096])
def test_tma_stored_outputs_keep_the_buckets_own_kernel(monkeypatch, s):
    _sm90(monkeypatch)
    q, kt = _qk(2, s, 128)
    table = dispatch.lookup("bmm", "bf16", "sm90", s, s, 128)
    key = batched.kernel_layout(q, kt, None, torch.bfloat16, table)[0]
    assert not key.c_direct
    assert (key.tile, key.cluster, key.stages) == (table.tile, table.cluster, table.stages)


def test_warmup_twins_and_explain_show_the_direct_kernel():
    bucket = dispatch.bucket_by_name("sm90", QK_BUCKET)
    twins = [k for call, k in aot._bucket_keys(bucket, "sm_90a", "all") if k.c_direct]
    assert twins and all(k.tile == bucket.direct.tile and k.cluster == (1, 1) for k in twins)
    plain = [k for call, k in aot._bucket_keys(bucket, "sm_90a", "all") if not k.c_direct
             and not k.a_loads]
    assert plain and all(k.tile == bucket.tile for k in plain)
    text = str(dispatch.explain("bmm", "bf16", "sm90", 1500, 1500, 128))
    assert "direct:  outputs the tile's threads store" in text and "tile 64x256x64" in text
    assert "no cluster" in text
    from detgemm_cute import tables

    listing = tables.format_table([bucket]).splitlines()[1]
    assert "128x128x64 (direct 64x256x64)" in listing


def test_direct_vector_loads_and_explain_and_listing_show_it(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(_bmm_bucket("    direct: {tile: [64, 256, 64], stages: 4, persistent: true}\n"
                                "    direct_vector: {tile: [128, 256, 64], stages: 3, "
                                "persistent: true}\n"))
    (b,) = R.add_config(path).buckets
    v = b.direct_vector
    assert (v.name, v.tile, v.cluster, v.stages) == ("q.direct_vector", (128, 256, 64), (1, 1), 3)
    assert b.direct_kernel(8) is v and b.direct_kernel(0) is b.direct
    text = str(dispatch.explain("bmm", "bf16", "sm90", 100, 100, 100))
    assert "vector:  outputs the tile's threads store 8 bytes at a time" in text
    from detgemm_cute import tables

    assert "128x128x64 (direct 64x256x64) (vector 128x256x64)" in tables.format_table([b])
    only = tmp_path / "only.yaml"
    only.write_text(_bmm_bucket("    direct_vector: {tile: [128, 256, 64], stages: 3}\n")
                    .replace("name: q", "name: r"))
    (r,) = R.add_config(only).buckets
    assert r.direct is None and r.direct_kernel(0) is None and r.direct_kernel(8).tile[1] == 256


@pytest.mark.parametrize("s, d, bucket, tile, align", [
    (1500, 128, "bmm_m513_wide_n1024", (128, 256, 64), 8),   # 8-byte stores: direct_vector
    (3000, 80, "bmm_m513_wide_n1024_k65_112", (128, 256, 64), 8),
    (1000, 64, "bmm_k1_64", (128, 256, 64), 8),
    (2047, 128, "bmm_m513_wide_n1024", (64, 256, 64), 0),    # element stores: direct
    (2047, 64, "bmm_k1_64", (64, 256, 64), 0),               # ... the bucket's own tile
    (4096, 128, "bmm_m513_wide_n1024", (128, 256, 64), None),  # TMA-stored: the bucket's
])
def test_the_h200_table_runs_each_store_width_on_its_kernel(monkeypatch, tmp_path, s, d, bucket,
                                                           tile, align):
    """With the H200 device table, q @ k^T rows the threads store 8 bytes at a time run the
    bucket's `direct_vector` tile, element-stored rows its `direct` (or its own) tile, all
    without a cluster; the key equals the sweep's forced candidate of that tile (the kernel
    `bench/sweep_bmm.py` timed and checked bits for on the GPU), and warmup builds it."""
    monkeypatch.setenv("DETGEMM_CUTE_DEVICE_TABLE", "nvidia-h200")
    R.invalidate()
    try:
        _sm90(monkeypatch)
        q, kt = _qk(2, s, d)
        table = dispatch.lookup("bmm", "bf16", "sm90", s, s, d)
        assert table.name == bucket
        key = batched.kernel_layout(q, kt, None, torch.bfloat16, table)[0]
        assert key.tile == tile
        if align is None:
            assert not key.c_direct and key.cluster == table.cluster
            return
        assert key.c_direct and key.c_align == align and key.cluster == (1, 1)
        assert key in {k for _, k in aot._bucket_keys(table, "sm_90a", "all")}
        with bench_on_path():
            import sweep_bmm
            from sweep_common import candidate_layer
        names = candidate_layer(tmp_path / "c.yaml", "bmm", "bcand", sweep_bmm.CANDIDATES)
        want = f".{tile[0]}x{tile[1]}x64_c"
        forced = [nm for nm in names if want in nm and key.stages == int(
            nm.rsplit("_s", 1)[1].split("_")[0]) and nm.endswith("_p")]
        assert any(batched.kernel_layout(q, kt, None, torch.bfloat16,
                                         dispatch.bucket_by_name("sm90", nm))[0] == key
                   for nm in forced), forced
    finally:
        monkeypatch.delenv("DETGEMM_CUTE_DEVICE_TABLE")
        R.invalidate()
