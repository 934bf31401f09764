"""World-size invariance on several GPUs with NCCL: the CPU suite's training checks
(tests/test_distributed_cpu.py) with one GPU per rank. Needs 2 (or 4) GPUs:

    python -m pytest -m multigpu -q tests/test_multigpu_distributed.py
"""

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

if not torch.cuda.is_available() or torch.cuda.device_count() < 2 \
        or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs 2 or more SM80+ GPUs", allow_module_level=True)

from dist_helpers import run_world, train_worker  # noqa: E402

GPUS = torch.cuda.device_count()


def _diff(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("world", [w for w in (2, 4) if w <= GPUS])
def test_weights_are_bit_identical_across_world_sizes(world):
    """A model of detgemm Linears (d 256, hidden 1024) and element-wise ops, 3 AdamW steps,
    a global batch of 16 x 16 tokens per step: world `world` (2 micro-batches per rank,
    64 KiB slices of output features), the same world with a flush per micro-batch over
    the interleaved layout, and world 1 all give the bits of one GPU trained without the
    wrapper."""
    seed = random.randrange(1 << 30)
    base = dict(kind="mlp", seed=seed, chunks=16, steps=3, order="rank_major", device="cuda",
                d=256, h=1024)
    runs = {
        "world 1": run_world(train_worker, 1, dict(base, micro=2, plain_too=True),
                             backend="nccl"),
        f"world {world}": run_world(train_worker, world,
                                    dict(base, micro=2, pipeline_bytes=64 << 10),
                                    backend="nccl"),
        f"world {world}, flush per micro-batch": run_world(
            train_worker, world, dict(base, micro=2, order="interleaved"), backend="nccl"),
    }
    ref = runs["world 1"][0]["plain"]["weights"]
    for label, results in runs.items():
        for rank, res in enumerate(results):
            assert not _diff(res["weights"], ref), (label, rank, seed, _diff(res["weights"], ref))
    st = runs[f"world {world}"][0]["stats"][-1]
    flat = runs[f"world {world}"][0]["flat_bytes"]
    assert st.sent_bytes == flat and st.broadcast_bytes == flat


def test_norm_model_is_identical_across_two_runs():
    """Embedding and norms beside detgemm Linears on 2 GPUs: two launches, same bits on
    every rank; the non-detgemm gradients are the fp32 sum in rank order."""
    seed = random.randrange(1 << 30)
    cfg = dict(kind="norm", seed=seed, chunks=4, steps=2, order="rank_major", micro=1,
               device="cuda")
    first = run_world(train_worker, 2, cfg, backend="nccl")
    second = run_world(train_worker, 2, cfg, backend="nccl")
    for a, b in zip(first, second):
        assert not _diff(a["weights"], b["weights"]), seed
        assert not _diff(a["weights"], first[0]["weights"]), seed
        assert all(ok for _, ok in a["sum_order_ok"]), a["sum_order_ok"]
