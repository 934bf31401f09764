"""fp32 "ieee" GEMMs with few rows: W split inside the GEMM (`kernels.split_gemv`).

At small M the split path (`split.scaled_operand_cuda` on W, then the chunked GEMM) spends
most of its time writing W's three fp16 parts and reading them back: 160 MB of traffic for a
64 MB fp32 W. `SplitGemvFp32` reads W as fp32 and splits it in registers, with the split
path's bits. Each CTA reads its block of W twice (the row maxima that set the scales, then
the chunks); at K = 4096 the second read is served by L2 (ncu on an H100: 67 MB of DRAM reads
for a 64 MB W), at K = 14336 mostly not (445 MB for 235 MB).

Which calls take it (`applies`): fwd/dX of the full-precision tier, no accumulation buffer,
1 <= M <= 32, K a positive multiple of 32, the weight K-contiguous with 16-byte-aligned rows
and base (`tensor_needs.SPLIT_ROWS`), a GPU from sm_80 up. ``DETGEMM_CUTE_FP32_DECODE=0``
(read at import) turns it off.

The launch shape is plain arithmetic (`launch_shape`): rows of W per CTA, chunks per warp
and round, and a persistent grid of two CTAs per SM at most.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from . import split
from .kernels import tensor_needs as needs

MAX_M = 32  # above, X's parts read per block of W cost more than W's split saves
ENV = "DETGEMM_CUTE_FP32_DECODE"
_ON = os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false")
CTAS_PER_SM = 2
_WARPS = 8  # kernels.split_gemv.WARPS (that module imports the DSL)
_SMEM_BYTES = 110 * 1024  # per CTA: two CTAs share an SM's 228 KiB
SMEM_LIMIT = 227 * 1024  # one CTA's most (sm_90; sm_80 has 163 KiB: `launch_shape` stays below)


W_NEED = needs.SPLIT_ROWS  # fp32 rows, 16-byte loads
OUT_NEED = needs.Need(needs.ELEMENT, (needs.ANY, needs.UNIT))
BIAS_NEED = needs.Need(needs.ELEMENT, (needs.UNIT,))


@contextlib.contextmanager
def fused(on: bool):
    """Turn the fused path on or off inside the block (process-wide; tests and benchmarks
    compare it with the split path)."""
    global _ON
    prev, _ON = _ON, bool(on)
    try:
        yield
    finally:
        _ON = prev


def covers(op: str, m: int, k: int) -> bool:
    """Whether a problem's shape is one the fused path serves (fwd or dX, 1 <= M <= MAX_M,
    K a positive multiple of 32): `applies` adds the operands' layout and the GPU."""
    return op != "dw" and 0 < m <= MAX_M and k > 0 and k % split.BLOCK_K == 0


def applies(a: torch.Tensor, b_nk: torch.Tensor, acc, op: str) -> bool:
    """Whether this fp32 "ieee" call runs on the fused kernel (see the module docstring)."""
    m, k = a.shape
    return (_ON and acc is None and covers(op, m, k) and W_NEED.meets(b_nk)
            and _capability(a.device) >= (8, 0))


def explain_note(op: str, dtype: str, m: int, k: int) -> str | None:
    """The line `detgemm-cute explain` adds where the fused path, not the bucket, serves an
    fp32 problem (None elsewhere)."""
    if dtype != "fp32" or not covers(op, m, k):
        return None
    return ('  fused:   at precision "ieee" with a K-contiguous weight (16-byte-aligned rows) '
            "this call runs split_decode's kernel (W split inside the GEMM, "
            "kernels/split_gemv.py; the same bits), not the bucket above; precision "
            f'"tf32", force_bucket or {ENV}=0 run the bucket')


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def m_rows_for(m: int) -> int:
    """The rows of X a kernel is built for (1 <= m <= MAX_M): the next power of two."""
    return 1 << max(m - 1, 0).bit_length()


def smem_bytes(m_rows: int, rows: int, group: int, stages: int) -> int:
    """Shared memory of one CTA (`SplitGemvFp32`): the stages of W rows and X's parts, the
    chunk exchange, the row scales."""
    slots = _WARPS * group
    w = stages * rows * (slots * 32 + 16) * 4
    a = stages * m_rows * (slots * 96 + 16) * 2
    return w + a + 2 * slots * m_rows * rows * 4 + 2 * max(8, rows) * 4 + 4 * 128


@functools.lru_cache(maxsize=4096)
def launch_shape(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int]:
    """(m_rows, rows, group, stages, ctas): X's rows (`m_rows_for`); 8 rows of W per block
    (one n8 block: measured faster than 2, 4 or 16 rows at every K, although fewer rows
    would keep more of the blocks that CTAs read twice in L2); chunks per warp and round;
    as many cp.async stages (2..4) as two CTAs per SM leave room for; a persistent grid of
    `CTAS_PER_SM` CTAs per SM when they fit (`bench/bench_fp32_decode.py --sweep` measured
    the choices)."""
    m_rows = m_rows_for(m)
    group, stages = 2, 4
    while stages > 2 and smem_bytes(m_rows, 8, group, stages) > _SMEM_BYTES:
        stages -= 1
    while group > 1 and smem_bytes(m_rows, 8, group, stages) > _SMEM_BYTES:
        group //= 2
    per_sm = CTAS_PER_SM if smem_bytes(m_rows, 8, group, stages) <= _SMEM_BYTES else 1
    rows = 8
    blocks = -(-n // rows)
    return m_rows, rows, group, stages, min(blocks, per_sm * sms)


def decode_gemm(a: torch.Tensor, b_nk: torch.Tensor, bias: torch.Tensor | None,
                shape: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """fp32 [M, N] = the split path's unscaled result of a [M, K] @ b_nk [N, K]^T, plus
    bias in fp32 (not yet rounded to another output dtype). `shape` overrides
    `launch_shape` (benchmarks)."""
    m, k = a.shape
    n = b_nk.shape[0]
    a2, sa = split.scaled_operand_cuda(a, "a")
    chunks = k // split.BLOCK_K
    y = torch.empty((m, n), dtype=torch.float32, device=a.device)
    if n == 0:
        return y
    m_rows, rows, group, stages, ctas = shape or launch_shape(m, n, k, _sms(a.device))
    if bias is not None:
        bias = needs.conform(bias.to(torch.float32), BIAS_NEED)
    ld = b_nk.stride(0) if n > 1 else k
    w = b_nk.as_strided((n, chunks, 2, 4, 4), (ld, 32, 16, 4, 1))
    w_bits = b_nk.view(torch.int32).as_strided((n, chunks * 8, 4), (ld, 4, 1))
    parts = a2.view(m, chunks, 3, 2, 4, 4)
    fn = _kernel(m_rows, rows, group, stages, bias is not None, a.device)
    fn(w, w_bits, parts, sa, y, bias, ctas)  # on the current device (`gemm.launch_on`)
    return y


def _kernel(m_rows, rows, group, stages, has_bias, device):
    arch = split.helper_arch(device)
    key = ("gemv", m_rows, rows, group, stages, has_bias, arch)
    return split.compiled_once(key, lambda: compile_kernel(m_rows, rows, group, stages,
                                                           has_bias, arch))


def compile_kernel(m_rows: int, rows: int, group: int, stages: int, has_bias: bool,
                   arch: str, extra_options: str = ""):
    """The compiled `SplitGemvFp32` for one launch shape (no GPU needed: fake tensors).
    `extra_options` passes DSL flags through (``--keep-ptx --dump-dir=D`` for audits)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .kernels.split_gemv import SplitGemvFp32

    n, m, chunks, quads = (cute.sym_int() for _ in range(4))
    w = needs.fake(cutlass.Float32, (n, chunks, 2, 4, 4), W_NEED,
                   strides=(W_NEED.strides[0], 32, 16, 4, needs.UNIT))
    w_bits = needs.fake(cutlass.Int32, (n, quads, 4), W_NEED,
                        strides=(W_NEED.strides[0], 4, needs.UNIT))
    parts = needs.fake(cutlass.Float16, (m, chunks, 3, 2, 4, 4), needs.SPLIT_PARTS,
                       strides=(needs.SPLIT_PARTS.strides[0], 96, 32, 16, 4, needs.UNIT))
    scales = needs.fake(cutlass.Float32, (m,), needs.SPLIT_SCALES)
    y = needs.fake(cutlass.Float32, (m, n), OUT_NEED)
    bias = needs.fake(cutlass.Float32, (n,), BIAS_NEED) if has_bias else None
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(SplitGemvFp32(m_rows, rows, group, stages, has_bias), w, w_bits, parts,
                        scales, y, bias, cutlass.Int32(1), stream,
                        options=f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip())


__all__ = ["fused", "covers", "applies", "explain_note", "decode_gemm", "launch_shape",
           "m_rows_for", "smem_bytes", "compile_kernel", "MAX_M", "ENV"]
