"""The fp32 tier's last step in one kernel (sm_80 up): the chunked GEMM's scaled accumulator
back to the output, with the bias and the one rounding.

    out[m, n] = round(((C[m, n] * (1 / s_a[m])) * (1 / s_b[n])) + bias[n])

with the bits of the PyTorch ops it replaces (`split.unscale`, then ``y + bias``, then
``y.to(out_dtype)``: five or six kernels and up to three passes over C): each product and
the bias add is one IEEE fp32 operation rounded to nearest even (explicit ``.rn``, so never
contracted into an FMA), the reciprocals of the power-of-two scales are exact (the exponent
field mirrored, 2^-127 as the subnormal it is: `split_gemv.reciprocal`), and the rounding to
bf16 / fp16 is one round-to-nearest-even conversion (a NaN becomes the dtype's canonical NaN,
as the GPU's fp32 multiply already made it).

Work: one thread per 4 consecutive outputs of a row (a 16-byte load of C, of s_b and of the
bias; one 16- or 8-byte store), threads in memory order.
Inputs: C [M, N/4, 4] fp32 (16-byte rows); s_a [M] fp32; s_b [N/4, 4] fp32; bias [N/4, 4]
fp32 or none; out [M, N/4, 4] in the output dtype, contiguous.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .split_gemv import add_rn, mul_rn, reciprocal

_THREADS = 256
_VEC = 4


class UnscaleFp32:
    """The module docstring's step, for one output dtype (a cutlass type) and with or
    without a bias."""

    def __init__(self, out_dtype, has_bias: bool):
        self.out_dtype = out_dtype
        self.has_bias = has_bias

    @cute.jit
    def __call__(self, mC: cute.Tensor, mSa: cute.Tensor, mSb: cute.Tensor, mBias, mO,
                 stream):
        units = cute.size(mC, mode=[0]) * cute.size(mC, mode=[1])
        self.kernel(mC, mSa, mSb, mBias, mO).launch(
            grid=[(units + _THREADS - 1) // _THREADS, 1, 1], block=[_THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mC: cute.Tensor, mSa: cute.Tensor, mSb: cute.Tensor, mBias,
               mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        quads = cute.size(mC, mode=[1])
        unit = bidx * _THREADS + tidx
        if unit < cute.size(mC, mode=[0]) * quads:
            m, q = unit // quads, unit % quads
            c = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
            cute.autovec_copy(mC[(m, q, None)], c)
            sb = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
            cute.autovec_copy(mSb[(q, None)], sb)
            bias = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
            if cutlass.const_expr(self.has_bias):
                cute.autovec_copy(mBias[(q, None)], bias)
            inv_a = reciprocal(mSa[m])
            y = cute.make_rmem_tensor((_VEC,), cutlass.Float32)
            for i in cutlass.range_constexpr(_VEC):
                v = mul_rn(mul_rn(c[i], inv_a), reciprocal(sb[i]))
                if cutlass.const_expr(self.has_bias):
                    v = add_rn(v, bias[i])
                y[i] = v
            out = cute.make_rmem_tensor((_VEC,), self.out_dtype)
            out.store(y.load().to(self.out_dtype))
            cute.autovec_copy(out, mO[(m, q, None)])
