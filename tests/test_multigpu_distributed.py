"""World-size invariance on several GPUs with NCCL: the CPU suite's training checks
(tests/test_distributed_cpu.py) with one GPU per rank: the pass overlapped with the
backward on a side stream, started at the flush, with a flush per micro-batch, and the
sharded finish, at 2 and 4 ranks; and the two faults. Needs 2 (or 4) GPUs:

    python -m pytest -m multigpu -q tests/test_multigpu_distributed.py
"""

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

if not torch.cuda.is_available() or torch.cuda.device_count() < 2 \
        or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs 2 or more SM80+ GPUs", allow_module_level=True)

import dist_helpers as H  # noqa: E402
from dist_helpers import run_world, train_worker  # noqa: E402

GPUS = torch.cuda.device_count()


def _diff(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("world", [w for w in (2, 4) if w <= GPUS])
def test_weights_are_bit_identical_across_world_sizes(world):
    """A model of detgemm Linears (d 256, hidden 1024) and element-wise ops, 3 AdamW steps,
    a global batch of 16 x 16 tokens per step. At world `world`, in one launch: the pass
    overlapped with the last micro-batch's backward (64 KiB slices; the first of 2
    micro-batches under no_sync()), a flush per micro-batch over the interleaved layout,
    the pass started at the flush, the sharded finish (64 KiB slices) and the sharded finish
    with a flush per micro-batch; all give the bits of one GPU trained without the wrapper,
    and so does world 1. Each NCCL communicator's posted operations match its peers'."""
    seed = random.randrange(1 << 30)
    base = dict(kind="mlp", seed=seed, chunks=16, steps=3, order="rank_major", device="cuda",
                d=256, h=1024, micro=2)
    cfgs = {
        "overlap": dict(base, pipeline_bytes=64 << 10, log=True),
        "flush per micro-batch": dict(base, order="interleaved"),
        "pass at the flush": dict(base, overlap=False),
        "sharded": dict(base, shard=True, pipeline_bytes=64 << 10, log=True),
        "sharded, flush per micro-batch": dict(base, shard=True, order="interleaved"),
    }
    solo = run_world(H.train_many, 1, {"overlap": dict(base, plain_too=True)}, backend="nccl")
    many = run_world(H.train_many, world, cfgs, backend="nccl")
    ref = solo[0]["overlap"]["plain"]["weights"]
    assert not _diff(solo[0]["overlap"]["weights"], ref), seed
    for label, cfg in cfgs.items():
        for rank, res in enumerate(many):
            got = res[label]["weights"]
            assert not _diff(got, ref), (label, rank, seed, _diff(got, ref))
        logs = [res[label]["log"] for res in many]
        if logs[0] is not None:
            assert not H.posting_order_problems(logs), (label, H.posting_order_problems(logs))
    flat = many[0]["overlap"]["flat_bytes"]
    st = many[0]["overlap"]["stats"][-1]
    assert st.sent_bytes == flat and st.broadcast_bytes == flat and st.overlapped == 1
    last = many[-1]["sharded"]["stats"][-1]
    assert last.broadcast_bytes == 0 and 0 < last.delivered_bytes < flat
    shares = [res["sharded"]["state_numel"] for res in many]
    assert sum(shares) == solo[0]["overlap"]["plain"]["state_numel"], shares


def test_norm_model_is_identical_across_two_runs():
    """Embedding and norms beside detgemm Linears on 2 GPUs: two launches (the second with
    the sharded finish), same bits on every rank; the non-detgemm gradients are the fp32
    sum in rank order."""
    seed = random.randrange(1 << 30)
    cfg = dict(kind="norm", seed=seed, chunks=4, steps=2, order="rank_major", micro=1,
               device="cuda")
    first = run_world(train_worker, 2, cfg, backend="nccl")
    second = run_world(train_worker, 2, dict(cfg, shard=True), backend="nccl")
    for a, b in zip(first, second):
        assert not _diff(a["weights"], b["weights"]), seed
        assert not _diff(a["weights"], first[0]["weights"]), seed
        assert all(ok for _, ok in a["sum_order_ok"]), a["sum_order_ok"]
        assert all(ok for _, ok in b["sum_order_ok"]), b["sum_order_ok"]


@pytest.fixture(scope="module")
def faults():
    """3 ranks if there are GPUs for them: rank 1's dW GEMM raises once in the middle of
    the overlapped pass, then (after a recovered step) its process exits there; 30 s
    process-group timeout. The others' GPUs then still wait for rank 1's data: they leave
    without tearing their process group down."""
    world = min(GPUS, 3)
    return run_world(H.fault_worker, world, random.randrange(1 << 30), "cuda",
                     backend="nccl", pg_timeout=30, timeout=180, may_exit=(1,))


def test_a_rank_raising_mid_chain_is_named_on_every_rank(faults):
    """Rank 1 passes its slices on, every rank raises at finalize_grads naming rank 1; after
    discard_pending() the next step trains to the same weights everywhere."""
    for rank, res in enumerate(faults):
        kind, msg = res["raise"]["error"]
        assert kind == "RuntimeError" and "rank 1 failed" in msg, (rank, kind, msg)
    assert all(not _diff(res["weights"], faults[0]["weights"]) for res in faults)


def test_a_rank_exiting_mid_chain_is_named_on_every_surviving_rank(faults):
    """The others raise at finalize_grads (the host flag exchange notices) naming rank 1,
    within the process-group timeout."""
    for rank, res in enumerate(faults):
        if rank == 1:
            continue
        kind, msg = res["exit"]["error"]
        assert kind == "PassFailed" and "rank 1" in msg.lower(), (rank, kind, msg)
        assert res["exit"]["seconds"] < 30, (rank, res["exit"]["seconds"])
