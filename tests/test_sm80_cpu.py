"""The SM80 family (cp.async + ldmatrix + mma.sync) without a GPU: every layout and epilogue
compiles (the per-bucket audit is in test_compile_cpu), the gpu-arch -> family mapping, and the
limits that refuse a bad sm80 bucket (naming file, line, bucket and field)."""

from __future__ import annotations

import pytest

from detgemm_cute import aot, cli
from detgemm_cute import compile as kcompile
from detgemm_cute import registry as R
from detgemm_cute.kernels import sm80, sm80_limits

GOOD_SM80 = ("cp.async.cg.shared.global [%r1], [%rd2], 16, 16;\n"
             "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];\n"
             "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f1};")


def test_every_layout_and_epilogue_compiles_for_one_tile(tmp_path):
    """The op layer's other calls: M-major A, [K, N] and [N, K] B with either dim
    contiguous, fp32 out, bias, accumulate; on the narrowest tile (N 16: B copies use half
    the threads) and built for an H100 (sm_90, no 'a': still the SM80 family)."""
    for a_major, b_form, b_contig, out, bias, acc in [
            ("m", "nk", "first", "bf16", True, False), ("k", "kn", "first", "fp32", False, True),
            ("m", "kn", "last", "fp16", True, False)]:
        key = kcompile.KernelKey(tile=(64, 16, 32), cluster=(1, 1), stages=3, persistent=False,
                                 dtype="fp16" if out == "fp16" else "bf16", out_dtype=out,
                                 a_major=a_major, b_form=b_form, b_contig=b_contig,
                                 has_bias=bias, arch="sm_90", accumulate=acc)
        fn = kcompile.build(key, f"--keep-ptx --dump-dir={tmp_path}")
        assert aot.audit_ptx(fn.__ptx__, "sm80") == [], key


@pytest.mark.slow
def test_fp32_tier_kernels_compile(tmp_path):
    """The fp32 tier on SM80: TF32 kernels (fp32 operands, both K-major, m16n8k8 TF32 with
    in-register rounding) with each output dtype and bias, and the chunked kernel (BK 96)
    on fp16 and bf16 parts, from +0.0 and continuing a buffer; audited for their MMAs."""
    cases = [("tf32", "fp32", True, False, (64, 32, 32)), ("tf32", "bf16", False, False,
                                                             (128, 128, 64)),
             ("fp16", "fp32", False, False, (64, 128, 96)), ("bf16", "fp32", False, True,
                                                              (64, 16, 96))]
    for dtype, out, bias, acc, tile in cases:
        key = kcompile.KernelKey(tile=tile, cluster=(1, 1), stages=3, persistent=False,
                                 dtype=dtype, out_dtype=out, a_major="k", b_form="nk",
                                 b_contig="last", has_bias=bias, arch="sm_80", accumulate=acc,
                                 split=dtype != "tf32")
        fn = kcompile.build(key, f"--keep-ptx --dump-dir={tmp_path}")
        assert aot.audit_ptx(fn.__ptx__, "sm80", dtype) == [], key
        if dtype == "tf32":  # rounded in registers: the 13 dropped bits are masked off
            assert "-8192" in fn.__ptx__ or "0xFFFFE000" in fn.__ptx__.upper(), key


@pytest.mark.slow
def test_cli_compile_sm80_bucket(capsys):
    assert cli.main(["compile", "--arch", "sm_80", "--bucket", "dw_bias"]) == 0
    out = capsys.readouterr().out
    assert "dw_bias" in out and "built and audited for sm_80" in out
    assert cli.main(["compile", "--arch", "sm_80", "--bucket", "fwd_large_wide_n"]) == 1
    # an sm90 name is not an sm80 bucket
    assert "no bucket 'fwd_large_wide_n' in the sm80 table" in capsys.readouterr().err
    assert cli.main(["compile", "--arch", "sm_75"]) == 2
    assert "unknown arch 'sm_75'" in capsys.readouterr().err


def test_audit_is_per_family():
    assert aot.audit_ptx(GOOD_SM80, "sm80") == []
    assert "missing wgmma.mma_async" in aot.audit_ptx(GOOD_SM80, "sm90")
    sm90_ptx = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\ncp.async.bulk.tensor.2d"
    problems = aot.audit_ptx(sm90_ptx, "sm80")
    assert "missing mma.sync.aligned.m16n8k16" in problems
    assert "missing cp.async (non-bulk)" in problems and "missing ldmatrix" in problems
    assert aot.audit_ptx(GOOD_SM80.replace("m16n8k16", "m16n8k8"), "sm80") == \
        ["missing mma.sync.aligned.m16n8k16"]
    tf32 = GOOD_SM80.replace("m16n8k16.row.col.f32.bf16.bf16", "m16n8k8.row.col.f32.tf32.tf32")
    assert aot.audit_ptx(tf32, "sm80", "tf32") == []
    assert aot.audit_ptx(GOOD_SM80, "sm80", "tf32") == \
        ["missing mma.sync.aligned.m16n8k8 ... .f32.tf32.tf32"]
    assert any("atom" in p for p in aot.audit_ptx(GOOD_SM80 + "\n\tatom.global.add.f32 [%rd1], %f1;",
                                                  "sm80"))
    assert any("red" in p for p in aot.audit_ptx(GOOD_SM80 + "\n\t@%p1 red.global.add.f32 [%rd1], %f1;",
                                                 "sm80"))


@pytest.mark.parametrize("gpu_arch, family", [
    ("sm_90a", "sm90"), ("SM_90A", "sm90"), ("sm90a", "sm90"),
    ("sm_90", "sm80"), ("sm_80", "sm80"), ("sm_86", "sm80"), ("sm_89", "sm80"),
    ("sm_100a", "sm80")])
def test_family_of_gpu_arch(gpu_arch, family):
    assert kcompile.family_of(gpu_arch) == family
    assert kcompile.kernel_module(gpu_arch).__name__.endswith(family)


@pytest.mark.parametrize("bad", ["sm_75", "sm_", "gfx90a", ""])
def test_family_of_unknown_arch(bad):
    with pytest.raises(ValueError, match="unknown GPU arch"):
        kcompile.family_of(bad)


def test_gpu_arch_for():
    assert kcompile.gpu_arch_for("sm90", (9, 0)) == "sm_90a"
    for minor in (0, 6, 7, 9):
        assert kcompile.gpu_arch_for("sm80", (8, minor)) == "sm_80"
    assert kcompile.gpu_arch_for("sm80", (9, 0)) == "sm_90"
    assert kcompile.gpu_arch_for("sm80", (12, 0)) == "sm_120"
    with pytest.raises(ValueError, match="unknown kernel family"):
        kcompile.gpu_arch_for("sm70", (8, 0))


def test_warmup_keys_for_sm80():
    keys = aot.warmup_keys("sm_80", ops=("fwd",), dtypes=("bf16",))
    assert keys and all(k.arch == "sm_80" and k.cluster == (1, 1) and not k.persistent
                        for _, k in keys)
    assert {name for name, _ in keys} <= {b.name for b in R.get_registry("sm80").buckets}


def test_sm80_registry_and_mainloop_order():
    reg = R.get_registry("sm80")
    assert reg.ops == ("fwd", "dx", "dw", "bmm")
    assert all(b.cluster == (1, 1) and not b.persistent for b in reg.buckets)
    assert reg.lookup("dw", "fp16", 4096, 8, 16384).name == "dw_bias"
    assert sm80.kernel_class(False) is sm80.Sm80Gemm
    with pytest.raises(ValueError, match="no persistent kernel"):
        sm80.kernel_class(True)
    with pytest.raises(ValueError, match="cluster"):
        sm80.Sm80Gemm((64, 64, 32), (2, 1), 3, b_is_kn=False, has_bias=False)
    assert "mma.sync" in sm80.mainloop_order() and "no split-K" in sm80.mainloop_order()


# --- limits ---------------------------------------------------------------------------------

def test_limits_accept_every_tile_that_fits():
    for bm in sm80_limits.TILE_M:
        for bn in sm80_limits.TILE_N:
            for bk in sm80_limits.TILE_K:
                tile = (bm, bn, bk)
                s = sm80_limits.max_stages(tile)
                assert s >= 3, tile
                assert sm80_limits.check_config(tile, (1, 1), s, False) == []
                assert sm80_limits.smem_bytes(tile, s) <= sm80_limits.SMEM_BYTES


@pytest.mark.parametrize("tile, cluster, stages, persistent, field, words", [
    ((96, 64, 32), (1, 1), 3, False, "tile", "tile M must be one of (64, 128), got 96"),
    ((64, 8, 32), (1, 1), 3, False, "tile", "tile N must be one of"),
    ((64, 64, 128), (1, 1), 3, False, "tile", "tile K must be one of (32, 64), got 128"),
    ((64, 64, 32), (2, 1), 3, False, "cluster", "cluster must be [1, 1], got [2, 1]"),
    ((64, 64, 32), (1, 2), 3, False, "cluster", "no thread block clusters"),
    ((64, 64, 32), (1, 1), 3, True, "persistent", "no persistent variant"),
    ((64, 64, 32), (1, 1), 3, "yes", "persistent", "must be true or false"),
    ((64, 64, 32), (1, 1), 1, False, "stages", "stages must be in [2, 8], got 1"),
    ((128, 256, 64), (1, 1), 4, False, "stages", "more than 166912; at most 3 stages fit"),
])
def test_limits_refuse(tile, cluster, stages, persistent, field, words):
    problems = sm80_limits.check_config(tile, cluster, stages, persistent)
    assert any(f == field and words in msg for f, msg in problems), problems


def _cfg(tile="[64, 64, 32]", cluster=None, stages=4, persistent=None):
    extra = (f"    cluster: {cluster}\n" if cluster else "") + \
            (f"    persistent: {persistent}\n" if persistent is not None else "")
    return ("arch: sm80\nbuckets:\n  - name: b\n    op: fwd\n    dtypes: [bf16]\n"
            f"    m: [1, 64]\n    tile: {tile}\n    stages: {stages}\n" + extra)


@pytest.mark.parametrize("content, words", [
    (_cfg(tile="[96, 64, 32]"),
     "bad.yaml:7: bucket 'b': field 'tile': tile M must be one of (64, 128), got 96"),
    (_cfg(tile="[64, 64, 128]"), "bad.yaml:7: bucket 'b': field 'tile': tile K must be one of"),
    (_cfg(cluster="[2, 1]"), "bad.yaml:9: bucket 'b': field 'cluster': the sm80 kernel has "
                             "no thread block clusters: cluster must be [1, 1], got [2, 1]"),
    (_cfg(persistent="true"), "bad.yaml:9: bucket 'b': field 'persistent': the sm80 kernel "
                              "has no persistent variant"),
    (_cfg(tile="[128, 256, 64]", stages=5),
     "bad.yaml:8: bucket 'b': field 'stages': 5 stages of tile [128, 256, 64] need 245760 "
     "bytes of shared memory, more than 166912; at most 3 stages fit"),
])
def test_bad_sm80_bucket_is_refused(tmp_path, capsys, content, words):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(R.ConfigError) as info:
        R.load_config(path)
    assert words in str(info.value)
    with pytest.raises(R.ConfigError):
        R.add_config(path, arch="sm80")
    assert R.user_configs() == ()
    assert cli.main(["audit", "--arch", "sm80", "--config", str(path)]) == 1
    assert words.split(": ", 1)[1] in capsys.readouterr().err


def test_good_sm80_layer_is_accepted(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(_cfg(tile="[128, 64, 64]", stages=6))
    R.add_config(path)
    assert R.get_registry("sm80").lookup("fwd", "bf16", 8, 8, 8).name == "b"
    assert R.get_registry("sm90").lookup("fwd", "bf16", 8, 8, 8).name != "b"
