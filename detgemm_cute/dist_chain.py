"""The engine behind `detgemm_cute.distributed`: each detgemm Linear's deferred (dY, X)
records, and the rank-ordered pass that continues the fp32 dW / db chains from rank to rank.

A pass walks a list of *units*, contiguous fp32 regions (a slice of output features of a
weight's ``main_grad``, a bias's ``main_grad``, or a chunk of the other parameters' summed
gradients). Rank r waits for each unit from rank r-1, adds its own part (continues the chain
over its records, or adds its local gradient in fp32), and sends it to rank r+1, so rank r
works on unit i while rank r+1 works on unit i-1. The last rank then broadcasts the results.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from .grads import bias_grad, weight_grad

OP = "detgemm_cute.distributed.InvariantDataParallel"
_OP = OP
_TOKEN_BLOCK = 16
_FP32 = torch.float32
_RECV_AHEAD = 2  # receives posted ahead of the region being waited for
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
    wait_seconds: the part spent waiting for the previous rank; broadcast_seconds: the part
    spent in the final broadcast."""

    flushes: int = 0
    units: int = 0
    calls: int = 0
    held_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    broadcast_bytes: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    broadcast_seconds: float = 0.0
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


class Layer:
    """One detgemm Linear: its parameters' fp32 buffer views and its deferred records."""

    def __init__(self, name, module):
        self.name, self.module = name, module
        self.params = list(module._grad_params())
        self.records: list[_Record] = []
        self.views: dict = {}  # id(param) -> its view of the flat fp32 buffer
        self.span = (0, 0)  # [start, end) in the flat buffer


class Deferral:
    """Set as ``Linear.dw_deferral``: called by the Linear's backward with (dY, X) instead of
    running dW / db; ``owner`` is the engine that `nn.finalize_grads` flushes."""

    __slots__ = ("owner", "layer")

    def __init__(self, owner, layer):
        self.owner, self.layer = owner, layer

    def __call__(self, grad, x):
        self.owner._defer(self.layer, grad, x)


class Unit:
    """A contiguous fp32 region passed rank to rank; `run(region, first)` adds this rank's
    part (first: this is rank 0, the chain's start)."""

    __slots__ = ("region", "run")

    def __init__(self, region, run):
        self.region, self.run = region, run


class Engine:
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
        self.layers: list[Layer] = []
        self.others: list[tuple[str, torch.nn.Parameter]] = []
        self.param_ids: set = set()
        self.params = list(module.parameters())  # kept alive: param_ids stay theirs
        self.flat: torch.Tensor | None = None
        self.device: torch.device | None = None

    # ------------------------------------------------------------------- recording
    def _defer(self, layer: Layer, grad, x):
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
    def _chain_units(self, layer: Layer) -> list[Unit]:
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
                    units.append(Unit(view[n0:n1].view(-1), _weight_run(records, n0, n1, k)))
            else:
                assert p is b
                units.append(Unit(view, _bias_run(records)))
        return units

    def _other_units(self, flat: torch.Tensor, active) -> tuple[list[Unit], list]:
        units, spans, off = [], [], 0
        chunk = max(1024, self.pipeline_bytes // 4)
        for (name, p), on in zip(self.others, active):
            numel = p.numel()
            if on:
                g = p.grad
                local = None if g is None else g.detach().reshape(-1)
                for a in range(0, numel, chunk):
                    e = min(numel, a + chunk)
                    units.append(Unit(flat[off + a:off + e], _sum_run(local, a, e)))
                spans.append((off, off + numel))
            off += numel
        return units, spans

    # ------------------------------------------------------------------- flush
    def _validate(self, finalize: bool) -> str | None:
        if finalize:
            for name, p in self.others:
                if p.grad is not None and p.grad.layout != torch.strided:
                    return (f"{_OP}: parameter '{name}' has a {p.grad.layout} gradient; only "
                            f"dense gradients are summed across ranks")
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
        error = self._validate(finalize)
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
        st.wait_seconds = self.pipeline(units, st)
        if self.world > 1:
            tb = time.perf_counter()
            src = self.ranks[-1]
            for buf, sp in ((self.flat, spans), (others_flat, other_spans)):
                for a, e in _merge(sp):
                    dist.broadcast(buf[a:e], src=src, group=self.group)
                    st.broadcast_bytes += (e - a) * 4
            st.broadcast_seconds = time.perf_counter() - tb
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

    def pipeline(self, units: list[Unit], st: FlushStats) -> float:
        """Rank r waits for each region from rank r-1, adds its part, sends it to rank r+1,
        so rank r works on region i while rank r+1 works on region i-1. Receives are posted
        `_RECV_AHEAD` regions ahead of the one being waited for: enough to keep the data
        flowing, and a send queued behind them (where a backend orders a rank's
        point-to-point operations on one stream) waits for few of them."""
        r, last, n = self.rank, self.world - 1, len(units)
        recvs: dict = {}

        def post(i):
            if r > 0 and i < n:
                recvs[i] = dist.irecv(units[i].region, src=self.ranks[r - 1],
                                      group=self.group, tag=i)

        for i in range(_RECV_AHEAD):
            post(i)
        sends, waited = [], 0.0
        for i, u in enumerate(units):
            if r > 0:
                post(i + _RECV_AHEAD)
                tw = time.perf_counter()
                recvs.pop(i).wait()
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


__all__ = ["Engine", "Layer", "Deferral", "Unit", "FlushStats", "OP"]
