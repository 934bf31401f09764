"""The RL proof on the GPU: a Hugging Face Llama with sdpa attention inside the mode
(`examples/rl_logprobs.py`): sampler log-probs == trainer log-probs (greedy and sampled),
alone == in a batch of 8, chunked == full prefill, training twice gives the same bits; and
every attention call ran on the flash engine."""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import rl_logprobs  # noqa: E402


def test_rl_logprobs_example_holds_every_check(capsys):
    results, report = rl_logprobs.run_checks("cuda")
    with capsys.disabled():
        print()
        for name, ok in results.items():
            print(f"{'yes' if ok else 'NO '}  {name}")
        print(report)
    assert all(results.values()), results
    assert report.fell_back == {}, str(report)
    assert all(engine == "flash" for engine, _ in report.attention), str(report)
