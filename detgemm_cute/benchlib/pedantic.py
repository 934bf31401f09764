"""cuBLAS in CUBLAS_PEDANTIC_MATH: `cublasGemmEx` on a handle of our own, per op.

torch resets the math mode of its own cuBLAS handle on every call, so PEDANTIC needs a handle
of our own. Two ways to call it:

- ctypes on the libcublas that torch has loaded (default). Nothing stands between the call and
  cuBLAS, so it can be captured in a CUDA graph like `torch.mm`. After each cublasSetStream
  (which resets the workspace) the handle gets a fixed 32 MiB workspace, so cuBLAS allocates
  nothing while a graph is captured.
- CuPy's binding (`cupy_backends.cuda.libs.cublas.gemmEx`). It refuses any cuBLAS call while a
  stream is captured ("calling cuBLAS API during stream capture is currently unsupported"), so
  it can only be timed by an eager loop, which at small M times CuPy's Python overhead as much
  as the GEMM. It serves as the cross-check: at start-up the ctypes path must give the same
  bits as CuPy's binding on every op, or it is not used. (nvmath-python's bindings would be a
  third way; it is not installed where this was measured.)

Row-major operands are column-major transposes, so (M, K, N as in `shapes`):
  fwd  Y^T[N,M]  = W^T'[N,K] X^T[K,M]: gemmEx(T, N, m=N, n=M, k=K, A=W lda K, B=X ldb K, C=Y ldc N)
  dx   dX^T[K,M] = W^T[K,N] dY^T[N,M]: gemmEx(N, N, m=K, n=M, k=N, A=W lda K, B=dY ldb N, C=dX ldc K)
  dw   dW^T[K,N] = X^T[K,M] dY[M,N]:   gemmEx(N, T, m=K, n=N, k=M, A=X lda K, B=dY ldb N, C=dW ldc K)
with alpha = 1, beta = 0 as host fp32 scalars, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT; dW is
written in fp32 (CUDA_R_32F), the others in the input dtype.
"""

from __future__ import annotations

import ctypes
import os
import warnings

import torch

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_PEDANTIC_MATH = 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUDA_R_16F, CUDA_R_32F, CUDA_R_16BF = 2, 0, 14
_CUDA_TYPES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F, torch.float32: CUDA_R_32F}


def gemm_ex_args(op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    """(transa, transb, m, n, k, A, lda, B, ldb, C, ldc) of the column-major call for `op`.

    fwd: a = X[M,K], b = W[N,K], out = Y[M,N]; dx: a = dY[M,N], b = W[N,K], out = dX[M,K];
    dw: a = dY[M,N], b = X[M,K], out = dW[N,K] (fp32)."""
    if op == "fwd":
        (m, k), n = a.shape, b.shape[0]
        return CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, b, k, a, k, out, n
    if op == "dx":
        (m, n), k = a.shape, b.shape[1]
        return CUBLAS_OP_N, CUBLAS_OP_N, k, m, n, b, k, a, n, out, k
    if op == "dw":
        (m, n), k = a.shape, b.shape[1]
        return CUBLAS_OP_N, CUBLAS_OP_T, k, n, m, b, k, a, n, out, k
    raise ValueError(f"unknown op {op!r}")


def out_buffer(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A NaN-filled output of the right shape and dtype (an unwritten element stays NaN)."""
    if op == "fwd":
        shape, dtype = (a.shape[0], b.shape[0]), a.dtype
    elif op == "dx":
        shape, dtype = (a.shape[0], b.shape[1]), a.dtype
    else:
        shape, dtype = (a.shape[1], b.shape[1]), torch.float32
    return torch.full(shape, float("nan"), dtype=dtype, device=a.device)


class Pedantic:
    """Common part of the two backends: `gemm(op, a, b, out)` with the mapping above."""

    backend = "?"
    graph_capturable = False
    version = None
    math_mode = None
    lib_path = None
    cupy_version = None

    def gemm(self, op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
        ta, tb, m, n, k, A, lda, B, ldb, C, ldc = gemm_ex_args(op, a, b, out)
        self._gemm_ex(ta, tb, m, n, k, A.data_ptr(), _CUDA_TYPES[A.dtype], lda,
                      B.data_ptr(), _CUDA_TYPES[B.dtype], ldb, C.data_ptr(),
                      _CUDA_TYPES[C.dtype], ldc)
        return out

    def run(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.gemm(op, a, b, out_buffer(op, a, b))

    def describe(self) -> str:
        return f"{self.backend}, cuBLAS {self.version}, math mode {self.math_mode}"

    def _gemm_ex(self, *args):  # pragma: no cover - backends implement it
        raise NotImplementedError


def loaded_cublas_path() -> str | None:
    """Path of the libcublas that this process (torch) has loaded, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith("libcublas.so") and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def _declare(lib) -> None:
    c_int, vp = ctypes.c_int, ctypes.c_void_p
    sigs = {
        "cublasCreate_v2": [ctypes.POINTER(vp)],
        "cublasSetMathMode": [vp, c_int],
        "cublasGetMathMode": [vp, ctypes.POINTER(c_int)],
        "cublasGetVersion_v2": [vp, ctypes.POINTER(c_int)],
        "cublasSetStream_v2": [vp, vp],
        "cublasSetWorkspace_v2": [vp, vp, ctypes.c_size_t],
        "cublasGemmEx": [vp, c_int, c_int, c_int, c_int, c_int, vp, vp, c_int, c_int,
                         vp, c_int, c_int, vp, vp, c_int, c_int, c_int, c_int],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = c_int


class PedanticCtypes(Pedantic):
    """cublasGemmEx through ctypes on a loaded libcublas (graph-capturable)."""

    backend = "ctypes cublasGemmEx (torch's libcublas)"
    graph_capturable = True
    WORKSPACE_BYTES = 32 * 2**20

    def __init__(self, lib, lib_path=None, workspace_ptr: int = 0, workspace_bytes: int = 0,
                 stream_ptr=None):
        """`lib`: the loaded library (declared here); `stream_ptr()`: the current stream."""
        _declare(lib)
        self.lib, self.lib_path = lib, lib_path
        self._ws, self._ws_bytes = workspace_ptr, workspace_bytes
        self._stream_ptr = stream_ptr or (lambda: torch.cuda.current_stream().cuda_stream)
        h = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.h = h
        self._check(lib.cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode")
        mode, ver = ctypes.c_int(), ctypes.c_int()
        self._check(lib.cublasGetMathMode(h, ctypes.byref(mode)), "cublasGetMathMode")
        self._check(lib.cublasGetVersion_v2(h, ctypes.byref(ver)), "cublasGetVersion")
        self.math_mode, self.version = mode.value, ver.value
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._alpha_p = ctypes.addressof(self._alpha)
        self._beta_p = ctypes.addressof(self._beta)
        self._stream = None

    @classmethod
    def open(cls, dtype: torch.dtype) -> "PedanticCtypes":
        """On the GPU: the libcublas torch loaded, a handle of our own, a fixed workspace."""
        torch.mm(torch.ones(8, 8, device="cuda", dtype=dtype),
                 torch.ones(8, 8, device="cuda", dtype=dtype))  # torch loads cuBLAS
        torch.cuda.synchronize()
        path = loaded_cublas_path()
        if path is None:
            raise RuntimeError("libcublas.so is not loaded in this process")
        workspace = torch.empty(cls.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        obj = cls(ctypes.CDLL(path), path, workspace.data_ptr(), cls.WORKSPACE_BYTES)
        obj.workspace = workspace  # kept alive with the handle
        return obj

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned cuBLAS status {status}")

    def _gemm_ex(self, ta, tb, m, n, k, a, a_t, lda, b, b_t, ldb, c, c_t, ldc):
        ptr = self._stream_ptr()
        if ptr != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.h, ptr), "cublasSetStream")
            if self._ws:
                self._check(self.lib.cublasSetWorkspace_v2(self.h, self._ws, self._ws_bytes),
                            "cublasSetWorkspace")
            self._stream = ptr
        self._check(self.lib.cublasGemmEx(
            self.h, ta, tb, m, n, k, self._alpha_p, a, a_t, lda, b, b_t, ldb,
            self._beta_p, c, c_t, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmEx")


class _StreamRef:
    """Minimal CUDA stream protocol object for a raw stream pointer."""

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


class PedanticCupy(Pedantic):
    """Through CuPy's binding on a handle of our own (not graph-capturable, see above)."""

    backend = "CuPy cublas.gemmEx"

    def __init__(self):
        import numpy as np
        import cupy
        from cupy_backends.cuda.libs import cublas

        self.np, self.cupy, self.cublas = np, cupy, cublas
        self.h = cublas.create()
        cublas.setMathMode(self.h, CUBLAS_PEDANTIC_MATH)
        cublas.setStream(self.h, torch.cuda.current_stream().cuda_stream)
        self.math_mode = cublas.getMathMode(self.h)
        try:
            self.version = cublas.getVersion(self.h)
        except Exception:  # noqa: BLE001
            self.version = None
        self.cupy_version = getattr(cupy, "__version__", "?")
        self.alpha = np.array(1.0, dtype=np.float32)
        self.beta = np.array(0.0, dtype=np.float32)
        self._streams = {}

    def _cupy_stream(self, ptr: int):
        s = self._streams.get(ptr)
        if s is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ext = getattr(self.cupy.cuda, "ExternalStream", None)
                if ext is not None:
                    s = ext(ptr, torch.cuda.current_device())  # never destroys the stream
                else:
                    s = self.cupy.cuda.Stream.from_external(_StreamRef(ptr))
            self._streams[ptr] = s  # kept for the whole run
        return s

    def _gemm_ex(self, ta, tb, m, n, k, a, a_t, lda, b, b_t, ldb, c, c_t, ldc):
        ptr = torch.cuda.current_stream().cuda_stream
        with self._cupy_stream(ptr):
            self.cublas.setStream(self.h, ptr)
            self.cublas.gemmEx(self.h, ta, tb, m, n, k, self.alpha.ctypes.data, a, a_t, lda,
                               b, b_t, ldb, self.beta.ctypes.data, c, c_t, ldc,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


def make_pedantic(dtype: torch.dtype, which: str = "auto", err=str):
    """-> (backend or None, reason or None, notes).

    'auto': ctypes (graph-capturable), used only if it gives the same bits as CuPy's binding
    on all three ops (when CuPy is there); else CuPy. 'ctypes' / 'cupy': that one only."""
    from .checks import same_bits

    notes, errors = [], []
    cupy_b = ctypes_b = None
    if which in ("auto", "cupy"):
        try:
            cupy_b = PedanticCupy()
        except Exception as e:  # noqa: BLE001
            errors.append(f"CuPy binding: {err(e)}")
    if which in ("auto", "ctypes"):
        try:
            ctypes_b = PedanticCtypes.open(dtype)
        except Exception as e:  # noqa: BLE001
            errors.append(f"ctypes: {err(e)}")
    if which == "auto" and ctypes_b is not None and cupy_b is not None:
        try:
            from .gpu import DEVICE

            g = torch.Generator(device=DEVICE).manual_seed(7)
            x = torch.randn(256, 1024, device=DEVICE, dtype=dtype, generator=g)
            w = torch.randn(768, 1024, device=DEVICE, dtype=dtype, generator=g) / 32
            dy = torch.randn(256, 768, device=DEVICE, dtype=dtype, generator=g)
            checks = {"fwd": (x, w), "dx": (dy, w), "dw": (dy, x)}
            differ = [op for op, (a, b) in checks.items()
                      if not same_bits(ctypes_b.run(op, a, b), cupy_b.run(op, a, b))]
            torch.cuda.synchronize()
            if differ:
                errors.append(f"the ctypes call gave different bits from CuPy's binding on "
                              f"{', '.join(differ)}")
                ctypes_b = None
            else:
                notes.append("PEDANTIC via ctypes gave the same bits as CuPy's gemmEx binding "
                             "on fwd, dx and dw checks (256 x 1024 x 768)")
        except Exception as e:  # noqa: BLE001
            notes.append(f"ctypes vs CuPy cross-check failed: {err(e)}")
    chosen = ctypes_b if ctypes_b is not None else cupy_b
    if chosen is None:
        return None, "; ".join(errors) or "no backend", notes
    if chosen is cupy_b:
        notes.append("PEDANTIC through CuPy's binding, which cannot be graph-captured: timed by "
                     "an event-timed loop (includes host launch cost)")
    chosen.cupy_version = getattr(cupy_b, "cupy_version", None)
    notes.extend(f"PEDANTIC {e}" for e in errors)
    return chosen, None, notes
