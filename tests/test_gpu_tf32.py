"""fp32 inputs at precision "tf32" on the GPU, on each kernel family the GPU runs.

SM90 reads fp32 operands through TF32 TMA tensor maps (each value rounded to TF32) and runs
TF32 WGMMA; SM80 rounds them to TF32 in registers and runs m16n8k8 TF32 mma.sync; the CPU
reference models that chain (`split.tf32_round`, 8-wide blocks) for both.
Bits against the reference (layouts, K tails, bias, output dtypes, edge values), every tf32
bucket forced, rows invariant at every M and under chunking, graphs, autograd, the mode, and
accuracy next to cuBLAS TF32."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU (each family the GPU can run is tested)",
                allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import reference, split  # noqa: E402
from detgemm_cute.reference import same_bits as same_bits_nan  # noqa: E402
from gpu_helpers import (SWEEP_M, assert_linear_matches_reference,  # noqa: E402,F401
                         bucket_names, family, family_bucket, graph_replayed,
                         poison, rel_err, same_bits, torch_tf32)

DEV = "cuda"
F32 = torch.float32


@pytest.fixture(autouse=True)
def tf32():
    with dg.fp32_precision("tf32"):
        yield


def rand(*shape, g=None, spread=0):
    x = torch.randn(*shape, device=DEV, dtype=F32, generator=g)
    if spread:
        e = torch.randint(-spread, spread + 1, shape, device=DEV, generator=g).to(F32)
        x = x * torch.exp2(e)
    return x


def ref_linear(x, w, bias=None, out_dtype=None):
    return reference.linear(x.cpu(), w.cpu(), None if bias is None else bias.cpu(), out_dtype)


# (the CPU reference costs M * N * K / 8 block steps: shapes stay below ~50M products)
@pytest.mark.parametrize("m,n,k", [(1, 256, 64), (7, 130, 40), (100, 264, 13), (300, 136, 777),
                                   (1000, 96, 512), (2100, 64, 136)])
@pytest.mark.parametrize("spread", [0, 20])
def test_linear_matches_reference_bits(m, n, k, spread):
    g = torch.Generator(device=DEV).manual_seed(m * 7 + n + k)
    x, w, bias = rand(m, k, g=g, spread=spread), rand(n, k, g=g, spread=spread), rand(n, g=g)
    assert_linear_matches_reference(x, w, bias)


def test_layouts_are_staged_to_the_same_bits():
    """mm with B [K, N] row-major, A as a transposed view, unaligned K: the op layer stages
    K-major copies, the bits are those of the reference."""
    g = torch.Generator(device=DEV).manual_seed(4)
    a, b = rand(300, 277, g=g), rand(277, 136, g=g)
    want = reference.mm(a.cpu(), b.cpu())
    assert same_bits(dg.mm(a, b).cpu(), want)
    assert same_bits(dg.mm(a.t().contiguous().t(), b).cpu(), want)
    assert same_bits(dg.mm(a, b.t().contiguous().t()).cpu(), want)
    assert same_bits(dg.addmm(b[0, :], a, b).cpu(), want + b[0, :].cpu())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_16bit_output_is_one_rounding(out_dtype):
    x, w = rand(200, 300), rand(136, 300)
    assert same_bits(dg.linear(x, w, out_dtype=out_dtype), dg.linear(x, w).to(out_dtype))


@pytest.mark.parametrize("bucket", bucket_names("tf32"))
def test_every_tf32_bucket_same_bits(bucket):
    x, w, bias = rand(333, 400, spread=8), rand(136, 400), rand(136)
    b = family_bucket(bucket, "tf32")
    poison()
    with dg.force_bucket(bucket):
        if b.op == "fwd":
            y, want = dg.linear(x, w, bias), ref_linear(x, w, bias)
        else:
            y, want = dg.input_grad(x, w.t().contiguous()), ref_linear(x, w)
    assert same_bits(y.cpu(), want)


def test_batch_invariance_every_m_and_chunks():
    g = torch.Generator(device=DEV).manual_seed(3)
    x, w = rand(10097, 1024, g=g), rand(1536, 1024, g=g)
    full = dg.linear(x, w)
    for m in SWEEP_M:
        poison()
        assert same_bits(dg.linear(x[:m], w), full[:m]), f"rows differ at M={m}"
    chunks = torch.cat([dg.linear(c, w) for c in x.split(777)])
    assert same_bits(chunks, full)
    dy = rand(4096, 1536, g=g)
    dx_full = dg.input_grad(dy, w)
    for m in (1, 17, 300, 2048):
        assert same_bits(dg.input_grad(dy[:m], w), dx_full[:m])


def test_run_to_run_and_graphs():
    x, w = rand(1000, 2048), rand(2048, 2048)
    first = dg.linear(x, w)
    assert same_bits(dg.linear(x, w), first)
    assert same_bits(graph_replayed(lambda: dg.linear(x, w)), first)


def test_volume_one_million_outputs_match_reference():
    g = torch.Generator(device=DEV).manual_seed(11)
    x, w, bias = rand(1024, 40, g=g, spread=20), rand(1040, 40, g=g, spread=4), rand(1040, g=g)
    y = dg.linear(x, w, bias)
    assert y.numel() >= 1_000_000
    assert same_bits(y.cpu(), ref_linear(x, w, bias))


def test_edge_values_match_reference():
    """Ties of the TF32 rounding, subnormals, values that round past the largest finite TF32,
    Inf and NaN: the kernel's bits are the reference's (NaN payloads aside)."""
    g = torch.Generator().manual_seed(9)
    top = torch.randint(0, 1 << 18, (64, 96), generator=g, dtype=torch.int32) << 13
    exp = torch.randint(100, 150, (64, 96), generator=g, dtype=torch.int32) << 23
    ties = ((top & ~0x7F800000) | exp | 0x1000).view(F32)  # low 13 bits exactly half an ulp
    w = torch.randn(72, 96, generator=g)
    x = ties.clone()
    x[1] = torch.randn(96, generator=g) * 2.0 ** -130  # subnormals
    x[2] = (torch.tensor(0x7F7FF000, dtype=torch.int32)
            + torch.randint(0, 0x1000, (96,), generator=g, dtype=torch.int32)).view(F32)
    x[3, 5], x[4, 0], w[7, 2] = float("inf"), float("nan"), float("-inf")
    want = ref_linear(x, w)
    y = dg.linear(x.cuda(), w.cuda()).cpu()
    assert same_bits_nan(y, want)
    eye = torch.eye(96)  # the inputs themselves, through the chain (Inf * 0 is NaN)
    assert same_bits_nan(dg.linear(x.cuda(), eye.cuda()).cpu(), ref_linear(x, eye))


def test_error_next_to_cublas_tf32():
    g = torch.Generator(device=DEV).manual_seed(2)
    a, b = rand(512, 4096, g=g), rand(4096, 512, g=g)
    ref = a.double() @ b.double()
    with torch_tf32(True):
        cublas = a @ b
    ours = dg.mm(a, b)
    assert rel_err(ours, ref) < 1.1 * rel_err(cublas, ref) and rel_err(ours, ref) < 1e-3


def test_torch_flag_selects_tf32():
    x, w = rand(64, 256), rand(96, 256)
    want = dg.linear(x, w)
    with torch_tf32(True), _no_override():
        assert same_bits(dg.linear(x, w), want)
    with dg.fp32_precision("ieee"):
        assert not same_bits(dg.linear(x, w), want)


class _no_override:
    """Drop this thread's fp32_precision override for a block (torch's flag decides)."""

    def __enter__(self):
        self.prev = getattr(split._local, "precision", None)
        split._local.precision = None

    def __exit__(self, *exc):
        split._local.precision = self.prev


def test_nn_linear_and_mode():
    """Autograd: dX on the tf32 kernels, dW at full precision (exact parts); the mode routes
    fp32 matmuls to the tf32 kernels."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 192).cuda()
    mod = dg.nn.Linear.from_linear(lin)
    x = torch.randn(40, 256, device=DEV, requires_grad=True)
    y = mod(x)
    assert same_bits(y.cpu(), ref_linear(x.detach(), lin.weight.detach(), lin.bias.detach()))
    gy = torch.randn_like(y)
    y.backward(gy)
    assert same_bits(x.grad.cpu(), reference.mm(gy.cpu(), lin.weight.detach().cpu()))
    want_dw = reference.chain(gy.t().cpu(), x.detach().cpu(), op="dw")
    assert same_bits(mod.weight.grad.cpu(), want_dw)
    a, b = rand(300, 512), rand(512, 200)  # b N-major: runs swapped, b read in place
    with dg.batch_invariant_mode(strict=True):
        z = a @ b
    assert same_bits(z.cpu(), reference.mm(a.cpu(), b.cpu()))
    # the mode's autograd: dX = dY @ W (W N-major as aten passes it), at torch's flag (the
    # backward runs on autograd's thread, where this thread's override does not reach)
    xm = x.detach().clone().requires_grad_(True)
    with torch_tf32(True), dg.batch_invariant_mode(strict=True):
        torch.nn.functional.linear(xm, lin.weight.detach()).backward(gy)
    assert same_bits(xm.grad.cpu(), reference.mm(gy.cpu(), lin.weight.detach().cpu()))


@pytest.mark.parametrize("rows,cols,width", [(777, 130, 784), (1, 64, 8), (64, 1, 64),
                                             (4096, 1024, 4096), (33, 31, 40)])
def test_staging_transpose_is_a_copy(rows, cols, width):
    from detgemm_cute import staging

    x = rand(rows, cols + 3)[:, :cols]  # a row stride that is not the width
    out = staging.transposed(x, width)
    want = torch.zeros(cols, width, device=DEV)
    want[:, :rows] = x.t()
    assert same_bits(out, want)


@pytest.mark.parametrize("lb,m,k,n", [(7, 100, 64, 130), (33, 64, 128, 64), (4, 300, 40, 96)])
def test_bmm_one_launch_entries_are_mm(lb, m, k, n):
    """fp32 bmm at "tf32": one launch, each entry the bits of dg.mm on it, whatever the batch
    count or layout (q @ k^T views, a [K, N] row-major B that is staged, a broadcast B)."""
    g = torch.Generator(device=DEV).manual_seed(lb * m)
    a = rand(lb, m, k, g=g, spread=6)
    kt = rand(lb, n, k, g=g).transpose(1, 2)  # [L, K, N], K contiguous: read in place
    b_rows = kt.contiguous()  # [L, K, N] row-major: staged K-major
    shared = rand(k, n, g=g).expand(lb, k, n)
    for b in (kt, b_rows, shared):
        poison()
        y = dg.bmm(a, b)
        for i in range(lb):
            assert same_bits(y[i], dg.mm(a[i], b[i])), i
        assert same_bits(dg.bmm(a[:3], b[:3]), y[:3])
    assert same_bits(y[1].cpu(), reference.mm(a[1].cpu(), shared[1].cpu()))
    with dg.fp32_precision("ieee"):  # entry by entry on the split tier
        z = dg.bmm(a, kt)
        assert same_bits(z[2], dg.mm(a[2], kt[2]))


def test_bmm_mode_and_backward():
    a, b = rand(6, 64, 96, spread=2), rand(6, 96, 80)
    with dg.batch_invariant_mode(strict=True):
        y = torch.bmm(a, b)
    assert same_bits(y, dg.bmm(a, b))
    a.requires_grad_(True)
    gy = rand(6, 64, 80)
    dg.bmm(a, b).backward(gy)
    assert same_bits(a.grad, dg.bmm(gy, b.transpose(1, 2)))


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_fp32_grouped_mm_rows_are_mm_of_their_group(precision):
    """fp32 grouped_mm (mixture-of-experts form), expert weights [K, N] row-major as torch
    stores them: each group's rows have the bits of dg.mm on those rows alone, empty groups
    write nothing, rows past the last group are zero; the backward matches per-group GEMMs."""
    g = torch.Generator(device=DEV).manual_seed(31)
    x = rand(700, 256, g=g).requires_grad_()
    w = rand(4, 256, 136, g=g).requires_grad_()
    offs = torch.tensor([100, 100, 433, 690], dtype=torch.int32, device=DEV)
    poison()
    y = dg.grouped_mm(x, w, offs, precision=precision)
    gy = rand(700, 136, g=g)
    y.backward(gy)
    xd, wd = x.detach(), w.detach()
    with dg.fp32_precision(precision):
        for s, e, ex in ((0, 100, 0), (100, 433, 2), (433, 690, 3)):
            assert same_bits(y[s:e], dg.mm(xd[s:e], wd[ex]))
            assert same_bits(y[s:s + 1], dg.mm(xd[s:s + 1], wd[ex]))
            assert same_bits(x.grad[s:e], dg.mm(gy[s:e], wd[ex].t()))
            assert same_bits(w.grad[ex], dg.weight_grad(xd[s:e], gy[s:e]))  # x^T gy
    assert not y[690:].any() and not w.grad[1].any()
