"""The fp32 tier's fused path for few rows (`split_decode`: kernels/split_gemv.py, and
kernels/cluster_gemv.py and kernels/split_tile.py on sm_90) on the GPU.

It must give the bits of the split path it replaces (W split to memory, the chunked GEMM,
unscale) and of the CPU reference, at every M it serves and for every launch shape, and a
row's bits must not depend on how many rows ride with it (M <= 64 fused, M > 64 split).

Run on the GPU machine:  python3 -m pytest -q tests/test_gpu_fp32_decode.py"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import reference, split_decode  # noqa: E402
from detgemm_cute.reference import same_bits as same_bits_nan  # noqa: E402
from gpu_helpers import graph_replayed, poison, same_bits  # noqa: E402

DEV = "cuda"
F32 = torch.float32
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def rand(*shape, g=None, spread=False):
    x = torch.randn(*shape, device=DEV, dtype=F32, generator=g)
    if spread:  # exponents over a wide range: both fp16 parts (and their subnormals) carry bits
        e = torch.randint(-30, 31, shape, device=DEV, generator=g).to(F32)
        x = x * torch.exp2(e)
    return x


def split_path(x, w, bias=None):
    with split_decode.fused(False):
        return dg.linear(x, w, bias)


def fused_path(x, w, bias=None):
    with split_decode.fused(True):
        assert split_decode.applies(x, w, None, "fwd")
        poison()
        return dg.linear(x, w, bias)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 50, 64])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (8, 96), (100, 320), (1000, 1024),
                                 (4096, 4096), (1280, 8192), (333, 14336)])
def test_fused_has_the_split_paths_bits(m, n, k):
    g = torch.Generator(device=DEV).manual_seed(m * 131 + n * 7 + k)
    x, w, bias = rand(m, k, g=g, spread=True), rand(n, k, g=g, spread=True), rand(n, g=g)
    assert same_bits(fused_path(x, w, bias), split_path(x, w, bias))
    assert same_bits(fused_path(x, w), split_path(x, w))


@pytest.mark.parametrize("m", [1, 5, 16, 29, 41])
def test_every_launch_shape_same_bits(m):
    """Every rows/group/stages/grid the kernel takes, X staged as its parts or as fp32
    (the latter on fewer shapes: the same loops, another A fragment source), X's scales
    from the split kernel or taken in the kernel (`x_inline`, up to 16 rows)."""
    g = torch.Generator(device=DEV).manual_seed(m)
    n, k = 600, 2048 + 32 * 7  # a partial last block and a partial last round
    x, w, bias = rand(m, k, g=g, spread=True), rand(n, k, g=g, spread=True), rand(n, g=g)
    want = split_path(x, w, bias)
    m_rows, ran = split_decode.m_rows_for(m), 0
    for x_fp32, x_inline in ((False, False), (True, False), (True, True)):
        if x_inline and m_rows > 16:
            continue
        for rows in (2, 4, 8, 16):
            for group in ((1, 2) if x_fp32 else (1, 2, 4)):
                for stages in ((2, 3) if x_fp32 else (2, 3, 5)):
                    if split_decode.smem_bytes(m_rows, rows, group, stages, x_fp32,
                                               x_inline) > split_decode.SMEM_LIMIT:
                        continue
                    for ctas in (1, 7, 2 * SMS):
                        shape = split_decode.StreamShape(m_rows, rows, group, stages, ctas,
                                                         x_fp32, x_inline)
                        poison()
                        assert same_bits(split_decode.decode_gemm(x, w, bias, shape),
                                         want), shape
                        ran += 1
    assert ran >= 6


def _guess_shape(m, rows=8, ctas=2 * SMS):
    """A streaming launch with guessed W scales: the most stages (3 at most) and chunks per
    round (2 at most) one CTA's shared memory holds."""
    m_rows = split_decode.m_rows_for(m)
    inline = m_rows <= split_decode.X_INLINE_M
    x_fp32 = m_rows >= split_decode.X_FP32_M or inline
    group, stages = next((g, s) for s in (3, 2) for g in (2, 1)
                         if split_decode.smem_bytes(m_rows, rows, g, s, x_fp32, inline, True)
                         <= split_decode.SMEM_LIMIT)
    return split_decode.StreamShape(m_rows, rows, group, stages, ctas, x_fp32, inline, True)


def _perturb(w, g):
    """Change W in place the way training and tests can: rows whose largest magnitude
    moves by a few binades (up and down), a row that gains one large value, a row that
    becomes NaN / Inf / zero / subnormal, and rows left as they were."""
    n = w.shape[0]
    w[0] *= 4.0
    w[min(5, n - 1)] *= 2.0 ** -3
    w[n // 2, 7] = 1e30
    if n > 20:
        w[11, 3] = float("nan")
        w[12, 9] = float("-inf")
        w[13].zero_()
        w[14] *= 2.0 ** -140
    w[n - 1] = rand(w.shape[1], g=g, spread=True)


@pytest.mark.parametrize("m", [1, 3, 4, 8, 16, 33, 64])
@pytest.mark.parametrize("rows", [2, 8, 16])
def test_guessed_scales_follow_a_weight_that_changes(m, rows):
    """The streaming kernel with guessed W scales (`w_guess`): the first call (a fresh
    buffer: arbitrary guesses), a second (every guess right), then W changed in place
    (some rows' scales move, special values) and two more calls: every result has the
    split path's bits, and the buffer ends holding W's row scales."""
    shape = _guess_shape(m, rows, ctas=7 if (m + rows) % 2 else 2 * SMS)  # 7: persistent
    _follows_a_changing_weight(m, shape, seed=300 + 7 * m + rows)


@pytest.mark.parametrize("m,rows,group", [(16, 64, 2), (17, 64, 2), (40, 32, 4), (64, 16, 1),
                                          (64, 64, 4), (33, 64, 2)])
def test_tile_kernel_guessed_scales_follow_a_weight_that_changes(m, rows, group):
    """`SplitTileFp32` with guessed W scales, as the streaming kernel above: each warp's
    rows of W meet in the check (the warps that split other rows add +0)."""
    shape = split_decode.TileShape(max(16, split_decode.m_rows_for(m)), rows, group, 2,
                                   7 if (m + rows) % 2 else 2 * SMS, True)
    _follows_a_changing_weight(m, shape, seed=400 + 7 * m + rows)


def _follows_a_changing_weight(m, shape, seed):
    from detgemm_cute import split

    g = torch.Generator(device=DEV).manual_seed(seed)
    n, k = 603, 32 * 45  # a partial last block and round
    x, w, bias = rand(m, k, g=g, spread=True), rand(n, k, g=g, spread=True), rand(n, g=g)
    for step in range(4):
        if step == 2:
            _perturb(w, g)
        want = split_path(x, w, bias)
        poison()
        assert same_bits_nan(split_decode.decode_gemm(x, w, bias, shape).cpu(), want.cpu()), \
            (step, shape)
    finite = torch.isfinite(w).all(dim=1)
    held = split_decode.guesses(w)[finite].view(F32)
    assert torch.equal(held, split.row_scales(w)[finite])


def test_guessed_scales_under_cuda_graph_replays():
    """A captured call keeps its guess buffer; W changed in place between replays (scales
    moved by whole binades in some rows) still gives the split path's bits on every
    replay, at M = 1 (X's scales in the kernel) and M = 12 (X split first)."""
    g = torch.Generator(device=DEV).manual_seed(77)
    for m in (1, 12):
        x, w = rand(m, 2048, g=g, spread=True), rand(1000, 2048, g=g, spread=True)
        out = torch.empty(m, 1000, device=DEV)
        fn = lambda: dg.linear(x, w)  # noqa: E731
        with split_decode.fused(True):
            assert split_decode.default_shape(m, 1000, 2048, w.device).w_guess
            out.copy_(fn())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out.copy_(fn())
        for replay in range(4):
            if replay in (1, 3):
                _perturb(w, g)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert same_bits_nan(out.cpu(), split_path(x, w).cpu()), (m, replay)


@pytest.mark.parametrize("m", [4, 5, 9, 16])
def test_guessed_scales_special_values(m):
    x, w = special_operands(m)
    want = split_path(x, w)
    shape = _guess_shape(m, ctas=5)
    for _ in range(2):  # arbitrary guesses, then right ones
        poison()
        assert same_bits_nan(split_decode.decode_gemm(x, w, None, shape).cpu(), want.cpu())


@pytest.mark.parametrize("m", [9, 16, 17, 29, 33, 41, 64])
def test_every_tile_shape_same_bits(m):
    """`SplitTileFp32`: every rows/group/stages it takes (16, 32, 64 rows of W; 1, 2, 4, 8
    chunks per round), grids of 1, 7 and 2 x SMs CTAs, a partial last block and round,
    with and without bias."""
    g = torch.Generator(device=DEV).manual_seed(200 + m)
    n, k = 600, 2048 + 32 * 7
    x, w, bias = rand(m, k, g=g, spread=True), rand(n, k, g=g, spread=True), rand(n, g=g)
    want, want_nb = split_path(x, w, bias), split_path(x, w)
    m_rows, ran = max(16, split_decode.m_rows_for(m)), 0
    for rows in (16, 32, 64):
        if (m_rows // 16) * (rows // 8) < 8:
            continue
        for group, stages in ((1, 2), (2, 2), (4, 2), (2, 4), (4, 3), (8, 2), (1, 8)):
            if split_decode.tile_smem_bytes(m_rows, rows, group, stages) > \
                    split_decode.SMEM_LIMIT:
                continue
            for i, ctas in enumerate((1, 7, 2 * SMS)):
                shape = split_decode.TileShape(m_rows, rows, group, stages, ctas)
                poison()
                if (i + group) % 2:
                    assert same_bits(split_decode.decode_gemm(x, w, bias, shape), want), shape
                else:
                    assert same_bits(split_decode.decode_gemm(x, w, None, shape), want_nb), \
                        shape
                ran += 1
    assert ran >= 6


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="tile kernel: sm_90")
@pytest.mark.parametrize("m,n", [(20, 8192), (32, 8200), (24, 4000), (30, 9000), (40, 3600),
                                 (64, 5000), (33, 9000)])
def test_tile_rule_shapes_through_the_default_path(m, n):
    """Every configuration `tile_shape` ships (32- and 64-row blocks, 4 or 2 chunks a
    round, one or two CTAs per SM; 32 and 64 rows of X), through `dg.linear`, with and
    without bias."""
    if split_decode.m_rows_for(m) not in split_decode.tile_min_n():
        pytest.skip("the streaming kernel serves these rows of X (guessed W scales)")
    assert isinstance(split_decode.default_shape(m, n, 256, torch.device(DEV)),
                      split_decode.TileShape)
    g = torch.Generator(device=DEV).manual_seed(m * n)
    x, w, bias = rand(m, 256, g=g, spread=True), rand(n, 256, g=g, spread=True), rand(n, g=g)
    assert same_bits(fused_path(x, w, bias), split_path(x, w, bias))
    assert same_bits(fused_path(x, w), split_path(x, w))


@pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0), reason="clusters: sm_90")
@pytest.mark.parametrize("m", [1, 3, 8, 29])
def test_every_cluster_shape_same_bits(m):
    """Cluster sizes 1..8, caps that leave the last CTAs partial or empty, 1/2/4 commit
    groups, a partial last block of W rows, with and without bias."""
    g = torch.Generator(device=DEV).manual_seed(100 + m)
    n, k = 603, 32 * 71
    x, w, bias = rand(m, k, g=g, spread=True), rand(n, k, g=g, spread=True), rand(n, g=g)
    want, want_nb = split_path(x, w, bias), split_path(x, w)
    m_rows, ran = split_decode.m_rows_for(m), 0
    for i, (cluster, cap) in enumerate([(1, 72), (2, 40), (3, 24), (5, 16), (8, 16), (8, 32),
                                        (7, 16)]):
        if split_decode.cluster_smem_bytes(m_rows, cluster, cap) > split_decode.SMEM_LIMIT:
            continue
        shape = split_decode.ClusterShape(m_rows, cluster, cap, (4, 2, 1)[i % 3])
        poison()
        if i % 2:
            assert same_bits(split_decode.decode_gemm(x, w, bias, shape), want), shape
        else:
            assert same_bits(split_decode.decode_gemm(x, w, None, shape), want_nb), shape
        ran += 1
    assert ran >= 4


@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (5, 72, 160), (19, 24, 96), (37, 24, 96)])
def test_matches_cpu_reference(m, n, k):
    g = torch.Generator(device=DEV).manual_seed(m + n + k)
    x, w, bias = rand(m, k, g=g, spread=True), rand(n, k, g=g, spread=True), rand(n, g=g)
    y = fused_path(x, w, bias)
    want = reference.linear(x.cpu(), w.cpu(), bias.cpu())
    assert same_bits(y.cpu(), want)


def test_random_problems_match_the_cpu_reference():
    """48 random problems the fused path serves (M 1..64, N 1..700, K a multiple of 32,
    values over a wide exponent range, a bias half the time, a weight sliced from a wider
    one a third of the time): each result against the CPU reference, bit for bit."""
    import random

    rng = random.Random(20261127)
    g = torch.Generator(device=DEV).manual_seed(27)
    for case in range(48):
        m, n = rng.randint(1, 64), rng.randint(1, 700)
        k = 32 * rng.randint(1, max(1, min(96, 4_000_000 // (32 * m * n))))
        x = rand(m, k, g=g, spread=True)
        w = rand(n, k + 64, g=g, spread=True)[:, 32:32 + k] if case % 3 == 0 else \
            rand(n, k, g=g, spread=True)
        bias = rand(n, g=g) if case % 2 else None
        y = fused_path(x, w, bias)
        want = reference.linear(x.cpu(), w.cpu(), None if bias is None else bias.cpu())
        assert same_bits(y.cpu(), want), (m, n, k, bias is not None)


@pytest.mark.parametrize("m", [9, 4, 40])  # 16 and 8 rows of W per block; X in fp32
def test_special_values_match_the_split_path(m):
    x, w = special_operands(m)
    y, want = fused_path(x, w), split_path(x, w)
    assert same_bits_nan(y.cpu(), want.cpu())
    assert same_bits_nan(y.cpu(), reference.linear(x.cpu(), w.cpu()))


@pytest.mark.parametrize("m", [4, 9, 16])
def test_inline_x_scales_special_values_match_the_split_path(m):
    x, w = special_operands(m)
    want = split_path(x, w)
    shape = split_decode.StreamShape(split_decode.m_rows_for(m), 8, 2, 2, 5, True, True)
    poison()
    assert same_bits_nan(split_decode.decode_gemm(x, w, None, shape).cpu(), want.cpu())


@pytest.mark.parametrize("m", [12, 40, 64])
def test_tile_kernel_special_values_match_the_split_path(m):
    x, w = special_operands(m)
    want = split_path(x, w)
    for rows in (16, 32, 64):
        if (max(16, split_decode.m_rows_for(m)) // 16) * (rows // 8) >= 8:
            shape = split_decode.TileShape(max(16, split_decode.m_rows_for(m)), rows, 2, 3, 5)
            poison()
            assert same_bits_nan(split_decode.decode_gemm(x, w, None, shape).cpu(),
                                 want.cpu()), shape


def special_operands(m):
    """X [m, 256] and W [64, 256] over a wide exponent range with zeros, signed zeros, Inf,
    NaN, subnormal and near-overflow rows."""
    g = torch.Generator(device=DEV).manual_seed(11)
    n, k = 64, 256
    x, w = rand(m, k, g=g, spread=True), rand(n, k, g=g, spread=True)
    w[0].zero_()  # a row of zeros (scale 2^127)
    w[1] = -0.0
    w[2, 5] = float("inf")
    w[3, 7] = float("nan")
    w[4, 100] = float("-inf")
    w[5] *= 2.0 ** -140  # subnormal fp32 values
    w[6] *= 2.0 ** 100  # near the top of fp32
    w[7, :128] = 0.0
    w[8] = torch.finfo(F32).max
    x[1, 3] = float("nan")
    x[2].zero_()
    x[3] *= 2.0 ** -130
    return x, w


@pytest.mark.parametrize("n,k", [(4096, 4096), (1280, 8192), (520, 96)])
def test_a_rows_bits_do_not_depend_on_how_many_rows_ride_with_it(n, k):
    g = torch.Generator(device=DEV).manual_seed(n + k)
    x, w, bias = rand(300, k, g=g), rand(n, k, g=g), rand(n, g=g)
    full = dg.linear(x, w, bias)  # M = 300: the split path
    for m in (1, 2, 17, 32, 33, 64):
        assert same_bits(dg.linear(x[:m], w, bias), full[:m]), m
    assert same_bits(dg.linear(x[37:38], w, bias), full[37:38])


def test_strided_and_misaligned_weights():
    g = torch.Generator(device=DEV).manual_seed(5)
    x = rand(4, 256, g=g)
    wide = rand(300, 512, g=g)
    w = wide[:, 128:384]  # row stride 512, 16-byte aligned base: read in place
    assert split_decode.applies(x, w, None, "fwd")
    assert same_bits(fused_path(x, w), split_path(x, w.contiguous()))
    odd = rand(300, 300, g=g)[:, 1:257]  # base 4 bytes past alignment: the split path
    assert not split_decode.applies(x, odd, None, "fwd")
    assert same_bits(dg.linear(x, odd), split_path(x, odd.contiguous()))
    ragged = rand(300, 100, g=g)  # K not a multiple of 32: the split path
    assert not split_decode.applies(rand(4, 100, g=g), ragged, None, "fwd")


def test_16bit_output_and_out_rounds_once():
    g = torch.Generator(device=DEV).manual_seed(9)
    x, w, bias = rand(3, 512, g=g), rand(200, 512, g=g), rand(200, g=g)
    y32 = fused_path(x, w, bias)
    with split_decode.fused(True):
        assert same_bits(dg.linear(x, w, bias, out_dtype=torch.bfloat16),
                         y32.to(torch.bfloat16))


def test_cuda_graph_replay():
    g = torch.Generator(device=DEV).manual_seed(2)
    x, w, bias = rand(2, 1024, g=g), rand(777, 1024, g=g), rand(777, g=g)
    with split_decode.fused(True):
        y = graph_replayed(lambda: dg.linear(x, w, bias))
    assert same_bits(y, split_path(x, w, bias))


def test_autograd_forward_uses_it_and_backward_matches():
    g = torch.Generator(device=DEV).manual_seed(4)
    x = rand(8, 256, g=g).requires_grad_()
    lin = dg.nn.Linear(256, 96).to(DEV)
    with split_decode.fused(True):
        y = lin(x)
        y.sum().backward()
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.weight.grad = None
    with split_decode.fused(False):
        y2 = lin(x)
        y2.sum().backward()
    assert same_bits(y, y2) and same_bits(x.grad, gx) and same_bits(lin.weight.grad, gw)


# ---- weights given [K, N] (dX's W, mm's [K, N] operand): read in place or K-major copied


def kn_paths(dy, w, bias=None):
    """dX = dY @ W (or addmm with a bias) on the fused path (W's columns read in place
    where `kn_in_place`, else through W's K-major copy), and the same call on the split
    path (W split in place down its columns). Where W is read in place, the copy's path
    must give the same bits too."""
    with split_decode.fused(True), split_decode.fused_kn(True):
        assert split_decode.applies_kn(dy, w, None, "dx")
        poison()
        got = dg.input_grad(dy, w) if bias is None else dg.addmm(bias, dy, w)
        if split_decode.kn_in_place(w):
            poison()
            assert same_bits_nan(split_decode.decode_gemm_kn(dy, w, bias, True).cpu(),
                                 got.cpu())
    with split_decode.fused_kn(False):
        want = dg.input_grad(dy, w) if bias is None else dg.addmm(bias, dy, w)
    return got, want


@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("r,c", [(32, 4), (96, 8), (320, 100), (1024, 1000), (4096, 4096),
                                 (8192, 1280), (1280, 8192)])
def test_kn_weight_has_the_split_paths_bits(m, r, c):
    """W [r, c]: the reduction runs down its r rows, the output has its c columns."""
    g = torch.Generator(device=DEV).manual_seed(m * 17 + r + 3 * c)
    dy, w = rand(m, r, g=g, spread=True), rand(r, c, g=g, spread=True)
    got, want = kn_paths(dy, w)
    assert same_bits(got, want)
    got, want = kn_paths(dy, w, rand(c, g=g))
    assert same_bits(got, want)


@pytest.mark.parametrize("m,r,c", [(1, 64, 40), (5, 160, 72), (37, 96, 24), (64, 512, 300),
                                   (5, 160, 70)])  # N % 4 != 0: the K-major copy
def test_kn_weight_matches_cpu_reference(m, r, c):
    g = torch.Generator(device=DEV).manual_seed(m + r + c)
    dy, w = rand(m, r, g=g, spread=True), rand(r, c, g=g, spread=True)
    got, _ = kn_paths(dy, w)
    assert same_bits(got.cpu(), reference.mm(dy.cpu(), w.cpu()))
    wide = torch.empty(r, c + 24, device=DEV)[:, 8:c + 8].copy_(w)  # row pitch != c
    got, _ = kn_paths(dy, wide)
    assert same_bits(got.cpu(), reference.mm(dy.cpu(), w.cpu()))


@pytest.mark.parametrize("m", [4, 9, 40])
def test_kn_weight_special_values_match_the_split_path(m):
    x, w = special_operands(m)  # W^T [256, 64]: the special rows of W are its columns
    got, want = kn_paths(x, w.t().contiguous())
    assert same_bits_nan(got.cpu(), want.cpu())


@pytest.mark.parametrize("m", [1, 5, 16, 40, 64])
def test_kn_in_place_every_launch_shape_same_bits(m):
    """The in-place [K, N] kernel at every rows/group/stages/grid it takes (a partial last
    block of 4 columns and a partial last round), X's form as `kn_shape` takes it."""
    g = torch.Generator(device=DEV).manual_seed(500 + m)
    k, n = 32 * 45, 604
    dy, w = rand(m, k, g=g, spread=True), rand(k, n, g=g, spread=True)
    with split_decode.fused_kn(False):
        want = dg.input_grad(dy, w)
    base, ran = split_decode.kn_shape(m, n, k, SMS), 0
    for rows in (8, 16):
        for group in (1, 2):
            for stages in (2, 3):
                if split_decode.smem_bytes(base.m_rows, rows, group, stages, base.x_fp32,
                                           base.x_inline, True, True) > split_decode.SMEM_LIMIT:
                    continue
                for ctas in (7, 2 * SMS):
                    shape = base._replace(rows=rows, group=group, stages=stages, ctas=ctas)
                    poison()
                    got = split_decode.decode_gemm_kn(dy, w, None, False, shape)
                    assert same_bits(got, want), shape
                    ran += 1
    assert ran >= (16 if m <= 16 else 4)  # 33..64 rows of X: 2 stages of 1-chunk rounds fit


@pytest.mark.parametrize("m", [20, 33, 64])
def test_kn_in_place_tile_kernel_every_shape_same_bits(m):
    """The in-place [K, N] tile kernel (`SplitTileFp32` with `w_kn`, as `kn_shape` gives it
    from 17 rows of X at wide N) at every rows/group/stages/grid it takes."""
    g = torch.Generator(device=DEV).manual_seed(600 + m)
    k, n = 32 * 45, 604
    dy, w = rand(m, k, g=g, spread=True), rand(k, n, g=g, spread=True)
    with split_decode.fused_kn(False):
        want = dg.input_grad(dy, w)
    ran, m_rows = 0, split_decode.m_rows_for(m)
    for rows in (16, 32, 64):
        for group in (2, 4):
            for stages in (2, 3):
                if (m_rows // 16) * (rows // 8) < 8 or split_decode.tile_smem_bytes(
                        m_rows, rows, group, stages, True, True) > split_decode.SMEM_LIMIT:
                    continue
                for ctas in (7, 2 * SMS):
                    shape = split_decode.TileShape(m_rows, rows, group, stages, ctas, True)
                    poison()
                    got = split_decode.decode_gemm_kn(dy, w, None, False, shape)
                    assert same_bits(got, want), shape
                    ran += 1
    assert ran >= (16 if m_rows == 64 else 8)
    assert isinstance(split_decode.kn_shape(m, 4096, k, SMS), split_decode.TileShape)


def test_kn_without_a_guess_buffer_takes_exact_column_scales(monkeypatch):
    """No guess buffer (a weight first seen under capture, the cap held): the column
    scales taken first (`kn_plan`; CPU-tested as exact) give the split path's bits,
    special values included."""
    monkeypatch.setattr(split_decode, "guesses", lambda b_nk, of=None: None)
    x, w = special_operands(9)
    got, want = kn_paths(x, w.t().contiguous())
    assert same_bits_nan(got.cpu(), want.cpu())
    g = torch.Generator(device=DEV).manual_seed(12)
    got, want = kn_paths(rand(33, 512, g=g, spread=True), rand(512, 1000, g=g, spread=True))
    assert same_bits(got, want)


def test_kn_guesses_follow_a_changing_weight_apart_from_its_fwd():
    """dX's guessed scales are W's column scales, kept apart from the row scales its fwd
    guesses (training alternates the two on one weight): fwd and dX in turn, W changed in
    place between steps, every result the split path's bits, and each buffer ends holding
    its own scales."""
    from detgemm_cute import split

    g = torch.Generator(device=DEV).manual_seed(91)
    n, k, m = 608, 32 * 45, 8
    x, w, dy = rand(m, k, g=g, spread=True), rand(n, k, g=g, spread=True), rand(m, n, g=g)
    for step in range(4):
        if step == 2:
            _perturb(w, g)
        got, want = kn_paths(dy, w)
        assert same_bits_nan(got.cpu(), want.cpu()), step
        assert same_bits_nan(fused_path(x, w).cpu(), split_path(x, w).cpu()), step
    finite = torch.isfinite(w)
    rows, cols = finite.all(dim=1), finite.all(dim=0)
    held_rows = split_decode.guesses(w)[rows].view(F32)
    assert torch.equal(held_rows, split.row_scales(w)[rows])
    held_cols = split_decode.guesses(w.t().contiguous(), of=w)[cols].view(F32)
    assert torch.equal(held_cols, split.row_scales(w.t())[cols])


def test_kn_weight_under_cuda_graph_replays():
    g = torch.Generator(device=DEV).manual_seed(78)
    dy, w = rand(12, 2048, g=g, spread=True), rand(2048, 1000, g=g, spread=True)
    out = torch.empty(12, 1000, device=DEV)
    with split_decode.fused(True), split_decode.fused_kn(True):
        out.copy_(dg.input_grad(dy, w))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(dg.input_grad(dy, w))
    for replay in range(3):
        if replay == 1:
            w[:, 5] *= 8.0  # one column's scale moves
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _, want = kn_paths(dy, w)
        assert same_bits(out, want), replay


def test_autograd_backward_takes_the_kn_path(monkeypatch):
    """nn.Linear at few rows: its backward's dX takes the kn path (W's columns read in
    place on sm_90) and gives the split path's bits."""
    g = torch.Generator(device=DEV).manual_seed(6)
    lin = dg.nn.Linear(256, 96).to(DEV)
    x = rand(8, 256, g=g).requires_grad_()
    calls, real = [], split_decode.decode_gemm_kn
    monkeypatch.setattr(split_decode, "decode_gemm_kn", lambda *a: calls.append(1) or real(*a))
    lin(x).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    with split_decode.fused_kn(False):
        lin(x).sum().backward()
    assert len(calls) == 1 and same_bits(gx, x.grad)
