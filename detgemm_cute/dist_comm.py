"""The communication of one data-parallel wrapper: its process groups, CUDA streams, waits
that turn a lost rank into a clear error, and the small host-side exchange at every flush.

Groups. With NCCL every rank's receives from rank r-1, its sends to rank r+1 and the
delivery of final results each get their own communicator (two-rank groups for the chain
hops, one group of all ranks for deliveries), so that they run on separate NCCL streams
whether or not the default group was initialized eagerly (``device_id``), where all of one
group's operations share one stream. The flags exchanged at each flush travel over a gloo
group of their own (host memory, no GPU synchronization). With gloo the data uses the
wrapper's group: its point-to-point operations are matched by tag, not by stream order.

Failures. A wait that fails (a peer exited: the connection closes at once; or nothing
arrived within the process-group timeout) raises `PassFailed` naming the rank waited for;
before raising, this rank writes its report into the job's key-value store and collects
the others' for a few seconds, so every surviving rank names the rank that failed first."""

from __future__ import annotations

import contextlib
import datetime
import time
import warnings

import torch
import torch.distributed as dist

from .dist_records import OP

_GRACE_S = 1.0  # at most this long (and a tenth of the timeout) collecting others' reports
_UIDS: dict = {}
_GROUPS: dict = {}  # (default group, ranks, nccl) -> (pair groups, delivery group, control)


class PassFailed(RuntimeError):
    """The rank-to-rank gradient pass could not go on (a rank failed, exited or stalled)."""


def _group_timeout(group, device) -> datetime.timedelta | None:
    try:
        return group._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001 - private API; the default timeout then applies
        return None


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API; reports are then local only
        return None


class Channels:
    """Process groups, streams and waits for one wrapper on `group` (ranks in chain order)."""

    def __init__(self, group, device: torch.device, backend: str):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world = len(self.ranks)
        self.device = device
        self.nccl = backend == "nccl"
        key = tuple(self.ranks)
        _UIDS[key] = _UIDS.get(key, 0) + 1
        self.uid = _UIDS[key]
        self.timeout = _group_timeout(group, device if self.nccl else torch.device("cpu"))
        self.log: list | None = None  # posted operations, kept when a test sets a list
        self.prev_group = self.next_group = self.deliver_group = self.control = group
        self.side = self.deliver = None
        if device.type == "cuda":  # the chain's GEMMs gate the next rank: high priority
            self.side = torch.cuda.Stream(device, priority=-1)
            self.deliver = torch.cuda.Stream(device)
        store = _default_store()
        self.store = (dist.PrefixStore(f"detgemm_idp/{'_'.join(map(str, key))}/{self.uid}/",
                                       store) if store is not None else None)

    def make_groups(self) -> None:
        """Collective over the wrapper's ranks: the gloo group of the flag exchange, and
        with NCCL the chain's and the deliveries' groups; made once per set of ranks and
        kept for later wrappers (a pass leaves no operation behind). Every rank of the
        default group takes part when the wrapper spans it; a subgroup's ranks create them
        alone (with NCCL not possible when the default group was initialized eagerly with
        a device_id: NCCL would need every rank). The exchange has its own group, so that
        it never waits behind a collective stuck on a stalled rank."""
        if self.world == 1:
            return
        whole = dist.get_world_size() == self.world
        if self.nccl and not whole \
                and getattr(dist.group.WORLD, "bound_device_id", None) is not None:
            raise ValueError(
                f"{OP}: a process group smaller than the world needs a default group "
                f"initialized without device_id (its NCCL subgroups are split from the "
                f"default communicator on every rank); wrap on the whole world, or "
                f"initialize without device_id")
        key = (dist.group.WORLD, tuple(self.ranks), self.nccl)
        made = _GROUPS.get(key)
        if made is None:  # every rank makes the same calls, so every rank finds the same
            kw = {"use_local_synchronization": not whole}
            if self.timeout is not None:
                kw["timeout"] = self.timeout
            control = _gloo_group(self.ranks, kw) if self.nccl else \
                dist.new_group(self.ranks, backend="gloo", **kw)
            pairs = deliver = None
            if self.nccl:
                pairs = [dist.new_group(self.ranks[i:i + 2], backend="nccl", **kw)
                         for i in range(self.world - 1)]
                deliver = dist.new_group(self.ranks, backend="nccl", **kw)
            made = (pairs, deliver, control)
        pairs, deliver, control = made
        self.control = control if control is not None else self.group
        if pairs is not None:
            r = self.rank
            self.prev_group = pairs[r - 1] if r > 0 else None
            self.next_group = pairs[r] if r < self.world - 1 else None
            self.deliver_group = deliver
        if key not in _GROUPS:
            if self.nccl:
                self._warm_up()
            _GROUPS[key] = made

    def _warm_up(self) -> None:
        """One small operation on every NCCL communicator the pass will use, now, while
        every rank is here: NCCL creates a communicator at its first operation, and a rank
        whose peer died before that would wait in the creation without any timeout."""
        r, last = self.rank, self.world - 1
        t = torch.zeros(1, device=self.device)
        if r > 0:
            self.recv(t, r - 1, 0, 0).wait()
        if r < last:
            self.send(t, r + 1, 0, 0).wait()
        for owner in range(last):  # deliveries (and a flush's copy) go from the last rank
            if r == last:
                self.send(t, owner, 1, 0).wait()
            elif r == owner:
                self.recv(t, last, 1, 0).wait()
        self.broadcast(t, 0).wait()
        self.all_gather(torch.zeros(self.world, device=self.device), t).wait()
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ streams
    def on_side(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def on_deliver(self):
        return (torch.cuda.stream(self.deliver) if self.deliver is not None
                else contextlib.nullcontext())

    # ------------------------------------------------------------------ point to point
    def tag(self, role: int, index: int) -> int:
        """gloo matches by tag: the wrapper, the role (0 hops, 1 deliveries, 2 a flush's
        copy to rank 0) and the unit keep stale operations of another wrapper apart."""
        return ((self.uid % 64) << 24) | (role << 22) | (index % (1 << 22))

    def _note(self, *entry):
        if self.log is not None:
            self.log.append(entry)

    def send(self, t, peer: int, role: int, index: int):
        group = self.next_group if role == 0 else self.deliver_group
        self._note("send", "hop" if role == 0 else "deliver", peer, index, t.numel())
        return self._post(peer, "sending to it", dist.isend, t, dst=self.ranks[peer],
                          group=group, tag=self.tag(role, index))

    def recv(self, t, peer: int, role: int, index: int):
        group = self.prev_group if role == 0 else self.deliver_group
        self._note("recv", "hop" if role == 0 else "deliver", peer, index, t.numel())
        return self._post(peer, "receiving from it", dist.irecv, t, src=self.ranks[peer],
                          group=group, tag=self.tag(role, index))

    def broadcast(self, t, index: int):
        self._note("broadcast", "deliver", self.world - 1, index, t.numel())
        return self._post(self.world - 1, "receiving its final values", dist.broadcast, t,
                          src=self.ranks[-1], group=self.deliver_group, async_op=True)

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor):
        self._note("all_gather", "deliver", -1, -1, out.numel())
        return self._post(None, "gathering the updated parameters", _gather_single, out,
                          mine, self.deliver_group, async_op=True)

    def _post(self, peer, what: str, fn, *args, **kwargs):
        """Post an operation; a peer already gone can make the posting itself fail."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a lost peer
            lost = f"lost rank {peer}" if peer is not None else "lost a rank"
            self.fail(f"rank {self.rank} {lost} while {what}: {type(exc).__name__}: "
                      f"{_first_line(exc)}", peer)

    def wait(self, work, peer: int, what: str) -> float:
        """Wait for `work` (on a GPU: the current stream waits; on a CPU: this thread).
        Returns host seconds spent; a failure becomes `PassFailed` naming `peer`."""
        t0 = time.perf_counter()
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - a lost or stalled peer
            self.fail(f"rank {self.rank} lost rank {peer} while {what}: "
                      f"{type(exc).__name__}: {_first_line(exc)}", peer)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ host exchange
    def exchange(self, row: list[int]) -> torch.Tensor:
        """Every rank's `row` of small ints, as a [world, len(row)] CPU tensor (gloo: on the
        host; without a gloo group, over NCCL: the host then waits for the GPU)."""
        where = self.device if (self.nccl and self.control is self.group) else "cpu"
        mine = torch.tensor(row, dtype=torch.int32, device=where)
        out = torch.empty(self.world * len(row), dtype=torch.int32, device=where)
        try:
            _gather_single(out, mine, self.control)
            out = out.cpu()
        except Exception as exc:  # noqa: BLE001 - a rank exited or never came
            self.fail(f"rank {self.rank} did not hear from every rank at the flush "
                      f"(finalize_grads / flush): {type(exc).__name__}: {_first_line(exc)}",
                      None)
        return out.view(self.world, len(row))

    def messages(self, msg: str | None) -> list:
        out = [None] * self.world
        self._post(None, "exchanging error messages at the flush", dist.all_gather_object,
                   out, msg, group=self.control)
        return out

    def fail(self, message: str, peer: int | None):
        """Report `message` to the other ranks (the store), collect theirs for a few
        seconds, and raise `PassFailed` with all of it."""
        reports = {}
        if self.store is not None:
            try:
                self.store.set(f"fault/{self.rank}", message)
                reports = self._collect()
            except Exception:  # noqa: BLE001 - the store itself may be gone
                pass
        others = [f"rank {r}: {m}" for r, m in sorted(reports.items()) if r != self.rank]
        suspects = [peer] if peer is not None else range(self.world)
        silent = [r for r in suspects if r != self.rank and r not in reports]
        text = f"{OP}: the gradient pass failed: {message}"
        if silent:
            who = f"Rank {silent[0]}" if len(silent) == 1 else f"Ranks {silent}"
            text += f". {who} reported nothing (exited, crashed or stuck)"
        if others:
            text += ". Reports from other ranks: " + "; ".join(others)
        raise PassFailed(text)

    def _collect(self) -> dict:
        """The reports in the store, after waiting briefly for those of ranks that fail at
        about the same time (a report written earlier is there at once)."""
        grace = _GRACE_S
        if self.timeout is not None:
            grace = min(grace, self.timeout.total_seconds() / 10)
        deadline = time.monotonic() + grace
        keys = {r: f"fault/{r}" for r in range(self.world)}
        while True:
            found = {r: k for r, k in keys.items() if self.store.check([k])}
            if len(found) == self.world or time.monotonic() >= deadline:
                return {r: self.store.get(k).decode(errors="replace") for r, k in found.items()}
            time.sleep(0.05)


def _gloo_group(ranks, kw):
    """A gloo group for the flag exchange beside NCCL, or None where gloo cannot connect
    the hosts (the flags then go over the wrapper's NCCL group)."""
    try:
        return dist.new_group(ranks, backend="gloo", **kw)
    except Exception as exc:  # noqa: BLE001 - e.g. no usable network interface for gloo
        warnings.warn(f"{OP}: no gloo group ({type(exc).__name__}: {_first_line(exc)}); "
                      f"the flags of each flush go over NCCL, which waits for the GPU")
        return None


def _gather_single(out, mine, group, async_op=False):
    """Every rank's `mine`, concatenated into `out` (torch >= 2.13 names it
    all_gather_single; all_gather_into_tensor before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, mine, group=group, async_op=async_op)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


__all__ = ["Channels", "PassFailed"]
