"""bmm / baddbmm / grouped_mm on the GPU: one launch for the batch, and every entry the chain
`dg.mm` computes for it alone.

- each entry's bits equal `dg.mm` on that entry (a 2-D GEMM from another table and tile),
  for every bmm bucket, every operand layout attention produces (q @ k^T on views, p @ v),
  fp32 output, bias, odd N/K, broadcast (batch stride 0) operands;
- batch-count invariance: an entry's bits do not depend on L;
- graphs: a captured bmm replays to the same bits;
- grouped_mm: a token's row does not depend on how many tokens its group received;
- batch_invariant_mode routes aten::bmm / baddbmm / _grouped_mm to one launch.
Outputs land in NaN-poisoned memory, so an element never written shows up."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import gemm, registry  # noqa: E402
from gpu_helpers import current_family, family, poison, rand, same_bits  # noqa: E402,F401

# (L, M, K, N): one problem per bmm bucket of both tables and the shapes attention makes
SHAPES = [(3, 1, 128, 1000), (5, 13, 72, 264), (4, 30, 128, 300), (6, 64, 64, 64),
          (2, 100, 1000, 40), (3, 300, 520, 128), (2, 129, 64, 776), (64, 128, 64, 128),
          (2, 777, 128, 777), (3, 512, 512, 64),
          (2, 1000, 128, 1000), (2, 600, 64, 1004),  # half-sector rows: direct stores
          (2, 600, 128, 1024), (2, 520, 72, 1032),  # 2x1 cluster; direct rows without it
          # p @ v at odd S: P's rows read by the producer warpgroup (sm90), one per p @ v tile
          (3, 333, 333, 64), (2, 777, 777, 128), (2, 1100, 1001, 128), (2, 1500, 1500, 256),
          (3, 40, 77, 96)]


def _entries_equal(c, a, b, bias=None, out_dtype=None):
    for i in range(a.shape[0]):
        want = (dg.mm(a[i], b[i], out_dtype=out_dtype) if bias is None
                else dg.addmm(bias, a[i], b[i], out_dtype=out_dtype))
        assert same_bits(c[i], want), i


def _bmm(a, b, **kw):
    poison()
    return dg.bmm(a, b, **kw)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bmm_entries_are_mm(family, shape):
    lb, m, k, n = shape
    a, b = rand(lb, m, k), rand(lb, k, n)
    _entries_equal(_bmm(a, b), a, b)
    bt = rand(lb, n, k).transpose(1, 2)  # q @ k^T: B is a transposed view
    _entries_equal(_bmm(a, bt), a, bt)
    at = rand(lb, k, m).transpose(1, 2)  # A^T @ G (bmm's dB): A is a transposed view
    _entries_equal(_bmm(at, b), at, b)
    bias = rand(n)
    _entries_equal(_bmm(a, b, bias=bias), a, b, bias)
    _entries_equal(_bmm(a, b, out_dtype=torch.float32), a, b, out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bmm_every_bucket(family, dtype):
    """Every bmm bucket of the table, forced onto problems cutting through its tiles."""
    reg = registry.get_registry(current_family())
    names = [b.name for b in reg.buckets if b.op == "bmm"
             and ("bf16" if dtype == torch.bfloat16 else "fp16") in b.dtypes]
    assert names
    # the fourth problem has odd K: unaligned A rows (staged, or read by the threads); the
    # last three rows the threads store 16 (half-sector pitch), 8 and 4 bytes at a time
    for lb, m, k, n in [(3, 5, 200, 72), (2, 130, 136, 264), (4, 64, 64, 128),
                        (2, 130, 131, 72), (2, 130, 72, 1000), (2, 70, 64, 1004),
                        (3, 70, 64, 302)]:
        a, b = rand(lb, m, k, dtype=dtype), rand(lb, k, n, dtype=dtype)
        want = dg.bmm(a, b)
        for name in names:
            with gemm.force_bucket(name):
                got = _bmm(a, b)
            assert same_bits(got, want), (name, lb, m, k, n)
        _entries_equal(want, a, b)


def test_bmm_batch_count_invariance(family):
    for m, k, n in [(128, 64, 128), (1, 128, 2048), (200, 200, 64)]:
        a, b = rand(40, m, k), rand(40, k, n)
        full = _bmm(a, b)
        for lb in (1, 2, 7, 31):
            assert same_bits(_bmm(a[:lb], b[:lb]), full[:lb]), (m, k, n, lb)
        assert same_bits(_bmm(a[9:13], b[9:13]), full[9:13])


def test_bmm_odd_sizes_and_broadcast(family):
    lb, m, k, n = 4, 37, 77, 51  # K, N not multiples of 8: staged operands, padded output
    a, b = rand(lb, m, k), rand(lb, k, n)
    _entries_equal(_bmm(a, b), a, b)
    w = rand(k, n)
    wb = w.expand(lb, k, n)  # shared weight, batch stride 0
    c = _bmm(a, wb)
    _entries_equal(c, a, wb)
    assert same_bits(c.reshape(lb * m, n), dg.mm(a.reshape(lb * m, k), w))
    ab = rand(m, k).expand(lb, m, k)  # broadcast A
    _entries_equal(_bmm(ab, b), ab, b)
    x = rand(lb, m, 2 * k)[:, :, ::2]  # no unit stride: staged
    _entries_equal(_bmm(x, b), x, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bmm_unaligned_a_rows_read_by_the_threads(dtype):
    """p @ v at an odd sequence length: P's rows are not 16-byte aligned, and the SM90 kernel
    reads them with its producer warpgroup (no copy into padded rows). Each entry equals `dg.mm`
    (which copies P into padded rows for TMA) for contiguous P, a 2-byte-aligned start, rows
    of a longer pitch, a broadcast P, every p @ v tile, fp32 out and bias; entries do not
    depend on L; a captured call replays to the same bits."""
    from detgemm_cute import batched, dispatch

    with dg.use_family("sm90"):
        for lb, s, d in [(4, 333, 64), (3, 777, 128), (2, 1001, 128), (2, 1500, 256),
                         (5, 67, 64), (3, 9, 128), (2, 257, 64)]:
            p, v = rand(lb, s, s, dtype=dtype), rand(lb, s, d, dtype=dtype)
            bucket = dispatch.lookup("bmm", "bf16" if dtype == torch.bfloat16 else "fp16",
                                     "sm90", s, d, s)
            key, stage_a, _, _ = batched.kernel_layout(p, v, None, dtype, bucket)
            threads = bucket.tile[0] >= 64 and s >= batched.A_ROWS_MIN_K
            assert key.a_loads == threads and stage_a != key.a_loads, (s, key)
            full = _bmm(p, v)
            _entries_equal(full, p, v)
            assert same_bits(_bmm(p[1:2], v[1:2])[0], full[1])
            assert same_bits(_bmm(p[:1].expand(lb, s, s), v)[lb - 1], dg.mm(p[0], v[-1]))
            shifted = rand(lb * s * s + 1, dtype=dtype)[1:].view(lb, s, s)  # 2-byte start
            _entries_equal(_bmm(shifted, v), shifted, v)
            wide = rand(lb, s, s + 5, dtype=dtype)[:, :, :s]  # pitch s + 5
            _entries_equal(_bmm(wide, v), wide, v)
            bias = rand(d, dtype=dtype)
            _entries_equal(_bmm(p, v, bias=bias), p, v, bias)
            _entries_equal(_bmm(p, v, out_dtype=torch.float32), p, v,
                           out_dtype=torch.float32)
        p, v = rand(8, 333, 333, dtype=dtype), rand(8, 333, 128, dtype=dtype)
        want = dg.bmm(p, v)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            dg.bmm(p, v)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            out = dg.bmm(p, v)
        p.copy_(rand(8, 333, 333, dtype=dtype))
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(out, dg.bmm(p, v)) and not same_bits(out, want)


def test_bmm_large_batch_small_entries(family):
    a, b = rand(2048, 64, 64), rand(2048, 64, 64)
    c = _bmm(a, b)
    for i in (0, 1, 1000, 2047):
        assert same_bits(c[i], dg.mm(a[i], b[i])), i


def test_baddbmm_forms(family):
    lb, m, k, n = 3, 40, 96, 72
    a, b = rand(lb, m, k), rand(lb, k, n)
    bias = rand(n)
    got = dg.baddbmm(bias, a, b)
    _entries_equal(got, a, b, bias)
    inp = rand(lb, m, n)
    got = dg.baddbmm(inp, a, b, beta=0.5, alpha=2.0)
    y32 = dg.bmm(a, b, out_dtype=torch.float32)
    assert same_bits(got, (y32 * 2.0 + inp.float() * 0.5).to(torch.bfloat16))


def test_bmm_cuda_graph(family):
    a, b = rand(16, 128, 128), rand(16, 128, 128)
    want = dg.bmm(a, b)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        dg.bmm(a, b)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = dg.bmm(a, b)
    a.copy_(rand(16, 128, 128))
    g.replay()
    torch.cuda.synchronize()
    assert same_bits(out, dg.bmm(a, b)) and not same_bits(out, want)


def test_bmm_autograd(family):
    a = rand(4, 64, 96).requires_grad_()
    b = rand(4, 96, 80).requires_grad_()
    g = rand(4, 64, 80)
    dg.bmm(a, b).backward(g)
    _entries_equal(a.grad, g, b.detach().transpose(1, 2))
    _entries_equal(b.grad, a.detach().transpose(1, 2), g)


def test_grouped_mm_group_size_invariance(family):
    experts, k, n = 8, 512, 384
    w = rand(experts, k, n)
    x = rand(600, k)
    for sizes in ([75] * 8, [0, 300, 1, 99, 50, 50, 100, 0], [600, 0, 0, 0, 0, 0, 0, 0]):
        offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        poison()
        y = dg.grouped_mm(x, w, offs)
        start = 0
        for g, size in enumerate(sizes):
            if size:
                rows = x[start:start + size]
                assert same_bits(y[start:start + size], dg.mm(rows, w[g])), (sizes, g)
                # one token alone in its expert gives the same row
                assert same_bits(dg.mm(rows[:1], w[g]), y[start:start + 1])
            start += size


def test_grouped_mm_on_a_user_stream_is_ordered(family):
    """The groups run on side streams: a grouped_mm called on a user stream, whose inputs are
    written just before on that stream and whose output is read right after on it, sees
    them in order, and each group equals dg.mm on its rows (large enough that a missing
    wait would show)."""
    experts, k, n = 8, 1024, 2048
    sizes = [700, 0, 513, 64, 1, 900, 300, 222]
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x, w = rand(sum(sizes), k), rand(experts, k, n)
    want = [dg.mm(x[e - s:e], w[g]) for g, (s, e) in
            enumerate(zip(sizes, offs.tolist())) if s]
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        x2 = torch.full_like(x, float("nan"))
        x2.copy_(x)  # written on the user stream just before the call
        y = dg.grouped_mm(x2, w, offs)
        y_sum = y.float().sum(dim=1)  # read right after, on the same stream
    torch.cuda.synchronize()
    got = [y[e - s:e] for s, e in zip(sizes, offs.tolist()) if s]
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert torch.equal(y_sum, y.float().sum(dim=1))


def test_grouped_mm_backward(family):
    experts, k, n = 4, 256, 128
    sizes = [10, 0, 70, 48]
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = rand(128, k).requires_grad_()
    w = rand(experts, k, n).requires_grad_()
    g = rand(128, n)
    dg.grouped_mm(x, w, offs).backward(g)
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        if size:
            assert same_bits(x.grad[rows], dg.mm(g[rows], w[e].detach().t()))
            want = dg.mm(x.detach()[rows].t(), g[rows])
            assert same_bits(w.grad[e], want), e
        else:
            assert not w.grad[e].any()
        start += size


def test_mode_routes_batched_ops(family):
    a, b = rand(8, 128, 64), rand(8, 64, 128)
    x, w = rand(96, 64), rand(4, 64, 32)
    offs = torch.tensor([20, 40, 60, 96], device="cuda", dtype=torch.int32)
    dg.reset_report()
    with dg.batch_invariant_mode(strict=True):
        y = torch.bmm(a, b)
        z = torch.baddbmm(rand(128), a, b)
        q = torch.matmul(a, b)  # 3-D matmul is aten::bmm
        gm = torch._grouped_mm(x, w, offs)
    assert same_bits(y, dg.bmm(a, b)) and same_bits(q, y)
    assert z.shape == y.shape and not z.isnan().any()
    assert same_bits(gm, dg.grouped_mm(x, w, offs))
    assert dg.report().total_fell_back == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(777, 777), (1, 5), (70001, 3), (96, 333, 333),
                                   (2, 5000, 4099)])
def test_staging_rows_pads_unaligned_rows(shape, dtype):
    """The 16-bit row copy: rows that do not start on 16 bytes (odd K, batches folded into
    rows, more rows than one grid dimension of 65535) copied into zero-padded rows of a
    multiple of 8, bit-exact, and the GEMM on them is the GEMM on the original rows."""
    x = rand(*shape, dtype=dtype)
    k = shape[-1]
    kp = -(-k // 8) * 8
    out = gemm.stage_k_major(x, True)
    want = torch.zeros(*shape[:-1], kp, dtype=dtype, device="cuda")
    want[..., :k] = x
    assert out.shape == want.shape and out.is_contiguous() and same_bits(out, want)
    if x.dim() == 3 and k > 8:  # p @ v with odd K: staged inside bmm
        v = rand(shape[0], k, 64, dtype=dtype)
        assert same_bits(dg.bmm(x, v)[1], dg.mm(x[1], v[1]))
