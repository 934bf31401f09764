"""CPU checks of the fp32 tier's fused path for few rows (`split_decode`,
kernels/split_gemv.py): which calls take it, its launch arithmetic, and its compiled code
(built for sm_80 and sm_90 from fake tensors: the PTX must show the m16n8k16 chain, 16-byte
loads of W and no fused multiply-add where the split path rounds twice)."""

from __future__ import annotations

import re

import pytest
import torch

from detgemm_cute import split_decode


@pytest.fixture
def on_gpu(monkeypatch):
    """`applies` as on an sm_90 GPU (CPU tensors stand in for CUDA ones)."""
    monkeypatch.setattr(split_decode, "_capability", lambda device: (9, 0))
    with split_decode.fused(True):
        yield


def test_which_calls_take_the_fused_path(on_gpu):
    x, w = torch.randn(4, 256), torch.randn(100, 256)
    assert split_decode.applies(x, w, None, "fwd")
    assert split_decode.applies(x, w, None, "dx")
    assert not split_decode.applies(x, w, None, "dw")  # dW has its own exact scheme
    assert not split_decode.applies(x, w, torch.zeros(4, 100), "fwd")  # accumulation
    assert split_decode.applies(torch.randn(split_decode.MAX_M, 256), w, None, "fwd")
    assert not split_decode.applies(torch.randn(split_decode.MAX_M + 1, 256), w, None, "fwd")
    assert not split_decode.applies(torch.randn(4, 100), torch.randn(8, 100), None, "fwd")
    assert not split_decode.applies(x, w.t().contiguous().t(), None, "fwd")  # N-contiguous
    assert not split_decode.applies(x, torch.randn(100, 260)[:, 1:257], None, "fwd")
    assert split_decode.applies(x, torch.randn(100, 512)[:, 128:384], None, "fwd")
    with split_decode.fused(False):
        assert not split_decode.applies(x, w, None, "fwd")


def test_which_kn_weights_take_the_fused_path(on_gpu, monkeypatch):
    """`applies_kn`: a B given [K, N] with unit stride along N (dX's weight), K a multiple
    of 32, no accumulation, fwd/dX, M within the fused path's rows; read in place where
    `kn_in_place`, else through the transpose kernel's copy up to `KN_COPY_MAX_M` rows."""
    monkeypatch.setattr(split_decode.split, "_kernels_on", lambda: True)
    dy, w = torch.randn(4, 256), torch.randn(256, 100)  # dX = dY [4, 256] @ W [256, 100]
    odd = torch.randn(256, 10)  # N not a multiple of 4: the copy
    assert split_decode.kn_in_place(w) and not split_decode.kn_in_place(odd)
    assert split_decode.applies_kn(dy, w, None, "dx")
    assert split_decode.applies_kn(dy, w, None, "fwd")  # mm(x, w [K, N])
    assert not split_decode.applies_kn(dy, w, None, "dw")
    assert not split_decode.applies_kn(dy, w, torch.zeros(4, 100), "dx")
    assert split_decode.applies_kn(torch.randn(split_decode.MAX_M, 256), w, None, "dx")
    assert not split_decode.applies_kn(torch.randn(split_decode.MAX_M + 1, 256), w, None, "dx")
    assert not split_decode.applies_kn(torch.randn(4, 100), torch.randn(100, 8), None, "dx")
    assert not split_decode.applies_kn(dy, w.t().contiguous().t(), None, "dx")  # K-contiguous
    assert split_decode.applies_kn(dy, torch.randn(256, 300)[:, 100:200], None, "dx")
    copy_m = split_decode.KN_COPY_MAX_M
    assert split_decode.applies_kn(torch.randn(copy_m, 256), odd, None, "dx")
    assert not split_decode.applies_kn(torch.randn(copy_m + 1, 256), odd, None, "dx")
    with split_decode.fused_kn(False):
        assert not split_decode.applies_kn(dy, w, None, "dx")
        assert split_decode.applies(dy, w.t().contiguous(), None, "dx")  # fused() apart
    with split_decode.fused(False):
        assert not split_decode.applies_kn(dy, w, None, "dx")
    monkeypatch.setattr(split_decode.split, "_kernels_on", lambda: False)
    assert not split_decode.applies_kn(dy, odd, None, "dx")  # PyTorch's strided copy: no
    assert split_decode.applies_kn(dy, w, None, "dx")  # the in-place read needs no copy


def test_kn_call_runs_on_a_k_major_copy_keyed_by_the_weight(monkeypatch):
    """`decode_gemm_kn` hands `decode_gemm` W's K-major copy (PyTorch's where the transpose
    kernel does not apply: here, CPU tensors) and W itself as the key of its guesses;
    `_gemm_fp32` routes a "kn" call there when `applies` does not take it."""
    from detgemm_cute import gemm

    calls = []

    def fake_decode(a, b_nk, bias, shape=None, guess_of=None):
        calls.append((a, b_nk, bias, guess_of))
        return torch.full((a.shape[0], b_nk.shape[0]), 2.5)

    monkeypatch.setattr(split_decode, "decode_gemm", fake_decode)
    monkeypatch.setattr(split_decode, "kn_in_place", lambda b_kn: False)
    dy, w = torch.randn(3, 64), torch.randn(64, 10)
    split_decode.decode_gemm_kn(dy, w, None)
    _, w_nk, _, of = calls[0]
    assert of is w and w_nk.is_contiguous() and torch.equal(w_nk, w.t())
    monkeypatch.setattr(split_decode, "applies", lambda a, b_nk, acc, op: False)
    monkeypatch.setattr(split_decode, "applies_kn", lambda a, b_kn, acc, op: True)
    y = gemm._gemm_fp32(dy, w, "kn", None, torch.float32, "dx", None, None)
    assert calls[1][3] is w and torch.equal(y, torch.full((3, 10), 2.5))
    monkeypatch.setattr(gemm.split, "scaled_operand_cuda", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # an "nk" call never takes the kn path
        gemm._gemm_fp32(dy, w.t(), "nk", None, torch.float32, "fwd", None, None)
    assert len(calls) == 2


def test_kn_weights_read_in_place_on_sm90(monkeypatch):
    """`kn_in_place`: sm_90, N a multiple of 4, 16-byte-aligned rows; `decode_gemm_kn` then
    hands W itself to `decode_gemm` (``kn=True``) unless told to copy."""
    caps = [(9, 0)]
    monkeypatch.setattr(split_decode, "_capability", lambda device: caps[0])
    w = torch.randn(64, 12)
    assert split_decode.kn_in_place(w)
    assert not split_decode.kn_in_place(torch.randn(64, 10))  # N % 4
    assert not split_decode.kn_in_place(torch.randn(64, 14)[:, 1:13])  # misaligned base
    assert not split_decode.kn_in_place(torch.randn(64, 14)[:, :12])  # 56-byte row pitch
    assert split_decode.kn_in_place(torch.randn(64, 16)[:, 4:16])
    caps[0] = (8, 0)
    assert not split_decode.kn_in_place(w)
    caps[0] = (9, 0)
    calls = []
    monkeypatch.setattr(split_decode, "decode_gemm",
                        lambda a, b, bias, shape=None, guess_of=None, kn=False:
                        calls.append((b, kn, guess_of)))
    dy = torch.randn(3, 64)
    split_decode.decode_gemm_kn(dy, w, None)
    split_decode.decode_gemm_kn(dy, w, None, via_copy=True)
    assert calls[0] == (w, True, None) and calls[1][1] is False and calls[1][2] is w
    with pytest.raises(ValueError, match="kn_in_place"):  # forced in place where it cannot
        split_decode.decode_gemm_kn(dy, torch.randn(64, 10), None, via_copy=False)
    with pytest.raises(ValueError, match="StreamShape or"):
        split_decode.decode_gemm_kn(dy, w, None, False, split_decode.ClusterShape(1, 2, 8, 2))
    assert len(calls) == 2


def test_kn_plan_takes_exact_scales_without_guessing(monkeypatch):
    """`kn_plan`: the weight's guess buffer, else (none, or guessing off) exact column
    scales: `split.row_scales` of the transposed view, as int32 bits."""
    monkeypatch.setattr(split_decode, "_sms", lambda device: 132)
    w = torch.randn(64, 12) * torch.exp2(torch.randint(-9, 9, (64, 12)).float())
    exact = split_decode.split.row_scales(w.t()).view(torch.int32)
    buf = torch.zeros(12, dtype=torch.int32)
    monkeypatch.setattr(split_decode, "guesses", lambda b_nk, of=None: buf)
    shape, got = split_decode.kn_plan(3, 12, 64, w)
    assert got is buf and shape == split_decode.kn_shape(3, 12, 64, 132)
    monkeypatch.setattr(split_decode, "GUESS", False)
    assert torch.equal(split_decode.kn_plan(3, 12, 64, w)[1], exact)
    monkeypatch.setattr(split_decode, "GUESS", True)
    monkeypatch.setattr(split_decode, "guesses", lambda b_nk, of=None: None)
    assert torch.equal(split_decode.kn_plan(3, 12, 64, w)[1], exact)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("n", [8, 1024, 4096, 14336])
def test_kn_shape_fits_its_ctas(m, n):
    """`kn_shape`: the guessing tile shape where a forward takes one (its padded stages
    smaller), else the guessing stream shape (8 or 16 rows of W) with its padded column
    stages fitting the CTAs it puts on an SM."""
    shape = split_decode.kn_shape(m, n, 4096, 132)
    tile = split_decode.tile_shape(m, n, 132, True)
    if tile is not None:
        assert shape == tile and shape.w_guess
        kn_w = shape.stages * shape.group * (32 * shape.rows + 64) * 4
        assert kn_w <= shape.stages * shape.rows * (shape.group * 32 + 16) * 4
        return
    assert shape.w_guess and shape.rows in (8, 16) and shape.stages >= 2
    smem = split_decode.smem_bytes(shape.m_rows, shape.rows, shape.group, shape.stages,
                                   shape.x_fp32, shape.x_inline, True, True)
    per_sm = 2 if shape.ctas > 132 else 1
    assert smem * per_sm <= (2 * split_decode._SMEM_BYTES if per_sm == 2
                             else split_decode.SMEM_LIMIT)


def test_old_gpus_keep_the_split_path(monkeypatch):
    monkeypatch.setattr(split_decode, "_capability", lambda device: (7, 5))
    assert not split_decode.applies(torch.randn(4, 256), torch.randn(100, 256), None, "fwd")


def test_sm80_serves_32_rows_of_x_at_most(monkeypatch):
    monkeypatch.setattr(split_decode, "_capability", lambda device: (8, 0))
    w = torch.randn(100, 256)
    with split_decode.fused(True):
        assert split_decode.applies(torch.randn(split_decode.SM80_MAX_M, 256), w, None, "fwd")
        assert not split_decode.applies(torch.randn(split_decode.SM80_MAX_M + 1, 256), w,
                                        None, "fwd")


@pytest.fixture(params=[True, False], ids=["guess", "two-pass"])
def guess(request, monkeypatch):
    """Guessed W scales on (the default) or off (``DETGEMM_CUTE_FP32_GUESS=0``)."""
    monkeypatch.setattr(split_decode, "GUESS", request.param)
    split_decode.launch_shape.cache_clear()
    split_decode.tile_shape.cache_clear()
    yield request.param
    split_decode.launch_shape.cache_clear()
    split_decode.tile_shape.cache_clear()


@pytest.mark.parametrize("m", [1, 7, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("n,k", [(1, 32), (100, 4096), (1280, 8192), (4096, 4096),
                                 (14336, 4096), (151936, 896), (1024, 4096)])
@pytest.mark.parametrize("cap", [(8, 0), (9, 0)])
def test_launch_shape_arithmetic(m, n, k, cap, guess):
    if m > split_decode.max_m(cap):  # sm_80 serves 32 rows of X at most
        assert cap == (8, 0) and m > split_decode.SM80_MAX_M
        return
    limit = split_decode.SMEM_LIMIT if cap >= (9, 0) else split_decode.SM80_SMEM
    shape = split_decode.launch_shape(m, n, k, 132, limit)
    m_rows, rows, group, stages, ctas, x_fp32, x_inline, w_guess = shape
    assert isinstance(shape, split_decode.StreamShape)
    assert m_rows >= m and m_rows == split_decode.m_rows_for(m)
    assert m_rows in (1, 2, 4, 8, 16, 32, 64)
    assert x_inline == (m_rows <= split_decode.X_INLINE_M)
    assert w_guess == guess
    smem = split_decode.smem_bytes(m_rows, rows, group, stages, x_fp32, x_inline, w_guess)
    assert smem <= limit
    if guess and m_rows <= 16:  # `GUESS_SHAPES`, X in fp32
        want = split_decode.GUESS_SHAPES[m_rows]
        if want[0] == 16 and 2 * -(-n // 16) < 132:  # 16-row blocks would idle SMs
            want = split_decode.GUESS_SHAPES[m_rows // 2]
        assert (rows, group, stages) == want[:3] and x_fp32
        assert ctas == min(-(-n // rows), want[3] * 132)
        return
    if x_inline:  # X in fp32, its scales taken in the kernel: 8 rows, 2 chunks, 3 stages
        assert (x_fp32, rows, group, stages) == (True, 8, 2, 3)
        per_sm_limit = split_decode.SMEM_LIMIT if cap >= (9, 0) else split_decode.SM80_SMEM
        assert 2 * smem <= per_sm_limit
        assert ctas == min(-(-n // 8), 2 * 132)
        return
    assert x_fp32 == (m_rows >= split_decode.X_FP32_M)
    # 16 rows of W from 32 rows of X, where one CTA's shared memory holds them and the
    # blocks give at least half the SMs one
    fits = split_decode.smem_bytes(m_rows, 16, 1, 2, x_fp32, w_guess=guess) <= limit
    wide = m_rows >= split_decode.WIDE_M and fits and 2 * -(-n // 16) >= 132
    assert rows == (16 if wide else 8)
    assert group in (1, 2, 4) and 2 <= stages <= 4
    if wide:  # 3 stages where they fit
        assert group == 1 and stages == (
            3 if split_decode.smem_bytes(m_rows, 16, 1, 3, x_fp32, w_guess=guess) <= limit
            else 2)
    per_sm = 2 if smem <= split_decode._SMEM_BYTES and rows == 8 else 1
    assert smem * per_sm <= split_decode.SMEM_LIMIT
    assert 1 <= ctas <= min(-(-n // rows), per_sm * 132)


def test_kernel_rejects_shapes_it_has_no_code_for():
    from detgemm_cute.kernels.split_gemv import SplitGemvFp32

    for bad in [(0, 8, 1, 2), (5, 8, 1, 2), (128, 8, 1, 2), (1, 3, 1, 2), (1, 8, 8, 2),
                (1, 8, 1, 1)]:
        with pytest.raises(ValueError, match="SplitGemvFp32"):
            SplitGemvFp32(*bad, False)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("shape", [(1, 8, 2, 4, True, False), (16, 16, 1, 2, False, False),
                                   (32, 8, 1, 2, True, False), (4, 2, 2, 3, False, False),
                                   (64, 16, 1, 2, True, True), (8, 8, 2, 2, False, True),
                                   (1, 8, 2, 3, True, True), (4, 8, 2, 3, False, True)])
def test_compiled_code(arch, shape, tmp_path):
    x_inline = shape[5] and shape[0] <= 4  # X's scales taken in the kernel
    fn = split_decode.compile_kernel(*shape[:5], arch, x_fp32=shape[5], x_inline=x_inline,
                                     extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = fn.__ptx__ or ""
    ops = set(re.findall(r"^\s*([a-z][\w.]*)", ptx, flags=re.M))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ops
    assert "ld.global.v4.b32" in ops  # the row maxima: 16-byte loads of W
    assert "cp.async.cg.shared.global" in ops  # W and X (fp32 or parts) staged by cp.async
    assert "cvt.rn.f16x2.f32" in ops  # the split's round-to-nearest-even conversions
    # Per chunk, each thread splits 2 x 4 values of W per n8 block (3 parts, 2 values a
    # cvt) and, with X in fp32, 4 x 4 values of X per m16 tile: the split is in the code.
    n_blocks, m_tiles = max(8, shape[1]) // 8, -(-shape[0] // 16)
    cvts = len(re.findall(r"^\s*cvt\.rn\.f16x2\.f32", ptx, flags=re.M))
    assert cvts >= 12 * n_blocks + (24 * m_tiles if shape[5] else 0), cvts
    assert "mul.rn.f32" in ops  # the unscale, as split.unscale rounds it
    assert ("add.rn.f32" in ops) == shape[4]  # the bias add
    assert not any(op.startswith(("fma.", "atom.", "red.")) for op in ops), sorted(ops)


def test_w_stage_size_is_the_kernels():
    """The host's stage arithmetic (`split_decode.w_stage_floats`, for the launch rules)
    is the kernels' own (`kernels.split_gemv.w_stage_floats`, their layouts' stride)."""
    from detgemm_cute.kernels import split_gemv

    for rows in (2, 4, 8, 16, 32, 64):
        for slots in (1, 2, 4, 8, 16, 32):
            for kn in (False, True):
                assert (split_decode.w_stage_floats(rows, slots, kn)
                        == split_gemv.w_stage_floats(rows, slots, kn))


def test_kn_tile_kernel_compiled_code(tmp_path):
    """`SplitTileFp32` with `w_kn`: W's columns by 16-byte cp.async, read as single values,
    the chain in registers; `w_kn` needs `w_guess`."""
    from detgemm_cute.kernels.split_tile import SplitTileFp32

    def ptx_of(w_kn):
        fn = split_decode.compile_tile_kernel(64, 64, 2, 2, True, "sm_90", w_guess=True,
                                              w_kn=w_kn,
                                              extra_options=f"--keep-ptx --dump-dir={tmp_path}")
        ptx = fn.__ptx__ or ""
        return open(ptx).read() if len(ptx) < 4096 else ptx

    def count(op, text):
        return len(re.findall(rf"^\s*{re.escape(op)}\s", text, flags=re.M))

    ptx, rows_ptx = ptx_of(True), ptx_of(False)
    ops = set(re.findall(r"^\s*([a-z][\w.]*)", ptx, flags=re.M))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ops
    assert "cp.async.cg.shared.global" in ops and "ld.global.v4.b32" not in ops
    # Per chunk (2 a round) the warp's n8 block: 2 x 4 single loads for 2 vector loads.
    assert count("ld.shared.b32", ptx) - count("ld.shared.b32", rows_ptx) >= 4 * 2 * 2
    assert count("ld.shared.v4.b32", rows_ptx) - count("ld.shared.v4.b32", ptx) >= 2 * 2
    assert not any(op.startswith(("fma.", "atom.", "red.")) for op in ops), sorted(ops)
    with pytest.raises(ValueError, match="w_kn only"):
        SplitTileFp32(64, 64, 2, 2, False, w_guess=False, w_kn=True)


@pytest.mark.parametrize("shape", [(1, 8, 2, 2, False, True, True), (16, 16, 1, 4, True, True,
                                                                    False),
                                   (64, 16, 1, 2, False, True, False)])
def test_kn_kernel_compiled_code(shape, tmp_path):
    """`w_kn`: W's columns copied by 16-byte cp.async and read as single values (four per
    fragment quad), no pass of 16-byte global loads over W (its scales come in), the
    chain's m16n8k16 steps and split conversions, no FMA or atomics."""
    from detgemm_cute.kernels.split_gemv import SplitGemvFp32

    m_rows, rows, group, stages, bias, x_fp32, x_inline = shape

    def ptx_of(w_kn):
        fn = split_decode.compile_kernel(m_rows, rows, group, stages, bias, "sm_90", x_fp32,
                                         x_inline, w_guess=True, w_kn=w_kn,
                                         extra_options=f"--keep-ptx --dump-dir={tmp_path}")
        ptx = fn.__ptx__ or ""
        return open(ptx).read() if len(ptx) < 4096 else ptx

    ptx, rows_ptx = ptx_of(True), ptx_of(False)
    ops = set(re.findall(r"^\s*([a-z][\w.]*)", ptx, flags=re.M))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ops
    assert "cp.async.cg.shared.global" in ops and "cvt.rn.f16x2.f32" in ops
    assert ("ld.global.v4.b32" in ops) == x_inline  # X's maxima only

    def count(op, text):
        return len(re.findall(rf"^\s*{re.escape(op)}\s", text, flags=re.M))

    # Against the same kernel reading W's rows: each chunk's 2 x 4 values per n8 block come
    # as 8 single loads instead of 2 vector loads.
    reads = 2 * max(8, rows) // 8 * group
    assert count("ld.shared.b32", ptx) - count("ld.shared.b32", rows_ptx) >= 4 * reads
    assert count("ld.shared.v4.b32", rows_ptx) - count("ld.shared.v4.b32", ptx) >= reads
    assert not any(op.startswith(("fma.", "atom.", "red.")) for op in ops), sorted(ops)
    for bad in [dict(w_guess=False), dict(w_guess=True, rows=4)]:
        args = dict(m_rows=1, rows=8, group=2, stages=2, has_bias=False, w_kn=True) | bad
        with pytest.raises(ValueError, match="w_kn only"):
            SplitGemvFp32(**args)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kernel,shape", [("stream", (1, 8, 2, 2, True, True, True)),
                                          ("stream", (16, 16, 1, 4, False, True, False)),
                                          ("stream", (4, 2, 2, 3, False, False, False)),
                                          ("tile", (64, 32, 4, 2, True)),
                                          ("tile", (16, 64, 2, 2, False))])
def test_guessed_scales_compiled_code(arch, kernel, shape, tmp_path):
    """With `w_guess` no pass of 16-byte loads takes W's row maxima (only X's, in the
    kernel, with `x_inline`): the maxima come from the split values, meet through
    butterfly shuffles and shared memory, and a wrong guess is written back."""
    opts = f"--keep-ptx --dump-dir={tmp_path}"
    if kernel == "stream":
        m_rows, rows, group, stages, bias, x_fp32, x_inline = shape
        fn = split_decode.compile_kernel(m_rows, rows, group, stages, bias, arch, x_fp32,
                                         x_inline, w_guess=True, extra_options=opts)
    else:
        fn = split_decode.compile_tile_kernel(*shape, arch, w_guess=True, extra_options=opts)
    ptx = fn.__ptx__ or ""
    ops = set(re.findall(r"^\s*([a-z][\w.]*)", ptx, flags=re.M))
    assert ("ld.global.v4.b32" in ops) == (kernel == "stream" and shape[6])
    assert "shfl.sync.bfly.b32" in ops and "st.global.b32" in ops and "ld.global.b32" in ops
    assert "cp.async.cg.shared.global" in ops and "cvt.rn.f16x2.f32" in ops
    assert not any(op.startswith(("fma.", "atom.", "red.")) for op in ops), sorted(ops)


def test_guessing_tile_rule_takes_17_to_32_rows_from_3584():
    """With guessed scales 17..32 rows of X run the tile kernel from N = 3584 under the
    33..64-row rule (`tile-guess-sweep` record); W's scales taken first, from N = 8192 with
    64-row blocks, two chunks a round, two CTAs per SM."""
    tile = split_decode.TileShape
    assert split_decode.tile_shape(20, 3583, 132, True) is None
    assert split_decode.tile_shape(20, 4096, 132, True) == tile(32, 32, 4, 2, 128, True)
    assert split_decode.tile_shape(32, 8192, 132, True) == tile(32, 64, 4, 2, 128, True)
    assert split_decode.tile_shape(17, 14336, 132, True) == tile(32, 64, 2, 2, 224, True)
    assert split_decode.tile_shape(32, 4096, 132, False) is None
    assert split_decode.tile_shape(32, 8192, 132, False) == tile(32, 64, 2, 2, 128, False)
    assert split_decode.tile_shape(16, 8192, 132, True) is None  # 16 rows: streaming kernel


@pytest.mark.parametrize("m", [1, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("n", [1, 1024, 3583, 3584, 4224, 4225, 8192, 8448, 8449, 18944])
def test_tile_shape_arithmetic(m, n, guess):
    shape = split_decode.tile_shape(m, n, 132)
    m_rows = split_decode.m_rows_for(m)
    min_n = split_decode.TILE_MIN_N_GUESS if guess else split_decode.TILE_MIN_N
    assert split_decode.tile_min_n() == min_n
    if m_rows not in min_n or n < min_n[m_rows]:
        assert shape is None
        return
    assert isinstance(shape, split_decode.TileShape) and shape.m_rows == m_rows
    assert shape.w_guess == guess
    blocks = -(-n // shape.rows)
    per_sm = 2 if (shape.rows, shape.group) == (64, 2) else 1
    assert shape.ctas == min(blocks, per_sm * 132) and shape.stages == 2
    if m_rows == 64 or guess:  # 32-row blocks while they leave one per SM, then 64,
        assert shape.rows == (32 if -(-n // 32) <= 132 else 64)  # then 2 per SM
        assert shape.group == (2 if -(-n // 64) > 132 else 4)
    else:
        assert (shape.rows, shape.group) == (64, 2)
    smem = split_decode.tile_smem_bytes(m_rows, shape.rows, shape.group, shape.stages, guess)
    assert smem * per_sm <= split_decode.SMEM_LIMIT


def test_tile_kernel_only_on_sm90(monkeypatch):
    x, w = torch.randn(64, 256), torch.randn(4096, 256)
    for cap, tile in (((9, 0), True), ((8, 0), False), ((12, 0), False)):
        monkeypatch.setattr(split_decode, "_capability", lambda device, cap=cap: cap)
        monkeypatch.setattr(split_decode, "_sms", lambda device: 132)
        split_decode.default_shape.cache_clear()
        shape = split_decode.default_shape(64, 4096, 256, x.device)
        assert isinstance(shape, split_decode.TileShape) == tile
    split_decode.default_shape.cache_clear()
    monkeypatch.setattr(split_decode, "_capability", lambda device: (9, 0))
    assert split_decode.applies(x, w, None, "fwd")


def test_tile_kernel_rejects_shapes_it_has_no_code_for():
    from detgemm_cute.kernels.split_tile import SplitTileFp32

    for bad in [(8, 64, 2, 2), (16, 32, 2, 2), (32, 16, 2, 2), (64, 8, 2, 2), (64, 128, 2, 2),
                (64, 32, 3, 2), (64, 32, 2, 1), (64, 32, 2, 9)]:
        with pytest.raises(ValueError, match="SplitTileFp32"):
            SplitTileFp32(*bad, False)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("shape", [(64, 32, 4, 2, True), (32, 64, 2, 2, False),
                                   (16, 64, 1, 3, True), (64, 16, 8, 2, False)])
def test_tile_compiled_code(arch, shape, tmp_path):
    fn = split_decode.compile_tile_kernel(*shape, arch,
                                          extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = fn.__ptx__ or ""
    ops = set(re.findall(r"^\s*([a-z][\w.]*)", ptx, flags=re.M))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ops
    assert "ld.global.v4.b32" in ops and "cp.async.cg.shared.global" in ops
    # Per chunk each warp splits W's 2 x 4 values of its n8 block (3 parts, 2 values a
    # cvt) and runs six steps per m16 tile it owns: the chain is in the code.
    m_rows, rows, group = shape[:3]
    wm = (m_rows // 16) // (8 // (rows // 8))
    assert len(re.findall(r"^\s*cvt\.rn\.f16x2\.f32", ptx, flags=re.M)) >= 6 * group
    assert len(re.findall(r"^\s*mma\.sync", ptx, flags=re.M)) == 6 * group * wm
    assert "mul.rn.f32" in ops and ("add.rn.f32" in ops) == shape[4]
    assert not any(op.startswith(("fma.", "atom.", "red.")) for op in ops), sorted(ops)
    # Shared memory takes the row scales and the warps' maxima only: no chunk exchange.
    assert len(re.findall(r"^\s*st\.shared", ptx, flags=re.M)) <= 3


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("k", [32, 96, 1024, 3584, 4096, 5120, 7168, 14336, 18944, 28672])
def test_cluster_shape_holds_the_block(m, k, guess):
    chunks = k // 32
    shape = split_decode.cluster_shape(m, k)
    if shape is None:  # a cluster of 8 cannot hold the block: the streaming kernel serves
        cap = -(-chunks // (8 * split_decode.CLUSTER_MAX)) * 8
        assert split_decode.cluster_smem_bytes(split_decode.m_rows_for(m), 8, cap) > \
            split_decode.SMEM_LIMIT
        assert not split_decode.uses_cluster(m, k, (9, 0))
        return
    m_rows, cluster, cap, groups = shape
    assert m_rows == split_decode.m_rows_for(m)
    assert 1 <= cluster <= split_decode.CLUSTER_MAX and cap % 8 == 0
    assert cluster * cap >= chunks > (cluster - 1) * cap  # every CTA holds some chunks
    assert split_decode.cluster_smem_bytes(m_rows, cluster, cap) <= split_decode.SMEM_LIMIT
    assert groups in (1, 2, 4) and -(-cap // groups) >= 8
    assert split_decode.uses_cluster(m, k, (9, 0)) == (
        not guess and m <= split_decode.CLUSTER_M
        and split_decode.CLUSTER_MIN_K <= k <= split_decode.CLUSTER_MAX_K)
    assert not split_decode.uses_cluster(m, k, (8, 0))  # clusters need sm_90


def test_cluster_kernel_rejects_shapes_it_has_no_code_for():
    from detgemm_cute.kernels.cluster_gemv import ClusterGemvFp32

    for bad in [(1, 0, 8, 1), (1, 9, 8, 1), (1, 2, 12, 1), (1, 2, 0, 1), (1, 2, 16, 3),
                (3, 2, 16, 1), (128, 2, 16, 1)]:
        with pytest.raises(ValueError, match="GemvFp32"):
            ClusterGemvFp32(*bad, False)


@pytest.mark.parametrize("shape", [(1, 3, 48, 4, True), (8, 8, 24, 2, False),
                                   (32, 1, 8, 1, True)])
def test_cluster_compiled_code(shape, tmp_path):
    fn = split_decode.compile_cluster_kernel(*shape, "sm_90",
                                             f"--keep-ptx --dump-dir={tmp_path}")
    ptx = fn.__ptx__ or ""
    ops = set(re.findall(r"^\s*([a-z][\w.:]*)", ptx, flags=re.M))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ops
    assert "cp.async.cg.shared.global" in ops and "ld.global.v4.b32" not in ops  # read once
    assert "cvt.rn.f16x2.f32" in ops and "mul.rn.f32" in ops
    assert ("add.rn.f32" in ops) == shape[4]
    assert {"barrier.cluster.arrive.relaxed", "barrier.cluster.arrive",
            "barrier.cluster.wait"} <= ops
    if shape[1] > 1:  # maxima and chunk values cross the cluster
        assert "mapa.shared::cluster.u32" in ops and "st.shared::cluster.b32" in ops
    assert not any(op.startswith(("fma.", "atom.", "red.")) for op in ops), sorted(ops)


def test_explain_names_the_fused_path_where_it_serves(guess):
    from detgemm_cute import tables

    text = tables.explain("fwd", "fp32", "sm90", 1, 4096, 4096)
    assert "fused:" in text and "split_gemv" in text and split_decode.ENV in text
    text = tables.explain("fwd", "fp32", "sm90", 1, 4096, 14336)
    assert ("cluster_gemv.py, clusters of" in text) == (not guess)
    assert "split_gemv" in tables.explain("fwd", "fp32", "sm80", 1, 4096, 14336)
    assert "fused:" in tables.explain("dx", "torch.float32", "sm90", 32, 4096, 4096)
    assert "fused:" in tables.explain("fwd", "fp32", "sm90", 64, 4096, 4096)
    assert "split_tile.py, 32-row blocks of W, 4 chunks" in tables.explain(
        "fwd", "fp32", "sm90", 64, 4096, 4096)
    assert ("split_tile.py, 64-row blocks of W, 2 chunks" in tables.explain(
        "fwd", "fp32", "sm90", 20, 8192, 4096)) == (not guess)
    narrow = tables.explain("fwd", "fp32", "sm90", 64, 1024, 4096)
    assert "split_gemv.py" in narrow and "split_tile" not in narrow
    assert "split_tile" not in tables.explain("fwd", "fp32", "sm80", 20, 8192, 4096)
    assert "fused:" not in tables.explain("fwd", "fp32", "sm80", 33, 4096, 4096)
    for op, dtype, m, k in [("fwd", "fp32", 65, 4096), ("dw", "fp32", 1, 4096),
                            ("fwd", "bf16", 1, 4096), ("fwd", "fp32", 1, 100)]:
        assert "fused:" not in tables.explain(op, dtype, "sm90", m, 4096, k)


def test_the_chain_does_not_see_the_order_inside_a_16_wide_block():
    """The fused kernel places a thread's consecutive values 4t..4t+3 in the fragment slots
    2t, 2t+1, 2t+8, 2t+9 of both operands: a permutation inside each 16-wide K block. The
    reference chain (the hardware's model) must give the same bits for any such
    permutation, on the fp32 tier's split operands and on 16-bit ones."""
    from detgemm_cute import reference, split

    g = torch.Generator().manual_seed(0)
    m, n, k = 3, 5, 96
    # The kernel's map, value 4t + v of a block -> slot: v 0, 1 -> 2t, 2t+1; v 2, 3 -> 2t+8, 2t+9.
    to_slot = torch.tensor([2 * (i // 4) + i % 2 + 8 * (i % 4 // 2) for i in range(16)])
    assert sorted(to_slot.tolist()) == list(range(16))
    perm = torch.cat([to_slot + 16 * b for b in range(k // 16)])
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 21, (m, k), generator=g))
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 21, (n, k), generator=g))
    with split.fp32_precision("ieee"):
        want = reference.chain(x, w.t(), op="fwd")
        got = reference.chain(x[:, perm], w[:, perm].t(), op="fwd")
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    want = reference.chain(xb, wb.t(), op="fwd")
    got = reference.chain(xb[:, perm], wb[:, perm].t(), op="fwd")
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    # ...while moving values across blocks does change them (the check can fail).
    cross = torch.arange(k).roll(5)
    with split.fp32_precision("ieee"):
        moved = reference.chain(x[:, cross], w[:, cross].t(), op="fwd")
        want = reference.chain(x, w.t(), op="fwd")
    assert not torch.equal(want.view(torch.int32), moved.view(torch.int32))


def test_gemm_routes_few_row_fp32_calls_to_the_fused_path(monkeypatch):
    """`gemm._gemm_fp32` hands an applicable call (and its bias) to `decode_gemm` through
    `launch_on`, rounds its fp32 result to the output dtype once, and leaves a
    `force_bucket` call to the table."""
    from detgemm_cute import gemm

    calls = []

    def fake_decode(a, b_nk, bias):
        calls.append((a, b_nk, bias))
        return torch.full((a.shape[0], b_nk.shape[0]), 1.5)

    monkeypatch.setattr(split_decode, "applies", lambda a, b_nk, acc, op: True)
    monkeypatch.setattr(split_decode, "decode_gemm", fake_decode)
    x, w, bias = torch.randn(2, 64), torch.randn(3, 64), torch.randn(3)
    y = gemm._gemm_fp32(x, w, "nk", bias, torch.bfloat16, "fwd", None, None)
    assert calls[0][0] is x and calls[0][1] is w and calls[0][2] is bias
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.full((2, 3), 1.5,
                                                                   dtype=torch.bfloat16))
    y = gemm._gemm_fp32(x, w.t(), "kn", None, torch.float32, "dx", None, None)
    assert calls[1][1].shape == (3, 64) and calls[1][2] is None and y.dtype == torch.float32

    def table(*args, **kwargs):
        raise RuntimeError("the table's kernels")

    monkeypatch.setattr(gemm.split, "scaled_operand_cuda", table)
    with gemm.force_bucket("any"), pytest.raises(RuntimeError, match="table's kernels"):
        gemm._gemm_fp32(x, w, "nk", None, torch.float32, "fwd", None, None)
    assert len(calls) == 2


@pytest.fixture
def fresh_guesses(monkeypatch):
    """An empty table of guess buffers (the module's own is process-wide)."""
    monkeypatch.setattr(split_decode, "_GUESSES", {})
    monkeypatch.setattr(split_decode, "_guess_bytes", 0)
    return split_decode._GUESSES


def test_guess_buffers_are_made_outside_capture_and_kept(fresh_guesses, monkeypatch):
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    w = torch.randn(300, 64)
    assert split_decode.guesses(w) is None and not fresh_guesses  # none made under capture
    capturing[0] = False
    buf = split_decode.guesses(w)
    assert buf.dtype == torch.int32 and buf.shape == (300,)
    capturing[0] = True
    assert split_decode.guesses(w) is buf  # a captured call keeps the buffer's address
    assert split_decode.guesses(w[:100]) is None  # another shape: another key
    capturing[0] = False
    assert split_decode.guesses(w[:100]) is not buf
    assert split_decode.guesses(w[:, 32:]) is not buf  # another address
    assert len(fresh_guesses) == 3
    monkeypatch.setattr(split_decode, "GUESS_CAP_BYTES", split_decode._guess_bytes + 4 * 299)
    assert split_decode.guesses(torch.randn(300, 64)) is None  # over the cap
    assert split_decode.guesses(w) is buf  # held buffers still serve


def test_kn_guesses_are_kept_apart_from_the_weights_row_guesses(fresh_guesses, monkeypatch):
    """dX's column scales of W (`guesses(copy, of=W)`) and its fwd row scales
    (`guesses(W)`) are two buffers; the copy's own address does not key them."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    w = torch.randn(300, 64)
    rows = split_decode.guesses(w)
    cols = split_decode.guesses(w.t().contiguous(), of=w)
    assert rows.shape == (300,) and cols.shape == (64,) and cols is not rows
    assert split_decode.guesses(w.t().contiguous(), of=w) is cols  # another copy
    assert split_decode.guesses(w) is rows and len(fresh_guesses) == 2


def test_a_call_without_a_guess_buffer_takes_the_two_pass_rules(fresh_guesses, monkeypatch):
    monkeypatch.setattr(split_decode, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(split_decode, "_sms", lambda device: 132)
    monkeypatch.setattr(split_decode, "GUESS", True)
    split_decode.default_shape.cache_clear()
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    try:
        for m, n, k in [(1, 4096, 14336), (20, 8192, 256), (64, 4096, 256), (16, 4096, 256)]:
            w = torch.randn(n, k)
            guessing = split_decode.default_shape(m, n, k, w.device)
            two_pass = split_decode.default_shape(m, n, k, w.device, False)
            assert guessing.w_guess and not getattr(two_pass, "w_guess", False)
            capturing[0] = True
            assert split_decode.plan(m, n, k, w) == (two_pass, None)
            assert split_decode.plan(m, n, k, w, guessing) == (guessing, None)  # as given
            capturing[0] = False
            shape, buf = split_decode.plan(m, n, k, w)
            assert shape == guessing and buf is split_decode.guesses(w)
        # the two-pass rules: the cluster kernel at one row of X and K 8192..16384, the tile
        # kernel from 17 rows of X at N >= 8192
        assert isinstance(split_decode.default_shape(1, 4096, 14336, w.device, False),
                          split_decode.ClusterShape)
        assert isinstance(split_decode.default_shape(20, 8192, 256, w.device, False),
                          split_decode.TileShape)
    finally:
        split_decode.default_shape.cache_clear()
