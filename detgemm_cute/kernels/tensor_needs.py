"""What every kernel assumes of the tensors it is launched with, written once.

A kernel is compiled against fake tensors that promise a base alignment and stride
divisibilities (``assumed_align``, ``sym_int64(divisibility=...)``, constant strides), and
TVM-FFI checks each launch's tensors against them: a tensor that breaks one raises the DSL's
``ValueError('Misaligned Tensor data on argument #0 ...')`` at the launch. A staging decision
that asks less than the fake promises therefore crashes there; e.g. ``x.contiguous()`` keeps
the misaligned base of an already contiguous view, which is how an fp32 operand at an odd
storage offset once reached the split kernel.

So each promise is a `Need`, here. The fake tensors are built from it (`fake`), and every
staging decision asks the same object about the tensor it will launch with (`Need.meets`,
`conform`, `tma_unit_dim`). Tensors the launch allocates itself (outputs, staged copies) are
fresh allocations (CUDA's caching allocator aligns them to 512 bytes).

Pure Python: torch is only touched through the tensors passed in, the DSL only in `fake`.
"""

from __future__ import annotations

from dataclasses import dataclass

VEC_BYTES = 16  # TMA, cp.async and 16-byte vector loads: base and non-unit strides

# Per-dim stride rules of a `Need` (torch dim order).
UNIT = "unit"  # stride 1
BYTES16 = "16B"  # a multiple of 16 bytes
STEP16 = "step16B"  # a nonzero multiple of 16 bytes (a mode TMA walks: no aliased rows)
ANY = "any"  # any stride
BYTES8 = "8B"  # a multiple of 8 bytes
ELEMENT = 0  # `Need.align`: the element size (any tensor of its dtype meets it)
_BYTES = {BYTES16: 16, BYTES8: 8}


@dataclass(frozen=True)
class Need:
    """What a kernel assumes of one tensor argument.

    align: bytes the base address is a multiple of (`ELEMENT`: the element size).
    strides: per dim, `UNIT`, `BYTES16`, `STEP16`, `ANY` or an int (exactly that stride).
    loose: dims whose stride is free where they hold a single entry (the launch's own check
    skips them; the kernel never steps along them). TMA descriptors encode every stride,
    so the dims of a TMA operand are loose only where the kernel folds them away."""

    align: int
    strides: tuple
    loose: tuple = ()

    def meets(self, t) -> bool:
        """Whether the tensor `t` (any device) satisfies this need."""
        if t.dim() != len(self.strides):
            return False
        el = t.element_size()
        if t.data_ptr() % (self.align or el):
            return False
        for d, (rule, size, stride) in enumerate(zip(self.strides, t.shape, t.stride())):
            if size == 1 and d in self.loose:
                continue
            if not _stride_ok(rule, stride, el):
                return False
        return True


def _stride_ok(rule, stride: int, el: int) -> bool:
    if rule == ANY:
        return True
    if rule == UNIT:
        return stride == 1
    if rule in _BYTES:
        return stride * el % _BYTES[rule] == 0
    if rule == STEP16:
        return stride != 0 and stride * el % VEC_BYTES == 0
    return stride == rule


def conform(t, need: Need):
    """`t` itself when it meets `need`, else a fresh contiguous copy (which does, for any
    need a row-major tensor of that shape can meet: checked)."""
    if need.meets(t):
        return t
    out = t.new_empty(t.shape).copy_(t)
    if not need.meets(out):
        raise RuntimeError(f"internal: a fresh copy of shape {tuple(t.shape)} does not meet "
                           f"{need}")
    return out


def fake(dtype, shape, need: Need, strides=None):
    """The fake tensor a kernel is compiled against for `need`: `dtype` a cutlass type,
    `shape` of ints / sym ints. `strides` (optional) replaces the need's per-dim rules for a
    view of more dims than the need describes (its rules then come from the caller)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    div = VEC_BYTES * 8 // dtype.width

    def sym(rule):
        if rule == UNIT:
            return 1
        if rule == STEP16:
            return cute.sym_int64(divisibility=div)
        if rule in _BYTES:
            return cute.sym_int64(divisibility=max(1, _BYTES[rule] * 8 // dtype.width))
        if rule == ANY:
            return cute.sym_int64()
        return rule

    align = need.align or dtype.width // 8
    return make_fake_tensor(dtype, shape, stride=tuple(sym(r) for r in strides or need.strides),
                            assumed_align=align)


# ---------------------------------------------------------------------------------------
# The GEMM kernels (both families; compile._make_fakes). A and B are read by TMA (SM90) or
# cp.async (SM80): 16-byte base, 16-byte non-unit strides, one unit-stride dim.

# A stride of 0 (rows or entries sharing memory: an expanded view) is staged: a TMA
# descriptor walks its modes with steps of 16 bytes or more.
TMA_K_LAST = Need(VEC_BYTES, (STEP16, UNIT))  # [rows, cols], cols contiguous ("last")
TMA_FIRST = Need(VEC_BYTES, (UNIT, STEP16))  # [rows, cols], rows contiguous ("first")
# [L, rows, cols] batches (bmm, grouped weights): the batch stride too, unless one entry.
TMA_BATCH_LAST = Need(VEC_BYTES, (STEP16, STEP16, UNIT), loose=(0,))
TMA_BATCH_FIRST = Need(VEC_BYTES, (STEP16, UNIT, STEP16), loose=(0,))
BIAS = Need(2, (UNIT,))  # read element by element: any 2-byte-aligned unit-stride row
OFFS = Need(4, (UNIT,))  # grouped: int32 cumulative row ends


def tma_operand(unit_last: bool, batched: bool = False) -> Need:
    """A, B or C of a GEMM kernel through TMA (SM90) or cp.async (SM80)."""
    if batched:
        return TMA_BATCH_LAST if unit_last else TMA_BATCH_FIRST
    return TMA_K_LAST if unit_last else TMA_FIRST


def a_rows(batched: bool = False) -> Need:
    """A read by the producer warpgroup (`KernelKey.a_loads`, kernels/sm90_a_rows.py):
    K-major, any row (and batch) stride, any element-aligned start."""
    return Need(ELEMENT, (ANY, ANY, UNIT) if batched else (ANY, UNIT))


def c_direct(swapped: bool, batched: bool = False, align: int = 0) -> Need:
    """C stored by the tile's threads (`KernelKey.c_direct`): any row (and batch) stride,
    element-aligned; swapped, the kernel's C is an M-major view. With `align` 8
    (`KernelKey.c_align`) the start and the non-unit strides are multiples of 8 bytes, so the
    threads store 8 bytes at once."""
    step = {0: ANY, 8: BYTES8}[align]
    inner = (UNIT, step) if swapped else (step, UNIT)
    return Need(align or ELEMENT, (step, *inner) if batched else inner)


# The helper kernels.
SPLIT_ROWS = Need(VEC_BYTES, (BYTES16, UNIT), loose=(0,))  # split's fp32 rows: 16-byte loads
SPLIT_PARTS = Need(VEC_BYTES, (BYTES16, UNIT))  # its 16-bit parts (a fresh buffer)
SPLIT_SCALES = Need(4, (UNIT,))  # its row scales (a fresh buffer)
COPY_ROWS_SRC = Need(2, (ANY, UNIT))  # kernels/rows.py: 16-bit rows, any pitch
COPY_ROWS_DST = Need(VEC_BYTES, (BYTES16, UNIT))  # its padded rows (a fresh buffer)
TRANSPOSE_SRC = Need(4, (ANY, UNIT))  # kernels/transpose.py: fp32, columns contiguous
TRANSPOSE_DST = Need(4, (ANY, UNIT))  # its K-major copy (a fresh buffer)


def tma_unit_dim(t) -> str | None:
    """Which of the last two dims of a 2-D or 3-D operand the GEMM kernels can take as
    contiguous in place ("last" or "first"), or None when it must be staged. "first" also
    needs more than one column (a single column is read as "last")."""
    last, first = ((TMA_K_LAST, TMA_FIRST) if t.dim() == 2
                   else (TMA_BATCH_LAST, TMA_BATCH_FIRST))
    if last.meets(t):
        return "last"
    if t.shape[-1] > 1 and first.meets(t):
        return "first"
    return None


__all__ = ["Need", "conform", "fake", "tma_unit_dim", "tma_operand", "a_rows", "c_direct",
           "VEC_BYTES", "UNIT", "BYTES16", "BYTES8", "STEP16", "ANY", "ELEMENT", "TMA_K_LAST",
           "TMA_FIRST", "TMA_BATCH_LAST", "TMA_BATCH_FIRST", "BIAS", "OFFS", "SPLIT_ROWS",
           "SPLIT_PARTS", "SPLIT_SCALES", "COPY_ROWS_SRC", "COPY_ROWS_DST", "TRANSPOSE_SRC",
           "TRANSPOSE_DST"]
