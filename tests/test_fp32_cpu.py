"""The fp32 tier on the CPU: the split arithmetic, the reference's chains, precisions, the
invariances CPU tensors can show, the table rules and that its kernels compile."""

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import reference as R
from detgemm_cute import registry, split
from detgemm_cute.kernels import sm80_limits, sm90_limits

F32 = torch.float32


def randn(*shape, seed=0, spread=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if spread:
        x = x * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=g).to(F32))
    return x


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def test_exact_parts_add_back_to_x():
    x = randn(4000, spread=60)
    hi, mid, lo = split.exact_parts(x)
    assert torch.equal(hi.double() + mid.double() + lo.double(), x.double())


def test_scaled_parts_keep_22_bits_and_scales_are_powers_of_two():
    x = randn(300, 64, seed=1, spread=8)
    s = split.row_scales(x)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)  # powers of two
    top = (x * s[:, None]).abs().amax(1)
    assert torch.all((top >= 2**13) & (top < 2**14))
    hi, lo = split.parts(x * s[:, None])
    back = (hi.double() + lo.double()) / s[:, None].double()
    big = x.abs() > 2.0**-14 * x.abs().amax(1, keepdim=True)  # away from fp16 subnormals
    assert ((back - x.double()).abs() <= 2.0**-22 * x.double().abs())[big].all()


def test_operand_layouts_hold_the_documented_steps():
    x = randn(3, 40, seed=2)
    s = split.row_scales(x)
    hi, lo = split.parts(torch.nn.functional.pad(x, (0, 24)) * s[:, None])
    for side, groups in (("a", (-lo, -hi, hi)), ("b", (-hi, -lo, hi))):
        o = split.operand(x, s, side).view(3, 2, 3, 32)
        for gi, want in enumerate(groups):
            assert torch.equal(o[:, :, gi].float(), want.float().view(3, 2, 32))
    assert split.operand(x, s, "a").shape == (3, split.split_k(40)) == (3, 192)


def test_ieee_is_more_accurate_than_an_fp32_fma_chain():
    a, b = randn(32, 2048, seed=3), randn(2048, 48, seed=4)
    ref = a.double() @ b.double()
    seq = torch.zeros(32, 48)
    for k in range(2048):
        seq = seq + a[:, k:k + 1] * b[k:k + 1, :]
    assert rel_err(dg.mm(a, b), ref) < rel_err(seq, ref)


def test_rows_invariant_and_micro_batched_dw_on_cpu():
    x, w = randn(40, 200, seed=5, spread=10), randn(24, 200, seed=6)
    y = dg.linear(x, w)
    for rows in (slice(0, 1), slice(7, 20), slice(39, 40)):
        assert R.same_bits(dg.linear(x[rows], w), y[rows])
    dy, xx = randn(96, 24, seed=7), randn(96, 40, seed=8)
    acc = torch.zeros(24, 40)
    for part in (slice(0, 16), slice(16, 48), slice(48, 96)):
        dg.weight_grad(dy[part], xx[part], acc=acc)
    assert R.same_bits(acc, dg.weight_grad(dy, xx))


def test_precisions_context_and_torch_flag():
    x, w = randn(20, 300, seed=9), randn(30, 300, seed=10)
    ref = x.double() @ w.double().t()
    ieee = dg.linear(x, w)
    with dg.fp32_precision("tf32"):
        tf32 = dg.linear(x, w)
        assert R.same_bits(tf32, R.linear(x, w))
    assert 1e-5 < rel_err(tf32, ref) < 1e-3 and rel_err(ieee, ref) < 1e-6
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert R.same_bits(dg.linear(x, w), tf32)
        with dg.fp32_precision("ieee"):
            assert R.same_bits(dg.linear(x, w), ieee)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    with pytest.raises(ValueError, match="precision"):
        with dg.fp32_precision("fp64"):
            pass
    with pytest.raises(ValueError, match="precision"):
        R.chain(x, w.t(), precision="fast")


def test_fp32_bucket_rules():
    ok = sm90_limits.check_config((128, 128, 96), (1, 1), 4, False, dtypes=("fp32",))
    assert ok == []
    assert sm90_limits.check_config((128, 128, 64), (1, 1), 4, False, dtypes=("fp32",))
    assert sm90_limits.check_config((128, 256, 96), (1, 1), 2, False, dtypes=("fp32",))
    assert sm90_limits.check_config((128, 128, 96), (1, 1), 4, False, dtypes=("bf16", "fp32"))
    assert sm90_limits.check_config((128, 128, 96), (1, 1), 4, False, dtypes=("bf16",))
    # sm80: BK 96 chunks, two fp32 fragments of at most 64 values per thread
    assert sm80_limits.check_config((64, 128, 96), (1, 1), 4, False, dtypes=("fp32",)) == []
    assert sm80_limits.check_config((128, 128, 32), (1, 1), 3, False, dtypes=("fp32",))
    assert "two fp32 fragments" in str(
        sm80_limits.check_config((128, 128, 96), (1, 1), 3, False, dtypes=("fp32",)))
    assert sm80_limits.check_config((64, 128, 96), (1, 1), 4, False, dtypes=("fp16", "fp32"))
    for arch, limits in (("sm90", sm90_limits), ("sm80", sm80_limits)):
        reg = registry.get_registry(arch)
        assert {b.op for b in reg.buckets if "fp32" in b.dtypes} == set(registry.FP32_OPS)
        for m in (1, 100, 5000):
            assert reg.lookup("fwd", "fp32", m, 4096, 4096).tile[2] == limits.SPLIT_TILE_K


def test_split_and_chunked_kernels_compile_on_cpu():
    pytest.importorskip("cutlass")
    from detgemm_cute import aot, compile as kcompile

    b = registry.get_registry("sm90").bucket("dw_fp32_m257")
    for call in aot._split_variants(b, "core"):
        fn = kcompile.build(kcompile.KernelKey.for_bucket(b, arch="sm_90a", **call))
        assert fn is not None
    for scheme in ("scaled", "exact"):
        for arch in ("sm_90", "sm_80"):  # CUDA-core helpers: built for the GPU's own arch
            assert split._compile_kernel(scheme, "a", arch) is not None
    for step in ("max", "b"):  # the in-place split of dX's weight (sm90 only)
        assert split._compile_kernel("columns", step, "sm_90") is not None
    for arch in ("sm_90", "sm_80"):  # the last step: unscale, bias, rounding
        for out in ("Float32", "BFloat16", "Float16"):
            for has_bias in (False, True):
                assert split._compile_kernel("unscale", (out, has_bias), arch) is not None
    dx = registry.get_registry("sm90").bucket("dx_fp32_m513")
    forms = [call["b_form"] for call in aot._split_variants(dx, "core", "sm90")]
    assert forms == ["nk", "kn"] and "kn" not in [
        call["b_form"] for call in aot._split_variants(dx, "core", "sm80")]
    call = list(aot._split_variants(dx, "core", "sm90"))[1]
    assert kcompile.build(kcompile.KernelKey.for_bucket(dx, arch="sm_90a", **call)) is not None


# (bucket, op, committed sweep record) of the fp32 tier's small-M buckets with alternatives
SMALL_M_FITS = (("fwd_fp32_m65_512", "fwd", "fp32_sweep_nvidia-h200.json.xz"),
                ("dx_fp32_m1_512", "dx", "fp32_sweep_dx_nvidia-h200.json.xz"))


@pytest.mark.parametrize("bucket,op,record", SMALL_M_FITS)
def test_fp32_small_m_buckets_are_the_fit_of_their_sweeps(tmp_path, bucket, op, record):
    """configs/sm90.yaml's alternatives (kernels and costs) for the fp32 tier at M 65..512 are
    `detgemm-cute tune-fit` of the committed `bench/sweep_fp32.py` records."""
    import argparse
    from pathlib import Path

    from detgemm_cute.tune import fit_command

    path = Path(__file__).resolve().parent.parent / "bench" / "results" / "tune" / record
    p = argparse.ArgumentParser()
    fit_command.add_arguments(p)
    out = tmp_path / "fit.yaml"
    args = p.parse_args([str(path), "--ops", op, "--m-min", "65", "--m-max", "512",
                         "--bucket-dtypes", "fp32", "--name", "fit", "--out", str(out)])
    assert fit_command.run(args, out=lambda *a: None) == 0
    fitted = registry.load_config(out, arch="sm90").buckets
    table = [b for b in registry.get_registry("sm90").buckets if b.group == bucket]
    assert [(b.tile, b.cluster, b.stages, b.persistent) for b in fitted] == [
        (b.tile, b.cluster, b.stages, b.persistent) for b in table]
    for f, t in zip(fitted, table):
        assert f.cost == pytest.approx(t.cost, rel=1e-3, abs=1e-3), t.name
