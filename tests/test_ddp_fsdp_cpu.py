"""Converted models under torch's DistributedDataParallel and FSDP2 (`fully_shard`), two
processes on CPU with gloo (detgemm's CPU path is the kernels' bit-exact reference): forward,
backward, AdamW steps, state_dict save/load. What is promised at a fixed world size: two runs
give identical weights and losses, every rank holds the same weights, and the all-reduced
gradient is exactly the mean of the ranks' detgemm gradients. What is not: the same bits at
another world size (the reduction adds per-rank partial gradients; shown below). The workers
are in tests/ddp_fsdp_workers.py; one spawn of two ranks runs all of them."""

import pytest
import torch

import detgemm_cute as dg

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import ddp_fsdp_workers as W  # noqa: E402
from dist_helpers import run_world  # noqa: E402

WORLD = 2


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def all_same(xs, ys):
    return len(xs) == len(ys) and all(same(a, b) for a, b in zip(xs, ys))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_world(W.world_worker, WORLD, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


@pytest.mark.parametrize("kind", ["bf16", "amp"])
def test_ddp_runs_are_identical_and_ranks_agree(ranks, kind):
    """bf16 parameters, or fp32 parameters under torch.autocast(bf16)."""
    runs = [r["ddp"][kind] for r in ranks]
    for r in runs:
        assert r["linears"] == 3  # the model's three Linears are detgemm's
        first, second = r["weights"]
        assert all_same(first, second) and all_same(*r["losses"])
        assert torch.isfinite(r["losses"][0]).all()
        want = torch.float32 if kind == "amp" else torch.bfloat16
        assert all(p.dtype == want for p in first)
    assert all_same(runs[0]["weights"][0], runs[1]["weights"][0])
    assert not all_same(runs[0]["local0"], runs[1]["local0"])  # the ranks saw different data


@pytest.mark.parametrize("kind", ["bf16", "amp"])
def test_ddp_gradient_is_the_exact_mean_of_the_rank_gradients(ranks, kind):
    """After the all-reduce each gradient is (g0 + g1) / 2 of the ranks' own detgemm
    gradients, rounded once in the gradient dtype."""
    local = [r["ddp"][kind]["local0"] for r in ranks]
    want = [((g0.double() + g1.double()) / 2).to(g0.dtype) for g0, g1 in zip(*local)]
    for r in ranks:
        assert all_same(r["ddp"][kind]["step0"], want)


def test_gradient_bits_depend_on_the_number_of_ranks(ranks):
    """One device on the whole global batch does not give the 2-rank gradient bits: dW's
    chain over 64 tokens is not the sum of two 32-token chains (see
    detgemm_cute.distributed for world-size-invariant gradients)."""
    model = W.build(0, torch.float32)
    xs, ts = zip(*(W.batch(0, r, WORLD) for r in range(WORLD)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.cat(xs))
    W.loss_of(out, torch.cat(ts)).backward()
    one_device = [p.grad for p in model.parameters()]
    two_ranks = ranks[0]["ddp"]["amp"]["step0"]
    assert not all_same(one_device, two_ranks)
    for a, b in zip(one_device, two_ranks):  # same gradient, other rounding
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("kind", ["bf16", "amp"])
def test_ddp_state_dict_round_trip(ranks, kind):
    """rank 0's DDP state_dict, loaded into a fresh converted model and into a plain torch
    model converted afterwards: the same forward bits."""
    for r in ranks:
        trained, fresh, plain = r["ddp"][kind]["checkpoint"]
        assert same(fresh, trained) and same(plain, trained)


def test_ddp_refuses_fp32_grad_accum(ranks):
    for r in ranks:
        msg = r["ddp"]["main_grad_refused"]
        assert msg and "inside torch DistributedDataParallel" in msg and "main_grad" in msg


def test_fsdp2_runs_are_identical_with_sharded_fp32_parameters(ranks):
    for r in ranks:
        f = r["fsdp"]
        assert all_same(*f["weights"]) and all_same(*f["losses"])
        assert all(d == torch.float32 for d in f["dtypes"])
        assert all(str(p) == "(Shard(dim=0),)" for p in f["sharded"])
    assert all_same(ranks[0]["fsdp"]["weights"][0], ranks[1]["fsdp"]["weights"][0])


def test_fsdp2_gradients_equal_ddp_with_autocast(ranks):
    """FSDP2 with MixedPrecisionPolicy(bf16 parameters, fp32 reduction) computes the same
    GEMMs as DDP + torch.autocast on fp32 parameters, and its reduce-scatter averages the
    same fp32 gradients: identical step-0 gradients and losses."""
    for r in ranks:
        assert all_same(r["fsdp"]["step0"], r["ddp"]["amp"]["step0"])
        assert same(r["fsdp"]["losses"][0][:1], r["ddp"]["amp"]["losses"][0][:1])


def test_fsdp2_state_dict_round_trip(ranks):
    """A full state dict gathered to rank 0, loaded into a fresh sharded model (broadcast
    from rank 0) and into one unsharded converted model in bf16: the same forward bits."""
    for r in ranks:
        trained, fresh, single = r["fsdp"]["checkpoint"]
        assert trained.dtype == torch.bfloat16
        assert same(fresh, trained) and same(single, trained)


def test_fsdp2_refuses_fp32_grad_accum(ranks):
    for r in ranks:
        msg = r["fsdp"]["main_grad_refused"]
        assert msg and "DTensor parameters" in msg and "MixedPrecisionPolicy" in msg


def test_the_workers_compute_with_detgemm():
    """The workers' model is made of detgemm Linears whose CPU path is the reference."""
    from detgemm_cute import reference

    model = W.build(0, torch.bfloat16)
    x = W.batch(0, 0, WORLD)[0].to(torch.bfloat16)
    lin = model[0]
    assert isinstance(lin, dg.nn.Linear)
    assert same(lin(x), reference.linear(x, lin.weight.detach(), lin.bias.detach()))
