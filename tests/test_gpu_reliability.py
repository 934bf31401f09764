"""Reliability on the GPU: concurrency (streams, threads, cold compile caches), CUDA-graph
capture of every op, no memory growth, and sizes past int32 indexing.

(Sanitizer runs: tests/sanitize.py under compute-sanitizer; NaN/Inf propagation and
misaligned storage: tests/test_reference_gpu.py and tests/test_gpu_core.py.)"""

import threading

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from gpu_helpers import DEV, rand, same_bits  # noqa: E402
from detgemm_cute import compile as kcompile  # noqa: E402
from detgemm_cute import gemm as _gemm  # noqa: E402


def _problems():
    """A mix of ops and buckets: (callable, inputs)."""
    x, w, b = rand(700, 1024), rand(1536, 1024), rand(1536)
    dy, xs, wi = rand(2048, 512), rand(2048, 768), rand(512, 768)
    return [
        lambda: dg.linear(x, w, b),
        lambda: dg.linear(x[:9], w),
        lambda: dg.mm(x, w.t()),
        lambda: dg.input_grad(dy, wi),
        lambda: dg.weight_grad(dy, xs),
        lambda: dg.bias_grad(dy),
    ]


def test_many_streams_give_sequential_bits():
    probs = _problems()
    want = [p() for p in probs]
    streams = [torch.cuda.Stream() for _ in range(4)]
    got = [[None] * len(probs) for _ in streams]
    torch.cuda.synchronize()
    for rep in range(3):
        for si, s in enumerate(streams):
            with torch.cuda.stream(s):
                for i, p in enumerate(probs):
                    got[si][i] = p()
        torch.cuda.synchronize()
        for si in range(len(streams)):
            for i in range(len(probs)):
                assert same_bits(got[si][i], want[i]), (rep, si, i)


def test_threads_and_cold_caches():
    """Several threads, each on its own stream, start with empty plan and kernel caches and
    hit the same new kernels at once: no crash, one result per problem, the sequential bits."""
    x, w = rand(333, 1000), rand(520, 1000)
    want = dg.linear(x, w, out_dtype=torch.float32)
    torch.cuda.synchronize()
    _gemm._plans.clear()
    with kcompile._lock:
        kcompile._compiled.clear()
    builds = []  # compiles or AOT-cache loads (DETGEMM_CUTE_AOT_DIR may be set): one wanted
    real_load_or_build = kcompile._load_or_build

    def counting_load_or_build(key, *a, **k):
        builds.append(key)
        return real_load_or_build(key, *a, **k)

    kcompile._load_or_build = counting_load_or_build
    errors, results = [], [None] * 6
    barrier = threading.Barrier(6)

    def worker(i):
        try:
            s = torch.cuda.Stream()
            barrier.wait()
            with torch.cuda.stream(s):
                for _ in range(20):
                    results[i] = dg.linear(x, w, out_dtype=torch.float32)
            s.synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        kcompile._load_or_build = real_load_or_build
    assert not errors, errors
    assert len(builds) == len(set(builds)) == 1  # compiled once
    assert all(same_bits(r, want) for r in results)


def test_graph_capture_of_every_op():
    x, w, b = rand(300, 512), rand(264, 512), rand(264)
    dy, xs = rand(512, 264), rand(512, 512)
    acc = torch.randn(264, 512, device=DEV)
    bacc = torch.randn(264, device=DEV)
    calls = {
        "linear": lambda: dg.linear(x, w, b),
        "mm": lambda: dg.mm(x, w.t()),
        "addmm": lambda: dg.addmm(b, x, w.t()),
        "input_grad": lambda: dg.input_grad(dy, w),
        "weight_grad": lambda: dg.weight_grad(dy, xs),
        "weight_grad_bf16": lambda: dg.weight_grad(dy, xs, out_dtype=torch.bfloat16),
        "bias_grad": lambda: dg.bias_grad(dy),
    }
    for name, f in calls.items():
        want = f()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = f()
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(out, want), name
    # Accumulating forms: each replay continues the buffers.
    a0, b0 = acc.clone(), bacc.clone()
    dg.weight_grad(dy, xs, acc=a0)
    dg.bias_grad(dy, acc=b0)
    dg.weight_grad(dy, xs, acc=a0)
    dg.bias_grad(dy, acc=b0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dg.weight_grad(dy, xs, acc=acc)
        dg.bias_grad(dy, acc=bacc)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert same_bits(acc, a0) and same_bits(bacc, b0)


def test_no_memory_growth_over_10000_calls():
    x, w, b = rand(64, 64), rand(64, 64), rand(64)
    dy = rand(64, 64)
    acc = torch.zeros(64, 64, device=DEV)
    for _ in range(10):  # warm: kernels, plans, the bias-gradient ones buffer
        dg.linear(x, w, b)
        dg.weight_grad(dy, x, acc=acc)
        dg.bias_grad(dy)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    plans = len(_gemm._plans)
    for _ in range(10_000):
        y = dg.linear(x, w, b)
        dg.weight_grad(dy, x, acc=acc)
        dg.bias_grad(dy)
    del y
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert len(_gemm._plans) == plans


def test_sizes_past_int32_indexing():
    """X with more than 2^31 elements: the rows past element 2^31 are right (they equal the
    same rows computed alone: batch invariance), and dW over those tokens equals the sum of
    two halves continued in one buffer."""
    k, n = 4096, 256
    m = (1 << 31) // k + 64  # 2^31 + 262144 elements in X
    x = torch.empty(m, k, device=DEV, dtype=torch.bfloat16)
    x.normal_()
    w = rand(n, k)
    y = dg.linear(x, w)
    tail = x[-100:].clone()
    assert same_bits(y[-100:], dg.linear(tail, w))
    ref = tail.double() @ w.double().t()
    assert ((y[-100:].double() - ref).norm() / ref.norm()).item() < 1e-2
    del y
    dy = rand(m, 64)
    whole = dg.weight_grad(dy, x)
    half = (m // 2) // 16 * 16
    acc = torch.zeros(64, k, device=DEV)
    dg.weight_grad(dy[:half], x[:half], acc=acc)
    dg.weight_grad(dy[half:], x[half:], acc=acc)
    assert same_bits(acc, whole)
