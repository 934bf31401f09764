"""The sharded finish of `detgemm_cute.distributed` (``shard_optimizer=True``, ZeRO-1 style):
each rank owns one chunk of every dtype group of the flat parameter space (`dist_layout`),
receives the final fp32 gradients of that chunk only, steps its optimizer over the pieces of
the parameters in it (optimizer state: 1/R per rank), and the updated parameters are then
all-gathered in their dtype. The parameters live in one flat buffer per dtype for this.

The optimizer steps flat 1-D pieces of the parameters: an element-wise optimizer (AdamW,
Adam, SGD, ...) gives each element the bits it gives it in the whole parameter; anything
that looks across elements (a per-tensor norm, gradient clipping by the global norm) sees
only this rank's pieces."""

from __future__ import annotations

import torch

from .dist_records import OP

_FP32 = torch.float32


def setup(eng) -> None:
    """Flat parameter buffers, this rank's pieces and their gradient views."""
    layout = eng.layout
    eng.param_bufs = layout.flatten_parameters(eng.device)
    eng.grad_bufs = layout.grad_buffers(eng.device, chunk=True)
    for p, gi, a, b in layout.shard_pieces(eng.rank):
        g = layout.groups[gi]
        chunk_lo = g.lo + eng.rank * g.chunk
        piece = torch.nn.Parameter(eng.param_bufs[gi][a - g.lo:b - g.lo],
                                   requires_grad=p.requires_grad)
        grad = (eng.flat[a:b] if g.dtype == _FP32
                else eng.grad_bufs[gi][a - chunk_lo:b - chunk_lo])
        eng.pieces[id(p)] = (piece, grad)
        eng.param_ids.add(id(piece))


def _param_groups(params, trainable) -> list[dict]:
    if params is None:
        return [{"params": trainable}]
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{OP}: make_optimizer: params must be an iterable of parameters or "
                        f"of dicts (parameter groups), got a single tensor")
    groups = list(params)
    if not groups:
        raise ValueError(f"{OP}: make_optimizer: params is empty")
    if all(isinstance(g, dict) for g in groups):
        return [dict(g, params=_as_list(g.get("params"))) for g in groups]
    if any(isinstance(g, dict) for g in groups):
        raise TypeError(f"{OP}: make_optimizer: params mixes parameters and parameter "
                        f"groups (dicts)")
    return [{"params": groups}]


def _as_list(ps) -> list:
    if ps is None:
        raise ValueError(f"{OP}: make_optimizer: a parameter group has no 'params'")
    return [ps] if isinstance(ps, torch.Tensor) else list(ps)


def make_optimizer(eng, module, cls, params, kwargs):
    """`cls` over the wrapped model's parameters (`params`: None for all trainable ones, or
    parameters / parameter groups of the model). Sharded: over this rank's pieces, with a
    step post-hook that all-gathers the updated parameters."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"{OP}: make_optimizer: optimizer_class must be a torch.optim."
                        f"Optimizer subclass, got {cls!r}")
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = _param_groups(params, trainable)
    known = {id(p) for p in trainable}
    for g in groups:
        for p in g["params"]:
            if id(p) not in known:
                raise ValueError(f"{OP}: make_optimizer: params holds a tensor that is not a "
                                 f"trainable parameter of the wrapped model")
    if not eng.shard:
        return cls(groups, **kwargs)
    sharded = [dict(g, params=[eng.pieces[id(p)][0] for p in g["params"] if id(p) in eng.pieces])
               for g in groups]
    if not any(g["params"] for g in sharded):
        # this rank's chunk holds only padding: a stand-in that never gets a gradient
        sharded[0]["params"] = [torch.nn.Parameter(torch.zeros(1, device=eng.device))]
    opt = cls(sharded, **kwargs)
    opt.register_step_post_hook(lambda _opt, _args, _kwargs: eng.gather_parameters())
    return opt


def state_numel(optimizer) -> int:
    """Elements of tensor state an optimizer holds (to check the 1/R share)."""
    return sum(v.numel() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


__all__ = ["setup", "make_optimizer", "state_numel"]
