"""The training example and the training bench on a CPU-only machine: they import, parse
their arguments, and say clearly that the kernels need an SM90 GPU (exit 0, or 1 when told
a GPU is required)."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load(rel):
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rel", ["examples/train_deterministic.py", "bench/bench_train.py"])
def test_help_parses(rel, capsys):
    with pytest.raises(SystemExit) as e:
        load(rel).main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_a_gpu_they_say_so(capsys):
    ex = load("examples/train_deterministic.py")
    assert ex.main([]) == 0
    assert "need an SM90 GPU" in capsys.readouterr().out
    assert ex.main(["--require-gpu"]) == 1
    assert load("bench/bench_train.py").main(["--quick"]) == 0
    assert "needs an SM90 GPU" in capsys.readouterr().out


def test_example_model_is_batch_invariant_by_construction():
    """The example's attention runs per sequence: a sequence's hidden states do not depend
    on its neighbours (checked on CPU, where detgemm's Linears run the reference)."""
    import detgemm_cute as dg

    ex = load("examples/train_deterministic.py")
    torch.manual_seed(0)
    blk = dg.nn.convert(ex.Block(32, 4).to(torch.bfloat16))
    x = torch.randn(3, 10, 32).to(torch.bfloat16)
    assert torch.equal(blk(x)[1], blk(x[1:2])[0])
