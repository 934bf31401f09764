"""The training example and the training bench on a CPU-only machine: they import, parse
their arguments, and say clearly that the kernels need an SM90 or SM80-family GPU (exit 0, or
1 when told a GPU is required). The example's model and training loop also run on CPU tensors, where
detgemm's Linears compute the reference's bits, so its checks are exercised here too."""

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
    assert "need an SM90 GPU (H100/H200) or an SM80-family GPU" in capsys.readouterr().out
    assert ex.main(["--require-gpu"]) == 1
    assert load("bench/bench_train.py").main(["--quick"]) == 0
    assert "needs an SM90 GPU (H100/H200) or an SM80-family GPU" in capsys.readouterr().out


def test_example_model_is_batch_invariant_by_construction():
    """The example's attention runs per sequence: a sequence's hidden states do not depend
    on its neighbours (checked on CPU, where detgemm's Linears run the reference)."""
    import detgemm_cute as dg

    ex = load("examples/train_deterministic.py")
    torch.manual_seed(0)
    blk = dg.nn.convert(ex.Block(32, 4).to(torch.bfloat16))
    x = torch.randn(3, 10, 32).to(torch.bfloat16)
    assert torch.equal(blk(x)[1], blk(x[1:2])[0])


TINY = ["--steps", "3", "--d-model", "32", "--layers", "1", "--heads", "4", "--seq", "16",
        "--vocab", "64", "--batch", "2", "--micro-batches", "2", "--pool", "8"]


def test_example_training_loop_on_cpu():
    """The example's own loop (fp32 main_grad accumulation, finalize_grads, AdamW) on a tiny
    model on CPU, where detgemm's Linears run the reference: two runs from one seed give the
    same loss and weight bits, another seed does not, and the trained model's logits pass
    the batch-invariance check."""
    ex = load("examples/train_deterministic.py")
    args = ex.parse_args(TINY)
    l1, w1, _ = ex.train(args, 0, "cpu")
    l2, w2, model = ex.train(args, 0, "cpu")
    assert l1.numel() == args.steps * args.micro_batches and torch.isfinite(l1).all()
    assert ex.same_bits(l1, l2)
    assert len(w1) == len(w2) and all(ex.same_bits(a, b) for a, b in zip(w1, w2))
    assert any(hasattr(p, "main_grad") for p in model.parameters())
    assert not ex.same_bits(l1, ex.train(args, 1, "cpu")[0])
    assert ex.batch_invariance(model.eval(), args, "cpu") == {2: True, 8: True, 31: True}


def test_same_bits_compares_bit_patterns():
    ex = load("examples/train_deterministic.py")
    a = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert ex.same_bits(a, a.clone())
    assert not ex.same_bits(a, torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.bfloat16))
    assert not ex.same_bits(a, a.float())
