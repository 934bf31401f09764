"""The training stack on the GPU: CUDA autocast (bf16 and fp16), fake CUDA tensors (no plan,
no launch), the mode leaving CPU matmuls alone, and 3-D linear through the op path (its
output written through a 2-D view). Bits are compared with torch.equal on integer views;
every expectation is the same computation with explicit casts, or the CPU reference."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("family")]

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU (each family the GPU can run is tested)",
                allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from gpu_helpers import family, poison, same_bits  # noqa: E402,F401
from detgemm_cute import gemm, mode, reference  # noqa: E402

DEV = "cuda"
F32 = torch.float32
AMP = [torch.bfloat16, torch.float16]


def rand(*shape, dtype=F32, grad=False):
    return torch.randn(*shape, device=DEV).to(dtype).requires_grad_(grad)


@pytest.mark.parametrize("dtype", AMP)
@pytest.mark.parametrize("out_dtype", [None, F32])
def test_cuda_autocast_forward_equals_explicit_casts(dtype, out_dtype):
    poison()
    x, w, b = rand(3, 77, 512), rand(1000, 512), rand(1000)
    xc, wc, bc = x.to(dtype), w.to(dtype), b.to(dtype)
    with torch.autocast("cuda", dtype=dtype):
        y = dg.linear(x, w, b, out_dtype=out_dtype)
        z = dg.mm(x[0], w.t(), out_dtype=out_dtype)
        za = dg.addmm(b, x[0], w.t(), out_dtype=out_dtype)
        assert torch.nn.functional.linear(x, w, b).dtype == dtype
    assert y.dtype == (out_dtype or dtype)
    assert same_bits(y, dg.linear(xc, wc, bc, out_dtype=out_dtype))
    assert same_bits(z, dg.mm(xc[0], wc.t(), out_dtype=out_dtype))
    assert same_bits(za, dg.addmm(bc, xc[0], wc.t(), out_dtype=out_dtype))
    assert same_bits(y[1].cpu(), reference.linear(xc[1].cpu(), wc.cpu(), bc.cpu(), out_dtype))


def test_bf16_inputs_under_fp16_autocast_are_cast():
    x, w = rand(64, 256, dtype=torch.bfloat16), rand(128, 256, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.float16):
        y = dg.linear(x, w)
    assert same_bits(y, dg.linear(x.half(), w.half()))


@pytest.mark.parametrize("dtype", AMP)
def test_cuda_autocast_module_grads_are_fp32_and_explicit(dtype):
    torch.manual_seed(0)
    model = dg.nn.convert(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                              torch.nn.Linear(512, 128))).to(DEV)
    x = rand(4, 48, 256)
    with torch.autocast("cuda", dtype=dtype):
        y = model(x)
    y.float().square().mean().backward()
    ps = [p.detach().clone().requires_grad_() for p in model.parameters()]
    h = torch.relu(dg.linear(x.to(dtype), ps[0].to(dtype), ps[1].to(dtype)))
    y_ref = dg.linear(h, ps[2].to(dtype), ps[3].to(dtype))
    y_ref.float().square().mean().backward()
    assert y.dtype == dtype and same_bits(y, y_ref)
    for p, r in zip(model.parameters(), ps):
        assert p.dtype == F32 and p.grad.dtype == F32 and same_bits(p.grad, r.grad)


def test_cuda_autocast_fp32_grad_accum_chain():
    """fp32 parameters under autocast with fp32 main_grad: micro-batches of 16 + 112 tokens
    give the main_grad bits of a bf16 model on all 128 tokens at once."""
    torch.manual_seed(1)
    base = torch.nn.Linear(384, 256).to(DEV)
    fp32 = dg.nn.Linear.from_linear(base, fp32_grad_accum=True)
    half = dg.nn.Linear(384, 256, device=DEV, dtype=torch.bfloat16, fp32_grad_accum=True)
    with torch.no_grad():
        half.weight.copy_(base.weight)
        half.bias.copy_(base.bias)
    x, g = rand(128, 384), rand(128, 256, dtype=torch.bfloat16)
    for rows in (slice(0, 16), slice(16, 128)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fp32(x[rows])
        y.backward(g[rows])
    half(x.bfloat16()).backward(g)
    for p, q in ((fp32.weight, half.weight), (fp32.bias, half.bias)):
        assert same_bits(p.main_grad, q.main_grad)
    dg.nn.finalize_grads(fp32)
    assert fp32.weight.grad.dtype == F32 and same_bits(fp32.weight.grad, half.weight.main_grad)


def test_fake_cuda_tensors_plan_nothing_and_launch_nothing():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    plans = len(gemm._plans)
    with FakeTensorMode():
        x, w = torch.randn(4096, 4096, device=DEV).bfloat16(), torch.randn(4096, 4096,
                                                                          device=DEV).bfloat16()
        y = dg.linear(x, w)
        dw = dg.weight_grad(y, x)
    assert isinstance(y, FakeTensor) and y.shape == (4096, 4096) and dw.dtype == F32
    assert len(gemm._plans) == plans


def test_mode_leaves_cpu_matmuls_to_pytorch():
    a, b = torch.randn(8, 32).bfloat16(), torch.randn(32, 16).bfloat16()
    cpu_kernel = repr(torch.library.get_kernel("aten::mm", "CPU"))
    with dg.batch_invariant_mode():
        assert mode.routed_devices() == ("cuda",)
        assert repr(torch.library.get_kernel("aten::mm", "CPU")) == cpu_kernel
        y_cpu = a @ b
        y_gpu = a.to(DEV) @ b.to(DEV)
    assert same_bits(y_cpu, a @ b)
    assert same_bits(y_gpu, dg.mm(a.to(DEV), b.to(DEV)))


@pytest.mark.parametrize("n", [1000, 1001])  # 1001: the output row needs a padded buffer
def test_3d_linear_through_the_op_equals_the_direct_path(n):
    """With grad the call goes through detgemm::linear, whose [..., N] output is written
    through its 2-D view; without grad the direct path. Same bits, and not a view."""
    poison()
    x, w, b = rand(3, 65, 512, dtype=torch.bfloat16), rand(n, 512, dtype=torch.bfloat16), \
        rand(n, dtype=torch.bfloat16)
    direct = dg.linear(x, w, b)
    y = dg.linear(x.clone().requires_grad_(), w, b)
    assert not y._is_view() and same_bits(y.detach(), direct)
    y32 = dg.linear(x.clone().requires_grad_(), w, b, out_dtype=F32)
    assert same_bits(y32.detach(), dg.linear(x, w, b, out_dtype=F32))
