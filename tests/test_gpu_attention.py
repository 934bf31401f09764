"""Invariant attention on the GPU: `dg.attention` on both engines and the mode's SDPA routing.

Every invariance of the contract, bit for bit, on fresh random inputs with NaN-poisoned
memory: decode step == row of the causal prefill, chunked == full prefill, a sequence alone ==
inside a batch, a cache's allocated length (unused slots hold NaN) changes nothing, run twice
and CUDA-graph replay give the same bits, the backward is deterministic and batch-invariant.
Accuracy: error vs an fp64 reference no worse than torch SDPA's (plus half an output ulp)."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute.attention import AttentionEngineWarning, flash_engine  # noqa: E402
from gpu_helpers import DEV, poison, same_bits  # noqa: E402

HAS_FLASH = flash_engine._module()[1] is None
ENGINES = ["flash", "math"] if HAS_FLASH else ["math"]
# (heads, kv_heads, head_dim): GQA 32/8 x 128, MHA 16 x 64, MQA 8/1 x 96
SHAPES = [(32, 8, 128), (16, 16, 64), (8, 1, 96)]


def qkv(b, hq, hk, sq, sk, d, dtype=torch.bfloat16, grad=False):
    poison()
    q = torch.randn(b, hq, sq, d, device=DEV).to(dtype)
    k = torch.randn(b, hk, sk, d, device=DEV).to(dtype)
    v = torch.randn(b, hk, sk, d, device=DEV).to(dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def test_flash_engine_is_installed_on_the_gpu_machine():
    assert HAS_FLASH, flash_engine._module()[1]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("hq,hk,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_step_equals_its_prefill_row(engine, hq, hk, d, dtype):
    s = 700
    q, k, v = qkv(2, hq, hk, s, s, d, dtype)
    full = dg.attention(q, k, v, causal=True, engine=engine)
    for t in (0, 1, 63, 127, 128, 129, 191, 192, 383, 699):
        step = dg.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=True,
                            engine=engine)
        assert same_bits(step, full[:, :, t:t + 1]), f"row {t}"
        free = dg.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], engine=engine)
        assert same_bits(free, step), f"row {t}: one query, causal vs all keys"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("hq,hk,d", SHAPES[:2])
def test_chunked_prefill_equals_full_prefill(engine, hq, hk, d):
    s = 1000
    q, k, v = qkv(2, hq, hk, s, s, d)
    full = dg.attention(q, k, v, causal=True, engine=engine)
    for chunk in (1, 17, 128, 300, 999):
        parts = [dg.attention(q[:, :, a:a + chunk], k[:, :, :a + chunk], v[:, :, :a + chunk],
                              causal=True, engine=engine) for a in range(0, s, chunk)
                 if chunk > 1 or a in (0, 500, 999)]
        got = torch.cat(parts, dim=2)
        want = full if chunk > 1 else full[:, :, [0, 500, 999]]
        assert same_bits(got, want), f"chunk {chunk}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("causal", [True, False])
def test_sequence_alone_equals_inside_a_batch(engine, causal):
    hq, hk, d = SHAPES[0]
    q, k, v = qkv(6, hq, hk, 333, 333, d)
    batch = dg.attention(q, k, v, causal=causal, engine=engine)
    for i in (0, 3, 5):
        alone = dg.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=causal, engine=engine)
        assert same_bits(alone, batch[i:i + 1])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("sq", [1, 4, 37])
def test_cache_allocated_length_changes_nothing(engine, sq):
    """Sequences of different lengths in one cache of 2048 slots (the unused ones hold large
    garbage, refilled between two calls): each equals its own exact-length call, and the
    lengths of its batch-mates change nothing."""
    hq, hk, d = SHAPES[0]
    lengths = [37, 700, 1, 2048, 129]
    q, k, v = qkv(len(lengths), hq, hk, sq, 2048, d)
    lens = torch.tensor(lengths, device=DEV, dtype=torch.int32)
    runs = []
    for fill in (1e4, -3e3):
        for i, n in enumerate(lengths):
            k[i, :, n:] = fill * torch.rand_like(k[i, :, n:].float()).to(k.dtype)
            v[i, :, n:] = fill
        runs.append(dg.attention(q, k, v, causal=True, kv_lengths=lens, engine=engine))
    batched = runs[0]
    assert same_bits(runs[0], runs[1]), "the unused cache slots changed a result"
    for i, n in enumerate(lengths):
        if n < sq:
            continue
        alone = dg.attention(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal=True,
                             engine=engine)
        assert same_bits(batched[i:i + 1], alone), f"sequence {i} (length {n})"
        assert not batched[i].isnan().any()


@pytest.mark.parametrize("engine", ENGINES)
def test_run_twice_and_graph_replay_give_the_same_bits(engine):
    hq, hk, d = SHAPES[0]
    q, k, v = qkv(2, hq, hk, 512, 512, d)
    first = dg.attention(q, k, v, causal=True, engine=engine)
    assert same_bits(first, dg.attention(q, k, v, causal=True, engine=engine))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dg.attention(q, k, v, causal=True, engine=engine)  # warm
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = dg.attention(q, k, v, causal=True, engine=engine)
    for _ in range(2):
        out.fill_(float("nan"))
        g.replay()
        assert same_bits(out, first)


def _grads(q, k, v, engine, causal=True):
    for t in (q, k, v):
        t.grad = None
    out = dg.attention(q, k, v, causal=causal, engine=engine)
    gen = torch.Generator(device=DEV).manual_seed(7)
    dout = torch.randn(out.shape, device=DEV, generator=gen).to(out.dtype)
    out.backward(dout)
    return out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("hq,hk,d", SHAPES[:2])
def test_backward_is_deterministic_and_batch_invariant(engine, hq, hk, d):
    q, k, v = qkv(4, hq, hk, 300, 300, d, grad=True)
    first = _grads(q, k, v, engine)
    second = _grads(q, k, v, engine)
    assert all(same_bits(a, b) for a, b in zip(first, second)), "two backward runs differ"
    q1, k1, v1 = (t[2:3].detach().clone().requires_grad_(True) for t in (q, k, v))
    gen = torch.Generator(device=DEV).manual_seed(7)
    out = dg.attention(q1, k1, v1, causal=True, engine=engine)
    dout_all = torch.randn(first[0].shape, device=DEV, generator=gen).to(out.dtype)
    out.backward(dout_all[2:3])
    for name, alone, batched in (("dq", q1.grad, first[1]), ("dk", k1.grad, first[2]),
                                 ("dv", v1.grad, first[3])):
        assert same_bits(alone, batched[2:3]), f"{name}: sequence alone vs in a batch of 4"


def _reference(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), kk, vv, is_causal=causal)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("hq,hk,d", SHAPES)
def test_error_no_worse_than_torch_sdpa(engine, hq, hk, d):
    q, k, v = qkv(2, hq, hk, 1024, 1024, d)
    ref = _reference(q, k, v, True)
    ours = (dg.attention(q, k, v, causal=True, engine=engine).double() - ref).abs().max().item()
    theirs = (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).double()
              - ref).abs().max().item()
    half_ulp = 2.0 ** -9  # bf16 outputs of magnitude < 1
    assert ours <= theirs + half_ulp, f"max error {ours:.3g} vs SDPA {theirs:.3g}"


# ----------------------------------------------------------------- the mode's SDPA routing
@pytest.fixture
def mode():
    dg.reset_report()
    with dg.batch_invariant_mode():
        yield
    dg.reset_report()


def test_mode_routes_sdpa_with_torch_semantics(mode):
    hq, hk, d = SHAPES[0]
    q, k, v = qkv(2, hq, hk, 256, 256, d)
    want = dg.attention(q, k, v, causal=True)
    kk, vv = (t.repeat_interleave(hq // hk, dim=1) for t in (k, v))
    assert same_bits(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                     want)
    assert same_bits(F.scaled_dot_product_attention(q, kk, vv, is_causal=True), want)
    # a decode step: one query, no mask, not causal (what Hugging Face passes)
    assert same_bits(F.scaled_dot_product_attention(q[:, :, -1:], kk, vv), want[:, :, -1:])
    # a chunk against the cache with a boolean and a float causal mask (bottom-right)
    allowed = torch.ones(56, 256, dtype=torch.bool, device=DEV).tril(200)[None, None]
    blocked = torch.zeros(allowed.shape, device=DEV, dtype=q.dtype).masked_fill(
        ~allowed, torch.finfo(q.dtype).min)
    for mask in (allowed.expand(2, 1, 56, 256), blocked):
        got = F.scaled_dot_product_attention(q[:, :, 200:], kk, vv, attn_mask=mask)
        assert same_bits(got, want[:, :, 200:])
    # torch's is_causal is top-left when fewer queries than keys
    top_left = F.scaled_dot_product_attention(q[:, :, :56], kk, vv, is_causal=True)
    assert same_bits(top_left, want[:, :, :56])
    rep = dg.report()
    assert rep.routed.get(("sdpa[flash]", "bf16"), 0) >= 6 and rep.total_fell_back == 0, str(rep)


def test_mode_sdpa_backward_matches_the_op(mode):
    hq, hk, d = SHAPES[1]
    q, k, v = qkv(2, hq, hk, 200, 200, d, grad=True)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    dg.attention(q2, k2, v2, causal=True).sum().backward()
    assert all(same_bits(a, b.grad) for a, b in zip(grads, (q2, k2, v2)))


def test_mode_general_mask_runs_on_the_math_engine_and_warns(mode):
    q, k, v = qkv(1, 4, 4, 64, 64, 64)
    window = torch.ones(64, 64, dtype=torch.bool, device=DEV).tril().triu(-8)
    with pytest.warns(AttentionEngineWarning):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
    rows = F.scaled_dot_product_attention(q[:, :, 40:41], k, v, attn_mask=window[40:41])
    assert same_bits(rows, got[:, :, 40:41])
    assert dg.report().routed.get(("sdpa[math]", "bf16"), 0) >= 2


def test_mode_dropout_falls_back_and_strict_raises():
    q, k, v = qkv(1, 4, 4, 64, 64, 64)
    with dg.batch_invariant_mode():
        with pytest.warns(UserWarning, match="dropout"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with dg.batch_invariant_mode(strict=True):
        with pytest.raises(dg.mode.BatchInvariantError, match="dropout"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def test_mode_under_inference_mode_and_autocast(mode):
    q, k, v = qkv(2, 8, 8, 128, 128, 64)
    want = dg.attention(q, k, v, causal=True)
    with torch.inference_mode():
        assert same_bits(F.scaled_dot_product_attention(q, k, v, is_causal=True), want)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert same_bits(got, want)
