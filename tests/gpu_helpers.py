"""Helpers shared by the GPU test modules: bit views, NaN poisoning, random CUDA inputs,
and the kernel-family fixture.

`family` parametrizes a module over the kernel families this GPU runs (an H100: "sm90"
and "sm80"; an 8.x GPU: "sm80";
``DETGEMM_TEST_FAMILIES=sm80`` narrows it) and runs each test inside ``use_family``, so the
same invariance suite proves the contract for each family on this GPU."""

import contextlib
import os

import pytest
import torch

DEV = "cuda"
# The batch-invariance sweep: rows at every M below against M = SWEEP_REF_M, on (N, K) pairs
# that together reach every fwd bucket of each family's table (tests/test_dispatch.py checks
# that on the CPU, so a table change that adds a bucket the sweep misses fails in CI).
SWEEP_REF_M = 12288
SWEEP_M = [1, 2, 3, 7, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 300, 512, 760, 1000,
           1024, 2024, 3032, 4096, 8192, 10097]
SWEEP_NK = [(4096, 4096), (768, 3072), (3072, 768), (9216, 1536), (14336, 512), (5120, 512),
            (7168, 512), (1536, 1536), (20480, 512), (10560, 512), (14848, 512), (16896, 512),
            (21120, 512), (25344, 512), (29632, 512), (31680, 512), (33792, 512), (38016, 512),
            (40960, 512), (1600, 512), (1280, 512), (2048, 1024), (4096, 1024), (28672, 4096),
            (1024, 512), (768, 512), (768, 8192), (3584, 8192), (4096, 512), (4096, 16384),
            (4096, 20480), (4096, 28672), (13312, 1024), (4096, 12288)]
_DEFAULT_FAMILIES = ("sm90,sm80" if torch.cuda.is_available()
                     and torch.cuda.get_device_capability() == (9, 0) else "sm80")
FAMILIES = [f for f in os.environ.get("DETGEMM_TEST_FAMILIES", _DEFAULT_FAMILIES).split(",")
            if f]


@pytest.fixture(params=FAMILIES)
def family(request):
    import detgemm_cute as dg

    with dg.use_family(request.param):
        yield request.param


def current_family() -> str:
    """The family the library runs on in this thread (what `family` set)."""
    from detgemm_cute import gemm

    return gemm.arch_of(torch.device(DEV))


def family_buckets(dtype: str, family: str | None = None) -> list:
    """The `dtype` buckets of `family` (default: the one this thread runs on)."""
    from detgemm_cute import registry

    reg = registry.get_registry(family or current_family())
    return [b for b in reg.buckets if dtype in b.dtypes]


def bucket_names(dtype: str) -> list[str]:
    """Every `dtype` bucket name of every family tested: parametrize an every-bucket test
    with it, and let `family_bucket` skip the names the running family lacks."""
    return sorted({b.name for f in FAMILIES for b in family_buckets(dtype, f)})


def family_bucket(name: str, dtype: str):
    """The running family's `dtype` bucket called `name` (the test skips when it has none)."""
    bucket = next((b for b in family_buckets(dtype) if b.name == name), None)
    if bucket is None:
        pytest.skip(f"{current_family()} has no {dtype} bucket {name}")
    return bucket


def bits(t):
    """The raw bit pattern of a 16- or 32-bit float tensor as integers."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(x, y):
    """Same shape, dtype and bits (NaN payloads included)."""
    return (x.shape == y.shape and x.dtype == y.dtype
            and torch.equal(bits(x.contiguous()), bits(y.contiguous())))


def poison():
    """Leave NaN-filled blocks in the caching allocator for outputs to land in, so an
    element a kernel never writes shows up as NaN."""
    blocks = [torch.full((n,), float("nan"), device=DEV) for n in (1 << 16, 1 << 20, 1 << 24)]
    del blocks


@contextlib.contextmanager
def torch_tf32(flag: bool):
    """PyTorch's own TF32 switch (``allow_tf32``) for a block, restored after."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = flag
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def assert_linear_matches_reference(x, w, bias=None):
    """dg.linear on CUDA fp32 inputs (outputs poisoned first) has the CPU reference's bits
    at this thread's fp32 precision."""
    import detgemm_cute as dg
    from detgemm_cute import reference

    poison()
    y = dg.linear(x, w, bias)
    assert y.dtype == torch.float32
    want = reference.linear(x.cpu(), w.cpu(), None if bias is None else bias.cpu())
    assert same_bits(y.cpu(), want)


def graph_replayed(fn):
    """fn()'s result as a CUDA graph replay writes it: fn runs once eagerly (compiles stay
    out of the capture), then once captured into a copy to a buffer that is NaN-filled
    before the replay."""
    out = torch.empty_like(fn())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fn())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV).to(dtype)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def fails_on_the_device(code: str, message: str, env: dict | None = None) -> str:
    """Run `code` in a fresh Python process (a failed launch ends the CUDA context), with
    `env` added to the environment, and check that it fails with `message` in its output: a
    device-side check. Returns the output."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env={**os.environ, **(env or {})})
    assert r.returncode != 0
    assert message in r.stdout + r.stderr, (r.stdout + r.stderr)[-800:]
    return r.stdout + r.stderr


def group_ends(sizes):
    """Group sizes -> grouped_mm's offs: int32 cumulative ends on the GPU."""
    return torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
