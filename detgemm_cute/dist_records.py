"""What the rank-ordered gradient pass of `detgemm_cute.distributed` works on: each detgemm
Linear's deferred (dY, X) records, the *units* (contiguous fp32 regions passed rank to rank)
and what one rank adds to a unit, and the per-flush statistics.

A unit is a slice of whole output-feature rows of a weight's ``main_grad``, a bias's
``main_grad``, or a chunk of a non-detgemm parameter's fp32 gradient sum. Rank r adds its
part to a unit by continuing the fp32 chain over its records of that layer (`add_part`), or
by adding its local gradient in fp32."""

from __future__ import annotations

import dataclasses

import torch

from .grads import bias_grad, weight_grad

OP = "detgemm_cute.distributed.InvariantDataParallel"
TOKEN_BLOCK = 16
FP32 = torch.float32
ROW_ALIGN = 8  # slice boundaries at multiples of 8 features keep dY column slices 16-B aligned


@dataclasses.dataclass
class FlushStats:
    """What flushes held, sent and took on this rank: one flush (``last_flush``) or every
    flush of a step, the finalizing one included (``stats``: sums; held_bytes the largest).

    flushes: how many flushes. overlapped: flushes whose pass started during the backward.
    units: regions passed. calls: backward calls whose dW / db ran. held_bytes: bytes of the
    X and dY tensors held at once (distinct storages; the peak since the last flush). sent_bytes /
    received_bytes: fp32 bytes passed to the next / from the previous rank.
    broadcast_bytes: fp32 bytes of the final broadcast (every rank gets every result).
    delivered_bytes: fp32 bytes of final results sent by the last rank to the ranks that own
    them (sharded finish; counted on both ends) or to rank 0 (a sharded flush). seconds:
    host wall time of flush / finalize_grads (on a GPU the queued work is not included);
    wait_seconds: host time spent waiting for another rank's data (CPU; on a GPU the
    waits are on streams); broadcast_seconds: host time spent in the final exchange of
    results (CPU)."""

    flushes: int = 0
    overlapped: int = 0
    units: int = 0
    calls: int = 0
    held_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    broadcast_bytes: int = 0
    delivered_bytes: int = 0
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


class Record:
    """One backward call of a detgemm Linear: its dY and X (2-D), their version counters
    (an in-place change before the pass is an error), and on a GPU the event after which
    they exist on the stream that made them."""

    __slots__ = ("dy", "x", "dy_version", "x_version", "ready")

    def __init__(self, dy, x, ready=None):
        self.dy, self.x, self.ready = dy, x, ready
        self.dy_version = dy._version
        self.x_version = None if x is None else x._version

    def changed(self) -> bool:
        return self.dy._version != self.dy_version or (
            self.x is not None and self.x._version != self.x_version)


class Holdings:
    """The distinct storages behind the records held now: bytes, and the peak since
    `reset_peak` (a record's tensors often share storages: a view of a micro-batch keeps
    its whole input)."""

    def __init__(self):
        self.refs: dict = {}
        self.bytes = 0
        self.peak = 0

    @staticmethod
    def _keys(rec):
        for t in (rec.dy, rec.x):
            if t is not None:
                s = t.untyped_storage()
                yield (t.device, s.data_ptr()), s.nbytes()

    def add(self, rec) -> None:
        for key, n in self._keys(rec):
            entry = self.refs.get(key)
            if entry is None:
                self.refs[key] = [1, n]
                self.bytes += n
            else:
                entry[0] += 1
        self.peak = max(self.peak, self.bytes)

    def drop(self, rec) -> None:
        for key, _ in self._keys(rec):
            entry = self.refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.bytes -= entry[1]
                del self.refs[key]

    def reset_peak(self) -> None:
        self.peak = self.bytes


class Unit:
    """A contiguous fp32 region passed rank to rank. ``kind``: "weight" (rows n0:n1 of a
    [N, K] weight gradient), "bias", or "sum" (elements a:e of a non-detgemm parameter's
    summed gradient). ``lo, hi``: the region's place in the flat fp32 buffer. ``pieces``:
    for a sharded finish, (owner rank, sub-region) of the parts other ranks than the last
    own."""

    __slots__ = ("index", "region", "kind", "layer", "param", "n0", "n1", "k", "lo", "hi",
                 "pieces")

    def __init__(self, region, kind, lo, *, layer=None, param=None, n0=0, n1=0, k=0):
        self.index = -1  # its place in the pass order, set by the engine
        self.region, self.kind, self.layer, self.param = region, kind, layer, param
        self.n0, self.n1, self.k = n0, n1, k
        self.lo, self.hi = lo, lo + region.numel()
        self.pieces: list = []

    @property
    def nbytes(self) -> int:
        return self.region.numel() * 4

    def label(self) -> str:
        if self.kind == "weight":
            return f"layer '{self.layer.name}' weight rows {self.n0}:{self.n1}"
        if self.kind == "bias":
            return f"layer '{self.layer.name}' bias"
        return f"parameter '{self.param[0]}' elements {self.n0}:{self.n1}"


def add_part(unit: Unit, records, first: bool) -> None:
    """This rank's part of `unit`: continue the fp32 chain over `records` (one dW / db call
    per record, in order) or add this rank's local gradient (`first`: rank 0 starts the
    sum). Looked up at call time, so `weight_grad` / `bias_grad` are this module's names."""
    if unit.kind == "weight":
        acc = unit.region.view(unit.n1 - unit.n0, unit.k)
        for r in records:
            weight_grad(r.dy[:, unit.n0:unit.n1], r.x, acc=acc)
    elif unit.kind == "bias":
        for r in records:
            bias_grad(r.dy, acc=unit.region)
    else:
        g = unit.param[1].grad
        local = None if g is None else g.detach().reshape(-1)[unit.n0:unit.n1]
        if local is None:
            if first:
                unit.region.zero_()
        elif first:
            unit.region.copy_(local)
        else:
            unit.region.add_(local.to(FP32))


def layer_units(layer, view_of, pipeline_bytes: int, lo_of) -> list[Unit]:
    """The units of one detgemm Linear: its weight in slices of about `pipeline_bytes` of
    whole output-feature rows (multiples of 8 rows), then its bias."""
    units = []
    w = layer.module.weight
    for p in layer.params:
        view = view_of(p)
        if p is w:
            n, k = view.shape
            rows = max(ROW_ALIGN, pipeline_bytes // (4 * k) // ROW_ALIGN * ROW_ALIGN)
            for n0 in range(0, n, rows):
                n1 = min(n, n0 + rows)
                units.append(Unit(view[n0:n1].view(-1), "weight", lo_of(p) + n0 * k,
                                  layer=layer, n0=n0, n1=n1, k=k))
        else:
            units.append(Unit(view, "bias", lo_of(p), layer=layer))
    return units


def sum_units(name, param, view, lo: int, pipeline_bytes: int) -> list[Unit]:
    """A non-detgemm parameter's summed gradient in chunks of about `pipeline_bytes`."""
    chunk = max(1024, pipeline_bytes // 4)
    numel = param.numel()
    flat = view.view(-1)
    return [Unit(flat[a:min(numel, a + chunk)], "sum", lo + a, param=(name, param), n0=a,
                 n1=min(numel, a + chunk)) for a in range(0, numel, chunk)]


class Layer:
    """One detgemm Linear: its trainable parameters, its records since the last pass, its
    units, and the token whose gradient hook tells that its backward calls are done."""

    def __init__(self, name, module):
        self.name, self.module = name, module
        self.params = list(module._grad_params())
        self.records: list[Record] = []
        self.units: list[Unit] = []
        self.token: torch.Tensor | None = None


class Deferral:
    """Set as ``Linear.dw_deferral``: the Linear's backward calls it with (dY, X, sync)
    instead of running dW / db; ``owner`` is the engine `nn.finalize_grads` flushes.
    ``token``: a 0-d tensor passed to the Linear's autograd function, whose gradient (zero)
    reaches it once every backward call of the layer in a backward pass has run."""

    __slots__ = ("owner", "layer")

    def __init__(self, owner, layer):
        self.owner, self.layer = owner, layer

    @property
    def token(self):
        return self.layer.token

    def sync_now(self) -> bool:
        """Whether a forward run now belongs to a synchronizing backward (not in no_sync)."""
        return self.owner.require_sync

    def __call__(self, grad, x, sync=False):
        self.owner.defer(self.layer, grad, x, sync)


__all__ = ["FlushStats", "Record", "Unit", "Layer", "Deferral", "add_part", "layer_units",
           "sum_units", "Holdings", "OP"]
