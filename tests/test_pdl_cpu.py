"""Programmatic dependent launch (PDL) on a CPU-only machine: which kernel keys carry it, the
switch, and the compiled code's order (no global access before griddepcontrol.wait)."""

import pytest

from detgemm_cute import aot, gemm, pdl, registry
from detgemm_cute import compile as kcompile

_CALL = dict(dtype="bf16", out_dtype="bf16", a_major="k", b_form="nk", b_contig="last",
             has_bias=True)


@pytest.fixture
def pdl_restored():
    before = pdl.enabled()
    yield
    pdl.set_enabled(before)


def _bucket(family, op="fwd"):
    return next(b for b in registry.get_registry(family).buckets if b.op == op)


def test_sm90_keys_carry_pdl_and_sm80_keys_never(pdl_restored):
    pdl.set_enabled(True)
    assert kcompile.KernelKey.for_bucket(_bucket("sm90"), arch="sm_90a", **_CALL).pdl
    for arch in ("sm_80", "sm_90"):  # the SM80 family, on any GPU
        assert not kcompile.KernelKey.for_bucket(_bucket("sm80"), arch=arch, **_CALL).pdl
    pdl.set_enabled(False)
    assert not kcompile.KernelKey.for_bucket(_bucket("sm90"), arch="sm_90a", **_CALL).pdl


def test_switch_drops_plans_and_checks_its_argument(pdl_restored):
    pdl.set_enabled(True)
    gemm._plans["sentinel"] = object()
    pdl.set_enabled(True)  # no change: the plans stay
    assert "sentinel" in gemm._plans
    pdl.set_enabled(False)
    assert "sentinel" not in gemm._plans and not pdl.enabled()
    with pytest.raises(TypeError, match="flag must be a bool"):
        pdl.set_enabled(1)


def test_off_by_default_and_the_env_var_turns_it_on():
    import os
    import subprocess
    import sys

    code = "from detgemm_cute import pdl; print(pdl.enabled())"
    for value, want in (("0", "False"), ("off", "False"), ("1", "True"), ("on", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, pdl.ENV_VAR: value}, check=True)
        assert out.stdout.strip() == want, value
    env = {k: v for k, v in os.environ.items() if k != pdl.ENV_VAR}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.strip() == "False"


def test_sm80_builds_refuse_pdl():
    key = kcompile.KernelKey(tile=(128, 128, 32), cluster=(1, 1), stages=3, persistent=False,
                             arch="sm_80", pdl=True, **_CALL)
    with pytest.raises(ValueError, match="pdl"):
        kcompile.build(key)


@pytest.mark.parametrize("tile, persistent, pingpong, accumulate", [
    ((16, 16, 128), True, False, False),    # a decode row tile
    ((128, 256, 64), False, False, False),  # one CTA per tile
    ((128, 192, 64), True, True, True)])    # ping-pong dW, reading C before its chain
def test_pdl_kernels_wait_before_any_global_access(tmp_path, tile, persistent, pingpong,
                                                   accumulate):
    call = dict(_CALL)
    if accumulate:
        call.update(out_dtype="fp32", has_bias=False, a_major="m", b_form="kn")
    key = kcompile.KernelKey(tile=tile, cluster=(1, 2) if tile[0] == 128 else (1, 1),
                             stages=4, persistent=persistent, pingpong=pingpong,
                             accumulate=accumulate, arch="sm_90a", pdl=True, **call)
    ptx = kcompile.build(key, f"--keep-ptx --dump-dir={tmp_path}").__ptx__
    assert aot.audit_ptx(ptx, "sm90", "bf16", pdl=True) == []
    assert ptx.count("griddepcontrol.wait;") == 1
    assert "griddepcontrol.launch_dependents;" in ptx
    off = kcompile.KernelKey(**{**key.__dict__, "pdl": False})
    ptx_off = kcompile.build(off, f"--keep-ptx --dump-dir={tmp_path}").__ptx__
    assert "griddepcontrol" not in ptx_off
    assert aot.pdl_order_problems(ptx_off) == ["missing griddepcontrol.wait (a PDL kernel)"]


def test_order_audit_flags_a_global_access_before_the_wait():
    tail = "\n\tgriddepcontrol.wait;\n\tcp.async.bulk.tensor.2d.shared::cta.global [%r1];\n"
    assert aot.pdl_order_problems("\tmov.u32 %r1, 0;" + tail) == []
    for early in ("\tld.global.nc.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];",
                  "\t@%p1 st.global.f32 [%rd2], %f1;",
                  "\tcp.async.bulk.tensor.2d.shared::cluster.global.tile [%r2];",
                  "\tcp.async.ca.shared.global [%r3], [%rd3], 16;",
                  "\tld.volatile.global.u32 %r4, [%rd4];",
                  "\tld.acquire.gpu.global.u32 %r5, [%rd5];",
                  "\tred.global.add.f32 [%rd6], %f2;",
                  "\tatom.global.cas.b32 %r6, [%rd7], 0, 1;"):
        problems = aot.pdl_order_problems(early + tail)
        assert len(problems) == 1 and "before griddepcontrol.wait" in problems[0], early
    # A TMA descriptor prefetch or an L2 prefetch reads nothing into the CTA: allowed.
    assert aot.pdl_order_problems("\tprefetch.tensormap [%rd1];\n"
                                  "\tcp.async.bulk.prefetch.L2.global [%rd2], 64;" + tail) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grouped", "grouped_k", "a_loads", "c_direct", "split"])
def test_pdl_kernels_of_every_kind_wait_first(tmp_path, kind):
    """The other kernel kinds with PDL: grouped (offs read on the device), grouped along K,
    A read by the producer warpgroup, thread-stored C, the fp32 tier's split operands."""
    call = dict(_CALL, has_bias=False)
    extra = {"grouped": dict(grouped=True, b_form="kn"),
             "grouped_k": dict(grouped_k=True, a_major="m", b_form="kn", out_dtype="fp32"),
             "a_loads": dict(a_loads=True, batched=True),
             "c_direct": dict(c_direct=True, batched=True),
             "split": dict(split=True, dtype="fp16", out_dtype="fp32")}[kind]
    key = kcompile.KernelKey(tile=(128, 128, 64), cluster=(1, 1), stages=4, persistent=True,
                             arch="sm_90a", pdl=True, **{**call, **extra})
    ptx = kcompile.build(key, f"--keep-ptx --dump-dir={tmp_path}").__ptx__
    assert aot.audit_ptx(ptx, "sm90", key.dtype, pdl=True) == []
    assert ptx.count("griddepcontrol.wait;") == 1
