"""The engine behind `detgemm_cute.distributed`: it records each detgemm Linear's (dY, X),
decides when the rank-ordered pass over them starts, and finishes it at the flush.

States. Backward calls under ``no_sync()`` only record. With ``overlap`` on, the first
backward call outside it starts a pass (`dist_pass.Pass`): every layer is launched as soon
as its backward calls in that backward are done (its token's gradient hook), and the rest
at the end of that backward. Without a pass started, the flush starts one over every
layer any rank used. The flush (`run`: `flush()` or `finalize_grads`) exchanges a few flags
over the host first (errors, flush vs finalize, whether a pass is running, which layers
and other parameters are in use), so that every rank raises the same error instead of
waiting for another, then adds the other parameters' units (finalizing), waits for the
pass and writes the gradients."""

from __future__ import annotations

import time

import torch

from .dist_comm import Channels, PassFailed
from .dist_pass import Pass, Timeline
from .dist_records import OP, TOKEN_BLOCK, FlushStats, Holdings, Record

_OP = OP


class Engine:
    """The deferred records of every detgemm Linear of one model, and its passes."""

    def __init__(self, module, group, pipeline_bytes: int, *, overlap: bool = True,
                 shard: bool = False, device=None, backend: str = "gloo"):
        self.group = group
        self.pipeline_bytes = pipeline_bytes
        self.overlap, self.shard = overlap, shard
        self.require_sync = True
        self.unfinished = False
        self.broken: str | None = None
        self.shard_stale = False
        self.stats = FlushStats()  # this step's flushes (summed); a new step starts after finalize
        self.last_flush = FlushStats()
        self.layers: list = []  # in registration order
        self.order: list = []  # the pass order: reverse registration order
        self.others: list[tuple[str, torch.nn.Parameter]] = []
        self.other_units: dict = {}  # id(param) -> its units
        self.param_ids: set = set()
        self.params = list(module.parameters())  # kept alive: param_ids stay theirs
        self.flat: torch.Tensor | None = None
        self.device = device
        self.layout = None
        self.grad_bufs: list = []
        self.param_bufs: list = []
        self.pieces: dict = {}  # sharded finish: id(model param) -> its piece on this rank
        self.timeline: Timeline | None = None
        self.pass_: Pass | None = None
        self.holdings = Holdings()
        self.ch = Channels(group, device or torch.device("cpu"), backend)
        self.rank, self.world, self.ranks = self.ch.rank, self.ch.world, self.ch.ranks

    # ------------------------------------------------------------------- recording
    def defer(self, layer, grad, x, sync: bool) -> None:
        self._usable()
        n = layer.module.out_features
        if grad.shape[-1] != n:
            raise ValueError(f"{_OP}: layer '{layer.name}' got a gradient of shape "
                             f"{tuple(grad.shape)}, expected [..., {n}]")
        dy = grad.reshape(-1, n)
        tokens = dy.shape[0]
        if tokens % TOKEN_BLOCK:
            raise ValueError(
                f"{_OP}: layer '{layer.name}' ran backward on {tokens} tokens on rank "
                f"{self.rank}; every micro-batch must have a multiple of {TOKEN_BLOCK} tokens "
                f"per rank for the rank-to-rank chain to equal one device's (pad with tokens "
                f"whose gradient is zero)")
        p = self.pass_
        if p is not None and p.backward_done:
            raise RuntimeError(
                f"{_OP}: a backward ran after this step's synchronizing backward (the one "
                f"outside no_sync()), before flush() or finalize_grads; run every "
                f"micro-batch but the last under model.no_sync(), or call model.flush() "
                f"after each micro-batch")
        if self.shard_stale:
            raise RuntimeError(
                f"{_OP}: with shard_optimizer=True, main_grad holds only this rank's shard "
                f"of the last step's gradients; call detgemm_cute.nn.zero_main_grads(model) "
                f"before each step's first backward")
        x2 = None if x is None else x.reshape(-1, x.shape[-1])
        overlapped = sync and self.overlap
        ready = None
        if overlapped and dy.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        rec = Record(dy, x2, ready)
        layer.records.append(rec)
        self.holdings.add(rec)
        self.unfinished = True
        if overlapped and p is None:
            if self.timeline is not None:
                self.timeline.reset()  # phase_times() reports the last pass
            self.pass_ = Pass(self, self.order, overlapped=True)
            self._guard(self.pass_.start)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def token_hook(self, layer, token) -> None:
        """Every backward call of `layer` in this backward has run."""
        token.grad = None
        p = self.pass_
        if p is not None and p.overlapped and not p.backward_done:
            self._guard(lambda: p.mark_ready(layer))

    def _backward_done(self) -> None:
        p = self.pass_
        if p is not None and not p.backward_done:
            self._guard(p.finish_backward)

    def _guard(self, fn):
        """Run `fn`; a lost peer leaves this wrapper unusable (raised again on later use)."""
        try:
            return fn()
        except PassFailed as exc:
            self.broken = str(exc)
            raise

    def _usable(self) -> None:
        if self.broken:
            raise RuntimeError(f"{_OP}: this rank's gradient pass failed earlier and its "
                               f"process group is not usable for it any more: {self.broken}")

    def pending_calls(self) -> int:
        return sum(len(layer.records) for layer in self.layers)

    def held_bytes(self) -> int:
        return self.holdings.bytes

    def release(self, records) -> None:
        for rec in records:
            self.holdings.drop(rec)

    def _abandon_pass(self) -> None:
        """Wait for a started pass (its operations were posted on every rank) and drop it."""
        p, self.pass_ = self.pass_, None
        if p is not None and not self.broken:
            if not p.backward_done:
                self._guard(p.finish_backward)
            self._guard(p.drain)

    def discard(self) -> None:
        """Drop the records and a started pass's results."""
        self._abandon_pass()
        for layer in self.layers:
            self.release(layer.records)
            layer.records.clear()
        self.holdings.reset_peak()
        self.unfinished = False

    def finalize(self) -> set:
        """Called by `nn.finalize_grads`: the flush, then ``.grad``; returns the ids of the
        parameters whose ``.grad`` it wrote (or, sharded, cleared)."""
        return self.run(finalize=True)

    def before_zero(self) -> None:
        """`nn.zero_main_grads` clearing buffers while deferred work is pending would lose it."""
        self._usable()
        if self.pending_calls() or self.unfinished:
            raise RuntimeError(
                f"{_OP}: zero_main_grads() ran after a backward whose gradients were not "
                f"finalized; call detgemm_cute.nn.finalize_grads(model) on every rank first "
                f"(or InvariantDataParallel.discard_pending() to drop that work)")
        self.shard_stale = False

    # ------------------------------------------------------------------- checks
    def layer_error(self, layer, records) -> str | None:
        for p in layer.params:
            view = self.layout.view(self.flat, p)
            buf = getattr(p, "main_grad", None)
            if buf is None or buf.shape != view.shape or buf.data_ptr() != view.data_ptr():
                return (f"the main_grad of '{layer.name}' was replaced after wrapping "
                        f"(moved to another device or reassigned); keep the buffers "
                        f"InvariantDataParallel created")
        if any(r.changed() for r in records):
            return (f"the input or output gradient of layer '{layer.name}' was modified in "
                    f"place after its backward, before the pass that needs it")
        return None

    def _local_error(self, finalize: bool) -> str | None:
        if finalize:
            for name, p in self.others:
                if p.grad is not None and p.grad.layout != torch.strided:
                    return (f"parameter '{name}' has a {p.grad.layout} gradient; only dense "
                            f"gradients are summed across ranks")
        p = self.pass_
        if p is not None:
            return p.failed
        for layer in self.layers:
            error = self.layer_error(layer, layer.records)
            if error:
                return error
        return None

    # ------------------------------------------------------------------- flush
    def run(self, finalize: bool) -> set:
        self._usable()
        t0 = time.perf_counter()
        tl = self.timeline
        p = self.pass_
        if tl is not None:
            if p is None:
                tl.reset()
            tl.mark("flush_start", torch.cuda.current_stream(self.ch.device))
        error = self._local_error(finalize)
        layer_on = [bool(layer.records) for layer in self.order]
        reduce_others = finalize and self.unfinished
        other_on = [reduce_others and q.grad is not None for _, q in self.others]
        if self.world > 1:
            error, layer_on, other_on = self._guard(
                lambda: self._agree(error, finalize, p is not None, layer_on, other_on))
        elif error:
            error = f"{_OP}: {error}"
        if error is not None:
            self._abandon_pass()
            raise RuntimeError(error)
        if p is None:
            p = Pass(self, [layer for layer, on in zip(self.order, layer_on) if on], False)
            self.pass_ = p
            self._guard(p.start)
            self._guard(p.finish_backward)
        units = [u for (_, q), on in zip(self.others, other_on) if on
                 for u in self.other_units[id(q)]]
        if units:
            self._guard(lambda: p.launch_others(units))
        if self.shard and not finalize and self.world > 1:
            self._guard(lambda: p.copy_to_first(self.layout))
        st = p.st
        st.broadcast_seconds = self._guard(p.drain)
        st.held_bytes = self.holdings.peak
        self.holdings.reset_peak()
        self.pass_ = None
        handled = self._write_grads(other_on) if finalize else set()
        if finalize:
            self.unfinished = False
            self.shard_stale = self.shard and self.world > 1
        if tl is not None:
            tl.mark("flush_end", torch.cuda.current_stream(self.ch.device))
        st.finalize = finalize
        st.seconds = time.perf_counter() - t0
        if self.stats.finalize:
            self.stats = FlushStats()
        self.stats.add(st)
        self.last_flush = st
        return handled

    def _agree(self, error, finalize, in_flight, layer_on, other_on):
        """The host exchange: every rank's error flag, flush kind, running pass and use of
        layers / other parameters; returns (error text or None, layers on, others on)."""
        nl = len(layer_on)
        row = [error is not None, 2 if finalize else 1, int(in_flight)] + layer_on + other_on
        table = self.ch.exchange([int(v) for v in row]).tolist()
        failed = [r for r, t in enumerate(table) if t[0]]
        if failed:
            texts = self.ch.messages(error)
            return ("; ".join(f"{_OP}: rank {r} failed its part of the gradient pass: "
                              f"{texts[r]}" for r in failed), layer_on, other_on)
        if len({t[1] for t in table}) > 1:
            return (f"{_OP}: ranks disagree: some called finalize_grads, others flush(); "
                    f"every rank must make the same calls in the same order", layer_on, other_on)
        if len({t[2] for t in table}) > 1:
            started = [r for r, t in enumerate(table) if t[2]]
            return (f"{_OP}: ranks disagree: ranks {started} ran a synchronizing backward "
                    f"(outside no_sync()) in this step, the others not; every rank must "
                    f"make the same calls", layer_on, other_on)
        cols = list(zip(*table))
        layer_on = [any(c) for c in cols[3:3 + nl]]
        other_on = [any(c) for c in cols[3 + nl:]]
        return None, layer_on, other_on

    def _write_grads(self, other_on) -> set:
        """``.grad`` from the fp32 results: every parameter's (replicated), or this rank's
        shard pieces' (sharded; the model's other parameters' local ``.grad`` is dropped).
        fp32 detgemm parameters get their ``main_grad`` itself, as ``.to(torch.float32)``
        would; an fp32 other parameter a copy (its next local gradient must not land in the
        buffer the next pass sums into)."""
        on = {id(q) for (_, q), o in zip(self.others, other_on) if o}
        chained = {id(p) for layer in self.layers for p in layer.params}
        handled = chained | {id(q) for _, q in self.others}
        if self.shard:
            for gi, (g, lo, hi) in enumerate(self.layout.owner_chunks(self.rank)):
                if g.dtype != torch.float32:
                    self.grad_bufs[gi].copy_(self.flat[lo:hi])
            for piece, grad in self.pieces.values():
                piece.grad = grad
            for _, q in self.others:
                q.grad = None
            return handled
        for g, buf in zip(self.layout.groups, self.grad_bufs):
            if buf is not None:
                buf.copy_(self.flat[g.lo:g.hi])
            for _, q, off in g.entries:
                if id(q) not in chained and id(q) not in on:
                    continue
                if buf is None:
                    region = self.flat[off:off + q.numel()]
                    if id(q) in on:
                        region = region.clone()
                else:
                    region = buf[off - g.lo:off - g.lo + q.numel()]
                q.grad = region.view(q.shape)
        return handled

    def gather_parameters(self) -> None:
        """Sharded finish, after the optimizer stepped this rank's pieces: every rank gets
        every updated parameter (all-gather in the parameters' dtype)."""
        if self.world == 1:
            return
        tl = self.timeline
        main = torch.cuda.current_stream(self.ch.device) if self.ch.side is not None else None
        if tl is not None and main is not None:
            tl.mark("gather_start", main)
        works = []
        for g, buf in zip(self.layout.groups, self.param_bufs):
            mine = buf[self.rank * g.chunk:(self.rank + 1) * g.chunk]
            works.append(self._guard(lambda b=buf, m=mine: self.ch.all_gather(b, m)))
        for w in works:
            self._guard(lambda w=w: self.ch.wait(w, self.world - 1,
                                                 "gathering the updated parameters"))
        if tl is not None and main is not None:
            tl.mark("gather_end", main)


__all__ = ["Engine"]
