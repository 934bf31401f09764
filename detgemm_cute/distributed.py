"""World-size-invariant data parallelism: the fp32 dW chain passed from rank to rank.

`InvariantDataParallel(model)` wraps a model converted with
``dg.nn.convert(model, fp32_grad_accum=True)``. Its detgemm Linears do not run dW and the
bias gradient in backward: each keeps the (dY, X) pair of every backward call, and the
fp32 ``main_grad`` of every such weight and bias is passed along the ranks in order:
rank 0 continues the chain from its ``main_grad`` over its own tokens, sends the fp32
buffer to rank 1, which continues it over its tokens, and so on; the last rank's result
then reaches every rank (or, with ``shard_optimizer=True``, the rank that owns it).

The contract (bit for bit). After a flush, each detgemm weight's and bias's ``main_grad``
is the chain that starts from rank 0's ``main_grad`` and runs over rank 0's recorded
backward calls in the order its backward made them, then rank 1's, ..., then rank R-1's. A
chain continued at a 16-token boundary is the chain of one call over all tokens, so when
every backward call carries a multiple of 16 tokens (checked) this is one device running
the same calls in that order: the global batch laid out rank-major, rank 0 first. With J
micro-batches a step, run the first J-1 under ``model.no_sync()``; rank r then holds
consecutive micro-batches r*J .. r*J+J-1 of the global step. Calling `flush()` after every
micro-batch instead gives the order (micro-batch j, rank r), i.e. rank r's j-th
micro-batch is global micro-batch j*R + r, and holds only one micro-batch's pairs. With
forward ops that work per sample (element-wise ops, row-wise norms without weights,
attention within a sequence) and losses scaled by the *global* token count (gradients are
sums over the global batch; nothing divides by the world size), every rank then trains to
the bits of one device.

Overlap (``overlap=True``, the default). The backward outside ``no_sync()`` starts the pass:
each layer's chain begins as soon as its backward calls on this rank are done (and the
layers before it in the pass order have begun), on a side stream beside the rest of the
backward, in slices of ``pipeline_bytes`` of fp32 that pipeline across ranks; the final
slices go out from the last rank as they are done. `finalize_grads` then only waits.

Parameters that are not detgemm Linears' (norms, embeddings) keep PyTorch's local ``.grad``
and are summed at `finalize_grads` in a fixed rank order in fp32 (rank 0's, + rank 1's,
...), through the same pipeline: deterministic for a given world size, not world-size
invariant.

Costs (docs/distributed.md): each rank keeps X and dY of every detgemm Linear call until
its layer's chain starts; the fp32 gradients travel R-1 hops (rank r sends them once to
rank r+1), then reach every rank by a broadcast from the last rank, or each rank its shard.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.distributed as dist

from . import dist_shard
from . import nn as dnn
from .dist_chain import Engine
from .dist_layout import Layout
from .dist_pass import Timeline
from .dist_records import OP as _OP
from .dist_records import Deferral, FlushStats, Layer, layer_units, sum_units

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
    train, the options) and broadcasts rank 0's parameters and buffers
    (``broadcast_parameters=False``: checks instead that their values already agree). Each
    rank's micro-batches must carry a multiple of 16 tokens.

    ``pipeline_bytes``: fp32 bytes per slice of output features passed from rank to rank
    (smaller slices start the next rank sooner; larger ones keep the GEMMs and transfers
    efficient and cost less host time: each slice is a few NCCL calls and GEMM launches;
    16 MiB is about one wave of 128 x 256 tiles of an H100 at 2048 inputs). ``overlap``: start the pass during the backward that synchronizes (the one
    outside `no_sync`), layer by layer; False: at the flush. ``shard_optimizer``: the last
    rank sends each final fp32 gradient only to the rank that owns it, each rank steps the
    optimizer from `make_optimizer` on its 1/R of the parameters, and the updated
    parameters are all-gathered (the parameters then live in one flat buffer per dtype).
    ``phase_events``: record CUDA events at phase boundaries for `phase_times`.

    The training loop is the one-device loop; `dg.nn.finalize_grads` (collective: every
    rank calls it) finishes the pass and writes ``.grad``::

        model = InvariantDataParallel(dg.nn.convert(model, fp32_grad_accum=True))
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        dg.nn.zero_main_grads(model); opt.zero_grad()
        for j, micro in enumerate(my_micro_batches):  # this rank's consecutive slice
            with model.no_sync() if j < len(my_micro_batches) - 1 else nullcontext():
                (loss_sum(model(micro)) / global_tokens).backward()
        dg.nn.finalize_grads(model)                   # same main_grad everywhere
        opt.step()
    """

    def __init__(self, module: torch.nn.Module, process_group=None, *,
                 broadcast_parameters: bool = True, pipeline_bytes: int = 16 << 20,
                 overlap: bool = True, shard_optimizer: bool = False,
                 phase_events: bool = False):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{_OP}: module must be a torch.nn.Module, got "
                            f"{type(module).__name__}")
        if isinstance(pipeline_bytes, bool) or not isinstance(pipeline_bytes, int) \
                or pipeline_bytes < 1:
            raise ValueError(f"{_OP}: pipeline_bytes must be a positive int, got "
                             f"{pipeline_bytes!r}")
        for name, value in (("broadcast_parameters", broadcast_parameters),
                            ("overlap", overlap), ("shard_optimizer", shard_optimizer),
                            ("phase_events", phase_events)):
            if not isinstance(value, bool):
                raise TypeError(f"{_OP}: {name} must be a bool, got {type(value).__name__}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{_OP}: torch.distributed is not initialized; call "
                               f"torch.distributed.init_process_group() on every rank first")
        group = _member_group(process_group)
        self.module = module
        backend = dist.get_backend(group)
        found = _find_layers(module, backend)
        options = {"pipeline_bytes": pipeline_bytes, "overlap": overlap,
                   "shard_optimizer": shard_optimizer}
        world = _agree(module, group, found, options, broadcast_parameters)
        if broadcast_parameters and world > 1:
            _broadcast_states(module, group)
        layers, others, device, _ = found
        eng = Engine(module, group, pipeline_bytes, overlap=overlap, shard=shard_optimizer,
                     device=device, backend=backend)
        eng.layers, eng.others = layers, others
        eng.param_ids.update(id(p) for p in module.parameters())
        if phase_events and device.type == "cuda":
            eng.timeline = Timeline()
        eng.ch.make_groups()
        _attach(module, eng)
        self._engine = eng

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward calls of forwards run inside only record (the step's earlier
        micro-batches); the backward of a forward outside it starts the pass."""
        eng = self._engine
        before, eng.require_sync = eng.require_sync, False
        try:
            yield
        finally:
            eng.require_sync = before

    def make_optimizer(self, optimizer_class, params=None, **kwargs):
        """``optimizer_class(params, **kwargs)`` over the wrapped model's parameters
        (`params`: None for every trainable one, or parameters / parameter groups of the
        model). With ``shard_optimizer=True`` it steps this rank's pieces of them only and
        all-gathers the updated parameters after each step (optimizer state: 1/R)."""
        return dist_shard.make_optimizer(self._engine, self.module, optimizer_class, params,
                                         kwargs)

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
        """Bytes of X and dY held now for a pass not yet started (distinct storages)."""
        return self._engine.held_bytes()

    def phase_times(self, since=None) -> dict:
        """Milliseconds of the last step's phases on this rank (``phase_events=True`` on a
        GPU; synchronizes the device, then clears the events): ``chain_wait`` (the side
        stream waiting for rank r-1's slices), ``tail`` (end of the main stream's backward
        to the end of this rank's chain work), ``flush`` (finalize_grads / flush on the
        stream), ``gather`` (the sharded finish's all-gather), and with `since` (a CUDA
        event recorded before the backward) ``backward`` (from it to the end of the main
        stream's backward)."""
        tl = self._engine.timeline
        if tl is None:
            return {}
        torch.cuda.synchronize(self._engine.device)
        out = {"chain_wait": tl.wait_ms(), "tail": tl.ms("backward_end", "chain_end"),
               "flush": tl.ms("flush_start", "flush_end"),
               "gather": tl.ms("gather_start", "gather_end")}
        if since is not None and "backward_end" in tl.marks:
            out["backward"] = since.elapsed_time(tl.marks["backward_end"])
        tl.reset()
        return {k: v for k, v in out.items() if v is not None}

    def invariant_parameter_names(self) -> list[str]:
        """Parameters whose gradients are the world-size-invariant chain."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [names[id(p)] for layer in self._engine.layers for p in layer.params]

    def other_parameter_names(self) -> list[str]:
        """Trainable parameters outside detgemm Linears: summed in rank order in fp32,
        deterministic for a given world size, not world-size invariant."""
        return [n for n, _ in self._engine.others]

    def flush(self) -> FlushStats:
        """Finish the rank-ordered chain now over every call recorded since the last flush
        (collective). After every micro-batch it bounds memory to one micro-batch and sets
        the chain order to (micro-batch, rank); `dg.nn.finalize_grads` still writes .grad."""
        self._engine.run(finalize=False)
        return self._engine.last_flush

    def discard_pending(self) -> None:
        """Drop the recorded calls and this step's unfinished state (e.g. to skip a step);
        ``main_grad`` keeps what earlier flushes wrote. A pass already started (its
        operations posted on every rank) is waited for first."""
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


def _member_group(process_group):
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
    return group


def _find_layers(module, backend: str):
    """Sort the trainable parameters into detgemm Linears (chained) and others (summed);
    returns (layers, others, device, the first local problem as a message or None)."""
    layers, others, owner, device = [], [], {}, None
    error = _sort_parameters(module, layers, others, owner)
    devices = {p.device for p in module.parameters()}
    if error is None and len(devices) != 1:
        error = (f"{_OP}: the module's parameters are on several devices: "
                 f"{sorted(map(str, devices))}")
    if len(devices) == 1:
        device = next(iter(devices))
    if error is None and backend == "gloo" and device.type != "cpu":
        error = (f"{_OP}: the gloo backend passes CPU tensors; parameters on {device} need "
                 f"the nccl backend")
    if error is None and backend == "nccl" and device.type != "cuda":
        error = (f"{_OP}: the nccl backend passes CUDA tensors; parameters on {device} need "
                 f"the gloo backend")
    return layers, others, device, error


def _sort_parameters(module, layers, others, owner) -> str | None:
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
            layers.append(layer)
    if not layers:
        return (f"{_OP}: the module has no trainable detgemm Linear; convert it with "
                f"detgemm_cute.nn.convert(model, fp32_grad_accum=True)")
    for name, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in owner and not isinstance(m, dnn.Linear):
                full = f"{name}.{pname}" if name else pname
                return (f"{_OP}: parameter '{full}' is shared with layer '{owner[id(p)]}' "
                        f"(tied weights); its other use would be lost from the gradient")
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in owner:
            others.append((name, p))
    return None


def _signature(module, layers, options: dict, device, values: bool) -> list:
    chained = {id(p) for layer in layers for p in layer.params}
    sig = sorted(options.items()) + [("device type", device.type if device else None)]
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


def _agree(module, group, found, options: dict, broadcast: bool) -> int:
    """Collective: raise the same kind of error on every rank if any rank's model cannot be
    wrapped or differs from rank 0's; returns the world size."""
    layers, _, device, error = found
    world = dist.get_world_size(group)
    sig = None if error else _signature(module, layers, options, device, values=not broadcast)
    if world == 1:
        if error:
            raise ValueError(error)
        return world
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    gathered = [None] * world
    dist.all_gather_object(gathered, (sig, error), group=group)
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
    return world


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"rank 0 has {x}, the other rank {y}"
    longer, which = (a, "rank 0") if len(a) > len(b) else (b, "the other rank")
    return f"{which} has more entries, starting with {longer[min(len(a), len(b))]}"


@torch.no_grad()
def _broadcast_states(module, group) -> None:
    src = dist.get_process_group_ranks(group)[0]
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_contiguous():
            dist.broadcast(t.data, src=src, group=group)
        else:
            tmp = t.detach().contiguous()
            dist.broadcast(tmp, src=src, group=group)
            t.copy_(tmp)


def _attach(module, eng: Engine) -> None:
    """One flat fp32 buffer (`dist_layout.Layout`) holds every chained parameter's
    main_grad (views; earlier values kept) and the other parameters' summed gradients; each
    Linear's backward hands its (dY, X) to the engine, and its token reports when its
    backward calls are done."""
    global _step_hook
    layout = Layout([(n, p) for n, p in module.named_parameters() if p.requires_grad],
                    eng.world)
    eng.layout = layout
    eng.flat = torch.zeros(layout.size, dtype=_FP32, device=eng.device)

    def view_of(p):
        return layout.view(eng.flat, p)

    def lo_of(p):
        return layout.offset[id(p)]

    for layer in eng.layers:
        for p in layer.params:
            old = getattr(p, "main_grad", None)
            if isinstance(old, torch.Tensor) and old.shape == p.shape:
                view_of(p).copy_(old)
            p.main_grad = view_of(p)
        layer.units = layer_units(layer, view_of, eng.pipeline_bytes, lo_of)
        layer.token = torch.zeros((), dtype=_FP32, device=eng.device, requires_grad=True)
        layer.token.register_post_accumulate_grad_hook(
            functools.partial(eng.token_hook, layer))
        layer.module.dw_deferral = Deferral(eng, layer)
    for name, p in eng.others:
        eng.other_units[id(p)] = sum_units(name, p, view_of(p), lo_of(p), eng.pipeline_bytes)
    eng.order = list(reversed(eng.layers))
    if eng.shard:
        last = eng.world - 1
        for u in [u for layer in eng.layers for u in layer.units] + \
                [u for units in eng.other_units.values() for u in units]:
            u.pieces = [(owner, u.region[a - u.lo:b - u.lo])
                        for owner, a, b in layout.pieces(u.lo, u.hi, skip=last)]
        dist_shard.setup(eng)
    else:
        eng.grad_bufs = layout.grad_buffers(eng.device)
    _ENGINES.add(eng)
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(_optimizer_pre_hook)


__all__ = ["InvariantDataParallel", "FlushStats"]
