"""World-size-invariant data parallelism: the fp32 dW chain passed from rank to rank.

`InvariantDataParallel(model)` wraps a model converted with
``dg.nn.convert(model, fp32_grad_accum=True)``. Its detgemm Linears do not run dW and the
bias gradient in backward: each keeps the (dY, X) pair of every backward call. When
``dg.nn.finalize_grads`` runs (on the wrapper or on the inner model, on every rank), the
fp32 ``main_grad`` of every such weight and bias is passed along the ranks in order:
rank 0 continues the chain from its ``main_grad`` over its own tokens, sends the fp32
buffer to rank 1, which continues it over its tokens, and so on; the last rank broadcasts
the result, so every rank ends with the same ``main_grad`` and ``.grad``.

The contract (bit for bit). After a flush, each detgemm weight's and bias's ``main_grad``
on every rank is the chain that starts from rank 0's ``main_grad`` and runs over rank 0's
recorded backward calls in the order its backward made them, then rank 1's, ..., then
rank R-1's. A chain continued at a 16-token boundary is the chain of one call over all
tokens, so when every backward call carries a multiple of 16 tokens (checked) this is one
device running the same calls in that order: the global batch laid out rank-major, rank 0
first. `finalize_grads` flushes once per step, so rank r holds consecutive micro-batches
r*J .. r*J+J-1 of the global step; calling `flush()` after every micro-batch instead gives
the order (micro-batch j, rank r), i.e. rank r's j-th micro-batch is global micro-batch
j*R + r, and holds only one micro-batch's pairs. With forward ops that work per sample
(element-wise ops, row-wise norms without weights, attention within a sequence) and losses
scaled by the *global* token count (gradients are sums over the global batch; nothing
divides by the world size), every rank then trains to the bits of one device.

The chain is pipelined over slices of the output features (``pipeline_bytes`` of fp32 per
slice): rank r computes slice s while rank r+1 computes slice s-1. Parameters that are not
detgemm Linears' (norms, embeddings) keep PyTorch's local ``.grad`` and are summed at
`finalize_grads` in a fixed rank order in fp32 (rank 0's, + rank 1's, ...), through the same
pipeline: deterministic for a given world size, not world-size invariant.

Costs (docs/distributed.md): each rank keeps X and dY of every detgemm Linear call from its
backward until the flush; the fp32 gradients travel R-1 hops (rank r sends them once to
rank r+1) and come back by one broadcast from the last rank.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import nn as dnn
from .dist_chain import OP as _OP
from .dist_chain import Deferral, Engine, FlushStats, Layer

_FP32 = torch.float32


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_step_hook = None


def _optimizer_pre_hook(optimizer, args, kwargs):
    """An optimizer step over parameters whose gradients were never finalized is an error:
    their ``.grad`` would be stale or missing on this rank (a silent wrong step)."""
    for eng in list(_ENGINES):
        if not eng.unfinished:
            continue
        owned = eng.param_ids
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in owned:
                    raise RuntimeError(
                        f"{_OP}: optimizer.step() ran after a backward whose gradients were "
                        f"not finalized; call detgemm_cute.nn.finalize_grads(model) on every "
                        f"rank before the step")


# --------------------------------------------------------------------------- the wrapper
class InvariantDataParallel(torch.nn.Module):
    """Data parallelism whose detgemm Linear gradients do not depend on the world size.

    ``module``: a model converted with ``dg.nn.convert(model, fp32_grad_accum=True)``, the
    same model on every rank of ``process_group`` (default: the whole world), with its
    parameters on one device (CUDA with NCCL, CPU with gloo). Construction is collective:
    it checks that every rank holds the same model (names, shapes, dtypes, which parameters
    train) and broadcasts rank 0's parameters and buffers (``broadcast_parameters=False``:
    checks instead that their values already agree). Each rank's micro-batches must carry
    a multiple of 16 tokens. ``pipeline_bytes``: fp32 bytes per slice of output features
    passed from rank to rank (smaller slices overlap the ranks' work sooner).

    The training loop is the one-device loop; `dg.nn.finalize_grads` (collective: every
    rank calls it) runs the rank-ordered chain, then writes ``.grad``::

        model = InvariantDataParallel(dg.nn.convert(model, fp32_grad_accum=True))
        dg.nn.zero_main_grads(model); opt.zero_grad()
        for micro in my_micro_batches:                # this rank's consecutive slice
            (loss_sum(model(micro)) / global_tokens).backward()
        dg.nn.finalize_grads(model)                   # same main_grad and .grad everywhere
        opt.step()
    """

    def __init__(self, module: torch.nn.Module, process_group=None, *,
                 broadcast_parameters: bool = True, pipeline_bytes: int = 4 << 20):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{_OP}: module must be a torch.nn.Module, got "
                            f"{type(module).__name__}")
        if isinstance(pipeline_bytes, bool) or not isinstance(pipeline_bytes, int) \
                or pipeline_bytes < 1:
            raise ValueError(f"{_OP}: pipeline_bytes must be a positive int, got "
                             f"{pipeline_bytes!r}")
        if not isinstance(broadcast_parameters, bool):
            raise TypeError(f"{_OP}: broadcast_parameters must be a bool, got "
                            f"{type(broadcast_parameters).__name__}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{_OP}: torch.distributed is not initialized; call "
                               f"torch.distributed.init_process_group() on every rank first")
        group = dist.group.WORLD if process_group is None else process_group
        if not isinstance(group, dist.ProcessGroup) \
                and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"{_OP}: this process (global rank {dist.get_rank()}) is not a "
                             f"member of process_group")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{_OP}: process_group must be a torch.distributed.ProcessGroup "
                            f"or None, got {type(process_group).__name__}")
        if dist.get_rank(group) < 0:
            raise ValueError(f"{_OP}: this process (global rank {dist.get_rank()}) is not a "
                             f"member of process_group")
        self.module = module
        eng = Engine(module, group, pipeline_bytes)
        error = _find_layers(module, eng, dist.get_backend(group))
        _agree(module, eng, error, broadcast_parameters)
        if broadcast_parameters and eng.world > 1:
            _broadcast_states(module, eng)
        _attach(eng)
        self._engine = eng

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def rank(self) -> int:
        """This process's rank in the process group (its place in the chain)."""
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world

    @property
    def stats(self) -> FlushStats:
        """This step's flushes on this rank, summed (held_bytes: the largest), up to and
        including the finalizing one; a new step's first flush starts a new sum."""
        return self._engine.stats

    @property
    def last_flush(self) -> FlushStats:
        """What the most recent flush held, sent and took on this rank."""
        return self._engine.last_flush

    @property
    def pending_bytes(self) -> int:
        """Bytes of X and dY held now for the next flush (distinct storages)."""
        return self._engine.held_bytes()

    def invariant_parameter_names(self) -> list[str]:
        """Parameters whose gradients are the world-size-invariant chain."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [names[id(p)] for layer in self._engine.layers for p in layer.params]

    def other_parameter_names(self) -> list[str]:
        """Trainable parameters outside detgemm Linears: summed in rank order in fp32,
        deterministic for a given world size, not world-size invariant."""
        return [n for n, _ in self._engine.others]

    def flush(self) -> FlushStats:
        """Run the rank-ordered chain now over every call recorded since the last flush
        (collective). After every micro-batch it bounds memory to one micro-batch and sets
        the chain order to (micro-batch, rank); `dg.nn.finalize_grads` still writes .grad."""
        return self._engine.run(finalize=False)

    def discard_pending(self) -> None:
        """Drop the recorded calls and this step's unfinished state (e.g. to skip a step);
        ``main_grad`` keeps what earlier flushes wrote. Local: no communication."""
        self._engine.discard()

    def close(self) -> torch.nn.Module:
        """Detach from the model (its Linears run dW in backward again); returns it."""
        eng = self._engine
        if eng.unfinished or eng.pending_calls():
            raise RuntimeError(f"{_OP}: close() with gradients not finalized; call "
                               f"detgemm_cute.nn.finalize_grads(model) or discard_pending() "
                               f"first")
        for layer in eng.layers:
            layer.module.dw_deferral = None
        _ENGINES.discard(eng)
        return self.module


def _find_layers(module, eng: Engine, backend: str) -> str | None:
    """Sort the trainable parameters into detgemm Linears (chained) and others (summed);
    returns the first local problem as a message (raised on every rank by `_agree`)."""
    owner = {}
    for name, m in module.named_modules():
        if isinstance(m, dnn.Linear) and any(True for _ in m._grad_params()):
            if not m.fp32_grad_accum:
                return (f"{_OP}: layer '{name}' is a detgemm Linear without fp32 gradient "
                        f"accumulation; convert the model with "
                        f"detgemm_cute.nn.convert(model, fp32_grad_accum=True)")
            if getattr(m, "dw_deferral", None) is not None:
                return f"{_OP}: layer '{name}' is already wrapped by an InvariantDataParallel"
            layer = Layer(name, m)
            for p in layer.params:
                if id(p) in owner:
                    return (f"{_OP}: layers '{owner[id(p)]}' and '{name}' share a parameter; "
                            f"shared detgemm weights are not supported")
                owner[id(p)] = name
            eng.layers.append(layer)
    if not eng.layers:
        return (f"{_OP}: the module has no trainable detgemm Linear; convert it with "
                f"detgemm_cute.nn.convert(model, fp32_grad_accum=True)")
    for name, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in owner and not isinstance(m, dnn.Linear):
                full = f"{name}.{pname}" if name else pname
                return (f"{_OP}: parameter '{full}' is shared with layer '{owner[id(p)]}' "
                        f"(tied weights); its other use would be lost from the gradient")
    devices = set()
    for name, p in module.named_parameters():
        devices.add(p.device)
        eng.param_ids.add(id(p))
        if p.requires_grad and id(p) not in owner:
            eng.others.append((name, p))
    if len(devices) != 1:
        return f"{_OP}: the module's parameters are on several devices: {sorted(map(str, devices))}"
    eng.device = devices.pop()
    if backend == "gloo" and eng.device.type != "cpu":
        return (f"{_OP}: the gloo backend passes CPU tensors; parameters on {eng.device} need "
                f"the nccl backend")
    if backend == "nccl" and eng.device.type != "cuda":
        return (f"{_OP}: the nccl backend passes CUDA tensors; parameters on {eng.device} need "
                f"the gloo backend")
    return None


def _signature(module, eng: Engine, values: bool) -> list:
    chained = {id(p) for layer in eng.layers for p in layer.params}
    sig = [("pipeline_bytes", eng.pipeline_bytes), ("device type", eng.device.type)]
    for name, p in module.named_parameters():
        entry = [name, tuple(p.shape), str(p.dtype), p.requires_grad,
                 "chained" if id(p) in chained else "summed"]
        if values:
            entry.append(_digest(p))
        sig.append(tuple(entry))
    if values:
        sig += [(name, tuple(b.shape), str(b.dtype), _digest(b))
                for name, b in module.named_buffers()]
    return sig


def _digest(t: torch.Tensor) -> str:
    import hashlib

    raw = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def _agree(module, eng: Engine, error: str | None, broadcast: bool) -> None:
    """Collective: raise the same kind of error on every rank if any rank's model cannot be
    wrapped or differs from rank 0's."""
    sig = None if error else _signature(module, eng, values=not broadcast)
    if eng.world == 1:
        if error:
            raise ValueError(error)
        return
    if eng.device is not None and eng.device.type == "cuda":
        torch.cuda.set_device(eng.device)
    gathered = [None] * eng.world
    dist.all_gather_object(gathered, (sig, error), group=eng.group)
    if error:
        raise ValueError(error)
    for r, (_, err) in enumerate(gathered):
        if err:
            raise RuntimeError(f"{_OP}: rank {r} could not wrap its model: "
                               f"{err.removeprefix(_OP + ': ')}")
    ref = gathered[0][0]
    for r, (other, _) in enumerate(gathered[1:], 1):
        if other != ref:
            raise RuntimeError(f"{_OP}: the model on rank {r} differs from rank 0's: "
                               f"{_first_difference(ref, other)}")


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"rank 0 has {x}, the other rank {y}"
    longer, which = (a, "rank 0") if len(a) > len(b) else (b, "the other rank")
    return f"{which} has more entries, starting with {longer[min(len(a), len(b))]}"


@torch.no_grad()
def _broadcast_states(module, eng: Engine) -> None:
    src = eng.ranks[0]
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_contiguous():
            dist.broadcast(t.data, src=src, group=eng.group)
        else:
            tmp = t.detach().contiguous()
            dist.broadcast(tmp, src=src, group=eng.group)
            t.copy_(tmp)


def _attach(eng: Engine) -> None:
    """One flat fp32 buffer holds every chained parameter's main_grad (views; earlier
    values kept), and each Linear's backward hands its (dY, X) to the engine."""
    global _step_hook
    size = sum(p.numel() for layer in eng.layers for p in layer.params)
    eng.flat = torch.zeros(size, dtype=_FP32, device=eng.device)
    off = 0
    for layer in eng.layers:
        start = off
        for p in layer.params:
            view = eng.flat[off:off + p.numel()].view(p.shape)
            old = getattr(p, "main_grad", None)
            if isinstance(old, torch.Tensor) and old.shape == p.shape:
                view.copy_(old)
            p.main_grad = view
            layer.views[id(p)] = view
            off += p.numel()
        layer.span = (start, off)
        layer.module.dw_deferral = Deferral(eng, layer)
    _ENGINES.add(eng)
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(_optimizer_pre_hook)


__all__ = ["InvariantDataParallel", "FlushStats"]
