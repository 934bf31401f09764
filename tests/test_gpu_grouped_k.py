"""The one-launch grouped GEMM with groups along K (grouped_mm's 2-D x 2-D form on SM90).

- every grouped_k bucket, forced: each entry has the bits of `dg.mm` on its group's columns
  of a and rows of b alone (a 2-D GEMM from another table and tile), for groups empty,
  shorter than a k tile, exactly one, one over, and many; columns past the last group are
  read by nothing; a and b in either contiguous order; unaligned output rows; fp32 output;
  outputs land in NaN-poisoned memory;
- NaN and Inf in one group never reach its neighbours' entries (the last k tile of a group
  holds the next group's values until they are zeroed);
- the call is one launch that a CUDA graph captures, and a replay after offs changed in
  place gives the new grouping's bits (offs is read on the device);
- a bad offs fails the launch (a device-side check), and names the wrong entry with
  DETGEMM_CUTE_REPORT_OFFS=1.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import gemm, grouped_k, registry  # noqa: E402
from gpu_helpers import (fails_on_the_device, group_ends, poison, rand,  # noqa: E402
                         same_bits)

if gemm.arch_of(torch.device("cuda")) != "sm90":
    pytest.skip("the grouped-K kernel is SM90's", allow_module_level=True)

SIZES = [0, 1, 63, 64, 65, 0, 3 * 64 + 17, 5, 128, 200]  # cut a 64-wide k tile every way


def _buckets():
    return sorted(b.name for b in registry.get_registry("sm90").buckets
                  if b.op == grouped_k.OP)


def _operands(m, t, n, a_layout, b_layout, dtype=torch.bfloat16):
    """a [M, T] (`a_layout` "m": x^T, M contiguous, as the MoE backward passes it; "t": T
    contiguous), b [T, N] ("n": N contiguous; "t": T contiguous)."""
    a = rand(t, m, dtype=dtype).t() if a_layout == "m" else rand(m, t, dtype=dtype)
    b = rand(t, n, dtype=dtype) if b_layout == "n" else rand(n, t, dtype=dtype).t()
    return a, b


def _assert_entries(y, a, b, sizes, out_dtype=None, skip=()):
    assert y.shape == (len(sizes), a.shape[0], b.shape[1])
    start = 0
    for g, size in enumerate(sizes):
        if g in skip:
            pass
        elif size:
            want = dg.mm(a[:, start:start + size], b[start:start + size], out_dtype=out_dtype)
            assert same_bits(y[g], want), (sizes, g)
        else:
            assert not y[g].isnan().any() and not y[g].any(), f"empty group {g}"
        start += size


def test_the_2d_2d_form_runs_one_launch():
    a, b = _operands(256, sum(SIZES), 384, "m", "n")
    key = grouped_k.kernel_key(grouped_k.bucket_for(a, b, len(SIZES)), a, b, a.dtype)
    assert key is not None and key.grouped_k


@pytest.mark.parametrize("name", _buckets())
@pytest.mark.parametrize("layouts", [("m", "n"), ("t", "t"), ("m", "t"), ("t", "n")])
def test_every_grouped_k_bucket_matches_mm(name, layouts):
    m, n = 392, 520  # not multiples of BM / BN: the last tiles move back
    a, b = _operands(m, sum(SIZES) + 9, n, *layouts)  # 9 columns past the last group
    with dg.force_bucket(name):
        poison()
        _assert_entries(dg.grouped_mm(a, b, group_ends(SIZES)), a, b, SIZES)
        poison()
        y32 = dg.grouped_mm(a, b, group_ends(SIZES), out_dtype=torch.float32)
        _assert_entries(y32, a, b, SIZES, out_dtype=torch.float32)


@pytest.mark.parametrize("m,n", [(100, 300), (64, 8), (4096, 2048), (7, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_k_shapes(m, n, dtype):
    """Unaligned output rows (N = 300: stored by the threads or padded), a narrow N, a
    large entry, M below one tile; both 16-bit dtypes."""
    sizes = [37, 0, 200, 129, 1, 64, 700]
    a, b = _operands(m, sum(sizes), n, "m", "n", dtype)
    poison()
    _assert_entries(dg.grouped_mm(a, b, group_ends(sizes)), a, b, sizes)


@pytest.mark.parametrize("m,t,n", [(0, 50, 16), (16, 50, 0), (16, 0, 16)])
def test_empty_dims(m, t, n):
    """M or N of 0 (nothing to compute) and T of 0 (every group empty): zeros of the right
    shape, as torch._grouped_mm gives."""
    sizes = [t // 2, 0, t - t // 2]
    a, b = _operands(m, t, n, "m", "n")
    y = dg.grouped_mm(a, b, group_ends(sizes))
    assert y.shape == (3, m, n) and not y.any()


def test_nan_and_inf_stay_in_their_group():
    """A group's last k tile is loaded with the next group's values; they must be zeroed on
    both sides (0 x Inf would be NaN), so a neighbour's NaN or Inf never reaches an entry."""
    sizes = [70, 50, 33, 130, 1, 64]
    a, b = _operands(320, sum(sizes), 256, "m", "n")
    starts = group_ends([0] + sizes[:-1]).tolist()
    a[:, starts[1]:starts[1] + 3] = float("nan")  # group 1: group 0's tail reads these
    b[starts[3]:starts[3] + 2] = float("inf")  # group 3: group 2's tail reads these
    a[:, starts[5]] = float("inf")  # group 5: group 4 (one column) reads it
    poison()
    y = dg.grouped_mm(a, b, group_ends(sizes))
    _assert_entries(y, a, b, sizes, skip=(1, 3, 5))
    assert y[1].isnan().any() and not y[0].isnan().any()


def test_grouped_k_is_captured_and_reads_offs_on_the_device():
    first, second = [100, 0, 300, 50, 250, 150], [1, 600, 0, 99, 0, 190]
    a, b = _operands(512, 900, 640, "m", "n")
    offs = group_ends(first)
    dg.grouped_mm(a, b, offs)  # compile outside the capture
    out = torch.empty(6, 512, 640, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(dg.grouped_mm(a, b, offs))
    for sizes in (first, second):
        offs.copy_(group_ends(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_entries(out, a, b, sizes)


def test_moe_weight_gradient_in_one_launch():
    """Autograd of the mixture-of-experts form: dW is the grouped-K call; each expert's
    gradient has the bits of dg.mm over its own tokens."""
    sizes = [10, 0, 130, 48, 300]
    x = rand(sum(sizes), 256)
    w = rand(5, 192, 256).transpose(1, 2).detach().requires_grad_()  # [E, K, N] view
    g = rand(sum(sizes), 192)
    dg.grouped_mm(x, w, group_ends(sizes)).backward(g)
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        want = dg.mm(x[rows].t(), g[rows]) if size else torch.zeros_like(w.grad[e])
        assert same_bits(w.grad[e], want), e
        start += size


@pytest.mark.parametrize("offs,message", [([50, 20, 100], "offs[1] = 20 after 50"),
                                          ([50, 70, 101], "offs[2] = 101 after 70")])
def test_bad_offs_fail_on_the_device(offs, message):
    """offs is never read on the host: the kernel checks it and fails the launch (in a
    subprocess: a failed launch ends the CUDA context); the build that
    DETGEMM_CUTE_REPORT_OFFS=1 asks for also prints the entry that is wrong."""
    code = ("import torch, detgemm_cute as dg\n"
            "a = torch.randn(100, 64, device='cuda', dtype=torch.bfloat16).t()\n"
            "b = torch.randn(100, 32, device='cuda', dtype=torch.bfloat16)\n"
            f"offs = torch.tensor({offs}, device='cuda', dtype=torch.int32)\n"
            "dg.grouped_mm(a, b, offs)\n"
            "torch.cuda.synchronize()\n")
    fails_on_the_device(code, message, env={"DETGEMM_CUTE_REPORT_OFFS": "1"})
    assert message not in fails_on_the_device(code, "CUDA error",
                                              env={"DETGEMM_CUTE_REPORT_OFFS": "0"})
