"""Staging copies on the GPU, each one pass of a helper kernel:

- `transposed` (`kernels/transpose.py`): the TF32 kernels read B K-major (and A too, except
  sm90's, which reads an M-major A through registers), so an fp32 operand in another layout
  (mm's B [K, N], and dX's W on sm80) is copied into a K-major [N, K'] buffer.
  PyTorch's strided `copy_` of a transposed view runs at about a third of the copy
  bandwidth; the tiled kernel reads and writes whole 128-byte rows.
- `rows` (`kernels/rows.py`): 16-bit rows whose starts TMA cannot address (an odd K) copied
  into rows padded with zeros to a multiple of 8. PyTorch's copy into the padded buffer
  runs at about half the copy bandwidth.

``DETGEMM_CUTE_SPLIT_KERNEL=0`` (read at import, as for the fp32 split) falls back to
PyTorch's copies. The bits are the same either way: a copy.
"""

from __future__ import annotations

import torch

from . import split
from .kernels import tensor_needs as needs

_GRID_Y_MAX = 65535  # the transpose kernel puts 32-wide tiles of `width` on grid y


def transposed(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """[C, width] fp32 with out[c, r] = x[r, c] (zero for r >= R), from a CUDA fp32 x [R, C]
    whose columns are contiguous; None when the kernel does not apply (the caller copies)."""
    if (not split._kernels_on() or x.dtype != torch.float32 or x.device.type != "cuda"
            or not needs.TRANSPOSE_SRC.meets(x) or -(-width // 32) > _GRID_Y_MAX):
        return None
    out = torch.empty((x.shape[1], width), dtype=x.dtype, device=x.device)
    if out.numel():
        arch = split.helper_arch(x.device)
        split.compiled_once(("transpose32", arch), lambda: _compile(arch))(x, out)
    return out


def rows(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """[..., width] contiguous with out[..., c] = x[..., c] (zero for c past x's last dim),
    from a CUDA 16-bit x whose last dim has unit stride and whose leading dims fold into
    rows, `width` a multiple of 8; None when the kernel does not apply (the caller copies)."""
    if (not split._kernels_on() or x.element_size() != 2 or x.device.type != "cuda"
            or width % 8 or x.dim() < 2):
        return None
    try:
        x2 = x.view(-1, x.shape[-1])  # no copy: None below when the rows do not fold
    except RuntimeError:
        return None
    if not needs.COPY_ROWS_SRC.meets(x2):
        return None
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if out.numel():
        arch = split.helper_arch(x.device)
        split.compiled_once(("rows16", arch), lambda: _compile_rows(arch))(
            x2.view(torch.int16), out.view(-1, width).view(torch.int16))
    return out


def _compile_rows(arch: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .kernels.rows import CopyRows

    r, c, width = cute.sym_int(), cute.sym_int(), cute.sym_int()
    x = needs.fake(cutlass.Int16, (r, c), needs.COPY_ROWS_SRC)
    out = needs.fake(cutlass.Int16, (r, width), needs.COPY_ROWS_DST)
    return cute.compile(CopyRows(), x, out, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=f"--enable-tvm-ffi --gpu-arch {arch}")


def _compile(arch: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .kernels.transpose import Transpose32

    r, c, width = cute.sym_int(), cute.sym_int(), cute.sym_int()
    x = needs.fake(cutlass.Float32, (r, c), needs.TRANSPOSE_SRC)
    out = needs.fake(cutlass.Float32, (c, width), needs.TRANSPOSE_DST)
    return cute.compile(Transpose32(), x, out, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=f"--enable-tvm-ffi --gpu-arch {arch}")
