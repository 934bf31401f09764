"""World-size-invariant data parallelism on CPU with gloo, in 1, 2 and 4 processes.

CPU tensors run detgemm's bit-exact reference of the GPU chain, so what holds here holds
for the kernels' bits. Every training check draws a fresh seed (printed on failure)."""

import random

import pytest
import torch

from dist_helpers import TOKENS, build, rank_chunks, run_world, train_worker
import dist_helpers as H

CHUNKS = 4  # a global batch of 4 x 16 tokens per step
STEPS = 3


def _seed():
    return random.randrange(1 << 30)


def _same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in bits (or are missing)."""
    return [k for k in a if k not in b or not torch.equal(a[k], b[k])] + \
        [k for k in b if k not in a]


def test_rank_chunks_layouts():
    """The global layouts the invariance statement is about: rank-major (consecutive slices,
    rank 0 first) and interleaved (micro-batch j of rank r is global micro-batch j*R + r)."""
    assert rank_chunks(0, 1, 4, 2, "rank_major") == [[0, 1], [2, 3]]
    assert rank_chunks(1, 2, 4, 2, "rank_major") == [[2], [3]]
    assert rank_chunks(3, 4, 4, 1, "rank_major") == [[3]]
    assert rank_chunks(0, 2, 4, 2, "interleaved") == [[0], [2]]
    assert rank_chunks(1, 2, 4, 2, "interleaved") == [[1], [3]]


def test_weights_are_bit_identical_at_world_sizes_1_2_4():
    """A model of detgemm Linears and element-wise ops, 3 AdamW steps with gradient
    accumulation, the global batch of each step split over 1, 2 or 4 ranks (consecutive
    slices, rank 0 first; 2 micro-batches per rank at worlds 1 and 2, the first under
    no_sync()): every rank of every world ends with the bits of one process trained without
    the wrapper on the same micro-batches in order. Each world runs several ways in turn:
    the pass overlapped with the backward (the default) or started at the flush
    (overlap=False), 1 KiB pipeline slices, a flush after every micro-batch over the
    interleaved layout, `finalize_grads` on the inner model, and the sharded finish
    (shard_optimizer=True: results to their owners, each rank steps 1/R of the parameters,
    then all-gathers them), whose optimizer state is split over the ranks. On NCCL each
    communicator runs its operations in posting order: the posted sequences match."""
    seed = _seed()
    base = dict(kind="mlp", seed=seed, chunks=CHUNKS, steps=STEPS, order="rank_major")
    two = dict(base, micro=2)
    worlds = {
        1: {"overlap": dict(two, plain_too=True)},
        2: {"overlap, 1 KiB slices": dict(two, pipeline_bytes=1024, log=True),
            "flush per micro-batch": dict(two, order="interleaved"),
            "pass at the flush": dict(two, overlap=False),
            "sharded, 1 KiB slices": dict(two, shard=True, pipeline_bytes=1024, log=True),
            "sharded, flush per micro-batch": dict(two, shard=True, order="interleaved",
                                                   pipeline_bytes=1024)},
        4: {"finalize on the inner model": dict(base, micro=1, finalize_inner=True, log=True),
            "sharded": dict(base, micro=1, shard=True, log=True)},
    }
    runs = {w: run_world(H.train_many, w, cfgs) for w, cfgs in worlds.items()}
    plain = runs[1][0]["overlap"]["plain"]
    ref = plain["weights"]
    # the one-process reference trained: its weights moved away from the initial ones
    init = {n: p.detach() for n, p in build("mlp", seed).named_parameters()}
    assert all(not torch.equal(ref[n], init[n]) for n in init)
    for w, results in runs.items():
        for label in worlds[w]:
            for rank, res in enumerate(results):
                got = res[label]
                assert not _same(got["weights"], ref), (w, label, rank, seed,
                                                        _same(got["weights"], ref))
                if not worlds[w][label].get("shard"):  # sharded: main_grad final on owners only
                    assert not _same(got["main_grads"], plain["main_grads"]), (w, label, rank)
            logs = [res[label]["log"] for res in results]
            if logs[0] is not None:
                assert not H.posting_order_problems(logs), (w, label,
                                                            H.posting_order_problems(logs))
    _check_costs(runs[1][0]["overlap"], [res["pass at the flush"] for res in runs[2]],
                 [res["overlap, 1 KiB slices"] for res in runs[2]])
    _check_shards([res["sharded"] for res in runs[4]], plain["state_numel"])


def _check_costs(solo, pair, overlapped):
    """What a flush moves, per rank: R-1 hops of the fp32 gradients (rank r < R-1 sends
    them once, rank r > 0 receives them once) and one broadcast of them; nothing at world
    1. 1 KiB slices cut each weight into slices of 8 output features. Held X and dY: at the
    flush, all of both micro-batches; overlapped, less (each layer's records go as its
    chain starts), but at least the first micro-batch's."""
    st = solo["stats"][-1]
    assert (st.sent_bytes, st.received_bytes, st.broadcast_bytes) == (0, 0, 0)
    flat = pair[0]["flat_bytes"]
    # Mlp(32, 64): up 64x32 + 64, mid 64x64, down 32x64 + 32 parameters, fp32
    assert flat == 4 * (64 * 32 + 64 + 64 * 64 + 32 * 64 + 32)
    for run in (pair, overlapped):
        s0, s1 = run[0]["stats"][-1], run[1]["stats"][-1]
        assert (s0.sent_bytes, s0.received_bytes) == (flat, 0)
        assert (s1.sent_bytes, s1.received_bytes) == (0, flat)
        assert s0.broadcast_bytes == s1.broadcast_bytes == flat
        assert s0.calls == 3 * 2 and s0.flushes == 1 and s0.finalize
    # 1 KiB = 256 fp32: 8 rows of a 32-wide weight, 8 rows (rounded down to 8) of 64-wide
    assert overlapped[0]["stats"][-1].units == 64 // 8 + 1 + 64 // 8 + 32 // 8 + 1
    assert overlapped[0]["stats"][-1].overlapped == 1 and pair[0]["stats"][-1].overlapped == 0
    # held until the flush: X and dY of each Linear call in bf16, 2 micro-batches of 16
    # tokens: (32+64) + (64+64) + (64+32) features per token
    micro_bytes = 2 * TOKENS * (32 + 64 + 64 + 64 + 64 + 32)
    assert pair[0]["stats"][-1].held_bytes == 2 * micro_bytes
    assert micro_bytes <= overlapped[0]["stats"][-1].held_bytes < 2 * micro_bytes


def _check_shards(shards, plain_state):
    """Sharded finish at world 4: each rank's optimizer state is about 1/4 of one
    process's (its chunk of the padded flat space), and together they hold all of it."""
    from detgemm_cute.dist_layout import ALIGN

    per_rank = [res["state_numel"] for res in shards]
    assert sum(per_rank) == plain_state  # AdamW: two moments of every element, once
    # a rank's chunk: a quarter of the flat space, which pads each of the 5 parameters
    # to a multiple of ALIGN elements
    assert max(per_rank) <= plain_state // 4 + 2 * ALIGN * 5, (per_rank, plain_state)
    s3 = shards[3]["stats"][-1]
    assert s3.broadcast_bytes == 0 and s3.delivered_bytes > 0


def test_norm_model_is_identical_across_two_runs_at_world_2():
    """Embedding, LayerNorm and RMSNorm beside detgemm Linears at world 2: two launches (the
    second with the sharded finish) give the same bits on every rank, and each non-detgemm
    gradient is exactly the fp32 sum rank 0 + rank 1 of the local gradients, rounded once."""
    seed = _seed()
    cfg = dict(kind="norm", seed=seed, chunks=CHUNKS, steps=2, order="rank_major", micro=1)
    first = run_world(train_worker, 2, cfg)
    second = run_world(train_worker, 2, dict(cfg, shard=True))
    for a, b in zip(first, second):
        assert not _same(a["weights"], b["weights"]), seed
        assert not _same(a["weights"], first[0]["weights"]), seed
        for res in (a, b):
            names = {n for n, _ in res["sum_order_ok"]}
            assert names == {"emb.weight", "ln.weight", "ln.bias", "rms.weight"}
            assert all(ok for _, ok in res["sum_order_ok"]), res["sum_order_ok"]


def test_bad_setups_get_clear_errors():
    """Run on 2 ranks: a model that differs on rank 1, values that differ without the
    broadcast, a micro-batch that is not a multiple of 16 tokens, a missing finalize (at
    optimizer.step and at zero_main_grads), ranks disagreeing on flush vs finalize, an input
    modified in place before the flush, a model not converted for fp32 accumulation, a
    module without detgemm Linears, a detgemm weight also used by another module, a sparse
    gradient to sum; each raises the named error on every rank; a rank outside the process
    group is told so. After a discarded step a proper step works, and
    the constructor's broadcast gives every rank rank 0's parameters."""
    results = run_world(H.bad_setup_worker, 2, _seed(), pg_timeout=60)
    for rank, res in enumerate(results):
        assert set(res["checks"]) == set(H.BAD_EXPECT)
        for name, (kind, msg) in res["checks"].items():
            types, texts = H.BAD_EXPECT[name]
            assert kind in types, (rank, name, kind, msg)
            assert any(t in msg for t in texts), (rank, name, msg)
        assert res["broadcast_ok"], rank
    assert results[0]["non_member"] == ("no error", "")
    kind, msg = results[1]["non_member"]
    assert kind == "ValueError" and "not a member of process_group" in msg, msg


def test_constructor_errors_without_a_process_group():
    """Local argument errors name the argument; without init_process_group it says so."""
    import torch.distributed as dist

    from detgemm_cute.distributed import InvariantDataParallel

    assert not dist.is_initialized()
    model = build("mlp", 0)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        InvariantDataParallel("model")
    with pytest.raises(ValueError, match="pipeline_bytes must be a positive int"):
        InvariantDataParallel(model, pipeline_bytes=0)
    with pytest.raises(TypeError, match="broadcast_parameters must be a bool"):
        InvariantDataParallel(model, broadcast_parameters="yes")
    with pytest.raises(TypeError, match="overlap must be a bool"):
        InvariantDataParallel(model, overlap=1)
    with pytest.raises(TypeError, match="shard_optimizer must be a bool"):
        InvariantDataParallel(model, shard_optimizer="yes")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        InvariantDataParallel(model)


def _run_example(rel, *args, timeout=300):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(root / rel), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=root)


def test_example_trains_to_identical_weights_at_world_sizes_1_and_2():
    """examples/train_data_parallel.py on 2 gloo processes (worlds 1 and 2 and one device
    without the wrapper) reports identical weights and exits 0; its loss is the global
    token-count scaled sum."""
    r = _run_example("examples/train_data_parallel.py", "--world", "2", "--steps", "2",
                     "--tokens", "64", "--d-model", "32", "--layers", "1",
                     "--seed", str(_seed()))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "weights identical at every world size: yes" in r.stdout, r.stdout
    table = r.stdout.split("weights identical")[0].splitlines()
    lines = [ln for ln in table if ln.strip().startswith(("1 rank", "2 ranks", "one device"))]
    assert len(lines) == 3 and all(ln.split()[-1] == "yes" for ln in lines), r.stdout


def test_example_rejects_token_counts_it_cannot_split():
    r = _run_example("examples/train_data_parallel.py", "--world", "2", "--tokens", "48")
    assert r.returncode != 0 and "multiple of 16 tokens" in r.stderr


def test_costs_script_compares_the_pass_with_all_reduce():
    r = _run_example("examples/data_parallel_costs.py", "--world", "2", "--sizes", "0.25",
                     "--reps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pass + broadcast ms" in r.stdout and "0.25" in r.stdout, r.stdout


def test_fp32_parameters_under_autocast_at_world_2():
    """fp32 parameters with bf16 GEMMs inside torch.autocast (fp32 main_grad and .grad):
    world 2 gives the bits of one process trained without the wrapper."""
    seed = _seed()
    cfg = dict(kind="mlp", seed=seed, chunks=CHUNKS, steps=2, order="rank_major", micro=1,
               autocast=True, plain_too=True)
    results = run_world(train_worker, 2, cfg)
    plain = results[0]["plain"]
    assert all(w.dtype == torch.float32 for w in plain["weights"].values())
    for rank, res in enumerate(results):
        assert not _same(res["weights"], plain["weights"]), (rank, seed)
        assert not _same(res["main_grads"], plain["main_grads"]), (rank, seed)


@pytest.fixture(scope="module")
def faults():
    """World 3, the pass overlapped with the backward, rank 1's dW GEMM replaced: it raises
    once, then (after a recovered step) its process exits; 10 s process-group timeout."""
    seed = _seed()
    return seed, run_world(H.fault_worker, 3, seed, pg_timeout=10, timeout=120, may_exit=(1,))


def test_a_rank_raising_mid_chain_is_named_on_every_rank(faults):
    """Rank 1's dW GEMM raises in the middle of the chain. Rank 1 passes its slices on
    unchanged, so no rank waits for data that never comes, and at finalize_grads every rank
    raises a RuntimeError naming rank 1 and its error, within seconds. After
    discard_pending() the next step trains on every rank, to the same weights everywhere."""
    seed, results = faults
    for rank, res in enumerate(results):
        kind, msg = res["raise"]["error"]
        assert kind == "RuntimeError", (rank, kind, msg)
        assert "rank 1 failed" in msg and "injected fault in rank 1's dW" in msg, (rank, msg)
        assert res["raise"]["seconds"] < 10, (rank, res["raise"]["seconds"])
    assert all(not _same(res["weights"], results[0]["weights"]) for res in results), seed


def test_a_rank_exiting_mid_chain_is_named_on_every_surviving_rank(faults):
    """Rank 1's process exits in the middle of the chain. Rank 2 (waiting for its slices)
    and rank 0 (at finalize_grads) each raise a RuntimeError that names rank 1, well within
    the process-group timeout (10 s) instead of hanging."""
    _, results = faults
    assert "exit" not in results[1]  # it saved its result, then exited inside the step
    for rank in (0, 2):
        kind, msg = results[rank]["exit"]["error"]
        assert kind == "PassFailed", (rank, kind, msg)
        assert "rank 1" in msg.lower(), (rank, msg)
        assert results[rank]["exit"]["seconds"] < 10, (rank, results[rank]["exit"]["seconds"])
