"""The training triad on the GPU: dX batch invariance, the dW micro-batch / padding contract
continued from an fp32 buffer, the bias gradient, autograd and modules, CUDA graphs of the
backward, and two training runs giving identical bits.

Bits are compared on integer views; values against fp64. Outputs land in NaN-poisoned
allocator blocks so unwritten elements show."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU (each family the GPU can run is tested)",
                allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from gpu_helpers import DEV, current_family, family, poison, rand, rel_err, same_bits  # noqa: E402,F401
from detgemm_cute import reference, registry  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def buckets(op):
    """The 16-bit buckets of `op` (fp32 and tf32 buckets have their own test modules)."""
    return [b for b in registry.get_registry(current_family()).buckets if b.op == op
            and set(b.dtypes) & set(registry.REQUIRED_DTYPES)]


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,n,k", [(1, 64, 64), (100, 250, 1001), (2048, 4096, 1024),
                                   (8192, 1024, 4096), (4000, 3000, 2000)])
def test_grads_match_fp64(dtype, t, n, k):
    x, w = rand(t, k, dtype=dtype), rand(n, k, dtype=dtype)
    dy = rand(t, n, dtype=dtype)
    poison()
    dx = dg.input_grad(dy, w)
    dw = dg.weight_grad(dy, x)
    db = dg.bias_grad(dy)
    for got in (dx, dw, db):
        assert not torch.isnan(got).any()
    assert dx.dtype == dtype and dw.dtype == torch.float32 and db.dtype == torch.float32
    d64 = dy.double()
    assert rel_err(dx, d64 @ w.double()) < TOL[dtype]
    assert rel_err(dw, d64.t() @ x.double()) < 1e-5  # fp32 out: no 16-bit rounding
    assert rel_err(db, d64.sum(0)) < 1e-5
    assert same_bits(dg.weight_grad(dy, x, out_dtype=dtype), dw.to(dtype))


@pytest.mark.parametrize("t,n,k", [(37, 24, 40), (100, 250, 1001), (300, 128, 64)])
def test_grads_are_the_reference_bits(t, n, k):
    """The kernels compute exactly the modelled chains (reference = CPU model of the GPU)."""
    x, w, dy = rand(t, k), rand(n, k), rand(t, n)
    acc = torch.randn(n, k, device=DEV)
    want_acc = reference.chain(dy.t().cpu(), x.cpu(), acc.cpu())
    assert same_bits(dg.input_grad(dy, w).cpu(), reference.mm(dy.cpu(), w.cpu()))
    assert same_bits(dg.weight_grad(dy, x).cpu(), reference.chain(dy.t().cpu(), x.cpu()))
    assert same_bits(dg.weight_grad(dy, x, acc=acc).cpu(), want_acc)
    ones = torch.ones(t, 1, dtype=dy.dtype)
    assert same_bits(dg.bias_grad(dy).cpu(), reference.chain(dy.t().cpu(), ones)[:, 0])


# ------------------------------------------------------------------- dX batch invariance
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 4096), (768, 3072)])
def test_input_grad_batch_invariance(n, k):
    """Row i of dX depends only on row i of dY: any M, any bucket."""
    w, dy = rand(n, k), rand(8192, n)
    full = dg.input_grad(dy, w)
    for m in (1, 7, 16, 100, 129, 512, 1000, 1025, 4096):
        poison()
        assert same_bits(dg.input_grad(dy[:m], w), full[:m]), m


@pytest.mark.parametrize("shard", range(4))
@pytest.mark.parametrize("n,k", [(4096, 1024), (768, 3072)])
def test_input_grad_every_bucket(n, k, shard):
    """Every dx bucket, forced, gives the rows of the table's own choice."""
    w, dy = rand(n, k), rand(600, n)
    full = dg.input_grad(dy, w)
    for b in buckets("dx")[shard::4]:
        with dg.force_bucket(b.name):
            poison()
            assert same_bits(dg.input_grad(dy, w), full), b.name


# ---------------------------------------------------------------------- dW contract
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 4096), (768, 3072), (250, 1001)])
def test_weight_grad_microbatches_equal_one_call(n, k):
    """Accumulating micro-batches whose token counts are multiples of 16 (in an fp32
    buffer that starts at zero) gives the bits of one call on all the tokens."""
    x, dy = rand(8192, k), rand(8192, n)
    whole = dg.weight_grad(dy, x)
    for splits in ((4096, 4096), (16, 4080, 2048, 2048), (1024,) * 8, (48, 8144)):
        acc = torch.zeros(n, k, device=DEV)
        lo = 0
        for size in splits:
            dg.weight_grad(dy[lo:lo + size], x[lo:lo + size], acc=acc)
            lo += size
        assert same_bits(acc, whole), splits
    db = torch.zeros(n, device=DEV)
    for lo in range(0, 8192, 2048):
        dg.bias_grad(dy[lo:lo + 2048], acc=db)
    assert same_bits(db, dg.bias_grad(dy))


def test_weight_grad_padding_tokens_change_nothing():
    x, dy = rand(1000, 512), rand(1000, 384)
    want = dg.weight_grad(dy, x)
    for pad in (1, 5, 16, 77):
        pdy = torch.cat([dy, torch.zeros(pad, 384, device=DEV, dtype=dy.dtype)])
        px = torch.cat([x, rand(pad, 512)])
        assert same_bits(dg.weight_grad(pdy, px), want), pad
        assert same_bits(dg.bias_grad(pdy), dg.bias_grad(dy)), pad


@pytest.mark.parametrize("shard", range(4))
def test_weight_grad_every_bucket_and_run_to_run(shard):
    x, dy = rand(3000, 1536), rand(3000, 2048)
    acc0 = torch.randn(2048, 1536, device=DEV)
    first = dg.weight_grad(dy, x, acc=acc0.clone())
    for _ in range(3):
        poison()
        assert same_bits(dg.weight_grad(dy, x, acc=acc0.clone()), first)
    for b in buckets("dw")[shard::4]:
        with dg.force_bucket(b.name):
            assert same_bits(dg.weight_grad(dy, x, acc=acc0.clone()), first), b.name


def test_weight_grad_into_strided_and_unaligned_buffers():
    """A buffer TMA cannot write in place goes through an aligned copy: same bits."""
    x, dy = rand(512, 250), rand(512, 96)
    acc0 = torch.randn(96, 250, device=DEV)
    want = dg.weight_grad(dy, x, acc=acc0.clone())
    big = torch.randn(96, 300, device=DEV)
    view = big[:, 3:253]  # 12-byte offset, 1200-byte rows: not TMA-addressable
    view.copy_(acc0)
    outside = torch.cat([big[:, :3], big[:, 253:]], 1).clone()
    dg.weight_grad(dy, x, acc=view)
    assert same_bits(view, want)
    assert same_bits(torch.cat([big[:, :3], big[:, 253:]], 1), outside)
    # Transposed operands (dY^T given as a view of a [N, T] tensor) need no copy.
    dyt = dy.t().contiguous().t()
    assert same_bits(dg.weight_grad(dyt, x, acc=acc0.clone()), want)


def test_non_multiple_of_16_microbatches_are_deterministic():
    """Documented: a split at a token count that is not a multiple of 16 is reproducible,
    but is allowed to differ from the unsplit result."""
    x, dy = rand(200, 256), rand(200, 128)
    runs = []
    for _ in range(2):
        acc = torch.zeros(128, 256, device=DEV)
        dg.weight_grad(dy[:37], x[:37], acc=acc)
        dg.weight_grad(dy[37:], x[37:], acc=acc)
        runs.append(acc)
    assert same_bits(runs[0], runs[1])
    assert rel_err(runs[0], dy.double().t() @ x.double()) < 1e-5


# ------------------------------------------------------------------ autograd, modules
def test_linear_autograd_runs_the_kernels_and_matches_explicit_calls():
    x = rand(4, 512, 1024).requires_grad_()
    w = rand(2048, 1024).requires_grad_()
    b = rand(2048).requires_grad_()
    y = dg.linear(x, w, b)
    g = rand(4, 512, 2048)
    y.backward(g)
    assert same_bits(x.grad, dg.input_grad(g, w.detach()))
    assert same_bits(w.grad, dg.weight_grad(g, x.detach()).to(torch.bfloat16))
    assert same_bits(b.grad, dg.bias_grad(g).to(torch.bfloat16))


def test_fp32_grad_accum_module_microbatches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).to(DEV, torch.bfloat16)
    dg.nn.convert(model, fp32_grad_accum=True)
    x = rand(4096, 1024)
    target = rand(4096, 1024)

    def run(chunks):
        dg.nn.zero_main_grads(model)
        for c in chunks:
            ((model(x[c]) - target[c]).float().square().sum()).backward()
        return [p.main_grad.clone() for p in model.parameters()]

    whole = run([slice(0, 4096)])
    split = run([slice(0, 1024), slice(1024, 1040), slice(1040, 4096)])
    assert all(same_bits(a, b) for a, b in zip(whole, split))


def test_cuda_graphs_capture_the_backward():
    lin = dg.nn.Linear(1024, 2048, device=DEV, dtype=torch.bfloat16)
    x = rand(1024, 1024).requires_grad_()
    graphed = torch.cuda.make_graphed_callables(lin, (x,))
    g = rand(1024, 2048)
    eager_x = x.detach().clone().requires_grad_()
    lin.weight.grad = None
    y = lin(eager_x)
    y.backward(g)
    want = (y.detach().clone(), eager_x.grad.clone(), lin.weight.grad.clone(),
            lin.bias.grad.clone())
    for _ in range(2):
        lin.weight.grad = lin.bias.grad = None
        xi = x.detach().clone().requires_grad_()
        out = graphed(xi)
        out.backward(g)
        got = (out.detach(), xi.grad, lin.weight.grad, lin.bias.grad)
        assert all(same_bits(a, b) for a, b in zip(got, want))

    # The accumulating ops under a raw graph capture.
    dy, xx = rand(2048, 512), rand(2048, 256)
    acc = torch.zeros(512, 256, device=DEV)
    dg.weight_grad(dy, xx, acc=acc)  # warm-up: compile and plan outside the capture
    dg.bias_grad(dy)
    acc.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dg.weight_grad(dy, xx, acc=acc)
    graph.replay()
    graph.replay()
    assert same_bits(acc, dg.weight_grad(torch.cat([dy, dy]), torch.cat([xx, xx])))


def test_torch_compile_backward_on_gpu():
    x = rand(256, 512).requires_grad_()
    w = rand(768, 512).requires_grad_()

    def f(x, w):
        return torch.nn.functional.silu(dg.linear(x, w)).float().sum()

    torch.compile(f, fullgraph=True)(x, w).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    f(x2, w2).backward()
    assert same_bits(x.grad, x2.grad) and same_bits(w.grad, w2.grad)


def _train(seed, steps=20):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
        torch.nn.GELU(), torch.nn.Linear(1024, 64)).to(DEV, torch.bfloat16)
    dg.nn.convert(model, fp32_grad_accum=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    data = torch.randn(8, 256, 512, device=DEV, generator=gen).to(torch.bfloat16)
    teacher = torch.randn(512, 64, device=DEV, generator=gen)
    labels = (data.float() @ teacher).argmax(-1)  # a learnable task
    losses = []
    for step in range(steps):
        dg.nn.zero_main_grads(model)
        opt.zero_grad(set_to_none=True)
        for micro in range(4):
            i = (4 * step + micro) % 8
            loss = torch.nn.functional.cross_entropy(model(data[i]).float(), labels[i])
            loss.backward()
            losses.append(loss.detach())
        dg.nn.finalize_grads(model)
        opt.step()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def test_training_twice_gives_identical_bits():
    l1, w1 = _train(7)
    l2, w2 = _train(7)
    assert same_bits(l1, l2), (l1 - l2).abs().max()
    assert all(same_bits(a, b) for a, b in zip(w1, w2)), "weights differ"
    assert l1[-4:].mean() < l1[:4].mean(), l1  # it learned something
