"""The deferred, rank-ordered dW chain of `detgemm_cute.distributed` on one GPU: a world of
one rank over NCCL, in this process. The deferred chain (records kept until finalize, dW and
db run per slice of output features) gives the bits of the plain chain (dW in backward),
and the GPU's deferred chain gives the CPU reference's bits. Multi-GPU runs:
tests/test_multigpu_distributed.py."""

import contextlib
import datetime
import random
import tempfile

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU (each family the GPU can run is tested)",
                allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import detgemm_cute as dg  # noqa: E402
from detgemm_cute.distributed import InvariantDataParallel  # noqa: E402
from gpu_helpers import DEV, family  # noqa: E402,F401


@pytest.fixture(scope="module", autouse=True)
def nccl_world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120))
        try:
            yield
        finally:
            dist.destroy_process_group()


class Net(torch.nn.Module):
    """Odd widths (250 outputs: dY column slices that TMA cannot read in place)."""

    def __init__(self, d=256, h=1000, out=250):
        super().__init__()
        self.up = torch.nn.Linear(d, h)
        self.mid = torch.nn.Linear(h, h, bias=False)
        self.down = torch.nn.Linear(h, out)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.mid(torch.nn.functional.gelu(self.up(x)))))


def _model(seed, dtype, device=DEV, **kw):
    torch.manual_seed(seed)
    return dg.nn.convert(Net(**kw).to(device=device, dtype=dtype), fp32_grad_accum=True)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _step(net, xs, ys, total, flush_each=False):
    """One step over micro-batches; wrapped, all but the last under no_sync() (the last
    backward starts the pass), or with a flush after each."""
    dg.nn.zero_main_grads(net)
    wrapped = isinstance(net, InvariantDataParallel)
    for j, (x, y) in enumerate(zip(xs, ys)):
        hold = wrapped and not flush_each and j < len(xs) - 1
        with net.no_sync() if hold else contextlib.nullcontext():
            ((net(x).float() - y.float()).square().sum() / total).backward()
        if flush_each:
            net.flush()
    dg.nn.finalize_grads(net)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pipeline_bytes,flush_each,overlap", [
    (4 << 20, False, True), (64 << 10, False, True), (64 << 10, True, True),
    (64 << 10, False, False)])
def test_deferred_chain_equals_plain_chain(dtype, pipeline_bytes, flush_each, overlap):
    """3 AdamW steps with micro-batches of 16, 48, 2048 and 512 tokens: the wrapped model
    (world of one, deferred dW/db per slice of output features on the side stream, started
    in the last backward or at the flush, optionally a flush after every micro-batch) keeps
    the plain model's main_grad, .grad and weights bit for bit."""
    seed = random.randrange(1 << 30)
    plain, wrapped = _model(seed, dtype), _model(seed, dtype)
    net = InvariantDataParallel(wrapped, pipeline_bytes=pipeline_bytes, overlap=overlap)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, wrapped)]
    sizes = [16, 48, 2048, 512]
    for step in range(3):
        xs = [torch.randn(t, 256, device=DEV).to(dtype) for t in sizes]
        ys = [torch.randn(t, 250, device=DEV).to(dtype) for t in sizes]
        _step(plain, xs, ys, sum(sizes))
        _step(net, xs, ys, sum(sizes), flush_each)
        for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(_bits(p.main_grad), _bits(q.main_grad)), (name, step, seed)
            assert torch.equal(_bits(p.grad), _bits(q.grad)), (name, step, seed)
        for o in opts:
            o.step()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(_bits(p.detach()), _bits(q.detach())), (name, seed)
    assert net.stats.units > 0 and net.stats.sent_bytes == 0


def test_gpu_deferred_chain_equals_cpu_reference():
    """The deferred chain on the GPU, in 1 KiB slices of output features, over micro-batches
    of 16, 32 and 48 tokens, equals the CPU reference's one chain over the same recorded
    dY and X (concatenated in order), for every weight and bias."""
    seed = random.randrange(1 << 30)
    net = InvariantDataParallel(_model(seed, torch.bfloat16, d=64, h=96, out=40),
                                pipeline_bytes=1024)
    sizes = [16, 32, 48]
    dg.nn.zero_main_grads(net)
    with net.no_sync():  # records kept until finalize_grads
        for t in sizes:
            x = torch.randn(t, 64, device=DEV).to(torch.bfloat16)
            y = torch.randn(t, 40, device=DEV).to(torch.bfloat16)
            ((net(x).float() - y.float()).square().sum() / sum(sizes)).backward()
    expected = {}
    for layer in net._engine.layers:
        dy = torch.cat([r.dy.cpu() for r in layer.records])
        x = torch.cat([r.x.cpu() for r in layer.records])
        mod = layer.module
        expected[id(mod.weight)] = dg.weight_grad(dy, x)
        if mod.bias is not None:
            expected[id(mod.bias)] = dg.bias_grad(dy)
    dg.nn.finalize_grads(net)
    assert len(expected) == 5
    for name, p in net.module.named_parameters():
        assert torch.equal(_bits(p.main_grad.cpu()), _bits(expected[id(p)])), (name, seed)
