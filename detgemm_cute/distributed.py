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
j*R + r, and holds only one micro-batch's pairs. With per-token forward ops (element-wise
ops, row-wise norms) and losses scaled by the *global* token count (gradients are sums
over the global batch; nothing divides by the world size), every rank then trains to the
bits of one device.

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

import dataclasses
import time
import weakref

import torch
import torch.distributed as dist

from . import bias_grad, weight_grad
from . import nn as dnn

_OP = "detgemm_cute.distributed.InvariantDataParallel"
_TOKEN_BLOCK = 16
_FP32 = torch.float32
_ROW_ALIGN = 8  # slice boundaries at multiples of 8 features keep dY column slices 16-B aligned


@dataclasses.dataclass
class FlushStats:
    """What flushes held, sent and took on this rank: one flush (``last_flush``) or every
    flush of a step, the finalizing one included (``stats``: sums; held_bytes the largest).

    flushes: how many flushes. units: regions passed. calls: backward calls whose dW / db
    ran. held_bytes: bytes of the X and dY tensors kept until their flush (distinct
    storages). sent_bytes / received_bytes: fp32 bytes passed to the next / from the
    previous rank. broadcast_bytes: fp32 bytes of the final broadcast. seconds: host wall
    time of the flush (on a GPU, work still queued on streams is not included);
    wait_seconds: the part spent waiting for the previous rank."""

    flushes: int = 0
    units: int = 0
    calls: int = 0
    held_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    broadcast_bytes: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    finalize: bool = False

    def add(self, other: "FlushStats") -> None:
        for f in dataclasses.fields(self):
            if f.name == "held_bytes":
                self.held_bytes = max(self.held_bytes, other.held_bytes)
            elif f.name == "finalize":
                self.finalize = self.finalize or other.finalize
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class _Record:
    __slots__ = ("dy", "x", "dy_version", "x_version")

    def __init__(self, dy, x):
        self.dy, self.x = dy, x
        self.dy_version = dy._version
        self.x_version = None if x is None else x._version


class _Layer:
    """One detgemm Linear: its parameters' fp32 buffer views and its deferred records."""

    def __init__(self, name, module):
        self.name, self.module = name, module
        self.params = list(module._grad_params())
        self.records: list[_Record] = []
        self.views: dict = {}  # id(param) -> its view of the flat fp32 buffer
        self.span = (0, 0)  # [start, end) in the flat buffer


class _Deferral:
    """Set as ``Linear.dw_deferral``: called by the Linear's backward with (dY, X) instead of
    running dW / db; ``owner`` is the engine that `nn.finalize_grads` flushes."""

    __slots__ = ("owner", "layer")

    def __init__(self, owner, layer):
        self.owner, self.layer = owner, layer

    def __call__(self, grad, x):
        self.owner._defer(self.layer, grad, x)


class _Unit:
    """A contiguous fp32 region passed rank to rank; `run(region, first)` adds this rank's
    part (first: this is rank 0, the chain's start)."""

    __slots__ = ("region", "run")

    def __init__(self, region, run):
        self.region, self.run = region, run


_ENGINES: "weakref.WeakSet[_Engine]" = weakref.WeakSet()
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


class _Engine:
    """The deferred records of every detgemm Linear of one model, and the rank-ordered pass."""

    def __init__(self, module, group, pipeline_bytes):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world = len(self.ranks)
        self.pipeline_bytes = pipeline_bytes
        self.unfinished = False
        self.stats = FlushStats()  # this step's flushes (summed); a new step starts after finalize
        self.last_flush = FlushStats()
        self.layers: list[_Layer] = []
        self.others: list[tuple[str, torch.nn.Parameter]] = []
        self.param_ids: set = set()
        self.flat: torch.Tensor | None = None
        self.device: torch.device | None = None

    # ------------------------------------------------------------------- recording
    def _defer(self, layer: _Layer, grad, x):
        n = layer.module.out_features
        if grad.shape[-1] != n:
            raise ValueError(f"{_OP}: layer '{layer.name}' got a gradient of shape "
                             f"{tuple(grad.shape)}, expected [..., {n}]")
        dy = grad.reshape(-1, n)
        tokens = dy.shape[0]
        if tokens % _TOKEN_BLOCK:
            raise ValueError(
                f"{_OP}: layer '{layer.name}' ran backward on {tokens} tokens on rank "
                f"{self.rank}; every micro-batch must have a multiple of {_TOKEN_BLOCK} tokens "
                f"per rank for the rank-to-rank chain to equal one device's (pad with tokens "
                f"whose gradient is zero)")
        x2 = None if x is None else x.reshape(-1, x.shape[-1])
        layer.records.append(_Record(dy, x2))
        self.unfinished = True

    def pending_calls(self) -> int:
        return sum(len(layer.records) for layer in self.layers)

    def held_bytes(self) -> int:
        seen = {}
        for layer in self.layers:
            for r in layer.records:
                for t in (r.dy, r.x):
                    if t is not None:
                        s = t.untyped_storage()
                        seen[(t.device, s.data_ptr())] = s.nbytes()
        return sum(seen.values())

    def discard(self):
        for layer in self.layers:
            layer.records.clear()
        self.unfinished = False

    def finalize(self) -> FlushStats:
        """Called by `nn.finalize_grads` before it writes ``.grad`` from ``main_grad``."""
        return self.run(finalize=True)

    def before_zero(self):
        """`nn.zero_main_grads` clearing buffers while deferred work is pending would lose it."""
        if self.pending_calls() or self.unfinished:
            raise RuntimeError(
                f"{_OP}: zero_main_grads() ran after a backward whose gradients were not "
                f"finalized; call detgemm_cute.nn.finalize_grads(model) on every rank first "
                f"(or InvariantDataParallel.discard_pending() to drop that work)")

    # ------------------------------------------------------------------- units
    def _chain_units(self, layer: _Layer) -> list[_Unit]:
        units = []
        w, b = layer.module.weight, layer.module.bias
        records = layer.records
        for p in layer.params:
            view = layer.views[id(p)]
            if p is w:
                n, k = view.shape
                rows = max(_ROW_ALIGN, self.pipeline_bytes // (4 * k) // _ROW_ALIGN * _ROW_ALIGN)
                for n0 in range(0, n, rows):
                    n1 = min(n, n0 + rows)
                    units.append(_Unit(view[n0:n1].view(-1), _weight_run(records, n0, n1, k)))
            else:
                assert p is b
                units.append(_Unit(view, _bias_run(records)))
        return units

    def _other_units(self, flat: torch.Tensor, active) -> tuple[list[_Unit], list]:
        units, spans, off = [], [], 0
        chunk = max(1024, self.pipeline_bytes // 4)
        for (name, p), on in zip(self.others, active):
            numel = p.numel()
            if on:
                g = p.grad
                local = None if g is None else g.detach().reshape(-1)
                for a in range(0, numel, chunk):
                    e = min(numel, a + chunk)
                    units.append(_Unit(flat[off + a:off + e], _sum_run(local, a, e)))
                spans.append((off, off + numel))
            off += numel
        return units, spans

    # ------------------------------------------------------------------- flush
    def _validate(self) -> str | None:
        for layer in self.layers:
            for p in layer.params:
                view = layer.views[id(p)]
                buf = getattr(p, "main_grad", None)
                if (buf is None or buf.shape != view.shape
                        or buf.data_ptr() != view.data_ptr()):
                    return (f"{_OP}: the main_grad of '{layer.name}' was replaced after "
                            f"wrapping (moved to another device or reassigned); keep the "
                            f"buffers InvariantDataParallel created")
            for r in layer.records:
                if r.dy._version != r.dy_version or (
                        r.x is not None and r.x._version != r.x_version):
                    return (f"{_OP}: the input or output gradient of layer '{layer.name}' "
                            f"was modified in place after its backward, before the flush "
                            f"that needs it")
        return None

    def run(self, finalize: bool) -> FlushStats:
        """The rank-ordered pass over every layer with records on any rank (and, when
        finalizing, the fixed-order fp32 sum of the other parameters' gradients)."""
        t0 = time.perf_counter()
        st = FlushStats(flushes=1, finalize=finalize, calls=self.pending_calls(),
                        held_bytes=self.held_bytes())
        layer_on = [bool(layer.records) for layer in self.layers]
        reduce_others = finalize and self.unfinished
        other_on = [reduce_others and p.grad is not None for _, p in self.others]
        error = self._validate()
        if self.world > 1:
            flags = torch.tensor(layer_on + other_on + [error is not None, finalize,
                                                        not finalize, reduce_others],
                                 dtype=torch.int32, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            flags = [bool(f) for f in flags.tolist()]
            nl, no = len(layer_on), len(other_on)
            layer_on, other_on = flags[:nl], flags[nl:nl + no]
            failed, fin_any, flush_any, reduce_others = flags[nl + no:]
            if error is None and failed:
                error = (f"{_OP}: another rank failed its checks before the gradient pass "
                         f"(see its error); rank {self.rank} stops too")
            elif error is None and fin_any and flush_any:
                error = (f"{_OP}: ranks disagree: some called finalize_grads, others "
                         f"flush(); every rank must make the same calls in the same order")
            other_on = [on and reduce_others for on in other_on]
        if error is not None:
            raise RuntimeError(error)

        units, spans = [], []
        for layer, on in zip(self.layers, layer_on):
            if on:
                units += self._chain_units(layer)
                spans.append(layer.span)
        others_flat, other_spans = None, []
        if any(other_on):
            size = sum(p.numel() for _, p in self.others)
            others_flat = torch.zeros(size, dtype=_FP32, device=self.device)
            more, other_spans = self._other_units(others_flat, other_on)
            units += more
        st.units = len(units)
        st.wait_seconds = self._pipeline(units, st)
        if self.world > 1:
            src = self.ranks[-1]
            for buf, sp in ((self.flat, spans), (others_flat, other_spans)):
                for a, e in _merge(sp):
                    dist.broadcast(buf[a:e], src=src, group=self.group)
                    st.broadcast_bytes += (e - a) * 4
        if others_flat is not None:
            off = 0
            for (_, p), on in zip(self.others, other_on):
                if on:
                    p.grad = others_flat[off:off + p.numel()].view(p.shape).to(p.dtype)
                off += p.numel()
        for layer in self.layers:
            layer.records.clear()
        if finalize:
            self.unfinished = False
        st.seconds = time.perf_counter() - t0
        if self.stats.finalize:
            self.stats = FlushStats()
        self.stats.add(st)
        self.last_flush = st
        return st

    def _pipeline(self, units: list[_Unit], st: FlushStats) -> float:
        """Rank r waits for each region from rank r-1, adds its part, sends it to rank r+1;
        all receives are posted up front, so rank r works on region i while rank r+1 works
        on region i-1."""
        r, last = self.rank, self.world - 1
        recvs = []
        if r > 0:
            src = self.ranks[r - 1]
            recvs = [dist.irecv(u.region, src=src, group=self.group, tag=i)
                     for i, u in enumerate(units)]
        sends, waited = [], 0.0
        for i, u in enumerate(units):
            if r > 0:
                tw = time.perf_counter()
                recvs[i].wait()
                waited += time.perf_counter() - tw
                st.received_bytes += u.region.numel() * 4
            u.run(u.region, r == 0)
            if r < last:
                sends.append(dist.isend(u.region, dst=self.ranks[r + 1], group=self.group,
                                        tag=i))
                st.sent_bytes += u.region.numel() * 4
        for s in sends:
            s.wait()
        return waited


def _weight_run(records, n0, n1, k):
    def run(region, first):
        acc = region.view(n1 - n0, k)
        for r in records:
            weight_grad(r.dy[:, n0:n1], r.x, acc=acc)
    return run


def _bias_run(records):
    def run(region, first):
        for r in records:
            bias_grad(r.dy, acc=region)
    return run


def _sum_run(local, a, e):
    def run(region, first):
        if local is None:
            if first:
                region.zero_()
        elif first:
            region.copy_(local[a:e])
        else:
            region.add_(local[a:e].to(_FP32))
    return run


def _merge(spans):
    out = []
    for a, e in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return out


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
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{_OP}: process_group must be a torch.distributed.ProcessGroup "
                            f"or None, got {type(process_group).__name__}")
        if dist.get_rank(group) < 0:
            raise ValueError(f"{_OP}: this process (global rank {dist.get_rank()}) is not a "
                             f"member of process_group")
        self.module = module
        eng = _Engine(module, group, pipeline_bytes)
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


def _find_layers(module, eng: _Engine, backend: str) -> str | None:
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
            layer = _Layer(name, m)
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


def _signature(module, eng: _Engine, values: bool) -> list:
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


def _agree(module, eng: _Engine, error: str | None, broadcast: bool) -> None:
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
            raise RuntimeError(f"{_OP}: rank {r} could not wrap its model: {err}")
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
def _broadcast_states(module, eng: _Engine) -> None:
    src = eng.ranks[0]
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_contiguous():
            dist.broadcast(t.data, src=src, group=eng.group)
        else:
            tmp = t.detach().contiguous()
            dist.broadcast(tmp, src=src, group=eng.group)
            t.copy_(tmp)


def _attach(eng: _Engine) -> None:
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
        layer.module.dw_deferral = _Deferral(eng, layer)
    _ENGINES.add(eng)
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(_optimizer_pre_hook)


__all__ = ["InvariantDataParallel", "FlushStats"]
