"""The calls being compared, per op, on one input set (`timing.InputSet`: a, b, out).

  op   set            detgemm                         cuBLAS default / cuBLASLt no split-K
  fwd  a=X, b=W       detgemm_cute.mm(X, W.t())       torch.mm(X, W.t())
  dx   a=dY, b=W      detgemm_cute.input_grad(dY, W)  torch.mm(dY, W)
  dw   a=dY, b=X      detgemm_cute.weight_grad(dY, X) torch.mm(dY.t(), X, out_dtype=torch.float32)
                      (fp32 output)

PEDANTIC is `pedantic.Pedantic.gemm(op, a, b, out)`.

cuBLASLt with split-K off (the same chain as detgemm on most shapes, so the like-for-like
peer) is torch's matmul under three global settings: `preferred_blas_library("cublaslt")`,
`allow_bf16_reduced_precision_reduction = (False, False)` and the same for fp16 (the second
flag forbids split-K; torch >= 2.10 takes the tuple). They are global, so `LtNoSplit` sets
them around each call (and so around each call captured in a graph) and restores the previous
values; `lt_nosplit_status()` says whether this torch accepts them.
"""

from __future__ import annotations

import contextlib

import torch

PEERS = ("detgemm", "cublas", "pedantic", "cublaslt")
LABELS = {"detgemm": "detgemm", "cublas": "cuBLAS default", "pedantic": "cuBLAS PEDANTIC",
          "cublaslt": "cuBLASLt no split-K"}
SHORT = {"detgemm": "det", "cublas": "cuB", "pedantic": "PED", "cublaslt": "Lt"}
HOWTO = {
    "fwd": {"detgemm": "detgemm_cute.mm(x, w.t())", "cublas": "torch.mm(x, w.t())",
            "cublaslt": "torch.mm(x, w.t()) under LtNoSplit"},
    "dx": {"detgemm": "detgemm_cute.input_grad(dy, w)", "cublas": "torch.mm(dy, w)",
           "cublaslt": "torch.mm(dy, w) under LtNoSplit"},
    "dw": {"detgemm": "detgemm_cute.weight_grad(dy, x) (fp32)",
           "cublas": "torch.mm(dy.t(), x, out_dtype=torch.float32)",
           "cublaslt": "torch.mm(dy.t(), x, out_dtype=torch.float32) under LtNoSplit"},
}
PEDANTIC_HOWTO = ("cublasGemmEx on a handle of our own: CUBLAS_PEDANTIC_MATH, "
                  "CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT")
LT_HOWTO = ("torch.backends.cuda.preferred_blas_library('cublaslt') and "
            "allow_{bf16,fp16}_reduced_precision_reduction = (False, False), set around "
            "each call and restored")


def _get_reduction(which: str):
    """(allow_reduced_precision, allow_splitk) for 'bf16' / 'fp16'."""
    getter = getattr(torch._C, f"_get_cublas_allow_{which}_reduced_precision_reduction")
    value = getter()
    if isinstance(value, tuple):
        return value
    split = getattr(torch.backends.cuda.matmul,
                    f"allow_{which}_reduced_precision_reduction_split_k", True)
    return bool(value), bool(split)


def _set_reduction(which: str, value: tuple) -> None:
    setattr(torch.backends.cuda.matmul, f"allow_{which}_reduced_precision_reduction",
            tuple(value))


class LtNoSplit(contextlib.ContextDecorator):
    """preferred BLAS library cuBLASLt and no reduced-precision split-K, restored on exit."""

    def __enter__(self):
        self._prev = (torch.backends.cuda.preferred_blas_library(),
                      _get_reduction("bf16"), _get_reduction("fp16"))
        self._entering = True
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            _set_reduction("bf16", (False, False))
            _set_reduction("fp16", (False, False))
        except BaseException:
            self._restore()
            raise
        finally:
            self._entering = False
        return self

    def _restore(self):
        """Every setting back, each on its own (one failing does not keep the others)."""
        lib, bf16, fp16 = self._prev
        failed = None
        for undo in (lambda: torch.backends.cuda.preferred_blas_library(lib),
                     lambda: _set_reduction("bf16", bf16), lambda: _set_reduction("fp16", fp16)):
            try:
                undo()
            except Exception as e:  # noqa: BLE001
                failed = failed or e
        if failed is not None and not self._entering:
            raise failed

    def __exit__(self, *exc):
        self._restore()
        return False


def lt_nosplit_status() -> str | None:
    """None when torch takes the split-K-off settings (and restores them), else why not."""
    try:
        before = (torch.backends.cuda.preferred_blas_library(), _get_reduction("bf16"),
                  _get_reduction("fp16"))
    except Exception as e:  # noqa: BLE001
        return f"torch {torch.__version__} cannot read the cuBLAS reduction settings ({e})"
    try:
        with LtNoSplit():
            inside = _get_reduction("bf16"), _get_reduction("fp16")
    except TypeError as e:
        return (f"torch {torch.__version__} does not accept allow_bf16_reduced_precision_"
                f"reduction = (False, False) ({e}); split-K cannot be switched off")
    except Exception as e:  # noqa: BLE001
        return f"torch {torch.__version__}: cuBLASLt settings failed ({type(e).__name__}: {e})"
    after = (torch.backends.cuda.preferred_blas_library(), _get_reduction("bf16"),
             _get_reduction("fp16"))
    if inside != ((False, False), (False, False)):
        return f"torch {torch.__version__} did not keep (False, False): read back {inside}"
    if after != before:
        return f"settings not restored: {before} -> {after}"
    return None


def mm_out_dtype_status() -> str | None:
    """None when torch.mm takes out_dtype=torch.float32 for 16-bit CUDA inputs, else why."""
    from .gpu import DEVICE

    try:
        a = torch.ones(16, 16, device=DEVICE, dtype=torch.bfloat16)
        y = torch.mm(a.t(), a, out_dtype=torch.float32)
        if y.dtype != torch.float32:
            return f"torch.mm(..., out_dtype=torch.float32) returned {y.dtype}"
    except Exception as e:  # noqa: BLE001
        return (f"torch {torch.__version__} has no torch.mm(..., out_dtype=torch.float32) for "
                f"bf16 inputs ({type(e).__name__}: {str(e)[:80]}); the dw cuBLAS peers are "
                f"not run")
    return None


def torch_call(op: str):
    """cuBLAS default: fn(set) -> output."""
    if op == "fwd":
        return lambda s: torch.mm(s.a, s.b.t())
    if op == "dx":
        return lambda s: torch.mm(s.a, s.b)
    if op == "dw":
        return lambda s: torch.mm(s.a.t(), s.b, out_dtype=torch.float32)
    raise ValueError(f"unknown op {op!r}")


def lt_call(op: str):
    """cuBLASLt with split-K off: the torch call under `LtNoSplit`."""
    inner = torch_call(op)
    lt = LtNoSplit()

    def call(s):
        with lt:
            return inner(s)

    return call


def detgemm_api():
    """detgemm's calls used here (mm, input_grad, weight_grad, force_bucket), taken from the
    modules that define them."""
    import types

    from .. import functional, gemm

    return types.SimpleNamespace(mm=functional.mm, input_grad=functional.input_grad,
                                 weight_grad=functional.weight_grad,
                                 force_bucket=gemm.force_bucket)


def detgemm_call(op: str, dg, bucket: str | None = None):
    """detgemm's call for `op`; with `bucket`, forced onto that bucket (by name)."""
    if op == "fwd":
        inner = lambda s: dg.mm(s.a, s.b.t())  # noqa: E731
    elif op == "dx":
        inner = lambda s: dg.input_grad(s.a, s.b)  # noqa: E731
    elif op == "dw":
        inner = lambda s: dg.weight_grad(s.a, s.b)  # noqa: E731
    else:
        raise ValueError(f"unknown op {op!r}")
    if bucket is None:
        return inner
    force = dg.force_bucket

    def forced(s):
        with force(bucket):
            return inner(s)

    return forced


def pedantic_call(op: str, ped):
    return lambda s: ped.gemm(op, s.a, s.b, s.out)


def detgemm_layout(op: str, m: int, k: int, n: int, swap_ab: bool = False) -> dict:
    """The operand layout fields of the KernelKey that `detgemm_call(op)` compiles, for
    freshly allocated inputs of a (M, K, N) problem (gemm.py's rules: an operand TMA can
    read in place keeps its layout; one it cannot is staged K-major, K padded to 8).
    `swap_ab`: the bucket swaps operands, so the kernel's A is op(B)^T and its B the A."""
    if swap_ab:
        return _swapped_layout(op, m, k, n)
    if op == "fwd":  # mm(x [M,K], w.t() [K,N] strides (1, K))
        a_major = "k"
        b = ("kn", "first") if k % 8 == 0 and n > 1 else ("nk", "last")
    elif op == "dx":  # gemm(dy [M,N], w [N,K] as kn)
        a_major = "k"
        b = ("kn", "last") if k % 8 == 0 else ("nk", "last")
    elif op == "dw":  # gemm(dy.t() [N,M] strides (1, N), x [M,K] as kn)
        a_major = "m" if n % 8 == 0 and m > 1 else "k"
        b = ("kn", "last") if k % 8 == 0 else ("nk", "last")
    else:
        raise ValueError(f"unknown op {op!r}")
    return {"a_major": a_major, "b_form": b[0], "b_contig": b[1], "has_bias": False,
            "accumulate": False}


def _swapped_layout(op: str, m: int, k: int, n: int) -> dict:
    if op == "fwd":  # A' = w [N,K]; B' = x [M,K] (staged K-major when K % 8)
        a_major, b = "k", ("nk", "last")
    elif op == "dx":  # A' = w.t() [K,N] strides (1, K); B' = dy [M,N]
        a_major, b = ("m" if k % 8 == 0 and n > 1 else "k"), ("nk", "last")
    elif op == "dw":  # A' = x.t() [K,M] strides (1, K); B' = dy.t() [N,M] strides (1, N)
        a_major = "m" if k % 8 == 0 and m > 1 else "k"
        b = ("nk", "first") if n % 8 == 0 and m > 1 else ("nk", "last")
    else:
        raise ValueError(f"unknown op {op!r}")
    return {"a_major": a_major, "b_form": b[0], "b_contig": b[1], "has_bias": False,
            "accumulate": False, "swap_ab": True}
