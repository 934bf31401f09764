"""Transposed copies of fp32 operands on the GPU in one tiled pass (`kernels/transpose.py`).

The TF32 kernels read both operands K-major, so a weight used as [K, N] (dX's W, mm's B) is
copied into a K-major [N, K'] buffer first. PyTorch's strided `copy_` of a transposed view
runs at about a third of the copy bandwidth; the tiled kernel reads and writes whole
128-byte rows. ``DETGEMM_CUTE_SPLIT_KERNEL=0`` (read at import, as for the fp32 split) falls
back to PyTorch's copy. The bits are the same either way: a copy.
"""

from __future__ import annotations

import torch

from . import split

_GRID_Y_MAX = 65535  # the kernel puts 32-wide tiles of `width` on grid y


def transposed(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """[C, width] fp32 with out[c, r] = x[r, c] (zero for r >= R), from a CUDA fp32 x [R, C]
    whose columns are contiguous; None when the kernel does not apply (the caller copies)."""
    if (not split._kernels_on() or x.dtype != torch.float32 or x.device.type != "cuda"
            or x.dim() != 2 or x.stride(1) != 1 or -(-width // 32) > _GRID_Y_MAX):
        return None
    out = torch.empty((x.shape[1], width), dtype=x.dtype, device=x.device)
    if out.numel():
        arch = split.helper_arch(x.device)
        split.compiled_once(("transpose32", arch), lambda: _compile(arch))(x, out)
    return out


def _compile(arch: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .kernels.transpose import Transpose32

    r, c, width = cute.sym_int(), cute.sym_int(), cute.sym_int()
    x = make_fake_tensor(cutlass.Float32, (r, c), stride=(cute.sym_int64(), 1), assumed_align=4)
    out = make_fake_tensor(cutlass.Float32, (c, width), stride=(cute.sym_int64(), 1),
                           assumed_align=4)
    return cute.compile(Transpose32(), x, out, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=f"--enable-tvm-ffi --gpu-arch {arch}")
