"""The "tf32" precision on the CPU: TF32 rounding of the inputs, the chain in 8-wide blocks
(the reference the GPU's TF32 kernels are checked against), the tf32 bucket rules and that
the tf32 kernels build without a GPU."""

import math

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import reference as R
from detgemm_cute import registry, split
from detgemm_cute.kernels import sm80_limits, sm90_limits

F32 = torch.float32


def f32(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(F32)


def test_tf32_round_nearest_ties_to_even():
    one = 0x3F800000
    x = f32([one, one + 0x0FFF, one + 0x1000, one + 0x1001, one + 0x3000, one + 0x2000,
             one | (1 << 31) | 0x3000])
    want = f32([one, one, one, one + 0x2000, one + 0x4000, one + 0x2000,
                (one | (1 << 31)) + 0x4000])
    assert torch.equal(split.tf32_round(x).view(torch.int32), want.view(torch.int32))


def test_tf32_round_specials_subnormals_and_overflow():
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 3.4028234663852886e38,
                      -3.4028234663852886e38, 1e-40])
    y = split.tf32_round(x)
    assert y[0] == math.inf and y[1] == -math.inf and math.isnan(y[2])
    assert R.same_bits(y[3:5], x[3:5])  # signed zeros kept
    assert y[5] == math.inf and y[6] == -math.inf  # past the largest TF32: Inf
    b = y[7:].view(torch.int32).item()
    assert b & 0x1FFF == 0 and abs(y[7].item() - 1e-40) <= 2.0 ** -136  # subnormals round too
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert (split.tf32_round(t).view(torch.int32) & 0x1FFF == 0).all()
    assert ((split.tf32_round(t) - t).abs() <= t.abs() * 2.0 ** -11).all()


def test_chain_runs_in_8_wide_blocks():
    """2^30 - 2^30 in K 0..1 and 1 at K 9: in 8-wide blocks the first block sums to 0 and the
    second adds 1 exactly; one 16-wide block (the 16-bit chain) aligns every term to 2^30's
    exponent, truncating the 1 away before the cancellation."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 9] = 2.0 ** 30, -(2.0 ** 30), 1.0
    w = torch.ones(1, 16)
    with dg.fp32_precision("tf32"):
        assert R.linear(x, w).item() == 1.0
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    assert R.linear(xb, wb, out_dtype=F32).item() == 0.0
    x[0, 9], x[0, 7] = 0.0, 1.0  # the 1 in the first block: truncated in 8-wide blocks too
    with dg.fp32_precision("tf32"):
        assert R.linear(x, w).item() == 0.0


def test_tf32_rows_invariant_and_error_level():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(50, 700, generator=g), torch.randn(40, 700, generator=g)
    with dg.fp32_precision("tf32"):
        y = dg.linear(x, w)
        for rows in (slice(0, 1), slice(3, 30), slice(49, 50)):
            assert R.same_bits(dg.linear(x[rows], w), y[rows])
        assert R.same_bits(R.chain(x, w.t(), op="fwd", precision="tf32"), y)
    ref = x.double() @ w.double().t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert 1e-5 < err < 1e-3
    # the chain is that of the TF32-rounded inputs, not of the fp32 inputs
    xr, wr = split.tf32_round(x), split.tf32_round(w)
    with dg.fp32_precision("tf32"):
        assert R.same_bits(dg.linear(xr, wr), y)


def test_tf32_bucket_rules():
    assert sm90_limits.check_config((128, 192, 32), (2, 1), 4, True, dtypes=("tf32",)) == []
    assert sm90_limits.check_config((16, 64, 32), (1, 1), 13, False, dtypes=("tf32",)) == []
    assert sm90_limits.check_config((128, 128, 64), (1, 1), 3, True, dtypes=("tf32",)) == []
    # 4-byte operands: 128x256x32 fits 4 stages, not 5
    assert sm90_limits.check_config((128, 256, 32), (1, 1), 4, True, dtypes=("tf32",)) == []
    assert sm90_limits.check_config((128, 256, 32), (1, 1), 5, True, dtypes=("tf32",))
    assert sm90_limits.max_stages((128, 256, 32), in_bytes=4) == 4
    assert sm90_limits.check_config((128, 128, 96), (1, 1), 3, False, dtypes=("tf32",))
    assert sm90_limits.check_config((128, 128, 32), (1, 1), 4, False, dtypes=("bf16", "tf32"))
    # sm80: fp32 in shared memory, 4 bytes per element (163 KiB per block)
    assert sm80_limits.check_config((128, 128, 32), (1, 1), 4, False, dtypes=("tf32",)) == []
    assert sm80_limits.check_config((128, 128, 32), (1, 1), 6, False, dtypes=("tf32",))
    assert sm80_limits.max_stages((128, 128, 32), in_bytes=4) == 5
    assert sm80_limits.check_config((128, 128, 96), (1, 1), 3, False, dtypes=("tf32",))
    assert sm80_limits.check_config((128, 128, 32), (1, 1), 3, False, dtypes=("bf16", "tf32"))
    for arch, limits in (("sm90", sm90_limits), ("sm80", sm80_limits)):
        reg = registry.get_registry(arch)
        assert {b.op for b in reg.buckets if "tf32" in b.dtypes} == set(registry.TF32_OPS)
        for m in (1, 100, 777, 5000):
            assert reg.lookup("fwd", "tf32", m, 4096, 4096).tile[2] in limits.TF32_TILE_K


def test_tf32_dw_bucket_is_refused(tmp_path):
    p = tmp_path / "dw_tf32.yaml"
    p.write_text("arch: sm90\nbuckets:\n  - name: dw_tf32\n    op: dw\n    dtypes: [tf32]\n"
                 "    m: [1, null]\n    tile: [128, 128, 32]\n    stages: 4\n")
    with pytest.raises(registry.ConfigError, match="no tf32 kernel"):
        registry.load_config(p)


def test_tf32_kernels_compile_on_cpu_with_tf32_wgmma(tmp_path):
    pytest.importorskip("cutlass")
    from detgemm_cute import aot, compile as kcompile

    b = next(b for b in registry.get_registry("sm90").buckets if "tf32" in b.dtypes)
    for call in aot._tf32_variants(b, "core"):
        fn = kcompile.build(kcompile.KernelKey.for_bucket(b, arch="sm_90a", **call),
                            f"--keep-ptx --dump-dir={tmp_path}")
        assert aot.audit_ptx(fn.__ptx__ or "", "sm90", "tf32") == []
    bf16 = next(b for b in registry.get_registry("sm90").buckets if "bf16" in b.dtypes)
    fn = kcompile.build(kcompile.KernelKey.for_bucket(
        bf16, arch="sm_90a", dtype="bf16", out_dtype="bf16", a_major="k", b_form="nk",
        b_contig="last", has_bias=False), f"--keep-ptx --dump-dir={tmp_path}")
    assert aot.audit_ptx(fn.__ptx__ or "", "sm90", "tf32") == [
        "missing wgmma.mma_async ... .f32.tf32.tf32"]


def test_backward_runs_at_the_forward_precision():
    """dX of an fp32 linear / mm runs at the precision its forward ran at, also when the
    backward runs outside the `fp32_precision` block (or on autograd's device thread)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 40, generator=g, requires_grad=True)
    w = torch.randn(16, 40, generator=g, requires_grad=True)
    gy = torch.randn(24, 16, generator=g)
    with dg.fp32_precision("tf32"):
        y = dg.linear(x, w)
        want_dx = R.chain(gy, w.detach(), op="dx", precision="tf32")
    y.backward(gy)  # outside the block
    assert R.same_bits(x.grad, want_dx)
    assert R.same_bits(w.grad, R.chain(gy.t(), x.detach(), op="dw"))  # dW: exact parts
    a = torch.randn(24, 40, generator=g, requires_grad=True)
    b = torch.randn(40, 16, generator=g)
    with dg.fp32_precision("tf32"):
        z = dg.mm(a, b)
    z.backward(gy)
    assert R.same_bits(a.grad, R.chain(gy, b.t(), op="dx", precision="tf32"))
    with dg.fp32_precision("ieee"):
        x.grad = None
        dg.linear(x, w).backward(gy)
    assert R.same_bits(x.grad, R.chain(gy, w.detach(), op="dx", precision="ieee"))


def test_transpose_kernel_compiles_on_cpu():
    pytest.importorskip("cutlass")
    from detgemm_cute import staging

    for arch in ("sm_90", "sm_80"):
        assert staging._compile(arch) is not None
    assert staging.transposed(torch.randn(4, 4), 8) is None  # CPU tensors: PyTorch's copy


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_fp32_bmm_on_cpu_is_mm_per_entry(precision):
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(3, 20, 36, generator=g), torch.randn(3, 36, 12, generator=g)
    with dg.fp32_precision(precision):
        y = dg.bmm(a, b)
        for i in range(3):
            assert R.same_bits(y[i], dg.mm(a[i], b[i]))


def test_precision_argument_on_the_ops():
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(10, 24, generator=g), torch.randn(6, 24, generator=g)
    for p in ("tf32", "ieee"):
        with dg.fp32_precision(p):
            want_lin, want_mm = dg.linear(x, w), dg.mm(x, w.t())
            want_dx = dg.input_grad(want_lin, w)
            want_bmm = dg.bmm(x.expand(2, 10, 24), w.t().expand(2, 24, 6))
        assert R.same_bits(dg.linear(x, w, precision=p), want_lin)
        assert R.same_bits(dg.mm(x, w.t(), precision=p), want_mm)
        assert R.same_bits(dg.addmm(w[:, 0], x, w.t(), precision=p), want_mm + w[:, 0])
        assert R.same_bits(dg.input_grad(want_lin, w, precision=p), want_dx)
        assert R.same_bits(dg.bmm(x.expand(2, 10, 24), w.t().expand(2, 24, 6), precision=p),
                           want_bmm)
    with pytest.raises(ValueError, match="precision"):
        dg.linear(x, w, precision="fp64")


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_fp32_grouped_mm_rows_are_their_own_chain(precision):
    """fp32 grouped_mm (mixture-of-experts form): each row is the chain of that row alone
    at the precision asked for; the backward runs at the forward's precision (dA: the dX
    chain against each expert, dB: dW's full-precision chain over the group's rows); the
    mode routes fp32 ``_grouped_mm``."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(20, 40, generator=g, requires_grad=True)
    w = torch.randn(3, 40, 12, generator=g, requires_grad=True)
    gy = torch.randn(20, 12, generator=g)
    offs = torch.tensor([6, 6, 17], dtype=torch.int32)
    groups = [(0, 6, 0), (6, 17, 2)]
    y = dg.grouped_mm(x, w, offs, precision=precision)
    xd, wd = x.detach(), w.detach()
    for s, e, ex in groups:
        want = R.chain(xd[s:e], wd[ex], op="fwd", precision=precision)
        assert R.same_bits(y[s:e], want)
        assert R.same_bits(y[s:s + 1], want[:1])  # alone in its group: the same bits
    assert not y[17:].any()
    y.backward(gy)  # outside any precision block: runs at the forward's
    for s, e, ex in groups:
        assert R.same_bits(x.grad[s:e], R.chain(gy[s:e], wd[ex].t(), op="dx",
                                                precision=precision))
        assert R.same_bits(w.grad[ex], R.chain(xd[s:e].t(), gy[s:e], op="dw"))
    assert not w.grad[1].any()
    if hasattr(torch, "_grouped_mm"):
        dg.reset_report()
        with dg.fp32_precision(precision), dg.batch_invariant_mode(strict=True, cpu=True):
            routed = torch._grouped_mm(xd, wd, offs)
        assert R.same_bits(routed, y.detach())
        assert dg.report().routed[("_grouped_mm", "fp32")] == 1


@pytest.mark.parametrize("tile, cluster, persistent, pingpong", [
    ((128, 64, 32), (1, 1), False, False), ((128, 192, 32), (2, 1), True, False),
    ((64, 256, 32), (1, 1), True, True)])
def test_m_major_a_is_read_through_registers(tmp_path, tile, cluster, persistent, pingpong):
    """An M-major fp32 A (dX's weight as it lies, the swapped dx_tf32 buckets) builds as
    TF32 WGMMA with A in registers: each k tile's A is loaded from its stage by the threads
    (ld.shared) and the MMA takes four registers for it instead of a shared-memory
    descriptor; with ptxas at hand, nothing spills. sm_80's TF32 kernels read A K-major
    only, and the key says so before compiling."""
    import re

    pytest.importorskip("cutlass")
    from detgemm_cute import compile as kcompile
    from test_compile_cpu import _assert_no_spills, _audited_ptx

    key = kcompile.KernelKey(tile=tile, cluster=cluster, stages=4, persistent=persistent,
                             pingpong=pingpong, dtype="tf32", out_dtype="fp32", a_major="m",
                             b_form="nk", b_contig="last", has_bias=False, swap_ab=True)
    ptx = _audited_ptx(key, tmp_path)
    mma = re.findall(r"wgmma\.mma_async\S*\.f32\.tf32\.tf32 \{[^}]*\}, (\{[^}]*\}|%rd\d+)", ptx)
    assert mma and all(re.fullmatch(r"\{%r\d+, %r\d+, %r\d+, %r\d+\}", a) for a in mma)
    assert re.search(r"ld\.shared\.b32", ptx)
    report = _assert_no_spills(ptx, tmp_path)
    assert "C7512" not in report, report[-500:]  # the WGMMAs are not serialized
    k_major = _audited_ptx(kcompile.KernelKey(**{**key.__dict__, "a_major": "k"}), tmp_path)
    assert not re.search(r"tf32\.tf32 \{[^}]*\}, \{", k_major)  # K-major: descriptors
    with pytest.raises(ValueError, match="K-major only"):
        kcompile.build(kcompile.KernelKey(**{**key.__dict__, "arch": "sm_80", "swap_ab": False,
                                             "persistent": False, "pingpong": False}))


def test_dx_tf32_buckets_read_the_weight_in_place():
    """Every sm90 dx tf32 alternative swaps operands (its kernel's A is the weight, M-major,
    read through registers: no staging copy), reads A through registers well (BM >= 64, no
    128-row ping-pong), and warmup builds it with that A; the sm80 ones stay K-major."""
    from detgemm_cute import aot, registry
    from detgemm_cute.kernels.sm90_limits import reads_a_in_registers

    reg = registry.get_registry("sm90")
    dx = [b for b in reg.buckets if b.op == "dx" and "tf32" in b.dtypes]
    assert len(dx) >= 10
    assert all(b.swap_ab and reads_a_in_registers(b.tile[0], b.pingpong) for b in dx)
    for b in dx:
        assert {call["a_major"] for call, _ in aot._bucket_keys(b, "sm_90a", "all")} == {"m"}
    for b in registry.get_registry("sm80").buckets:
        if "tf32" in b.dtypes:
            assert {c["a_major"] for c, _ in aot._bucket_keys(b, "sm_80", "all")} == {"k"}


def test_tf32_calls_with_an_mn_major_b_run_swapped_on_sm90():
    """sm90's TF32 kernels read B K-major only: a call whose B is N-major (mm's [K, N]
    weight, the mode's dX = dY @ W) runs swapped, so B is the kernel's A (read through
    registers), on the table's pick for the transposed problem; a K-major B, sm80, a bucket
    that already swaps and a transposed pick that swaps back keep the table's bucket."""
    from detgemm_cute import dispatch
    from detgemm_cute.gemm import TF32, tf32_orientation

    a, b = torch.randn(300, 512), torch.randn(512, 4096)  # A K-major, B [K, N] N-major
    fwd = dispatch.lookup("fwd", TF32, "sm90", 300, 4096, 512)
    got = tf32_orientation("fwd", "sm90", fwd, a, b, "kn", 300, 4096, 512)
    want = dispatch.lookup("fwd", TF32, "sm90", 4096, 300, 512)
    assert got.swap_ab and got.tile[0] >= 64 and not want.swap_ab
    assert (got.tile, got.cluster, got.stages, got.name) == (want.tile, want.cluster,
                                                              want.stages, want.name)
    w = torch.randn(4096, 512)  # B as [N, K], K-major: nothing to do
    assert tf32_orientation("fwd", "sm90", fwd, a, w, "nk", 300, 4096, 512) is fwd
    assert tf32_orientation("fwd", "sm80", fwd, a, b, "kn", 300, 4096, 512) is fwd
    dx = dispatch.lookup("dx", TF32, "sm90", 300, 4096, 512)
    assert dx.swap_ab and tf32_orientation("dx", "sm90", dx, a, b, "kn", 300, 4096, 512) is dx
    a_m = torch.randn(512, 300).t()  # an M-major A cannot be the swapped kernel's B
    assert tf32_orientation("fwd", "sm90", fwd, a_m, b, "kn", 300, 4096, 512) is fwd
    # (4096, 384, 4096) transposed is (384, 4096, 4096), whose pick swaps: B is staged
    assert dispatch.lookup("fwd", TF32, "sm90", 384, 4096, 4096).swap_ab
    fwd = dispatch.lookup("fwd", TF32, "sm90", 4096, 384, 4096)
    a, b = torch.randn(4096, 4096), torch.randn(4096, 384)
    assert tf32_orientation("fwd", "sm90", fwd, a, b, "kn", 4096, 384, 4096) is fwd
