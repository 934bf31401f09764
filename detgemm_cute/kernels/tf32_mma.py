"""The warpgroup TF32 MMA (``wgmma.mma_async...f32.tf32.tf32``), which the DSL's
`warpgroup` module does not offer as an Op: the same atom type as its F16/BF16 op, with
TF32 operands and an 8-wide K step."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
import cutlass.cute as cute
from cutlass.cute.atom import make_atom
from cutlass.cute.core import _pack_shape
from cutlass.cute.nvgpu.warpgroup.mma import MmaOp, MmaTraits

MMA_K = 8


@dataclass(frozen=True)
class MmaTF32Op(MmaOp):
    """TF32 x TF32 -> fp32 warpgroup MMA (m64nNk8). Operands in shared memory must be
    K-major."""

    descriptive_name = "warpgroup TF32 MMA Operation"

    def __init__(self, tiler_mn, a_src, a_major_mode, b_major_mode) -> None:
        super().__init__(cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32,
                         (*tiler_mn, MMA_K), a_src, a_major_mode, b_major_mode)

    def _make_trait(self, *, loc=None, ip=None, **kwargs):
        shape_mnk = _pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute, self.a_major_mode._to_ir(), self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type,
            self.a_src._to_ir())
        return MmaTF32Trait(make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)],
                                      loc=loc, ip=ip))


class MmaTF32Trait(MmaTraits):
    pass


def make_tf32_tiled_mma(atom_layout_mnk, tiler_mn, a_regs: bool = False) -> cute.TiledMma:
    """A tiled TF32 MMA over K-major B in shared memory and A K-major in shared memory, or
    (`a_regs`) in registers, where its layout in shared memory does not matter."""
    k_major = cute.nvgpu.OperandMajorMode.K
    src = cute.nvgpu.warpgroup.OperandSource
    op = MmaTF32Op(tiler_mn, src.RMEM if a_regs else src.SMEM, k_major, k_major)
    return cute.make_tiled_mma(cute.make_mma_atom(op), atom_layout_mnk)
