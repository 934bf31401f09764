"""Programmatic dependent launch (PDL) of the SM90 kernels: a kernel that starts under its
predecessor's tail reads and writes nothing before that predecessor has completed.

Every check runs the same calls back to back with PDL on (no synchronisation between them)
and with PDL off (synchronised after each call), and asserts the same bits:
- a chain of linear layers, each reading the output the previous kernel just wrote
  (read after write), at decode, small and prefill M (row tiles, one-CTA-per-tile and
  persistent kernels), eagerly and in a CUDA graph;
- dW micro-batches accumulating into one fp32 buffer back to back (each kernel reads what
  the previous one wrote), which must also equal one call on all the tokens;
- a kernel that writes (accumulates into) the memory the previous kernel reads as its
  input (write after read);
- grouped GEMMs feeding each other, and bmm.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("PDL is launched by the SM90 kernels (needs an H100/H200)",
                allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import pdl  # noqa: E402
from gpu_helpers import group_ends, poison, rand, same_bits  # noqa: E402


@pytest.fixture(autouse=True)
def _sm90_pdl_restored():
    before = pdl.enabled()
    with dg.use_family("sm90"):
        yield
    pdl.set_enabled(before)


def _both(run):
    """run(sync) -> list of outputs, with PDL off (a sync after each call), then on (no
    syncs; after one warm-up run, so no compile or plan sits between two launches); asserts
    equal bits element by element and returns the PDL outputs."""
    pdl.set_enabled(False)
    poison()
    off = run(torch.cuda.synchronize)
    torch.cuda.synchronize()
    pdl.set_enabled(True)
    run(lambda: None)  # warm-up: every PDL kernel compiled or loaded and planned, so the
    torch.cuda.synchronize()  # checked run below launches them back to back
    poison()
    on = run(lambda: None)
    torch.cuda.synchronize()
    assert len(on) == len(off)
    for i, (a, b) in enumerate(zip(on, off)):
        assert same_bits(a, b), f"output {i} differs with PDL on"
        assert not a.isnan().any(), f"output {i} has NaN"
    return on


def _chain(x, weights, step):
    """run(sync) for `_both`: y = step(y, w) for each weight in turn, each reading the output
    the kernel before it wrote; every output kept."""
    def run(sync):
        y, outs = x, []
        for w in weights:
            y = step(y, w)
            outs.append(y)
            sync()
        return outs

    return run


@pytest.mark.parametrize("m", [1, 40, 300, 2048])
def test_dependent_linear_chain(m):
    d = 1024
    x = rand(m, d)
    layers = [(rand(d, d) * d ** -0.5, rand(d)) for _ in range(10)]
    _both(_chain(x, layers, lambda y, wb: dg.linear(y, *wb)))


def test_dependent_chain_in_a_graph():
    d, m = 2048, 64
    x = rand(m, d)
    layers = [rand(d, d) * d ** -0.5 for _ in range(8)]

    def chain(inp):
        y = inp
        for w in layers:
            y = dg.linear(y, w)
        return y

    pdl.set_enabled(False)
    want = chain(x)
    torch.cuda.synchronize()
    pdl.set_enabled(True)
    chain(x)  # compile outside the capture
    torch.cuda.synchronize()
    static_x = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = chain(static_x)
    for _ in range(3):
        got.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(got, want)


def test_weight_grad_micro_batches_back_to_back():
    n, k, tokens, micro = 1536, 768, 1024, 64
    dy, x = rand(tokens, n) * tokens ** -0.5, rand(tokens, k)

    def run(sync):
        acc = torch.zeros(n, k, device="cuda", dtype=torch.float32)
        for s in range(0, tokens, micro):
            dg.weight_grad(dy[s:s + micro], x[s:s + micro], acc=acc)
            sync()
        return [acc]

    (acc,) = _both(run)
    assert same_bits(acc, dg.weight_grad(dy, x))


def test_kernel_writes_what_the_previous_kernel_reads():
    """Kernel A reads T (as a bf16 operand); kernel B, next in the stream, accumulates into
    T in place (its fp32 dW buffer, the same memory): B must not store before A has read."""
    n, k, d, t = 8192, 2048, 4096, 64
    w = rand(d, 2 * k) * (2 * k) ** -0.5
    dy, x = rand(t, n) * t ** -0.5, rand(t, k)
    t16 = rand(n, 2 * k)  # finite bf16 values; as fp32 pairs, finite too (normal high halves)

    def run(sync):
        buf = t16.clone()
        before = buf.clone()
        y = dg.linear(buf, w)  # A reads buf
        sync()
        dg.weight_grad(dy, x, acc=buf.view(torch.float32))  # B writes buf
        torch.cuda.synchronize()
        assert same_bits(y, dg.linear(before, w)), "A read memory B had already written"
        return [y, buf.view(torch.float32)]

    _both(run)


def test_grouped_gemms_feed_each_other():
    experts, d, tokens = 8, 1024, 2048
    sizes = [300, 0, 257, 500, 1, 390, 200, 400]
    assert sum(sizes) == tokens
    offs = group_ends(sizes)
    x = rand(tokens, d)
    ws = [rand(experts, d, d) * d ** -0.5 for _ in range(4)]
    _both(_chain(x, ws, lambda y, w: dg.grouped_mm(y, w, offs)))


def test_bmm_chain():
    b, s, h = 12, 333, 128
    q, k, v = rand(b, s, h), rand(b, s, h), rand(b, s, h)

    def run(sync):
        p = dg.bmm(q, k.transpose(1, 2))
        sync()
        o = dg.bmm(p, v)
        sync()
        o2 = dg.bmm(o, k.transpose(1, 2))
        sync()
        return [p, o, o2]

    _both(run)
