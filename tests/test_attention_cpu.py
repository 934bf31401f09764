"""Invariant attention on the CPU: the math engine (through the bit-exact GEMM reference),
argument checks, the mode's SDPA routing with ``cpu=True`` and its mask mapping, and the
flash engine's fake implementation. Small shapes: the reference is slow."""

import math

import pytest
import torch
import torch.nn.functional as F

import detgemm_cute as dg
from detgemm_cute.attention import sdpa as sdpa_mod
from detgemm_cute.attention.spec import check


def qkv(b=2, hq=4, hk=2, sq=9, sk=9, d=16, dtype=torch.bfloat16, grad=False):
    q, k, v = (torch.randn(b, h, s, d).to(dtype) for h, s in ((hq, sq), (hk, sk), (hk, sk)))
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def reference(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_math_engine_matches_an_fp64_reference(dtype):
    q, k, v = qkv(dtype=dtype, sq=5, sk=11)
    got = dg.attention(q, k, v, causal=True)
    mask = torch.ones(5, 11, dtype=torch.bool).tril(6)
    err = (got.double() - reference(q, k, v, mask)).abs().max().item()
    assert err < {torch.float32: 1e-5}.get(dtype, 2e-2), err


def test_decode_chunks_and_batch_give_the_prefill_bits():
    q, k, v = qkv(b=3, sq=20, sk=20)
    full = dg.attention(q, k, v, causal=True)
    for t in (0, 7, 16, 19):
        step = dg.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=True)
        assert torch.equal(step, full[:, :, t:t + 1])
    chunks = [dg.attention(q[:, :, a:a + 6], k[:, :, :a + 6], v[:, :, :a + 6], causal=True)
              for a in range(0, 20, 6)]
    assert torch.equal(torch.cat(chunks, dim=2), full)
    assert torch.equal(dg.attention(q[1:2], k[1:2], v[1:2], causal=True), full[1:2])


def test_kv_lengths_ignore_the_unused_cache_slots():
    q, k, v = qkv(b=3, sq=2, sk=16)
    lengths = [5, 16, 2]
    for i, n in enumerate(lengths):
        k[i, :, n:] = float("nan")
        v[i, :, n:] = float("nan")
    got = dg.attention(q, k, v, causal=True, kv_lengths=torch.tensor(lengths))
    for i, n in enumerate(lengths):
        alone = dg.attention(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal=True)
        assert torch.equal(got[i:i + 1], alone)


def test_bshd_layout_and_rows_that_see_no_key():
    q, k, v = qkv(sq=6, sk=3)
    bhsd = dg.attention(q, k, v, causal=True)
    bshd = dg.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, layout="bshd")
    assert torch.equal(bshd.transpose(1, 2), bhsd)
    assert torch.equal(bhsd[:, :, :3], torch.zeros_like(bhsd[:, :, :3]))  # rows 0..2 see none


def test_backward_runs_and_is_deterministic():
    q, k, v = qkv(grad=True)
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        dg.attention(q, k, v, causal=True).float().square().sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert all(g.abs().sum() > 0 for g in grads[0])


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(q="x"), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.randn(2, 3, 4)), ValueError, "q must be 4-D"),
    (dict(k=torch.randn(2, 3, 9, 16).to(torch.bfloat16), v=torch.randn(2, 3, 9, 16).to(
        torch.bfloat16)), ValueError, "multiple of k/v"),
    (dict(v=torch.randn(2, 2, 9, 16)), TypeError, "v must have q's dtype"),
    (dict(k=torch.randn(2, 2, 9, 8).to(torch.bfloat16)), ValueError, "head_dim differ"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(scale=float("nan")), TypeError, "scale must be a finite float"),
    (dict(layout="sbhd"), ValueError, "layout must be one of"),
    (dict(kv_lengths=torch.tensor([1.0, 2.0])), TypeError, "kv_lengths must be torch.int32"),
    (dict(kv_lengths=torch.tensor([1])), ValueError, "kv_lengths must be 1-D"),
    (dict(kv_lengths=torch.tensor([3, 10])), ValueError, "kv_lengths must lie in"),
    (dict(engine="fast"), ValueError, "engine must be one of"),
    (dict(engine="flash"), RuntimeError, "engine='flash' cannot run"),
])
def test_bad_arguments_name_what_is_wrong(kwargs, exc, words):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v)
    args.update({n: kwargs.pop(n) for n in ("q", "k", "v") if n in kwargs})
    with pytest.raises(exc, match=words):
        dg.attention(args["q"], args["k"], args["v"], **kwargs)


def test_meta_and_fake_tensors_get_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (t.to("meta") for t in qkv(sq=3, sk=9))
    out, lse = torch.ops.detgemm.flash_attention_fwd(q, k, v, None, True, 0.25)
    assert out.shape == (2, 4, 3, 16) and lse.shape == (2, 4, 3) and out.device.type == "meta"
    with FakeTensorMode():
        q, k, v = (torch.empty(t.shape, dtype=t.dtype) for t in qkv(sq=3, sk=9))
        lse = torch.empty(2, 4, 3)
        dq, dk, dv = torch.ops.detgemm.flash_attention_bwd(q, q, k, v, q, lse, None, True, 0.25)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ------------------------------------------------------------------ the mode's SDPA routing
def causal_mask(sq, sk):
    return torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)


def test_mode_maps_torch_sdpa_semantics_exactly():
    q, k, v = qkv(hq=4, hk=4, sq=12, sk=12)
    with dg.batch_invariant_mode(cpu=True):
        want = dg.attention(q, k, v, causal=True)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), want)
        assert torch.equal(F.scaled_dot_product_attention(q[:, :, -1:], k, v), want[:, :, -1:])
        for mask in (causal_mask(5, 12),
                     torch.zeros(5, 12).masked_fill(~causal_mask(5, 12), float("-inf")),
                     torch.zeros(5, 12, dtype=torch.bfloat16).masked_fill(
                         ~causal_mask(5, 12), torch.finfo(torch.bfloat16).min)):
            got = F.scaled_dot_product_attention(q[:, :, 7:], k, v, attn_mask=mask)
            assert torch.equal(got, want[:, :, 7:])
        top_left = F.scaled_dot_product_attention(q[:, :, :5], k, v, is_causal=True)
        assert torch.equal(top_left, want[:, :, :5])
        scaled = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        assert torch.equal(scaled, dg.attention(q, k, v, causal=True, scale=0.3))
        rep = dg.report()
    assert rep.routed.get(("sdpa[math]", "bf16"), 0) == 7 and rep.total_fell_back == 0, str(rep)


def test_mode_general_masks_keep_their_meaning():
    q, k, v = qkv(hq=2, hk=2, sq=8, sk=8, dtype=torch.float32)
    window = torch.ones(8, 8, dtype=torch.bool).tril().triu(-2)
    bias = torch.randn(8, 8)
    more_queries = torch.ones(8, 5, dtype=torch.bool).tril()  # is_causal, Sq > Sk (top-left)
    with dg.batch_invariant_mode(cpu=True):
        got_w = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
        got_b = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        got_c = F.scaled_dot_product_attention(q, k[:, :, :5], v[:, :, :5], is_causal=True)
    for got, mask, kk in ((got_w, window, k), (got_b, bias, k), (got_c, more_queries, k[:, :, :5])):
        ref = F.scaled_dot_product_attention(q.double(), kk.double(), v[:, :, :kk.shape[2]].double(),
                                             attn_mask=mask if mask.dtype == torch.bool else mask.double())
        assert (got.double() - ref).abs().max() < 1e-5


def test_mode_gqa_and_3d_inputs():
    q, k, v = qkv(hq=4, hk=2, sq=6, sk=6)
    with dg.batch_invariant_mode(cpu=True):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.equal(got, dg.attention(q, k, v, causal=True))
        got3 = F.scaled_dot_product_attention(q[0], k[0].repeat_interleave(2, 0),
                                              v[0].repeat_interleave(2, 0), is_causal=True)
        assert torch.equal(got3, got[0])


def test_mode_autograd_through_sdpa():
    q, k, v = qkv(hq=2, hk=2, grad=True)
    with dg.batch_invariant_mode(cpu=True):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    dg.attention(q, k, v, causal=True).float().sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(want, (q, k, v)))


def test_mode_falls_back_on_dropout_and_strict_raises():
    q, k, v = qkv(hq=2, hk=2)
    with dg.batch_invariant_mode(cpu=True):
        with pytest.warns(UserWarning, match="dropout_p"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    with dg.batch_invariant_mode(strict=True, cpu=True):
        with pytest.raises(dg.mode.BatchInvariantError, match="dropout_p"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    # outside the mode torch's kernel is back
    assert "detgemm" not in repr(torch.library.get_kernel(
        "aten::scaled_dot_product_attention", "AutogradCPU"))


def test_mask_recognition_is_cached_per_tensor_and_version():
    mask = causal_mask(4, 10)[None, None].expand(2, 1, 4, 10)
    assert sdpa_mod._mask_rule(mask, 2, 3, 4, 10) == ("causal", None)
    assert sdpa_mod._cached_rule(mask) == ("causal", None)
    lengths_mask = torch.arange(10)[None, None, None, :] < torch.tensor([3, 10]).view(2, 1, 1, 1)
    kind, lengths = sdpa_mod._classify(lengths_mask.expand(2, 1, 4, 10), 2, 3, 4, 10)
    assert kind == "full" and lengths.tolist() == [3, 10]
    m2 = causal_mask(4, 10).clone()
    sdpa_mod._mask_rule(m2, 1, 1, 4, 10)
    m2[0, 0] = False  # in place: the version changes, the rule is recomputed
    assert sdpa_mod._mask_rule(m2, 1, 1, 4, 10) == ("general", None)


def test_default_scale_is_one_over_sqrt_head_dim():
    q, k, v = qkv(d=24)
    assert check(q, k, v).scale == 1 / math.sqrt(24)
