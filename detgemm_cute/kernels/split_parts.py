"""The fp32 tier's operand split in one pass (any GPU from sm_80 up).

`SplitFp16Parts` writes what `detgemm_cute.split.operand` (with `split.row_scales`) computes
with several PyTorch kernels, reading each fp32 value from DRAM once and writing its three
fp16 slots once: for a row r and
a 32-wide block j of K, x = X[r, 32j:32j+32] * S[r] (exact: S[r] is a power of two),
hi = fp16(x), and the block's 96 output values are, per operand side,

    A: [fp16(hi - x), -hi, hi]        B: [-hi, fp16(hi - x), hi]

(fp16(hi - x) = -lo; see split.py for why the signs sit there). Every value is one IEEE
round-to-nearest-even conversion of an exact fp32 value, so the bits equal the reference's.

Work: 4 consecutive values per thread (one 16-byte load, three 8-byte stores), threads in
memory order, so a warp reads 512 contiguous bytes and writes three 64-byte runs per block.
Inputs: X [rows, blocks, 8, 4] fp32 (unit stride inside a row); S [rows] fp32 (written by
`SplitFp16Parts`, which also computes it); out [rows, blocks, 3, 8, 4] fp16, contiguous.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

_THREADS = 256
_VEC = 4  # fp32 values per thread: one 16-byte load


def _grid(mX: cute.Tensor):
    """Blocks of `_THREADS` threads, one thread per 4 values of X [rows, blocks, quads, 4]."""
    units = cute.size(mX, mode=[0]) * cute.size(mX, mode=[1]) * cute.size(mX, mode=[2])
    return [(units + _THREADS - 1) // _THREADS, 1, 1]


@cute.jit
def _this_quad(mX: cute.Tensor):
    """(in range, row, block, quad) of this thread's 4 values; threads in memory order."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    quads = cute.size(mX, mode=[2])
    blocks = cute.size(mX, mode=[1])
    unit = bidx * _THREADS + tidx
    q = unit % quads
    rest = unit // quads
    r = rest // blocks
    return unit < cute.size(mX, mode=[0]) * blocks * quads, r, rest - r * blocks, q


@cute.jit
def _load_quad(mX: cute.Tensor, r, j, q):
    xs = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
    cute.autovec_copy(mX[(r, j, q, None)], xs)
    return xs.load()


SIGN_OFF = 0x7FFFFFFF  # |x| as bits: an integer maximum orders them, Inf < NaN
_WARPS = _THREADS // 32


class SplitFp16Parts:
    """The scaled fp16 split of operand side "a" or "b", with its row scales
    (`split.row_scales`), in one kernel: one CTA per row. Pass 1 takes the integer maximum of
    |x|'s bits over the row (a NaN dominates, as in PyTorch's inf-norm); thread 0 builds
    the scale 2^(13 - floor(log2 max|x|)), clamped to [2^-126, 2^127], from exponent bits and
    writes it to S[r]. Pass 2 re-reads the row (now in L2) and writes its parts, 4 values per
    thread. One DRAM read of X."""

    def __init__(self, side: str):
        if side not in ("a", "b"):
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        self.neg_lo_group = 0 if side == "a" else 1  # where fp16(hi - x) goes
        self.neg_hi_group = 1 - self.neg_lo_group

    @cute.jit
    def __call__(self, mX: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, stream):
        self.kernel(mX, mS, mO).launch(grid=[cute.size(mX, mode=[0]), 1, 1],
                                       block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        quads = cute.size(mX, mode=[2])
        units = cute.size(mX, mode=[1]) * quads
        mXi = cute.make_tensor(cute.recast_ptr(mX.iterator, dtype=cutlass.Int32), mX.layout)
        top = cutlass.Int32(0)
        for u in cutlass.range(tidx, units, _THREADS, unroll=4):
            bits = cute.make_rmem_tensor((_VEC,), cutlass.Int32)
            cute.autovec_copy(mXi[(r, u // quads, u % quads, None)], bits)
            for i in cutlass.range_constexpr(_VEC):
                top = cutlass.max(top, bits[i] & SIGN_OFF)
        top = cute.arch.warp_reduction(top, lambda a, b: cutlass.max(a, b))
        smem = cutlass.memory.SmemAllocator()
        warp_top = smem.allocate_tensor(cutlass.Int32, cute.make_layout(_WARPS), 4)
        scale_bits = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), 4)
        if tidx % 32 == 0:
            warp_top[tidx // 32] = top
        cute.arch.sync_threads()
        if tidx == 0:
            t = warp_top[0]
            for w in cutlass.range_constexpr(1, _WARPS):
                t = cutlass.max(t, warp_top[w])
            e = cutlass.min(cutlass.max(13 + 254 - (t >> 23), 1), 254)
            scale_bits[0] = e << 23
        cute.arch.sync_threads()
        scale_f = cute.make_tensor(cute.recast_ptr(scale_bits.iterator, dtype=cutlass.Float32),
                                   scale_bits.layout)
        scale = scale_f[0]
        if tidx == 0:
            mS[r] = scale
        for u in cutlass.range(tidx, units, _THREADS, unroll=4):
            j, q = u // quads, u % quads
            self._write_parts(mO, r, j, q, _load_quad(mX, r, j, q) * scale)

    @cute.jit
    def _write_parts(self, mO: cute.Tensor, r, j, q, x):
        """The three fp16 groups of 4 scaled values x (exact products) at row r, block j."""
        hi = x.to(cutlass.Float16)
        for group, value in ((self.neg_lo_group, (hi.to(cutlass.Float32) - x)),
                             (self.neg_hi_group, -x), (2, x)):
            part = cute.make_rmem_tensor((_VEC,), cutlass.Float16)
            part.store(value.to(cutlass.Float16))
            cute.autovec_copy(part, mO[(r, j, group, q, None)])


class SplitBf16Exact:
    """One pass of dW's exact bf16 split (split.py): per 16-wide block of K, six 16-wide
    steps of hi / mid / lo = bf16(x), bf16(x - hi), bf16(x - hi - mid), in side "a"'s order
    [lo, hi, mid, mid, hi, hi] or side "b"'s [hi, lo, mid, hi, mid, hi]. Inputs: X
    [rows, blocks, 4, 4] fp32 (unit stride inside a row), out [rows, blocks, 6, 4, 4] bf16,
    contiguous; one thread per 4 consecutive values."""

    _STEPS = {"a": (2, 0, 1, 1, 0, 0), "b": (0, 2, 1, 0, 1, 0)}  # 0 hi, 1 mid, 2 lo

    def __init__(self, side: str):
        if side not in self._STEPS:
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        self.steps = self._STEPS[side]

    @cute.jit
    def __call__(self, mX: cute.Tensor, mO: cute.Tensor, stream):
        self.kernel(mX, mO).launch(grid=_grid(mX), block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mO: cute.Tensor):
        ok, r, j, q = _this_quad(mX)
        if ok:
            x = _load_quad(mX, r, j, q)
            hi = x.to(cutlass.BFloat16)
            rest_v = x - hi.to(cutlass.Float32)
            mid = rest_v.to(cutlass.BFloat16)
            lo = (rest_v - mid.to(cutlass.Float32)).to(cutlass.BFloat16)
            for step, which in enumerate(self.steps):
                part = cute.make_rmem_tensor((_VEC,), cutlass.BFloat16)
                part.store((hi, mid, lo)[which])
                cute.autovec_copy(part, mO[(r, j, step, q, None)])
