"""One rank-ordered pass of `detgemm_cute.distributed` on one rank: from its start (during the
backward that synchronizes, or at the flush) until every operation it posted is done.

Order. Every rank walks the same units in the same order: the layers in reverse
registration order (roughly the order their backward finishes), each layer's units in
order, then (when finalizing) the other parameters' units. A layer is *launched* once its
records on this rank are complete (its backward calls in this pass have all run) and every
layer before it has been launched; rank r > 0 keeps the receives of the next `AHEAD`
layers posted, so the data of rank r-1 lands while rank r is still busy.

Per unit, on a GPU: the side stream waits for the unit's receive, runs this rank's dW / db
GEMMs into it, and the unit is sent to rank r+1; the final value then goes out from the
last rank, by a broadcast (every rank gets every result) or, with a sharded finish, to the
ranks that own its parts. The main stream only waits at the end of the backward and at the
flush. On a CPU (gloo) the same happens synchronously on the thread that runs the backward.

An exception in this rank's own part (a record changed in place, a GEMM that raised) does not
stop the pass: the rank passes the units on unchanged, so no rank waits for data that never
comes, and every rank raises it at the flush (`failed`). A lost peer raises at once."""

from __future__ import annotations

import torch

from .dist_records import FlushStats, add_part

AHEAD = 2  # layers whose receives are posted before the layer being launched


class Timeline:
    """CUDA events at phase boundaries of the last step (``phase_events=True``)."""

    def __init__(self):
        self.marks: dict = {}
        self.waits: list = []

    def mark(self, name: str, stream) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        self.marks[name] = ev

    def wait_pair(self, stream):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        self.waits.append((a, b))
        return b

    def reset(self) -> None:
        self.marks, self.waits = {}, []

    def ms(self, a: str, b: str) -> float | None:
        if a in self.marks and b in self.marks:
            return self.marks[a].elapsed_time(self.marks[b])
        return None

    def wait_ms(self) -> float:
        return sum(a.elapsed_time(b) for a, b in self.waits)


class Pass:
    def __init__(self, eng, layers: list, overlapped: bool):
        self.eng, self.ch = eng, eng.ch
        self.layers = layers
        self.units = [u for layer in layers for u in layer.units]
        for i, u in enumerate(self.units):
            u.index = i
        self.overlapped = overlapped
        self.backward_done = False
        self.next = 0
        self.ready: set = set()
        self.recvs: dict = {}
        self.sends: list = []
        self.deliveries: list = []  # (work, peer, what)
        self.failed: str | None = None
        self.main = None
        self.posted = 0  # layers whose receives are posted
        self.st = FlushStats(flushes=1, overlapped=int(overlapped))

    # ------------------------------------------------------------------ start, launch
    def start(self) -> None:
        ch = self.ch
        if ch.side is not None:
            self.main = torch.cuda.current_stream(ch.device)
            ch.side.wait_stream(self.main)
            if self.eng.timeline is not None:
                self.eng.timeline.mark("pass_start", ch.side)
        self._post_layers(AHEAD)

    def _post_layers(self, upto: int) -> None:
        """Post the receives of the layers before index `upto` (in pass order, as rank r-1
        sends them), so rank r-1's data can land while this rank is still busy."""
        while self.posted < min(upto, len(self.layers)):
            self._post_receives(self.layers[self.posted].units)
            self.posted += 1

    def _post_receives(self, units) -> None:
        ch = self.ch
        if ch.rank == 0:
            return
        with ch.on_side():
            for u in units:
                self.recvs[u.index] = ch.recv(u.region, ch.rank - 1, 0, u.index)

    def mark_ready(self, layer) -> None:
        self.ready.add(id(layer))
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next < len(self.layers) and id(self.layers[self.next]) in self.ready:
            layer = self.layers[self.next]
            self.next += 1
            self._post_layers(self.next + AHEAD)
            self._launch_layer(layer)

    def finish_backward(self) -> None:
        """Every layer is complete now: launch the rest; the main stream waits for the
        side stream (nothing may change a record in place while the GEMMs read it)."""
        self.ready.update(id(layer) for layer in self.layers)
        self._launch_ready()
        self.backward_done = True
        ch = self.ch
        if ch.side is not None:
            tl = self.eng.timeline
            main = torch.cuda.current_stream(ch.device)
            if tl is not None:
                tl.mark("backward_end", self.main or main)
                tl.mark("chain_end", ch.side)
            for s in {self.main or main, main}:
                s.wait_stream(ch.side)

    def _launch_layer(self, layer) -> None:
        records, layer.records = layer.records, []
        self.st.calls += len(records)
        error = self.eng.layer_error(layer, records)
        if error:
            self._fail(error)
        ch = self.ch
        with ch.on_side():
            if ch.side is not None:
                for rec in records:
                    if rec.ready is not None:
                        ch.side.wait_event(rec.ready)
            for u in layer.units:
                self._unit(u, records)
            if ch.side is not None:
                for rec in records:
                    rec.dy.record_stream(ch.side)
                    if rec.x is not None:
                        rec.x.record_stream(ch.side)
        self.eng.release(records)

    def launch_others(self, units) -> None:
        """The other parameters' units (finalizing), after every layer's."""
        base = len(self.units)
        for i, u in enumerate(units):
            u.index = base + i
        self.units += units
        self._post_receives(units)
        with self.ch.on_side():
            for u in units:
                self._unit(u, ())

    # ------------------------------------------------------------------ one unit
    def _unit(self, u, records) -> None:
        ch, st = self.ch, self.st
        r, last = ch.rank, ch.world - 1
        st.units += 1
        if r > 0:
            tl = self.eng.timeline
            end = tl.wait_pair(ch.side) if tl is not None and ch.side is not None else None
            st.wait_seconds += ch.wait(self.recvs.pop(u.index), r - 1,
                                       f"receiving {u.label()} from it")
            if end is not None:
                end.record(ch.side)
            st.received_bytes += u.nbytes
        if self.failed is None:
            try:
                add_part(u, records, r == 0)
            except Exception as exc:  # noqa: BLE001 - reported by every rank at the flush
                self._fail(f"computing {u.label()}: {type(exc).__name__}: {exc}")
        sent = None
        if r < last:
            sent = ch.send(u.region, r + 1, 0, u.index)
            self.sends.append(sent)
            st.sent_bytes += u.nbytes
        if ch.world > 1:
            self._deliver(u, sent)

    def _deliver(self, u, sent) -> None:
        """The final value of `u`, from the last rank: to every rank (broadcast) or, for a
        sharded finish, each part to the rank that owns it. A rank's delivery overwrites
        the region only after its own send of the unit (GPU: stream order)."""
        ch, st = self.ch, self.st
        r, last = ch.rank, ch.world - 1
        if not self.eng.shard:
            with ch.on_deliver():
                self._after_send(sent)
                work = ch.broadcast(u.region, u.index)
            self.deliveries.append((work, last, f"receiving the final {u.label()}"))
            st.broadcast_bytes += u.nbytes
            return
        if r == last:  # posted on the side stream: after this rank's GEMMs of the unit
            for owner, sub in u.pieces:
                self.deliveries.append((ch.send(sub, owner, 1, u.index), owner,
                                        f"sending the final {u.label()} to it"))
                st.delivered_bytes += sub.numel() * 4
            return
        mine = [sub for owner, sub in u.pieces if owner == r]
        if mine:
            with ch.on_deliver():
                self._after_send(sent)
                for sub in mine:
                    self.deliveries.append((ch.recv(sub, last, 1, u.index), last,
                                            f"receiving the final {u.label()} from it"))
                    st.delivered_bytes += sub.numel() * 4

    def _after_send(self, sent) -> None:
        """GPU: the delivery stream waits until this rank's last use of the region is done
        (its send, or on the last rank its GEMMs). CPU: nothing to order (the final value
        exists only after every rank has sent the unit on)."""
        ch = self.ch
        if ch.deliver is None:
            return
        if sent is not None:
            sent.wait()
        else:
            ch.deliver.wait_stream(ch.side)

    def copy_to_first(self, layout) -> None:
        """A sharded flush that does not finalize: rank 0 continues the next pass from
        every final value, so the last rank sends it the parts it does not own."""
        ch, st = self.ch, self.st
        last = ch.world - 1
        if ch.rank not in (0, last):
            return
        k = 0
        with ch.on_deliver():
            if ch.deliver is not None:
                ch.deliver.wait_stream(ch.side)
                for w in self.sends:
                    w.wait()
            for u in self.units:
                for _, a, b in layout.pieces(u.lo, u.hi, skip=0):
                    sub = u.region[a - u.lo:b - u.lo]
                    if ch.rank == last:
                        work = ch.send(sub, 0, 2, k)
                        what = "sending the flushed gradients to it"
                    else:
                        work = ch.recv(sub, last, 2, k)
                        what = "receiving the flushed gradients from it"
                    self.deliveries.append((work, 0 if ch.rank == last else last, what))
                    st.delivered_bytes += sub.numel() * 4
                    k += 1

    # ------------------------------------------------------------------ end
    def _fail(self, message: str) -> None:
        if self.failed is None:
            self.failed = message

    def drain(self) -> float:
        """Wait for every operation this pass posted (GPU: the current stream waits; CPU:
        this thread). Returns host seconds spent waiting for deliveries."""
        ch = self.ch
        r = ch.rank
        if ch.side is not None:
            with ch.on_deliver():
                for w in self.sends:
                    w.wait()
                for w, _, _ in self.deliveries:
                    w.wait()
            main = torch.cuda.current_stream(ch.device)
            main.wait_stream(ch.side)
            main.wait_stream(ch.deliver)
            self.sends, self.deliveries = [], []
            return 0.0
        for w in self.sends:
            ch.wait(w, r + 1, "sending to it")
        spent = 0.0
        for w, peer, what in self.deliveries:
            spent += ch.wait(w, peer, what)
        self.sends, self.deliveries = [], []
        return spent


__all__ = ["Pass", "Timeline"]
