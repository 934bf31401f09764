"""fp32 operands as 16-bit parts: the arithmetic of the fp32 tier (GPU and reference).

Two schemes: scaled fp16 parts (fwd and dX, below) and exact bf16 parts (dW, further down).

Each row r of an fp32 operand (a row of X, of W, of dY^T, ...: always a row along K) gets a
power-of-two scale s_r that brings its largest finite magnitude into [2^13, 2^14); every
scaled value x = s_r * v (exact) is split into two fp16 values, hi = fp16(x) (round to
nearest even) and lo = fp16(x - hi) (x - hi is exact in fp32). hi + lo carries 22 of v's 24
significant bits (the last two are rounded away in lo); values 2^-27 below the row's largest
lose more as hi and lo become fp16 subnormals.

A product then takes the three part products whose size is at least 2^-12 of hi*hi: lo*hi,
hi*lo, hi*hi (lo*lo, below 2^-22 of it, is left out). For every 32-wide block of K (two
16-wide blocks j0, j1) the operand written here holds six 16-wide steps, smallest products
first, so one K-major fp16 GEMM over 3x the K (rounded up to a multiple of 32) computes
them:

    A row, per block: [-lo j0, -lo j1, -hi j0, -hi j1, hi j0, hi j1]
    B row, per block: [-hi j0, -hi j1, -lo j0, -lo j1, hi j0, hi j1]

The kernel sums each block's six steps from +0.0 (a "chunk": the WGMMA chain of `reference`,
docs/reference.md, over 96 values) and adds the chunk to an fp32 accumulator with one IEEE add. Then the
result is unscaled, ``(acc * (1 / s_a)[:, None]) * (1 / s_b)[None, :]`` -- exact unless the
value lands below fp32's normal range -- the bias is added in fp32 and the sum rounded once
to the output dtype. dW += continues from ``(acc * s_a) * s_b``. Scaling by powers of two
commutes with every rounding of the chain in fp32's normal range, so a row's result does
not depend on the other rows of its batch, and micro-batched dW equals one call.

Non-finite inputs: hi carries the Inf or NaN and lo is NaN, so every output an Inf or NaN
input touches is NaN (IEEE would give Inf for an Inf that is not cancelled).

With few rows (fwd/dX, M <= 64) `split_decode` computes the same bits without writing W's
parts: its kernel splits W in registers and runs the same chunks and adds.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .env import env_flag
from .kernels import tensor_needs as needs

BLOCK_K = 32  # original K per chunk
STEPS = 6  # 16-wide steps per chunk
CHUNK_K = 96  # split-operand K per chunk = the kernel's k tile
PART_DTYPE = torch.float16
TOP_EXP = 13  # a row's largest scaled magnitude lies in [2^13, 2^14)


# ---------------------------------------------------------------------------------------
# Which precision an fp32 GEMM runs at.
#
# "ieee" (full precision): the schemes above and below. "tf32": no split at all: the kernel
# reads the fp32 operands through TMA as TF32, which rounds each value to TF32 (10 fraction
# bits, round to nearest, ties to even -- `tf32_round`), and TF32 WGMMA (k8 steps) runs the
# chain of `reference` (docs/reference.md) in 8-wide K blocks. dW stays "ieee" (its exact scheme keeps
# micro-batches one chain).

PRECISIONS = ("ieee", "tf32")
_local = threading.local()


@contextlib.contextmanager
def fp32_precision(precision: str):
    """Run the fp32 GEMMs of this thread at `precision` ("ieee" or "tf32"), whatever
    ``torch.backends.cuda.matmul`` says. The choice is read when each op runs; in eager
    autograd, detgemm's ops (linear, mm, addmm, bmm, nn.Linear) run their backward at the
    precision their forward ran at, also outside the block and on autograd's device thread.
    A backward compiled by torch.compile, and autograd's own matmul backward in the mode,
    read the precision when they run."""
    checked_precision(precision, "fp32_precision", none_ok=False)
    prev = getattr(_local, "precision", None)
    _local.precision = precision
    try:
        yield
    finally:
        _local.precision = prev


def checked_precision(precision, op: str, none_ok: bool = True):
    """`precision` when it is "ieee", "tf32" (or None, with `none_ok`), else a TypeError (not
    a string) or ValueError naming the argument and `op`."""
    if (precision is None and none_ok) or (isinstance(precision, str)
                                            and precision in PRECISIONS):
        return precision
    allowed = f"one of {PRECISIONS}" + (" or None" if none_ok else "")
    if not isinstance(precision, str):
        raise TypeError(f"{op}: precision must be {allowed}, got {type(precision).__name__} "
                        f"{precision!r}")
    raise ValueError(f"{op}: precision must be {allowed}, got {precision!r}")


_warned_autocast = False


def call_precision(precision: str, t, op: str):
    """The context of a call's ``precision=`` argument. It chooses among fp32 chains, so it
    applies to fp32 inputs only: 16-bit inputs (one chain, nothing to choose) raise
    ValueError; fp32 inputs inside an autocast region run as the autocast dtype, where it has
    no effect (a warning says so once per process). Non-tensors pass: the op's own checks
    name them."""
    global _warned_autocast
    checked_precision(precision, op)
    dtype = getattr(t, "dtype", None)
    if dtype in (torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: precision={precision!r} chooses how fp32 inputs are computed; "
                         f"these inputs are {dtype}, which have one chain: leave precision "
                         f"unset")
    if (dtype == torch.float32 and not _warned_autocast
            and torch.is_autocast_enabled(t.device.type)):
        _warned_autocast = True
        import warnings

        warnings.warn(f"{op}: precision={precision!r} has no effect inside torch.autocast, "
                      f"which computes this fp32 call in "
                      f"{torch.get_autocast_dtype(t.device.type)} (shown once)", stacklevel=3)
    return fp32_precision(precision)


def forward_precision(dtype: torch.dtype) -> str | None:
    """What an autograd op saves at forward time for its backward: this thread's precision
    for fp32 inputs, else None. (A backward may run on another thread -- autograd's device
    threads -- where a `fp32_precision` block of the forward's is not in force.)"""
    return precision() if dtype == torch.float32 else None


def at_precision(saved: str | None):
    """The context a backward runs its GEMMs in: the forward's precision (`saved`), or no
    change (16-bit inputs)."""
    return fp32_precision(saved) if saved else contextlib.nullcontext()


def precision() -> str:
    """This thread's fp32 precision: `fp32_precision`'s, else PyTorch's own choice
    (``torch.backends.cuda.matmul.fp32_precision == "tf32"``, or ``allow_tf32``)."""
    p = getattr(_local, "precision", None)
    if p is not None:
        return p
    matmul = torch.backends.cuda.matmul
    try:
        return "tf32" if matmul.fp32_precision == "tf32" else "ieee"
    except (AttributeError, RuntimeError):
        return "tf32" if matmul.allow_tf32 else "ieee"


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32 (the top 19 bits: sign, 8 exponent bits, 10 fraction
    bits), round to nearest, ties to even, as TMA's TF32 tensor maps do on the H100; fp32
    again. A value whose rounding passes the largest finite TF32 becomes Inf; Inf and NaN stay
    as they are; subnormals round like any other value (no flush)."""
    bits = x.contiguous().view(torch.int32)
    odd = torch.bitwise_and(torch.bitwise_right_shift(bits, _TF32_DROP), 1)
    up = torch.bitwise_and(bits + (_TF32_HALF - 1) + odd, _TF32_MASK)
    finite = torch.bitwise_and(bits, _EXP_MASK) != _EXP_MASK
    return torch.where(finite, up, bits).view(torch.float32)


_TF32_DROP = 13  # fraction bits TF32 drops
_TF32_HALF = 1 << (_TF32_DROP - 1)
_TF32_MASK = -(1 << _TF32_DROP)
_EXP_MASK = 0x7F800000


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: the power of two 2^(13 - floor(log2 max|row|)) per row, clamped to
    [2^-126, 2^127] (a row of zeros or subnormals gets 2^127; a row holding an Inf or NaN
    some scale: its outputs are NaN anyway). Built from exponent bits: exact everywhere."""
    if x.shape[-1] == 0:
        return torch.ones(x.shape[:-1], dtype=torch.float32, device=x.device)
    top = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1)  # max |x|, one pass
    scale_exp = (TOP_EXP + 254 - (top.view(torch.int32) >> 23)).clamp_(1, 254)
    return (scale_exp << 23).view(torch.float32)


def split_k(k: int) -> int:
    """K of the split operand for an original K."""
    return -(-k // BLOCK_K) * CHUNK_K


def operand(x: torch.Tensor, scale: torch.Tensor, side: str) -> torch.Tensor:
    """x fp32 [rows, K] (any strides), scale fp32 [rows] -> fp16 [rows, split_k(K)],
    contiguous, K-major: the parts of (x * scale) in `side`'s ("a" or "b") step order; the K
    tail is zero-padded to a whole 32-wide block.

    Signs: the two smaller products are written as (-lo)(-hi) and (-hi)(-lo) -- the same
    exact products -- because -lo = fp16(hi - x * s) is one fused kernel (x * s is exact)."""
    rows, k = x.shape
    blocks = -(-k // BLOCK_K)
    if blocks * BLOCK_K != k:
        x = torch.nn.functional.pad(x, (0, blocks * BLOCK_K - k))
    xv = x.reshape(rows, blocks, 1, BLOCK_K)
    sv = scale.view(rows, 1, 1, 1)
    out = torch.empty((rows, blocks, 3, BLOCK_K), dtype=PART_DTYPE, device=x.device)
    hi, neg_hi, neg_lo = out[:, :, 2:3], out[:, :, _NEG_HI[side]:_NEG_HI[side] + 1], \
        out[:, :, _NEG_LO[side]:_NEG_LO[side] + 1]
    torch.mul(xv, sv, out=hi)  # fp16(x * s): x * s is exact, one rounding
    torch.neg(hi, out=neg_hi)
    torch.addcmul(hi, xv, sv, value=-1, out=neg_lo)  # fp16(hi - x * s) = -lo
    return out.view(rows, blocks * CHUNK_K)


# Per chunk the three 32-wide groups are: A [-lo, -hi, hi], B [-hi, -lo, hi]
# (steps lo*hi j0, j1; hi*lo j0, j1; hi*hi j0, j1).
_NEG_LO = {"a": 0, "b": 1}
_NEG_HI = {"a": 1, "b": 0}


KERNEL_ENV = "DETGEMM_CUTE_SPLIT_KERNEL"
_kernels: dict = {}
_kernel_lock = threading.Lock()


def scaled_operand_cuda(x: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(`operand(x, row_scales(x), side)`, `row_scales(x)`) on a CUDA tensor in one kernel
    (`kernels.split_parts.SplitFp16Parts`: the row maxima and the split share the read of x;
    the same bits). ``DETGEMM_CUTE_SPLIT_KERNEL=0`` (read at import): the PyTorch version.
    A K that is not a multiple of 32, a K that is not the unit-stride dim, or a base or row
    stride that is not 16-byte aligned, is copied first (`_blocked`)."""
    if not _kernels_on():
        scale = row_scales(x)
        return operand(x, scale, side), scale
    x, rows, blocks = _blocked(x, BLOCK_K)
    out = torch.empty((rows, blocks * CHUNK_K), dtype=PART_DTYPE, device=x.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows:
        x4 = x.as_strided((rows, blocks, BLOCK_K // 4, 4),
                          (x.stride(0) if rows > 1 else blocks * BLOCK_K, BLOCK_K, 4, 1))
        _kernel("scaled", side, x.device)(x4, scale,
                                          out.view(rows, blocks, 3, BLOCK_K // 4, 4))
    return out, scale


def columns_apply(w: torch.Tensor) -> bool:
    """Whether `scaled_columns_cuda` takes W [R, C] (the B of dX = dY @ W, or of mm's [K, N]
    weight) in place: the split kernels on, R >= 1, C a positive multiple of 8 (16-byte rows
    of fp16 parts for TMA), W's rows 16-byte loads (`tensor_needs.SPLIT_ROWS`). (The caller
    also asks for the sm90 kernels, which read the parts N-major.)"""
    return (_kernels_on() and w.dim() == 2 and w.shape[0] > 0 and w.shape[1] > 0
            and w.shape[1] % 8 == 0 and needs.SPLIT_ROWS.meets(w))


def scaled_columns_cuda(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(parts [96 ceil(R / 32), C] fp16, scales [C] fp32) of W [R, C] whose reduction runs
    down its columns: the bits of ``operand(w.t(), row_scales(w.t()), "b")`` laid out as its
    transpose, with no transposed copy of W (`kernels.split_columns`; `columns_apply` says
    where it runs)."""
    rows, cols = w.shape
    blocks = -(-rows // BLOCK_K)
    top = torch.zeros((cols,), dtype=torch.int32, device=w.device)
    out = torch.empty((blocks * CHUNK_K, cols), dtype=PART_DTYPE, device=w.device)
    scale = torch.empty((cols,), dtype=torch.float32, device=w.device)
    w3 = w.as_strided((rows, cols // 4, 4), (w.stride(0), 4, 1))
    top2, scale2 = top.view(cols // 4, 4), scale.view(cols // 4, 4)
    _kernel("columns", "max", w.device)(w3, top2)
    _kernel("columns", "b", w.device)(w3, top2, out.view(blocks, 3, BLOCK_K, cols // 4, 4),
                                      scale2)
    return out, scale


# Per-column values read a quad (16 bytes) at a time: [C/4, 4] as the kernels see them (the
# column split's maxima and scales, the unscale kernel's s_b and bias), [C] as staged.
_QUADS = needs.Need(needs.VEC_BYTES, (4, needs.UNIT))
_QUAD_ROWS = needs.Need(needs.VEC_BYTES, (needs.UNIT,))


# Read once at import: the split runs on every fp32 GEMM.
_KERNELS_ON = env_flag(KERNEL_ENV, True)


def _kernels_on() -> bool:
    return _KERNELS_ON


def _blocked(x, block):
    """x with K padded to whole blocks and laid out as the split kernels read it
    (`tensor_needs.SPLIT_ROWS`: K the unit-stride dim, 16-byte rows and base), its rows and
    blocks. A copy only where x is not already so (a misaligned base included: an odd
    storage offset or a slice of a wider buffer, which ``contiguous()`` would keep)."""
    rows, k = x.shape
    blocks = -(-k // block)
    if blocks * block != k:
        x = torch.nn.functional.pad(x, (0, blocks * block - k))
    return needs.conform(x, needs.SPLIT_ROWS), rows, blocks


def compiled_once(name, build):
    """`build()` (a compiled helper kernel) once per `name` per process, thread-safe."""
    fn = _kernels.get(name)
    if fn is None:
        with _kernel_lock:
            fn = _kernels.get(name)
            if fn is None:
                fn = _kernels[name] = build()
    return fn


_helper_archs: dict = {}


def helper_arch(device: torch.device) -> str:
    """The ``--gpu-arch`` the helper kernels (split parts, transposes: CUDA cores only) are
    built for on `device`: the GPU's own, e.g. sm_90 on an H100, sm_80 on an A100."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    arch = _helper_archs.get(idx)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(idx)
        arch = _helper_archs[idx] = f"sm_{major}{minor}"
    return arch


def _kernel(scheme: str, side: str, device: torch.device):
    arch = helper_arch(device)
    fn = _kernels.get((scheme, side, arch))
    return fn if fn is not None else compiled_once(
        (scheme, side, arch), lambda: _compile_kernel(scheme, side, arch))


def _compile_kernel(scheme: str, side: str, arch: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .kernels.split_parts import SplitBf16Exact, SplitFp16Parts

    if scheme == "columns":
        return _compile_columns(side, arch)
    if scheme == "unscale":
        return _compile_unscale(*side, arch)
    block = EXACT_BLOCK_K if scheme == "exact" else BLOCK_K
    rows, blocks = cute.sym_int(), cute.sym_int()
    # X [rows, blocks, block/4, 4] and the parts [rows, blocks, groups, block/4, 4]: views
    # of the [rows, K] needs whose row stride they keep.
    x = needs.fake(cutlass.Float32, (rows, blocks, block // 4, 4), needs.SPLIT_ROWS,
                   strides=(needs.SPLIT_ROWS.strides[0], block, 4, needs.UNIT))
    groups = STEPS if scheme == "exact" else 3
    o_type = cutlass.BFloat16 if scheme == "exact" else cutlass.Float16
    o = needs.fake(o_type, (rows, blocks, groups, block // 4, 4), needs.SPLIT_PARTS,
                   strides=(needs.SPLIT_PARTS.strides[0], CHUNK_K, block, 4, needs.UNIT))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if scheme == "exact":
        return cute.compile(SplitBf16Exact(side), x, o, stream, options=options)
    s = needs.fake(cutlass.Float32, (rows,), needs.SPLIT_SCALES)
    return cute.compile(SplitFp16Parts(side), x, s, o, stream, options=options)


def _compile_columns(step: str, arch: str):
    """`kernels.split_columns`' maxima (`step` "max") or split ("b") kernel: W [R, C/4, 4]
    (16-byte rows), top and scales [C/4, 4], parts [R'/96, 3, 32, C/4, 4] contiguous."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .kernels.split_columns import ColumnMaxima, SplitFp16Columns

    rows, quads, blocks = cute.sym_int(), cute.sym_int(), cute.sym_int()
    w = needs.fake(cutlass.Float32, (rows, quads, 4), needs.SPLIT_ROWS,
                   strides=(needs.BYTES16, 4, needs.UNIT))
    top = needs.fake(cutlass.Int32, (quads, 4), _QUADS)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if step == "max":
        return cute.compile(ColumnMaxima(), w, top, stream, options=options)
    o = needs.fake(cutlass.Float16, (blocks, 3, BLOCK_K, quads, 4), needs.SPLIT_PARTS,
                   strides=(needs.BYTES16, needs.BYTES16, needs.BYTES16, 4, needs.UNIT))
    s = needs.fake(cutlass.Float32, (quads, 4), _QUADS)
    return cute.compile(SplitFp16Columns(), w, top, o, s, stream, options=options)


def _compile_unscale(out_type: str, has_bias: bool, arch: str):
    """`kernels.unscale.UnscaleFp32`: C [M, N/4, 4] fp32 (16-byte rows), s_a [M], s_b and
    bias [N/4, 4] fp32, out [M, N/4, 4] (`out_type`, contiguous) for `finish`."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .kernels.unscale import UnscaleFp32

    m, quads = cute.sym_int(), cute.sym_int()
    out_t = getattr(cutlass, out_type)
    c = needs.fake(cutlass.Float32, (m, quads, 4), needs.SPLIT_ROWS,
                   strides=(needs.SPLIT_ROWS.strides[0], 4, needs.UNIT))
    sb = needs.fake(cutlass.Float32, (quads, 4), _QUADS)
    bias = needs.fake(cutlass.Float32, (quads, 4), _QUADS) if has_bias else None
    rows = needs.BYTES16 if out_type == "Float32" else needs.BYTES8  # N is a multiple of 4
    o = needs.fake(out_t, (m, quads, 4), needs.Need(needs.VEC_BYTES, (rows, 4, needs.UNIT)))
    sa = needs.fake(cutlass.Float32, (m,), needs.SPLIT_SCALES)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(UnscaleFp32(out_t, has_bias), c, sa, sb, bias, o, stream,
                        options=f"--enable-tvm-ffi --gpu-arch {arch}")


def parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) fp16 of already-scaled fp32 values (|x| < 2^14): hi + lo ~ x."""
    hi = x.to(PART_DTYPE)
    return hi, (x - hi.to(torch.float32)).to(PART_DTYPE)


# ---------------------------------------------------------------------------------------
# dW's scheme: exact bf16 parts, no scales.
#
# dW += dY^T X reduces over tokens, so per-row scales would depend on which tokens a call
# received, and micro-batches would not continue one chain. dW therefore splits each fp32
# value without scaling into three bf16 values (bf16 has fp32's exponent range):
# hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid), hi + mid + lo = x exactly (down
# to bf16's smallest subnormal, 2^-133). A product takes the six part products within 2^-16
# of hi*hi; per 16-wide block of K (a chunk of 96, the same k tile), smallest first:
#     A row: [lo, hi, mid, mid, hi, hi]      B row: [hi, lo, mid, hi, mid, hi]
# Twice the tensor-core work of the fp16 scheme; a micro-batch whose token count is a
# multiple of 16 continues the chain exactly, as in the bf16 tier.

EXACT_BLOCK_K = 16
_EXACT_PARTS = {"a": (2, 0, 1, 1, 0, 0), "b": (0, 2, 1, 0, 1, 0)}


def exact_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, mid, lo) bf16 with hi + mid + lo == x (finite x below bf16's largest value,
    3.39e38; above it, and for Inf/NaN, the lower parts are Inf/NaN: those outputs are NaN)."""
    hi = x.to(torch.bfloat16)
    rest = x - hi.to(torch.float32)
    mid = rest.to(torch.bfloat16)
    return hi, mid, (rest - mid.to(torch.float32)).to(torch.bfloat16)


def exact_operand_cuda(x: torch.Tensor, side: str) -> torch.Tensor:
    """`exact_operand` on a CUDA tensor in one pass (`kernels.split_parts`, the same bits);
    ``DETGEMM_CUTE_SPLIT_KERNEL=0`` runs the PyTorch version instead."""
    if not _kernels_on():
        return exact_operand(x, side)
    x, rows, blocks = _blocked(x, EXACT_BLOCK_K)
    out = torch.empty((rows, blocks * CHUNK_K), dtype=torch.bfloat16, device=x.device)
    if rows:
        x4 = x.as_strided((rows, blocks, EXACT_BLOCK_K // 4, 4),
                          (x.stride(0) if rows > 1 else blocks * EXACT_BLOCK_K,
                           EXACT_BLOCK_K, 4, 1))
        _kernel("exact", side, x.device)(x4, out.view(rows, blocks, STEPS,
                                                       EXACT_BLOCK_K // 4, 4))
    return out


def exact_operand(x: torch.Tensor, side: str) -> torch.Tensor:
    """x fp32 [rows, K] (any strides) -> bf16 [rows, 6 * ceil(K / 16) * 16], contiguous,
    K-major, dW's six steps per 16-wide block of K in `side`'s order."""
    rows, k = x.shape
    blocks = -(-k // EXACT_BLOCK_K)
    if blocks * EXACT_BLOCK_K != k:
        x = torch.nn.functional.pad(x, (0, blocks * EXACT_BLOCK_K - k))
    src = [p.reshape(rows, blocks, 1, EXACT_BLOCK_K) for p in exact_parts(x)]
    out = torch.empty((rows, blocks, STEPS, EXACT_BLOCK_K), dtype=torch.bfloat16,
                      device=x.device)
    for step, p in enumerate(_EXACT_PARTS[side]):
        out[:, :, step:step + 1].copy_(src[p])
    return out.view(rows, blocks * CHUNK_K)


def scale_acc(acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """An fp32 [M, N] accumulator into the scaled domain (dW +=): (acc * s_a) * s_b."""
    return (acc * sa.unsqueeze(1)) * sb.unsqueeze(0)


def unscale(acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """The scaled fp32 accumulator back: (acc * (1 / s_a)) * (1 / s_b), reciprocals exact."""
    return (acc * sa.reciprocal().unsqueeze(1)) * sb.reciprocal().unsqueeze(0)


_UNSCALE_OUT = {torch.float32: "Float32", torch.bfloat16: "BFloat16", torch.float16: "Float16"}
_UNSCALE_MAX_QUADS = 2 ** 31 - 1 - 256  # kernels/unscale.py: 256 threads a block, int32 index


def finish(acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias, out_dtype):
    """The output of the scaled fp32 accumulator [M, N]: `unscale`, plus bias (fp32), rounded
    once to `out_dtype` (None: fp32): one kernel where `unscale_applies` (`unscale_cuda`),
    else (and with ``DETGEMM_CUTE_SPLIT_KERNEL=0``) the PyTorch ops, with the same bits."""
    out_dtype = out_dtype or torch.float32
    if acc.is_cuda and unscale_applies(acc, out_dtype):
        return unscale_cuda(acc, sa, sb, bias, out_dtype)
    return biased_rounded(unscale(acc, sa, sb), bias, out_dtype)


def biased_rounded(y: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    """fp32 y plus bias (added in fp32), rounded once to `out_dtype` (None: fp32)."""
    if bias is not None:
        y = y + bias
    return y if out_dtype is None or out_dtype == torch.float32 else y.to(out_dtype)


def unscale_applies(acc: torch.Tensor, out_dtype) -> bool:
    """Whether `unscale_cuda` takes this accumulator: the split kernels on, N a multiple of
    4 and rows of 16-byte loads (`tensor_needs.SPLIT_ROWS`), an fp32/bf16/fp16 output, and
    quads of outputs that the kernel's int32 thread index (up to a block past the last
    quad) counts."""
    m, n = acc.shape
    return (_kernels_on() and acc.dtype == torch.float32 and n % 4 == 0
            and m * (n // 4) <= _UNSCALE_MAX_QUADS and out_dtype in _UNSCALE_OUT
            and needs.SPLIT_ROWS.meets(acc))


def unscale_cuda(acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias, out_dtype):
    """`finish` in one kernel (`kernels.unscale.UnscaleFp32`), where `unscale_applies`."""
    m, n = acc.shape
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    if out.numel():
        b4 = None
        if bias is not None:
            b4 = needs.conform(bias.to(torch.float32), _QUAD_ROWS).view(n // 4, 4)
        fn = _kernel("unscale", (_UNSCALE_OUT[out_dtype], bias is not None), acc.device)
        c4 = acc.as_strided((m, n // 4, 4), (acc.stride(0) if m > 1 else n, 4, 1))
        fn(c4, sa, sb.view(n // 4, 4), b4, out.view(m, n // 4, 4))
    return out


__all__ = ["PRECISIONS", "fp32_precision", "checked_precision", "precision",
           "forward_precision", "at_precision",
           "tf32_round", "row_scales", "parts", "operand", "scaled_operand_cuda",
           "exact_parts", "exact_operand", "exact_operand_cuda", "split_k", "scale_acc",
           "unscale", "finish", "biased_rounded", "unscale_applies", "unscale_cuda",
           "BLOCK_K", "EXACT_BLOCK_K", "STEPS", "CHUNK_K", "PART_DTYPE"]
