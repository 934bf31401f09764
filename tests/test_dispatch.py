"""Dispatch: a memoised table lookup. Bucket boundaries, user-layer precedence and
shadowing, memo invalidation, environment layers, and arch selection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from detgemm_cute import dispatch as D
from detgemm_cute import registry as R

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BIG = 2**31 - 1




def _write(tmp_path, name, bucket_name, m, dtypes="[bf16]", extra=""):
    p = tmp_path / name
    p.write_text(f"arch: sm90\nbuckets:\n  - name: {bucket_name}\n    op: fwd\n"
                 f"    dtypes: {dtypes}\n    m: {m}\n    tile: [64, 64, 64]\n    stages: 4\n"
                 f"{extra}")
    return p


def _containing(buckets, m, n, k):
    """The bucket (or, for alternatives, the bucket name) that contains the point."""
    (b,) = {b.group or b.name for b in buckets if b.contains(m, n, k)}
    return b


def _served_by(op, dtype, p):
    got = D.lookup(op, dtype, "sm90", *p)
    return got.group or got.name


def _ends(rng):
    lo, hi = rng
    return [lo, hi if hi is not None else BIG]


@pytest.mark.parametrize("dtype", R.DTYPES)
def test_every_builtin_boundary(dtype):
    """Every corner of every bucket's (M, N, K) box maps to it; one step outside maps to
    the one bucket that contains that point."""
    every = [b for b in R.load_builtin("sm90").buckets if dtype in b.dtypes]
    assert every
    for b in every:
        buckets = [c for c in every if c.op == b.op]
        for m in _ends(b.m):
            for n in _ends(b.n):
                for k in _ends(b.k):
                    assert _served_by(b.op, dtype, (m, n, k)) == (b.group or b.name), (m, n, k)
                    for dm, dn, dk in ((-1, 0, 0), (1, 0, 0), (0, -1, 0), (0, 1, 0),
                                       (0, 0, -1), (0, 0, 1)):
                        p = (m + dm, n + dn, k + dk)
                        if min(p) < 1 or max(p) > BIG or b.contains(*p):
                            continue
                        got = _served_by(b.op, dtype, p)
                        assert got == _containing(buckets, *p) != (b.group or b.name), p


def test_warm_lookup_is_a_dict_hit(monkeypatch):
    b = D.lookup("fwd", "bf16", "sm90", 100, 4096, 4096)
    assert D._memo[("fwd", "bf16", "sm90", 100, 4096, 4096)] is b

    def boom(arch):
        raise AssertionError("registry consulted on a warm lookup")

    monkeypatch.setattr(R, "get_registry", boom)
    assert D.lookup("fwd", "bf16", "sm90", 100, 4096, 4096) is b


def test_memo_is_cleared_when_configs_change():
    g0 = D.generation()
    assert D.lookup("fwd", "bf16", "sm90", 4, 64, 64).name == "fwd_decode_m1_16_n1_2112"
    R.add_config(FIXTURES / "user_small_m.yaml")
    assert D.generation() != g0
    assert D.lookup("fwd", "bf16", "sm90", 4, 64, 64).name == "my_decode"
    assert D.lookup("fwd", "fp16", "sm90", 4, 64, 64).name == "fwd_decode_m1_16_n1_2112"  # bf16-only bucket
    user = D.lookup("fwd", "fp16", "sm90", 32, 64, 64)
    assert user.name == "fwd_decode_m33_64_n1_1536" and user.layer == 1
    assert user.tile == (64, 128, 64)
    R.reset_user_configs()
    assert D.lookup("fwd", "bf16", "sm90", 4, 64, 64).name == "fwd_decode_m1_16_n1_2112"
    assert D.lookup("fwd", "fp16", "sm90", 32, 64, 64).layer == 0


def test_last_added_layer_wins_and_explain_shows_shadowing(tmp_path):
    R.add_config(_write(tmp_path, "one.yaml", "first", "[1, 100]"))
    R.add_config(_write(tmp_path, "two.yaml", "second", "[50, 60]"))
    assert D.lookup("fwd", "bf16", "sm90", 55, 8, 8).name == "second"
    assert D.lookup("fwd", "bf16", "sm90", 61, 8, 8).name == "first"
    ex = D.explain("fwd", "bf16", "sm90", 55, 8, 8)
    assert (ex.bucket.name, ex.layer, ex.line) == ("second", 2, 3)
    assert ex.source == tmp_path / "two.yaml"
    assert [(b.name, b.layer) for b in ex.shadowed] == [("first", 1), ("fwd_decode_m33_64_n1_1536", 0)]
    text = str(ex)
    assert "second (" in text and "two.yaml:3" in text and "layer 2 = user 2" in text
    assert "shadows: first" in text and "shadows: fwd_decode_m33_64_n1_1536" in text


def test_same_name_shadowing_is_explained():
    R.add_config(FIXTURES / "user_small_m.yaml")
    assert D.bucket_by_name("sm90", "fwd_decode_m33_64_n1_1536").layer == 1
    ex = D.explain("fwd", "bf16", "sm90", 20, 8, 8)
    assert ex.bucket.layer == 1
    assert ex.shadowed[0].name == "fwd_decode_m17_32_n1_2112"
    assert ex.shadowed[0].layer == 0
    assert [(b.name, b.layer) for b in ex.same_name] == [("fwd_decode_m33_64_n1_1536", 0)]
    assert "hides:   fwd_decode_m33_64_n1_1536 (" in str(ex)
    assert "user_small_m.yaml" in str(ex) and "sm90.yaml" in str(ex)


def test_explain_reason_and_text():
    ex = D.explain("fwd", torch.bfloat16, "sm90", 40, 1000, 4096)
    assert ex.bucket.name == "fwd_decode_m33_64_n1_1536" and ex.dtype == "bf16"
    assert ex.reason == "M=40 in [33, 64], N=1000 in [1, 1536], K any"
    assert ex.shadowed == () and ex.layer == 0
    assert f"sm90.yaml:{ex.line}" in str(ex) and "no other bucket matches" in str(ex)
    ex = D.explain("fwd", "fp16", "sm90", 5000, 1, 1)
    assert ex.reason.startswith("M=5000 in [1536, inf), N=1 in [1, 2560], K any; the least "
                                "predicted time of its ")
    assert ex.bucket.group == "fwd_prefill_narrow"
    assert len(ex.predicted) > 1 and min(ex.predicted, key=lambda x: x[1])[0] is ex.bucket
    assert f"{ex.bucket.name.split('.')[1]}" in str(ex) and "<- runs" in str(ex)


def test_explain_with_bounded_n_and_k(tmp_path):
    R.add_config(_write(tmp_path, "u.yaml", "narrow", "[1, 8]",
                        extra="    n: [1, 4096]\n    k: [256, null]\n"))
    ex = D.explain("fwd", "bf16", "sm90", 3, 4096, 300)
    assert ex.reason == "M=3 in [1, 8], N=4096 in [1, 4096], K=300 in [256, inf)"
    assert D.lookup("fwd", "bf16", "sm90", 3, 4097, 300).layer == 0
    assert D.lookup("fwd", "bf16", "sm90", 3, 4096, 255).layer == 0


def test_env_var_configs(monkeypatch, tmp_path):
    a = _write(tmp_path, "a.yaml", "env_a", "[1, 4]")
    b = _write(tmp_path, "b.yaml", "env_b", "[3, 3]")
    monkeypatch.setenv(R.ENV_VAR, os.pathsep.join([str(a), str(b)]))
    R.reset_user_configs()
    assert D.lookup("fwd", "bf16", "sm90", 3, 8, 8).name == "env_b"
    assert D.lookup("fwd", "bf16", "sm90", 4, 8, 8).name == "env_a"
    # add_config goes above the environment layers.
    R.add_config(_write(tmp_path, "c.yaml", "api_c", "[1, 3]"))
    assert D.lookup("fwd", "bf16", "sm90", 3, 8, 8).name == "api_c"
    assert D.explain("fwd", "bf16", "sm90", 3, 8, 8).layer == 3


def test_broken_env_config_fails_loudly(monkeypatch):
    monkeypatch.setenv(R.ENV_VAR, str(FIXTURES / "bad_tile.yaml"))
    R.reset_user_configs()
    with pytest.raises(R.ConfigError, match="bad_tile.yaml:7: bucket 'odd_tile': field 'tile'"):
        D.lookup("fwd", "bf16", "sm90", 1, 1, 1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="M must be an integer >= 1"):
        D.lookup("fwd", "bf16", "sm90", 0, 8, 8)
    with pytest.raises(ValueError, match="K must be an integer >= 1"):
        D.explain("fwd", "bf16", "sm90", 1, 8, -1)
    with pytest.raises(ValueError, match="unknown op"):
        D.lookup("bwd", "bf16", "sm90", 1, 8, 8)
    with pytest.raises(ValueError, match="unknown dtype"):
        D.lookup("fwd", "fp64", "sm90", 1, 8, 8)
    with pytest.raises(R.NoBucketError, match="the sm90 tables have no fp32 buckets for op bmm"):
        D.lookup("bmm", "fp32", "sm90", 1, 8, 8)  # the fp32 tier has fwd/dx/dw only
    with pytest.raises(R.NoBucketError, match="the sm80 tables have no tf32 buckets for op dw"):
        D.lookup("dw", "tf32", "sm80", 1, 8, 8)  # dW runs full precision at either setting
    with pytest.raises(R.NoBucketError, match="named 'nope'"):
        D.bucket_by_name("sm90", "nope")
    with pytest.raises(ValueError, match="unknown arch 'sm70'"):
        D.lookup("fwd", "bf16", "sm70", 1, 8, 8)
    assert D.lookup("fwd", "bf16", "sm80", 1, 8, 8).op == "fwd"  # the SM80 table exists


def test_dtype_name():
    assert D.dtype_name(torch.bfloat16) == "bf16"
    assert D.dtype_name(torch.half) == "fp16"
    assert D.dtype_name(torch.float32) == "fp32"
    assert D.dtype_name("fp16") == "fp16"
    with pytest.raises(TypeError, match="torch.bfloat16.*torch.float16.*torch.float32"):
        D.dtype_name(torch.float64)
    with pytest.raises(TypeError, match="unsupported dtype"):
        D.dtype_name("fp8")


def test_arch_for_capability():
    assert D.arch_for_capability(9, 0) == "sm90"
    for minor in (0, 6, 7, 9):
        assert D.arch_for_capability(8, minor) == "sm80"
    for cap in [(7, 5), (7, 0), (6, 1)]:
        with pytest.raises(RuntimeError, match="needs an SM80\\+ GPU"):
            D.arch_for_capability(*cap)
    for cap in [(10, 0), (12, 0), (11, 0)]:
        with pytest.raises(RuntimeError, match="sm_90a-only; set DETGEMM_CUTE_FAMILY=sm80"):
            D.arch_for_capability(*cap)
        assert D.arch_for_capability(*cap, family="sm80") == "sm80"


def test_forced_family():
    assert D.arch_for_capability(9, 0, "sm80") == "sm80"  # SM80 family on an H100
    assert D.arch_for_capability(9, 0, "sm90") == "sm90"
    with pytest.raises(RuntimeError, match="sm90 kernel family .* cannot run on compute "
                                           "capability 8.0; use sm80"):
        D.arch_for_capability(8, 0, "sm90")
    with pytest.raises(RuntimeError, match="needs an SM80\\+ GPU"):
        D.arch_for_capability(7, 5, "sm80")
    with pytest.raises(ValueError, match="unknown kernel family 'sm70'.*DETGEMM_CUTE_FAMILY"):
        D.arch_for_capability(9, 0, "sm70")


def test_use_family_validates_and_restores():
    import detgemm_cute as dg
    from detgemm_cute import gemm as G

    with pytest.raises(ValueError, match="use_family: unknown kernel family 'sm75'"):
        with dg.use_family("sm75"):
            pass
    before = G._forced.family
    with dg.use_family("sm80"):
        assert G._forced.family == "sm80"
        with dg.use_family(None):
            assert G._forced.family is None
    assert G._forced.family == before


def test_same_name_elsewhere_is_shown_as_hidden(tmp_path):
    R.add_config(_write(tmp_path, "u.yaml", "fwd_decode_m1_16_n1_2112", "[2000, 3000]"))
    ex = D.explain("fwd", "bf16", "sm90", 2500, 8, 8)
    assert ex.bucket.layer == 1 and [b.group for b in ex.shadowed] == ["fwd_prefill_narrow"]
    assert [b.layer for b in ex.same_name] == [0]
    assert "hides:   fwd_decode_m1_16_n1_2112 (" in str(ex) and "same name" in str(ex)
    assert D.lookup("fwd", "bf16", "sm90", 4, 8, 8).layer == 0  # built-in range still served


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_gpu_invariance_sweep_reaches_every_builtin_fwd_bucket(arch):
    """The GPU suite's batch-invariance sweep (tests/gpu_helpers.py) must pass through every
    16-bit forward bucket of each table; checked here so a table change cannot silently skip
    one. (fp32 buckets are exercised by tests/test_gpu_fp32.py.)"""
    from gpu_helpers import SWEEP_M, SWEEP_NK, SWEEP_REF_M

    # A bucket with alternatives counts once (each alternative runs in the every-bucket
    # invariance tests of test_gpu_core.py, forced by name).
    seen = {D.lookup("fwd", "bf16", arch, m, n, k).group or
            D.lookup("fwd", "bf16", arch, m, n, k).name
            for m in SWEEP_M + [SWEEP_REF_M] for n, k in SWEEP_NK}
    assert seen == {b.group or b.name for b in R.load_builtin(arch).buckets
                    if b.op == "fwd" and set(b.dtypes) & set(R.REQUIRED_DTYPES)}
