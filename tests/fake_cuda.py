"""A stand-in for the CUDA pieces the bench and tune use (events, streams, graphs), so their
GPU code paths run on CPU tensors in CI.

Time is the host clock plus a virtual offset: a "graph" remembers how long its capture took
and a replay advances the offset by that much without running anything, so a replay "lasts"
as long as the calls it captured. Inputs are made on the CPU (`benchlib.gpu.DEVICE`), where
detgemm runs its bit-exact reference."""

from __future__ import annotations

import contextlib
import ctypes
import time
import types

import numpy as np
import torch

from detgemm_cute.benchlib import gpu as bgpu


class Clock:
    offset = 0.0

    @classmethod
    def now(cls) -> float:
        return time.perf_counter() + cls.offset


class Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = Clock.now()

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1000.0


class Stream:
    cuda_stream = 1234

    def wait_stream(self, other):
        pass


class Graph:
    captures = 0

    def __init__(self):
        self.duration = None

    def replay(self):
        if self.duration is None:
            raise RuntimeError("replay of a graph that was never captured")
        Clock.offset += self.duration


@contextlib.contextmanager
def graph(g, pool=None, stream=None, capture_error_mode="global"):
    t0 = time.perf_counter()
    yield g
    g.duration = time.perf_counter() - t0
    Graph.captures += 1


def install(monkeypatch, device_name="NVIDIA H100 80GB HBM3", arch="sm90", l2=1 << 20):
    """Patch torch.cuda's timing pieces and benchlib's device hooks for a CPU run."""
    cuda = torch.cuda
    current = Stream()
    monkeypatch.setattr(cuda, "Event", Event)
    monkeypatch.setattr(cuda, "Stream", lambda *a, **k: Stream())
    monkeypatch.setattr(cuda, "current_stream", lambda *a, **k: current)
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda, "graph", graph)
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bgpu, "DEVICE", "cpu")
    monkeypatch.setattr(bgpu, "gpu_check", lambda: (None, arch))
    monkeypatch.setattr(bgpu, "l2_bytes", lambda: l2)
    monkeypatch.setattr(bgpu, "device_meta", lambda: {
        "device": device_name, "capability": "90", "sm_count": 132, "l2_mb": l2 / 1e6,
        "memory_gb": 80.0, "torch": torch.__version__, "cuda": "13.0",
        "date": "2026-01-01 00:00 UTC", "argv": [], "detgemm": "0.1.0", "cutlass_dsl": "4.8.1"})
    monkeypatch.setattr(cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(multi_processor_count=132,
                                                         L2_cache_size=l2, name=device_name))
    fake_blas = {"lib": torch._C._BlasBackend.Cublas}

    def preferred(backend=None):
        if backend is not None:
            fake_blas["lib"] = (torch._C._BlasBackend.Cublaslt if backend == "cublaslt"
                                else backend)
        return fake_blas["lib"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    return fake_blas


# ---------------------------------------------------------------------------------------
# A fake libcublas: cublasGemmEx with column-major semantics, on host memory
# ---------------------------------------------------------------------------------------

_NP = {2: (np.uint16, torch.float16), 14: (np.uint16, torch.bfloat16), 0: (np.float32, None)}


def _colmajor(ptr: int, cuda_type: int, rows: int, cols: int, ld: int) -> torch.Tensor:
    """A [rows, cols] view of a column-major matrix at host address `ptr` with leading dim ld."""
    np_t, torch_t = _NP[cuda_type]
    count = ld * (cols - 1) + rows
    buf = (ctypes.c_byte * (count * np.dtype(np_t).itemsize)).from_address(ptr)
    arr = np.frombuffer(buf, dtype=np_t, count=count)
    t = torch.from_numpy(arr)
    if torch_t is not None:
        t = t.view(torch_t)
    full = torch.nn.functional.pad(t, (0, ld * cols - count)) if ld * cols > count else t
    return full.reshape(cols, ld)[:, :rows].t()


class FakeCublas:
    """Records calls; cublasGemmEx computes C = op(A) op(B) in fp32 and stores it."""

    def __init__(self):
        self.calls = []
        self.math_mode = 0

    class _Fn:
        def __init__(self, impl):
            self.impl, self.argtypes, self.restype = impl, None, None

        def __call__(self, *args):
            return self.impl(*args)

    def __getattr__(self, name):
        impl = getattr(self, "_" + name, None)
        if impl is None:
            raise AttributeError(name)
        fn = FakeCublas._Fn(impl)
        self.__dict__[name] = fn
        return fn

    def _cublasCreate_v2(self, ref):
        ref._obj.value = 1
        return 0

    def _cublasSetMathMode(self, h, mode):
        self.math_mode = mode
        return 0

    def _cublasGetMathMode(self, h, ref):
        ref._obj.value = self.math_mode
        return 0

    def _cublasGetVersion_v2(self, h, ref):
        ref._obj.value = 130100
        return 0

    def _cublasSetStream_v2(self, h, s):
        self.calls.append(("stream", s))
        return 0

    def _cublasSetWorkspace_v2(self, h, p, n):
        self.calls.append(("workspace", p, n))
        return 0

    def _cublasGemmEx(self, h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc,
                      compute, algo):
        self.calls.append(("gemm", ta, tb, m, n, k, lda, ldb, ldc, at, bt, ct, compute, algo))
        A = _colmajor(a, at, m if ta == 0 else k, k if ta == 0 else m, lda).float()
        B = _colmajor(b, bt, k if tb == 0 else n, n if tb == 0 else k, ldb).float()
        A = A if ta == 0 else A.t()
        B = B if tb == 0 else B.t()
        C = _colmajor(c, ct, m, n, ldc)
        C.copy_((A @ B).to(C.dtype))
        return 0
