"""The chain-floor probe: one accumulator's dependent chain of MMA steps, operands already
in shared memory (WGMMA) or in registers (mma.sync), no global loads in the loop.

Every output element of a detgemm GEMM is one chain: K / 16 MMA steps (8-wide for TF32),
each adding onto the accumulator the previous one wrote. With enough bandwidth and no split-K
the time of a long chain is K / 16 x (time of one dependent step): the floor a decode row
cannot beat however its tiles are laid out. This kernel measures that step. Each CTA runs
`groups` batches of `steps` MMAs onto one accumulator, in the order the GEMM mainloop issues
them (`kernels/sm90_base.Sm90Base._mainloop`: fence, a k tile's steps, commit, wait until at
most `depth` batches are in flight), so time / (groups x steps) over a long loop is the time
per step; the bench (`bench/bench_chain_floor.py`) fits it as the slope over several lengths.

Forms (`ChainProbe.FORMS`):
  wgmma       SM90 ``wgmma.mma_async.m64nNk16.f32.bf16.bf16``, A and B K-major in shared
              memory (swizzled like the GEMM's stages), one warpgroup per CTA;
  wgmma_tf32  the same with TF32 operands, ``m64nNk8`` (the "tf32" precision's step);
  mma_sync    SM80 ``mma.sync.m16n8k16`` bf16 -> fp32, operands in registers (the SM80
              kernel loads them by ldmatrix a step ahead), N / 8 fragments per step, one
              warp's chain (`warps` warps run the same chain side by side).

The shared memory holds a fixed pattern of finite values (1..2, varying mantissas), so the
tensor cores see toggling data as in a GEMM. One fp32 value per thread is written to `out`
(shape (CTAs, threads)) so nothing is dead code. Compiles without a GPU (`compile_probe`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

WG = 128
FORMS = ("wgmma", "wgmma_tf32", "mma_sync")
WGMMA_NS = (8, 16, 24, 32, 48, 64, 96, 112, 128, 192, 256)
PATTERN_BASE = 0x3F803F80  # two bf16 1.0s (or fp32 ~1.0039); the mantissas vary per word
PATTERN_MASK = 0x007F007F


class ChainProbe:
    """One probe configuration: `form`, MMA width `n`, `steps` MMAs per batch (a k tile of
    the GEMM: BK / 16, TF32 BK / 8), `depth` batches left in flight before the next one is
    issued (the mainloop's 1), `warps` (mma_sync only)."""

    def __init__(self, form: str, n: int, steps: int = 8, depth: int = 1, warps: int = 1):
        if form not in FORMS:
            raise ValueError(f"form: {form!r} is not one of {', '.join(FORMS)}")
        if form == "mma_sync":
            if n < 8 or n % 8:
                raise ValueError(f"n: {n} must be a positive multiple of 8 for mma_sync")
            if not 1 <= warps <= 32:
                raise ValueError(f"warps: {warps} must be in 1..32")
        elif n < 8 or n > 256 or n % 8:
            raise ValueError(f"n: {n} must be a multiple of 8 in 8..256 for {form}")
        if not 1 <= steps <= 64:
            raise ValueError(f"steps: {steps} must be in 1..64")
        if depth not in (0, 1):
            raise ValueError(f"depth: {depth} must be 0 or 1 (batches left in flight)")
        self.form, self.n, self.steps, self.depth, self.warps = form, n, steps, depth, warps
        self.mma_k = 8 if form == "wgmma_tf32" else 16
        self.threads = 32 * warps if form == "mma_sync" else WG

    @property
    def label(self) -> str:
        m = 16 if self.form == "mma_sync" else 64
        s = f"{self.form} m{m}n{self.n}k{self.mma_k} x{self.steps}/batch depth {self.depth}"
        return s + (f" {self.warps} warps" if self.form == "mma_sync" else "")

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mOut: cute.Tensor, groups: cutlass.Int32, stream):
        bk = self.steps * self.mma_k
        if cutlass.const_expr(self.form == "mma_sync"):
            dtype = cutlass.BFloat16
            tiled_mma = cute.make_tiled_mma(
                cute.nvgpu.warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
                cute.make_layout((1, 1, 1)))
            a_smem = cute.make_layout((16, bk), stride=(bk, 1))
            b_smem = cute.make_layout((self.n, bk), stride=(bk, 1))
        else:
            dtype = cutlass.TFloat32 if cutlass.const_expr(self.form == "wgmma_tf32") \
                else cutlass.BFloat16
            if cutlass.const_expr(self.form == "wgmma_tf32"):
                from ..kernels.tf32_mma import make_tf32_tiled_mma
                tiled_mma = make_tf32_tiled_mma((1, 1, 1), (64, self.n))
            else:
                k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
                tiled_mma = sm90_utils.make_trivial_tiled_mma(
                    dtype, dtype, k_major, k_major, cutlass.Float32, (1, 1, 1),
                    tiler_mn=(64, self.n))
            tile = (64, self.n, bk)
            a_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, dtype, 1)
            b_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, dtype, 1)

        @cute.struct
        class SharedStorage:
            sA: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_smem)], 1024]

        self.shared_storage = SharedStorage
        self.dtype = dtype
        self.kernel(mOut, groups, tiled_mma, a_smem, b_smem).launch(
            grid=[cute.size(mOut, mode=[0]), 1, 1], block=[self.threads, 1, 1], stream=stream)

    # -------------------------------------------------------------- device side
    @cute.jit
    def _fill(self, ptr, words: cutlass.Constexpr):
        """Write the pattern into `words` 32-bit words of shared memory at `ptr`."""
        flat = cute.make_tensor(cute.recast_ptr(ptr, dtype=cutlass.Int32),
                                cute.make_layout(words))
        tidx, _, _ = cute.arch.thread_idx()
        for i in cutlass.range(tidx, words, self.threads, unroll=1):
            flat[i] = cutlass.Int32(PATTERN_BASE) | ((i * 40503) & PATTERN_MASK)

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, groups: cutlass.Int32, tiled_mma: cute.TiledMma,
               a_smem, b_smem):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        width = self.dtype.width
        self._fill(storage.sA.data_ptr(), cute.cosize(a_smem) * width // 32)
        self._fill(storage.sB.data_ptr(), cute.cosize(b_smem) * width // 32)
        if cutlass.const_expr(self.form == "mma_sync"):
            cute.arch.sync_threads()
            sA = storage.sA.get_tensor(a_smem)
            sB = storage.sB.get_tensor(b_smem)
            thr_mma = tiled_mma.get_slice(tidx % 32)
            tCsA, tCsB = thr_mma.partition_A(sA), thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            cute.autovec_copy(tCsA, tCrA)
            cute.autovec_copy(tCsB, tCrB)
            acc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((16, self.n)))
            acc.fill(0.0)
            for _g in cutlass.range(groups, unroll=1):
                for kb in cutlass.range_constexpr(self.steps):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb)], tCrB[(None, None, kb)],
                              acc)
        else:
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            thr_mma = tiled_mma.get_slice(tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(
                thr_mma.partition_C(cute.make_identity_tensor((64, self.n))).shape,
                cutlass.Float32)
            acc.fill(0.0)
            for _g in cutlass.range(groups, unroll=1):
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range_constexpr(self.steps):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, 0)],
                              tCrB[(None, None, kb, 0)], acc)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(self.depth)
            cute.nvgpu.warpgroup.wait_group(0)
        mOut[(bidx, tidx)] = acc[0] + acc[cute.size(acc) - 1]


def compile_probe(probe: ChainProbe, gpu_arch: str = "sm_90a", extra_options: str = ""):
    """Compile `probe` against a fake (CTAs, threads) fp32 output and a TVM-FFI stream (no
    GPU needed); the result is called as f(out, groups) with a torch tensor."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    out = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), probe.threads),
                                   stride_order=(1, 0))
    return cute.compile(probe, out, cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=f"--enable-tvm-ffi --gpu-arch {gpu_arch} {extra_options}".strip())


__all__ = ["ChainProbe", "FORMS", "WGMMA_NS", "compile_probe"]
