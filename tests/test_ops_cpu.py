"""The torch-facing layer on CPU: custom ops, fake impls under torch.compile, input errors,
and CPU tensors served by the bit-exact reference."""

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import reference


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def test_ops_are_registered():
    for name in ("mm", "addmm", "linear"):
        assert hasattr(torch.ops.detgemm, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_tensors_give_the_reference_bits(dtype):
    x, w, b = rand(33, 70, dtype=dtype), rand(20, 70, dtype=dtype), rand(20, dtype=dtype)
    y = dg.linear(x, w, b)
    assert torch.equal(bits(y), bits(reference.linear(x, w, b)))
    assert torch.equal(bits(dg.mm(x, w.t())), bits(reference.linear(x, w)))
    assert torch.equal(bits(dg.addmm(b, x, w.t())), bits(y))
    assert torch.equal(bits(dg.linear(x[:5], w, b)), bits(y[:5]))  # batch invariance
    y3 = dg.linear(x.view(3, 11, 70), w, out_dtype=torch.float32)
    assert y3.shape == (3, 11, 20) and y3.dtype == torch.float32


def test_fake_impls_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, b = rand(7, 5, 64), rand(32, 64), rand(32)
        y = torch.ops.detgemm.linear(x, w, b, torch.float32)
        assert y.shape == (7, 5, 32) and y.dtype == torch.float32
        z = torch.ops.detgemm.mm(rand(9, 64), rand(64, 16), None)
        assert z.shape == (9, 16) and z.dtype == torch.bfloat16
        z = torch.ops.detgemm.addmm(rand(16), rand(9, 64), rand(64, 16), None)
        assert z.shape == (9, 16)


def test_opcheck():
    x, w, b = rand(8, 32), rand(16, 32), rand(16)
    torch.library.opcheck(torch.ops.detgemm.linear.default, (x, w, b, None))
    torch.library.opcheck(torch.ops.detgemm.mm.default, (x, w.t(), None))


def test_torch_compile_fullgraph_traces_the_ops():
    def f(x, w, b):
        return torch.relu(dg.linear(x, w, b)) + dg.mm(x, w.t())

    x, w, b = rand(12, 48), rand(24, 48), rand(24)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(bits(compiled(x, w, b)), bits(f(x, w, b)))


@pytest.mark.parametrize("call,exc,words", [
    (lambda: dg.linear(rand(4, 8, dtype=torch.float64), rand(3, 8, dtype=torch.float64)),
     TypeError, ["input", "torch.float16 or torch.float32, got torch.float64"]),
    (lambda: dg.linear(rand(4, 8), rand(3, 8, dtype=torch.float16)), TypeError,
     ["weight", "same dtype"]),
    (lambda: dg.linear(torch.ones(4, 8, dtype=torch.int32), rand(3, 8)), TypeError, ["input"]),
    (lambda: dg.linear(rand(4, 8), rand(3, 9)), ValueError, ["K mismatch", "K=8", "K=9"]),
    (lambda: dg.mm(rand(4, 8), rand(8)), ValueError, ["b", "2-D"]),
    (lambda: dg.linear(rand(4, 8), rand(3, 8), rand(4)), ValueError, ["bias", "length N=3"]),
    (lambda: dg.linear(rand(4, 8), rand(3, 8), rand(3, dtype=torch.float16)), TypeError,
     ["bias", "dtype"]),
    (lambda: dg.linear(rand(4, 8), rand(0, 8)), ValueError, ["N and K must be >= 1"]),
    (lambda: dg.mm(rand(4, 8), rand(8, 3), out_dtype=torch.int8), TypeError, ["out_dtype"]),
    (lambda: dg.mm("x", rand(8, 3)), TypeError, ["a must be a torch.Tensor"]),
    (lambda: dg.linear(rand(4, 8), rand(3, 8).to("meta")), ValueError, ["weight", "meta"]),
])
def test_bad_input_messages_name_the_argument(call, exc, words):
    with pytest.raises(exc) as e:
        call()
    for w in words:
        assert w in str(e.value)


def test_m_zero():
    assert dg.linear(rand(0, 8), rand(3, 8)).shape == (0, 3)


def test_cli_verify(tmp_path, capsys):
    from detgemm_cute import cli

    x, w, b = rand(6, 40), rand(10, 40), rand(10)
    y = reference.linear(x, w, b)
    for name, t in (("x", x), ("w", w), ("b", b), ("y", y)):
        torch.save(t, tmp_path / f"{name}.pt")
    args = [str(tmp_path / "x.pt"), str(tmp_path / "w.pt"), str(tmp_path / "y.pt"),
            "--bias", str(tmp_path / "b.pt")]
    assert cli.main(["verify", *args]) == 0
    bad = y.clone()
    bad.view(torch.int16)[2, 3] ^= 1
    torch.save(bad, tmp_path / "y.pt")
    assert cli.main(["verify", *args]) == 1
