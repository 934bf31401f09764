"""Rank workers for tests/test_ddp_fsdp_cpu.py: converted models under torch's
DistributedDataParallel and FSDP2 (`fully_shard`), run by `dist_helpers.run_world` on CPU
with gloo (detgemm's CPU path is the bit-exact reference of the kernels).

Every rank builds the same model from a seed and takes its own slice of a global batch that
every rank draws from the same generator. Each worker trains twice from scratch and returns
what the test compares: weights of both runs, the step-0 gradients after the all-reduce /
reduce-scatter, the step-0 gradients of the same replica without the wrapper on this rank's
slice, and forward outputs of checkpoints saved and loaded through `state_dict`."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import detgemm_cute as dg

D_IN, D_HID, D_OUT = 32, 64, 16
TOKENS = 32  # per rank and step
STEPS = 3


def build(seed: int, dtype, fp32_grad_accum: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.ReLU(),
                                torch.nn.Linear(D_HID, D_HID), torch.nn.ReLU(),
                                torch.nn.Linear(D_HID, D_OUT)).to(dtype)
    return dg.nn.convert(model, fp32_grad_accum=fp32_grad_accum)


def batch(step: int, rank: int, world: int):
    """This rank's slice of the step's global batch (fp32 inputs and targets)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * TOKENS, D_IN, generator=g)
    t = torch.randn(world * TOKENS, D_OUT, generator=g)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    return x[rows], t[rows]


def loss_of(out, t):
    return (out.float() - t).square().mean()


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _local_step0_grads(rank, world, dtype, amp):
    """The step-0 gradients of this rank's slice without any wrapper."""
    model = build(0, dtype)
    x, t = batch(0, rank, world)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x if amp else x.to(dtype))
    loss_of(out, t).backward()
    return _grads(model)


def _train_ddp(rank, world, dtype, amp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build(0, dtype)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=False)
    step0, losses = None, []
    for step in range(STEPS):
        x, t = batch(step, rank, world)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = ddp(x if amp else x.to(dtype))
        loss = loss_of(out, t)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            step0 = _grads(model)
        opt.step()
        losses.append(loss.detach())
    return model, step0, torch.stack(losses)


def _probe():
    return torch.randn(8, D_IN, generator=torch.Generator().manual_seed(7))


def _ddp_checkpoint(rank, model, dtype, amp, tmp):
    """rank 0 saves the state_dict; every rank loads it into a fresh converted model and a
    plain torch model; returns the three forward outputs on one probe input."""
    path = os.path.join(tmp, "ddp.pt")
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    sd = torch.load(path, weights_only=True)
    fresh = build(1, dtype)  # another seed: the load must overwrite every weight
    fresh.load_state_dict(sd)
    plain = torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.ReLU(),
                                torch.nn.Linear(D_HID, D_HID), torch.nn.ReLU(),
                                torch.nn.Linear(D_HID, D_OUT)).to(dtype)
    plain.load_state_dict(sd)
    dg.nn.convert(plain)
    x = _probe()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        xin = x if amp else x.to(dtype)
        return [m(xin) for m in (model, fresh, plain)]


def ddp_worker(rank, world, tmp):
    out = {}
    for name, dtype, amp in (("bf16", torch.bfloat16, False), ("amp", torch.float32, True)):
        m1, step0, losses1 = _train_ddp(rank, world, dtype, amp)
        m2, _, losses2 = _train_ddp(rank, world, dtype, amp)
        out[name] = {
            "weights": [[p.detach().clone() for p in m.parameters()] for m in (m1, m2)],
            "losses": [losses1, losses2],
            "step0": step0,
            "local0": _local_step0_grads(rank, world, dtype, amp),
            "checkpoint": _ddp_checkpoint(rank, m1, dtype, amp, tmp),
            "linears": sum(isinstance(m, dg.nn.Linear) for m in m1.modules()),
        }
    out["main_grad_refused"] = _ddp_main_grad_refused()
    return out


def _ddp_main_grad_refused():
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(build(0, torch.bfloat16, fp32_grad_accum=True))
    try:
        ddp(torch.randn(16, D_IN).to(torch.bfloat16))
    except RuntimeError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------- FSDP2
def _shard(model):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _full(ts):
    return [t.full_tensor().detach().clone() for t in ts]


def _train_fsdp(rank, world, fp32_grad_accum=False):
    model = _shard(build(0, torch.float32, fp32_grad_accum))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    step0, losses = None, []
    for step in range(STEPS):
        x, t = batch(step, rank, world)
        loss = loss_of(model(x), t)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            step0 = _full(p.grad for p in model.parameters())
        opt.step()
        losses.append(loss.detach())
    return model, step0, torch.stack(losses)


def _fsdp_checkpoint(rank, model, tmp):
    """Full state dict gathered to rank 0 and saved; loaded (broadcast from rank 0) into a
    fresh sharded model and into an unsharded converted model with bf16 parameters."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         set_model_state_dict)

    path = os.path.join(tmp, "fsdp.pt")
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    if rank == 0:
        torch.save(sd, path)
    dist.barrier()
    fresh = _shard(build(1, torch.float32))
    full = torch.load(path, weights_only=True) if rank == 0 else {}
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    single = build(1, torch.float32)
    single.load_state_dict(torch.load(path, weights_only=True))
    single = single.to(torch.bfloat16)  # what the mixed-precision policy computes with
    x = _probe()
    with torch.no_grad():
        return [model(x), fresh(x), single(x.to(torch.bfloat16))]


def fsdp_worker(rank, world, tmp):
    m1, step0, losses1 = _train_fsdp(rank, world)
    m2, _, losses2 = _train_fsdp(rank, world)
    out = {
        "weights": [_full(m.parameters()) for m in (m1, m2)],
        "dtypes": [p.dtype for p in m1.parameters()],
        "losses": [losses1, losses2],
        "step0": step0,
        "checkpoint": _fsdp_checkpoint(rank, m1, tmp),
        "sharded": [tuple(p.placements) for p in m1.parameters()],
    }
    # fp32_grad_accum cannot see FSDP2's reduce-scatter: refused at finalize_grads
    model, _, _ = _train_fsdp_main_grad_once(rank, world)
    try:
        dg.nn.finalize_grads(model)
        out["main_grad_refused"] = None
    except RuntimeError as e:
        out["main_grad_refused"] = str(e)
    return out


def _train_fsdp_main_grad_once(rank, world):
    model = _shard(build(0, torch.float32, fp32_grad_accum=True))
    x, t = batch(0, rank, world)
    loss_of(model(x), t).backward()
    return model, None, None


def world_worker(rank, world, tmp):
    """Both wrappers in one process group (one spawn for the whole test module); `tmp` is
    a directory shared by the ranks for checkpoints."""
    return {"ddp": ddp_worker(rank, world, tmp), "fsdp": fsdp_worker(rank, world, tmp)}
