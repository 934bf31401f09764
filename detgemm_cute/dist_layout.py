"""Where every trainable parameter's fp32 gradient lives in the data-parallel wrapper's flat
buffer, which rank owns which part of it (sharded finish), and the flat buffers in the
parameters' dtype that `.grad` and the sharded optimizer use.

Parameters are grouped by dtype (first appearance first); inside a group each starts at a
multiple of `ALIGN` elements, and each group is padded to a multiple of `ALIGN` x world
size, so rank r owns the r-th of `world` equal chunks of every group and every chunk
boundary falls at a multiple of `ALIGN` elements from the start of the parameter it cuts.
An element-wise optimizer step over such a piece then runs the same per-element code as
over the whole parameter (vectorized bodies and tails split at the same elements)."""

from __future__ import annotations

import torch

FP32 = torch.float32
ALIGN = 64


class Group:
    """The parameters of one dtype: [lo, hi) in the flat buffer, ``chunk`` elements a rank."""

    def __init__(self, dtype, lo):
        self.dtype, self.lo, self.hi, self.chunk = dtype, lo, lo, 0
        self.entries: list[tuple[str, torch.nn.Parameter, int]] = []  # (name, param, offset)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Layout:
    """Offsets of `named_params` (trainable, in order) in one flat fp32 buffer for a world
    of `world` ranks."""

    def __init__(self, named_params, world: int):
        self.world = world
        self.groups: list[Group] = []
        self.offset: dict[int, int] = {}
        by_dtype: dict = {}
        for name, p in named_params:
            by_dtype.setdefault(p.dtype, []).append((name, p))
        lo = 0
        for dtype, entries in by_dtype.items():
            g = Group(dtype, lo)
            off = lo
            for name, p in entries:
                g.entries.append((name, p, off))
                self.offset[id(p)] = off
                off = _round_up(off + p.numel(), ALIGN)
            size = _round_up(max(off - lo, 1), ALIGN * world)
            g.hi, g.chunk = lo + size, size // world
            self.groups.append(g)
            lo = g.hi
        self.size = lo

    def view(self, flat: torch.Tensor, p) -> torch.Tensor:
        off = self.offset[id(p)]
        return flat[off:off + p.numel()].view(p.shape)

    def owner_chunks(self, rank: int) -> list[tuple[Group, int, int]]:
        """(group, lo, hi) of the chunk of every group that `rank` owns."""
        return [(g, g.lo + rank * g.chunk, g.lo + (rank + 1) * g.chunk) for g in self.groups]

    def pieces(self, lo: int, hi: int, skip: int) -> list[tuple[int, int, int]]:
        """(owner, a, b): the parts of flat range [lo, hi) by owning rank, except `skip`."""
        out = []
        for g in self.groups:
            a0, b0 = max(lo, g.lo), min(hi, g.hi)
            if a0 >= b0:
                continue
            for r in range(self.world):
                a, b = max(a0, g.lo + r * g.chunk), min(b0, g.lo + (r + 1) * g.chunk)
                if a < b and r != skip:
                    out.append((r, a, b))
        return out

    # ------------------------------------------------------------------ param-dtype buffers
    def grad_buffers(self, device, chunk: bool = False) -> list:
        """Per group, a buffer in the group's dtype for `.grad` (the group, or with `chunk`
        one rank's chunk of it); None for fp32 groups, whose `.grad` is the fp32 buffer."""
        return [None if g.dtype == FP32
                else torch.empty(g.chunk if chunk else g.hi - g.lo, dtype=g.dtype,
                                 device=device)
                for g in self.groups]

    @torch.no_grad()
    def flatten_parameters(self, device) -> list[torch.Tensor]:
        """Move every parameter into one buffer of its group's dtype, at its offset (the
        parameters become views of it; values unchanged); returns the buffers."""
        bufs = []
        for g in self.groups:
            buf = torch.zeros(g.hi - g.lo, dtype=g.dtype, device=device)
            for _, p, off in g.entries:
                view = buf[off - g.lo:off - g.lo + p.numel()].view(p.shape)
                view.copy_(p.detach())
                p.data = view
            bufs.append(buf)
        return bufs

    def shard_pieces(self, rank: int) -> list[tuple[torch.nn.Parameter, int, int, int]]:
        """(param, group index, a, b): the part [a, b) (flat coordinates) of each parameter
        in the chunk `rank` owns."""
        out = []
        for gi, (g, lo, hi) in enumerate(self.owner_chunks(rank)):
            for _, p, off in g.entries:
                a, b = max(lo, off), min(hi, off + p.numel())
                if a < b:
                    out.append((p, gi, a, b))
        return out


__all__ = ["Layout", "Group", "ALIGN"]
