"""SM90 kernels on the GPU: correctness, determinism and the batch-invariance contract.

Bits are compared with torch.equal on integer views; values against an fp64 reference.
Before each run the caching allocator is filled with NaN blocks, so an output element the
kernel never writes shows up as NaN."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU (each family the GPU can run is tested)",
                allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from gpu_helpers import (SWEEP_M, SWEEP_NK, SWEEP_REF_M, bits, current_family, family,  # noqa: E402,F401
                         poison, same_bits)
from detgemm_cute import dispatch, registry  # noqa: E402

DEV = "cuda"
M_LIST = SWEEP_M
NK_LIST = SWEEP_NK  # (N, K) pairs that reach every built-in bucket's N/K conditions
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rand(*shape, dtype=torch.bfloat16, g=None):
    return torch.randn(*shape, device=DEV, dtype=torch.float32, generator=g).to(dtype)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def all_buckets():
    """The 16-bit fwd buckets (the fp32 tier's are tested in test_gpu_fp32.py)."""
    return [b for b in registry.get_registry(current_family()).buckets
            if b.op == "fwd" and set(b.dtypes) & set(registry.REQUIRED_DTYPES)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (100, 520, 776), (1000, 3072, 768),
                                   (2048, 768, 3072), (5000, 2048, 2048), (300, 9216, 1536)])
def test_matches_fp64_reference(dtype, m, n, k):
    x, w, bias = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype), rand(n, dtype=dtype)
    poison()
    y = dg.linear(x, w, bias)
    ref = x.double() @ w.double().t() + bias.double()
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) < TOL[dtype]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_out_dtypes_round_once(out_dtype):
    x, w, bias = rand(300, 1000), rand(264, 1000), rand(264)
    y32 = dg.linear(x, w, bias, out_dtype=torch.float32)
    ref = x.double() @ w.double().t() + bias.double()
    assert rel_err(y32, ref) < 1e-5  # fp32 accumulation, no intermediate 16-bit rounding
    y = dg.linear(x, w, bias, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    assert same_bits(y, y32.to(out_dtype))  # exactly one rounding of the fp32 value


def test_run_to_run_identical():
    x, w = rand(777, 4096), rand(4096, 4096)
    first = dg.linear(x, w)
    for _ in range(3):
        poison()
        assert same_bits(dg.linear(x, w), first)


@pytest.mark.parametrize("n,k", NK_LIST)
def test_batch_invariance_across_all_m(n, k):
    g = torch.Generator(device=DEV).manual_seed(n + k)
    x, w = rand(SWEEP_REF_M, k, g=g), rand(n, k, g=g)
    full = dg.linear(x, w)
    seen = set()
    for m in M_LIST:
        poison()
        part = dg.linear(x[:m], w)
        seen.add(dispatch.lookup("fwd", "bf16", current_family(), m, n, k).name)
        assert same_bits(part, full[:m]), f"rows differ at M={m} (N={n}, K={k})"
    assert len(seen) >= 3


def test_invariance_sweep_reaches_every_fwd_bucket():
    """The (M, N, K) points above (M = SWEEP_REF_M is the reference) pass through every
    bucket (a bucket with alternatives once; each alternative is forced below)."""
    fam = current_family()
    picked = [dispatch.lookup("fwd", "bf16", fam, m, n, k)
              for m in M_LIST + [SWEEP_REF_M] for n, k in NK_LIST]
    assert {b.group or b.name for b in picked} == {b.group or b.name for b in all_buckets()}


SHARDS = 8  # every-bucket tests run in shards, so parallel workers share the compiles


@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_bucket_gives_identical_bits(shard):
    x, w, bias = rand(333, 1100), rand(700, 1100), rand(700)
    base = dg.linear(x, w, bias)
    names = [b.name for b in all_buckets()]
    assert len(names) == len(set(names)) >= 5
    for name in names[shard::SHARDS]:
        with dg.force_bucket(name):
            poison()
            assert same_bits(dg.linear(x, w, bias), base), f"bucket {name} differs"


@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_bucket_bits_fp16_fp32_out(shard):
    x, w = rand(130, 512, dtype=torch.float16), rand(300, 512, dtype=torch.float16)
    base = dg.linear(x, w, out_dtype=torch.float32)
    for b in all_buckets()[shard::SHARDS]:
        with dg.force_bucket(b.name):
            assert same_bits(dg.linear(x, w, out_dtype=torch.float32), base), b.name


def test_chunked_prefill_and_padding_rows():
    x, w = rand(3000, 2048), rand(1536, 2048)
    full = dg.linear(x, w)
    chunks, start = [], 0
    for size in (1, 5, 16, 100, 513, 1, 2000, 364):
        chunks.append(dg.linear(x[start:start + size], w))
        start += size
    assert start == 3000
    assert same_bits(torch.cat(chunks), full)
    padded = torch.cat([x, rand(77, 2048)])
    assert same_bits(dg.linear(padded, w)[:3000], full)
    zero_padded = torch.cat([x[:10], torch.zeros(500, 2048, device=DEV, dtype=x.dtype)])
    assert same_bits(dg.linear(zero_padded, w)[:10], full[:10])


def test_cuda_graph_capture_and_replay():
    x, w, bias = rand(64, 4096), rand(4096, 4096), rand(4096)
    eager = dg.linear(x, w, bias)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dg.linear(x, w, bias)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = dg.linear(x, w, bias)
    for _ in range(3):
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(y, eager)
    x.copy_(rand(64, 4096))
    g.replay()
    assert same_bits(y, dg.linear(x, w, bias))


def test_layouts_without_copies_give_same_bits():
    x, w = rand(500, 1024), rand(640, 1024)
    base = dg.linear(x, w)
    assert same_bits(dg.mm(x, w.t()), base)  # weight transposed view (K-major B)
    assert same_bits(dg.mm(x, w.t().contiguous()), base)  # row-major [K, N]
    x_mmajor = x.t().contiguous().t()
    assert same_bits(dg.linear(x_mmajor, w), base)
    assert same_bits(dg.linear(x.view(5, 100, 1024), w).view(500, 640), base)


def test_non_contiguous_and_misaligned_inputs_are_staged():
    x, w = rand(200, 1030), rand(300, 1030)
    base = dg.linear(x[:, 3:1027].contiguous(), w[:, 3:1027].contiguous())
    assert same_bits(dg.linear(x[:, 3:1027], w[:, 3:1027]), base)  # 6-byte offsets
    xs = rand(400, 1024)[::2]  # row stride 2048 elements: fine for TMA
    assert same_bits(dg.linear(xs, w[:, :1024]), dg.linear(xs.contiguous(), w[:, :1024]))


@pytest.mark.parametrize("n", [333, 1001, 30522])
def test_operands_contiguous_in_m_or_n_are_padded_in_place(n):
    """dY^T of an odd vocabulary (dW's A, M-major), a [K, N] B and an N-contiguous [N, K]
    B with an odd N: TMA cannot read them; they are copied with their contiguous dim padded
    (`gemm.stage_padded`), which must give the bits of the same GEMM on aligned copies."""
    t, k = 520, 256
    dy, x = rand(t, n), rand(t, k)
    poison()
    dw = dg.weight_grad(dy, x)
    dy_k = dy.t().contiguous()  # [n, t] K-major: read in place when t is aligned
    assert same_bits(dw, dg.mm(dy_k, x, out_dtype=torch.float32))
    ref = dy.double().t() @ x.double()
    assert rel_err(dw, ref) < 1e-5
    a, b_kn = rand(300, k), rand(k, n)  # mm(a, [K, N]) with N contiguous, N odd
    assert same_bits(dg.mm(a, b_kn), dg.mm(a, b_kn.t().contiguous().t()))
    w_nk = rand(k, n).t()  # linear's weight [N, K], N contiguous
    assert same_bits(dg.linear(a, w_nk), dg.linear(a, w_nk.contiguous()))
    xs = rand(k, 7).t()  # M-major, misaligned: decode buckets' row tiles take it K-major
    assert same_bits(dg.linear(xs, w_nk), dg.linear(xs.contiguous(), w_nk.contiguous()))


@pytest.mark.parametrize("k", [1, 7, 100, 1001])
@pytest.mark.parametrize("n", [1, 9, 250, 1023])
def test_unaligned_k_and_n(k, n):
    x, w, bias = rand(70, k), rand(n, k), rand(n)
    poison()
    y = dg.linear(x, w, bias)
    assert y.shape == (70, n) and y.is_contiguous()
    ref = x.double() @ w.double().t() + bias.double()
    assert rel_err(y, ref) < 1e-2
    kp = -(-k // 8) * 8  # explicit zero padding of K gives the very same bits
    xp = torch.zeros(70, kp, device=DEV, dtype=x.dtype)
    wp = torch.zeros(n, kp, device=DEV, dtype=w.dtype)
    xp[:, :k], wp[:, :k] = x, w
    assert same_bits(dg.linear(xp, wp, bias), y)
    assert same_bits(dg.linear(x[:5], w, bias), y[:5])


def test_addmm_and_bias_add_in_fp32():
    a, b, bias = rand(129, 512), rand(512, 384), rand(384)
    y = dg.addmm(bias, a, b)
    y32 = dg.mm(a, b, out_dtype=torch.float32)
    assert same_bits(y, (y32 + bias.float()).to(torch.bfloat16))


def test_m_zero_returns_empty():
    y = dg.linear(torch.empty(0, 64, device=DEV, dtype=torch.bfloat16), rand(32, 64))
    assert y.shape == (0, 32)


def test_bad_inputs_raise_before_launch():
    x, w = rand(4, 64), rand(8, 64)
    with pytest.raises(TypeError, match="weight"):
        dg.linear(x, w.float())
    with pytest.raises(ValueError, match="K mismatch"):
        dg.linear(x, rand(8, 32))
    with pytest.raises(ValueError, match="bias"):
        dg.linear(x, w, rand(7))
    with pytest.raises(ValueError, match="cpu"):
        dg.linear(x.cpu(), w)


def test_torch_compile_runs_the_kernel():
    x, w = rand(96, 512), rand(256, 512)
    f = torch.compile(lambda a, b: dg.linear(a, b) * 2, fullgraph=True)
    assert same_bits(f(x, w), dg.linear(x, w) * 2)
