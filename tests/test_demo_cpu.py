import torch
import pytest

from detgemm_cute import demo


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only path")
def test_demo_on_cpu_says_what_needs_a_gpu_and_runs_the_reference(capsys):
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "No SM90 or SM80+ GPU" in out and "bit-identical" in out and "fwd_decode_m1_16_n1_2112" in out
    assert "one call on 64 tokens: bit-identical" in out
    assert "entry 2 alone: bit-identical" in out
