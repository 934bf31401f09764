"""Register pins for WGMMA accumulators (SM90 kernels).

A WGMMA reads and writes its accumulator registers asynchronously: between
`warpgroup.fence()` and the wait that retires it, no other instruction may touch them. If
the compiler moves a write of an accumulator register (a zero a chain starts from, a value
loaded from C, an add) past the fence, ptxas protects it by draining the WGMMA pipe itself:
it injects a `warpgroup.wait` (info C7517) or issues every WGMMA alone (warnings C751x).
Writing through a volatile asm fixes the write's place in program order:

- `pinned_zero()`: +0.0 written by a `mov` of its own (not a copy of another register, which
  the compiler may sink past the fence);
- `fence_operands(frag)`: an empty asm that reads and writes each register of `frag`
  (CUTLASS's `warpgroup_fence_operand`), so the values it holds are complete there;
- `zero_pinned(frag)`: every element of `frag` set by `pinned_zero`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import dsl_user_op
from cutlass._mlir.dialects import llvm


@dsl_user_op
def _pinned(x, *, loc=None, ip=None):
    """x, through an empty volatile asm that the compiler cannot move or see through."""
    return cutlass.Float32(llvm.inline_asm(
        cutlass.Float32.mlir_type, [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], "",
        "=f,0", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def pinned_zero(*, loc=None, ip=None):
    """+0.0 written into a register of its own by a volatile asm (not a copy of another)."""
    return cutlass.Float32(llvm.inline_asm(
        cutlass.Float32.mlir_type, [], "mov.b32 $0, 0f00000000;", "=f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def fence_operands(frag):
    """Every fp32 register of `frag` is read and written here, in program order with the
    WGMMA instructions."""
    for i in cutlass.range_constexpr(cute.size(frag)):
        frag[i] = _pinned(frag[i])


@cute.jit
def zero_pinned(frag):
    """Every element of `frag` set to +0.0, each by its own volatile `mov`."""
    for i in cutlass.range_constexpr(cute.size(frag)):
        frag[i] = pinned_zero()
