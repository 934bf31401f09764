"""bmm / baddbmm / grouped_mm on CPU tensors (the bit-exact reference), their ops' fakes and
autograd, bad-input errors, and batch_invariant_mode's routing of aten::bmm, baddbmm and
_grouped_mm (cpu=True)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import detgemm_cute as dg
from detgemm_cute import reference

BF = torch.bfloat16


def rand(*shape, dtype=BF):
    return torch.randn(*shape).to(dtype)


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def same(x, y):
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y))


@pytest.mark.parametrize("shape", [(3, 5, 40, 7), (1, 17, 24, 9), (4, 1, 33, 16)])
def test_bmm_is_mm_per_entry(shape):
    lb, m, k, n = shape
    a, b = rand(lb, m, k), rand(lb, k, n)
    c = dg.bmm(a, b)
    for i in range(lb):
        assert same(c[i], reference.mm(a[i], b[i]))
    bias = rand(n)
    c = dg.bmm(a, b, bias=bias, out_dtype=torch.float32)
    for i in range(lb):
        assert same(c[i], reference.addmm(bias, a[i], b[i], out_dtype=torch.float32))
    # views and broadcast entries give the same per-entry bits
    bt = b.transpose(1, 2).contiguous().transpose(1, 2)
    assert same(dg.bmm(a, bt), dg.bmm(a, b))
    assert same(dg.bmm(a, b[:1].expand(lb, k, n))[0], dg.bmm(a[:1], b[:1])[0])


def test_bmm_empty_and_zero_k():
    assert dg.bmm(rand(0, 3, 4), rand(0, 4, 5)).shape == (0, 3, 5)
    z = dg.bmm(rand(2, 3, 0), rand(2, 0, 5), bias=rand(5))
    assert z.shape == (2, 3, 5) and torch.equal(z[1], z[0])


def test_baddbmm_forms():
    a, b = rand(2, 6, 32), rand(2, 32, 8)
    bias = rand(8)
    assert same(dg.baddbmm(bias, a, b), dg.bmm(a, b, bias=bias))
    assert same(dg.baddbmm(bias.view(1, 1, 8).expand(2, 6, 8), a, b), dg.bmm(a, b, bias=bias))
    inp = rand(2, 6, 8)
    got = dg.baddbmm(inp, a, b, beta=0.5, alpha=2.0)
    want = (dg.bmm(a, b, out_dtype=torch.float32) * 2.0 + inp.float() * 0.5).to(BF)
    assert same(got, want)
    assert same(dg.baddbmm(inp, a, b, beta=0), dg.bmm(a, b))


def test_bmm_autograd():
    a, b = rand(2, 6, 32).requires_grad_(), rand(2, 32, 8).requires_grad_()
    bias = rand(8).requires_grad_()
    g = rand(2, 6, 8)
    dg.bmm(a, b, bias=bias).backward(g)
    for i in range(2):
        assert same(a.grad[i], reference.mm(g[i], b.detach()[i].t()))
        assert same(b.grad[i], reference.mm(a.detach()[i].t(), g[i]))
    assert bias.grad.shape == (8,) and bias.grad.dtype == BF


def test_grouped_mm_rows_are_their_own_chain():
    x, w = rand(20, 40), rand(4, 40, 7)
    offs = torch.tensor([3, 3, 12, 18], dtype=torch.int32)
    y = dg.grouped_mm(x, w, offs)
    for g, (s, e) in enumerate([(0, 3), (3, 3), (3, 12), (12, 18)]):
        if e > s:
            assert same(y[s:e], reference.mm(x[s:e], w[g]))
            assert same(y[s:s + 1], reference.mm(x[s:s + 1], w[g]))  # alone in its group
    assert not y[18:].any()  # past the last group: zero


def test_grouped_mm_weight_grad_form_and_autograd():
    x, w = rand(20, 40).requires_grad_(), rand(4, 40, 7).requires_grad_()
    offs = torch.tensor([5, 5, 12, 20], dtype=torch.int32)
    g = rand(20, 7)
    dg.grouped_mm(x, w, offs).backward(g)
    xd, wd = x.detach(), w.detach()
    for e, (s, t) in enumerate([(0, 5), (5, 5), (5, 12), (12, 20)]):
        if t > s:
            assert same(x.grad[s:t], reference.mm(g[s:t], wd[e].t()))
            assert same(w.grad[e], reference.mm(xd[s:t].t(), g[s:t]))
        else:
            assert not w.grad[e].any()
    dw = dg.grouped_mm(xd.t(), g, offs, out_dtype=torch.float32)  # 2-D x 2-D: [G, K, N]
    assert dw.shape == (4, 40, 7) and dw.dtype == torch.float32
    assert same(dw[3], reference.mm(xd[12:20].t(), g[12:20], out_dtype=torch.float32))


def test_grouped_mm_3d_is_bmm():
    a, b = rand(3, 5, 16), rand(3, 16, 4)
    assert same(dg.grouped_mm(a, b), dg.bmm(a, b))


def test_fakes_give_shapes():
    with FakeTensorMode():
        a, b = torch.empty(4, 8, 32, dtype=BF), torch.empty(4, 32, 16, dtype=BF)
        y = torch.ops.detgemm.bmm(a, b, None, torch.float32)
        assert y.shape == (4, 8, 16) and y.dtype == torch.float32
        x, w = torch.empty(10, 32, dtype=BF), torch.empty(3, 32, 16, dtype=BF)
        offs = torch.empty(3, dtype=torch.int32)
        assert torch.ops.detgemm.grouped_mm(x, w, offs, None).shape == (10, 16)
        assert torch.ops.detgemm.grouped_mm(x.t(), torch.empty(10, 16, dtype=BF), offs,
                                            None).shape == (3, 32, 16)
    m = dg.bmm(torch.empty(2, 3, 4, dtype=BF, device="meta"),
               torch.empty(2, 4, 5, dtype=BF, device="meta"))
    assert m.shape == (2, 3, 5) and m.is_meta


@pytest.mark.parametrize("call, exc, msg", [
    (lambda: dg.bmm(rand(2, 3, 4), rand(3, 4, 5)), ValueError, r"batch mismatch"),
    (lambda: dg.bmm(rand(2, 3, 4), rand(2, 5, 5)), ValueError, r"K mismatch"),
    (lambda: dg.bmm(rand(3, 4), rand(2, 4, 5)), ValueError, r"a must be 3-D"),
    (lambda: dg.bmm(rand(2, 3, 4, dtype=torch.float64), rand(2, 4, 5, dtype=torch.float64)),
     TypeError, r"a must be torch.bfloat16, torch.float16 or torch.float32"),
    (lambda: dg.bmm(rand(2, 3, 4), rand(2, 4, 5, dtype=torch.float16)), TypeError,
     r"b must have the same dtype"),
    (lambda: dg.bmm(rand(2, 3, 4), rand(2, 4, 5), bias=rand(4)), ValueError,
     r"bias must be 1-D of length N=5"),
    (lambda: dg.bmm(rand(2, 3, 4), rand(2, 4, 5), out_dtype=torch.int8), TypeError,
     r"out_dtype"),
    (lambda: dg.bmm([1.0], rand(2, 4, 5)), TypeError, r"a must be a torch.Tensor"),
    (lambda: dg.baddbmm(1.0, rand(2, 3, 4), rand(2, 4, 5)), TypeError,
     r"input must be a torch.Tensor"),
    (lambda: dg.grouped_mm(rand(10, 4), rand(3, 4, 5), torch.tensor([1, 2, 3])), TypeError,
     r"offs must be a 1-D torch.int32"),
    (lambda: dg.grouped_mm(rand(10, 4), rand(3, 4, 5), torch.tensor([1, 2], dtype=torch.int32)),
     ValueError, r"offs has 2 entries but b has 3 groups"),
    (lambda: dg.grouped_mm(rand(10, 4), rand(3, 4, 5), torch.tensor([5, 2, 9], dtype=torch.int32)),
     ValueError, r"non-decreasing"),
    (lambda: dg.grouped_mm(rand(10, 4), rand(3, 4, 5), torch.tensor([5, 8, 11], dtype=torch.int32)),
     ValueError, r"<= 10"),
    (lambda: dg.grouped_mm(rand(10, 4), rand(3, 4, 5)), ValueError, r"offs is expected"),
    (lambda: dg.grouped_mm(rand(10, 4), rand(3, 5, 5), torch.tensor([1, 2, 3], dtype=torch.int32)),
     ValueError, r"inner dims differ"),
    (lambda: dg.grouped_mm(rand(2, 10, 4), rand(4, 5), torch.tensor([1], dtype=torch.int32)),
     ValueError, r"takes a \[T, K\]"),
])
def test_bad_inputs(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_mode_routes_bmm_baddbmm_grouped_on_cpu():
    a, b = rand(3, 8, 32), rand(3, 32, 16)
    x, w = rand(12, 32), rand(2, 32, 16)
    offs = torch.tensor([5, 12], dtype=torch.int32)
    dg.reset_report()
    with dg.batch_invariant_mode(strict=True, cpu=True):
        y = torch.bmm(a, b)
        z = torch.baddbmm(rand(16), a, b)
        q = a @ b
        gm = torch._grouped_mm(x, w, offs)
    assert same(y, dg.bmm(a, b)) and same(q, y)
    assert z.shape == y.shape
    assert same(gm, dg.grouped_mm(x, w, offs))
    assert dg.report().total_fell_back == 0 and dg.report().total_routed >= 4


def test_baddbmm_input_must_broadcast():
    a, b = rand(2, 3, 16), rand(2, 16, 8)
    for bad in (rand(8).expand(5, 8), rand(8).expand(7, 1, 8), rand(4, 2, 3, 8), rand(5)):
        with pytest.raises(ValueError, match="input of shape"):
            dg.baddbmm(bad, a, b)
        with dg.batch_invariant_mode(cpu=True), pytest.raises(RuntimeError):
            torch.baddbmm(bad, a, b)  # the mode leaves it to torch, whose error comes out
    ok = rand(1, 3, 8)  # broadcasts over the batch
    want = (dg.bmm(a, b, out_dtype=torch.float32) + ok.float() * 0.5).to(BF)
    assert same(dg.baddbmm(ok, a, b, beta=0.5), want)


def test_grouped_edge_cases():
    x, w = rand(6, 0), rand(2, 0, 5)  # K = 0: zeros
    offs = torch.tensor([2, 6], dtype=torch.int32)
    assert not dg.grouped_mm(x, w, offs).any()
    assert dg.grouped_mm(rand(6, 4), rand(2, 4, 0), offs).shape == (6, 0)
    m = dg.grouped_mm(torch.empty(6, 4, dtype=BF, device="meta"),
                      torch.empty(2, 4, 5, dtype=BF, device="meta"), offs.to("meta"))
    assert m.shape == (6, 5) and m.is_meta
    with FakeTensorMode():  # the fake checks what eager checks
        xf, wf = torch.empty(6, 4, dtype=BF), torch.empty(2, 4, 5, dtype=BF)
        with pytest.raises(TypeError, match="offs must be a 1-D torch.int32"):
            torch.ops.detgemm.grouped_mm(xf, wf, torch.empty(2, dtype=torch.int64), None)
        with pytest.raises(ValueError, match="offs has 3 entries"):
            torch.ops.detgemm.grouped_mm(xf, wf, torch.empty(3, dtype=torch.int32), None)
        with pytest.raises(ValueError, match="batch mismatch"):
            torch.ops.detgemm.grouped_mm(torch.empty(2, 3, 4, dtype=BF),
                                         torch.empty(3, 4, 5, dtype=BF), None, None)


def test_mode_refuses_grouped_forms_it_does_not_take():
    a3, b2 = rand(3, 5, 32), rand(32, 24)
    offs = torch.tensor([8, 16, 24], dtype=torch.int32)
    with dg.batch_invariant_mode(cpu=True, strict=True):
        with pytest.raises(dg.mode.BatchInvariantError, match="3-D x 2-D"):
            torch._grouped_mm(a3, b2, offs)


def test_bmm_unhashable_out_dtype_is_named():
    with pytest.raises(TypeError, match="out_dtype"):
        dg.bmm(rand(2, 3, 4), rand(2, 4, 5), out_dtype=[1])

