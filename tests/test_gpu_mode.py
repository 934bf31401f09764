"""batch_invariant_mode on the GPU: PyTorch's matmuls and a Hugging Face Llama-style model.

The model is built from a config in code (random weights, no downloads, eager attention,
bf16). Inside the mode: one sequence's logits are bit-identical alone and inside batches,
greedy generation gives the same tokens alone and batched, and training twice gives the same
weights. The same checks are run outside the mode and reported (not asserted): whether plain
PyTorch (cuBLAS) differs on this GPU."""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from gpu_helpers import DEV, rand, same_bits  # noqa: E402

SEQ = 48


@pytest.fixture(autouse=True)
def _fresh_report():
    dg.reset_report()
    yield
    while dg.mode.is_enabled():
        dg.disable()


def test_torch_matmuls_run_on_detgemm():
    x, w, b = rand(300, 1024), rand(768, 1024), rand(768)
    with dg.batch_invariant_mode():
        y = F.linear(x, w, b)
        y_rows = F.linear(x[:7], w, b)
        q, k = rand(4, 8, 64, 32), rand(4, 8, 64, 32)
        s = q @ k.transpose(-1, -2)
        s_one = q[1:2] @ k[1:2].transpose(-1, -2)
    assert same_bits(y, dg.linear(x, w, b)) and same_bits(y_rows, y[:7])
    assert same_bits(s[1:2], s_one)
    r = dg.report()
    assert r.total_routed >= 4 and r.total_fell_back == 0, str(r)
    before = torch.library.get_kernel("aten::mm", "CUDA")
    assert "detgemm" not in repr(before)


def _llama(seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(DEV, torch.bfloat16)
    return model


def _batch_logits(model, target, batch_sizes, gen):
    """Logits of `target` [SEQ] alone and at a middle position of batches of others."""
    out = []
    with torch.no_grad():
        for bs in batch_sizes:
            others = torch.randint(3, 1024, (bs, SEQ), device=DEV, generator=gen)
            ids = torch.cat([others[: bs // 2], target[None], others[bs // 2:]])
            out.append(model(ids).logits[bs // 2].clone())
    return out


def test_llama_logits_are_batch_invariant_in_the_mode(capsys):
    model = _llama().eval()
    gen = torch.Generator(device=DEV).manual_seed(1)
    target = torch.randint(3, 1024, (SEQ,), device=DEV, generator=gen)
    sizes = (0, 2, 8, 31)  # other sequences around the target
    with dg.batch_invariant_mode():
        inside = _batch_logits(model, target, sizes, gen)
    rep = dg.report()
    plain = _batch_logits(model, target, sizes, gen)
    for n, lg in zip(sizes[1:], inside[1:]):
        assert same_bits(lg, inside[0]), f"logits differ with {n} other sequences"
    plain_same = [same_bits(lg, plain[0]) for lg in plain[1:]]
    with capsys.disabled():
        print(f"\n[llama logits] detgemm mode: identical for batches {sizes[1:]}; plain "
              f"PyTorch identical: {dict(zip(sizes[1:], plain_same))}\n{rep}")
    assert rep.total_routed > 0


def test_llama_greedy_generation_is_batch_invariant(capsys):
    model = _llama().eval()
    gen = torch.Generator(device=DEV).manual_seed(2)
    prompt = torch.randint(3, 1024, (1, 16), device=DEV, generator=gen)
    others = torch.randint(3, 1024, (7, 16), device=DEV, generator=gen)
    batch = torch.cat([others[:3], prompt, others[3:]])
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    with dg.batch_invariant_mode(), torch.no_grad():
        alone = model.generate(prompt, **kw)[0]
        batched = model.generate(batch, **kw)[3]
    with torch.no_grad():
        p_alone = model.generate(prompt, **kw)[0]
        p_batched = model.generate(batch, **kw)[3]
    assert alone.shape == (80,) and torch.equal(alone, batched)
    with capsys.disabled():
        print(f"\n[llama generate] 64 greedy tokens identical alone vs batch of 8 in the mode; "
              f"plain PyTorch identical: {torch.equal(p_alone, p_batched)}")


def _train(seed, steps=3):
    model = _llama(seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=DEV).manual_seed(seed + 10)
    for _ in range(steps):
        ids = torch.randint(3, 1024, (4, SEQ), device=DEV, generator=gen)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach(), [p.detach().clone() for p in model.parameters()]


def test_llama_training_twice_gives_identical_weights():
    prev = torch.are_deterministic_algorithms_enabled()
    # Embedding backward and the other non-matmul ops: PyTorch's deterministic kernels.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with dg.batch_invariant_mode():
            l1, w1 = _train(3)
            l2, w2 = _train(3)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert same_bits(l1, l2)
    assert all(same_bits(a, b) for a, b in zip(w1, w2))
    assert dg.report().routed.get(("mm", "bf16"), 0) > 0


@pytest.mark.skipif(not os.environ.get("DETGEMM_MODE_STRICT_PROBE"), reason="diagnostic")
def test_strict_mode_lists_what_the_model_does_outside_detgemm():
    model = _llama().eval()
    with dg.batch_invariant_mode(strict=True), torch.no_grad():
        model(torch.randint(3, 1024, (2, SEQ), device=DEV))
