"""The RL on-policy property, end to end, on a Hugging Face Llama with its default (sdpa)
attention inside `batch_invariant_mode()`.

A sampler generates with a KV cache; a trainer scores the same tokens with one teacher-forced
forward (grad enabled). Checked bit for bit, and printed:

1. the sampler's per-token log-probs equal the trainer's (greedy and sampled generation);
2. a prompt generated alone and inside a batch of 8 (same length, no padding) gives the same
   tokens and log-probs;
3. a chunked prefill (the prompt fed in pieces through the cache) gives the logits of the full
   prefill;
4. two training steps run twice from one seed give the same loss and weights.

Not covered: left-padded batches (padding shifts a sequence's positions and its keys; such
masks run on the math engine, a different arithmetic than the unpadded sequence alone) and the
paged caches of serving engines.

    python examples/rl_logprobs.py            # CUDA (SM90 with flash-attn-4 for speed)
    python examples/rl_logprobs.py --device cpu   # the same checks on the CPU reference, small
Needs the ``transformers`` package. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

import detgemm_cute as dg

VOCAB = 1024


def build_model(device, seed=0, hidden=512, layers=2, heads=8, kv_heads=2):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, attn_implementation="sdpa", pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(device, torch.bfloat16)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) per row, in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]


def sample(model, prompts, new_tokens, greedy=True, seed=0):
    """(generated tokens [B, new], their log-probs [B, new]) from generate with a KV cache."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=not greedy, top_k=0, top_p=1.0, temperature=1.0,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    gen = out.sequences[:, prompts.shape[1]:]
    logits = torch.stack(out.logits, dim=1)  # [B, new, V]
    return gen, token_logprobs(logits, gen)


def score(model, prompts, gen):
    """The trainer's log-probs of `gen` after `prompts`: one teacher-forced forward, grad on."""
    ids = torch.cat([prompts, gen], dim=1)
    with torch.enable_grad():
        logits = model(ids).logits[:, prompts.shape[1] - 1:-1]
    return token_logprobs(logits, gen).detach()


def chunked_prefill_logits(model, ids, chunk):
    """Logits of `ids` fed `chunk` tokens at a time through the KV cache."""
    from transformers import DynamicCache

    cache, parts = DynamicCache(), []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            out = model(ids[:, start:start + chunk], past_key_values=cache, use_cache=True)
            parts.append(out.logits)
    return torch.cat(parts, dim=1)


def train_steps(device, steps=2, seed=3, seq=64, **size):
    model = build_model(device, seed, **size).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (4, seq), device=device, generator=gen)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach(), [p.detach().clone() for p in model.parameters()]


def run_checks(device, prompt_len=40, new_tokens=24, batch=8, chunk=16, train_seq=64, **size):
    """Every check's result as {name: bool}, and the mode's report. `size`: build_model's."""
    gen = torch.Generator(device=device).manual_seed(1)
    prompts = torch.randint(3, VOCAB, (batch, prompt_len), device=device, generator=gen)
    results = {}
    model = build_model(device, **size).eval()
    with dg.batch_invariant_mode(cpu=device == "cpu"):
        for greedy in (True, False):
            name = "greedy" if greedy else "sampled"
            toks, lp_sampler = sample(model, prompts[:1], new_tokens, greedy)
            results[f"{name}: sampler log-probs == trainer log-probs"] = torch.equal(
                lp_sampler, score(model, prompts[:1], toks))
        toks_alone, lp_alone = sample(model, prompts[3:4], new_tokens)
        toks_batch, lp_batch = sample(model, prompts, new_tokens)
        results[f"prompt alone == inside a batch of {batch} (tokens, log-probs)"] = (
            torch.equal(toks_alone[0], toks_batch[3]) and torch.equal(lp_alone[0], lp_batch[3]))
        with torch.no_grad():
            full = model(prompts[:2]).logits
        results[f"chunked prefill ({chunk}-token chunks) == full prefill"] = torch.equal(
            chunked_prefill_logits(model, prompts[:2], chunk), full)
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward
        try:
            (l1, w1), (l2, w2) = (train_steps(device, seq=train_seq, **size) for _ in range(2))
        finally:
            torch.use_deterministic_algorithms(prev)
        results["two training steps, run twice: same loss and weights"] = (
            torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(w1, w2)))
        report = dg.report()
    return results, report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("rl_logprobs: needs the transformers package (pip install transformers)",
              file=sys.stderr)
        return 2
    small = (dict(prompt_len=12, new_tokens=6, batch=8, chunk=5, train_seq=16, hidden=128,
                  heads=4, kv_heads=2) if args.device == "cpu" else {})
    results, report = run_checks(args.device, **small)
    for name, ok in results.items():
        print(f"{'yes' if ok else 'NO '}  {name}")
    print(report)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
