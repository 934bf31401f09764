"""`--shard I/N`: the I-th of N disjoint parts of the collected tests (conftest.py).

The GPU suite takes longer than one sitting of a lent machine allows; shards run it as N
processes side by side (one GPU is enough: the tests check bits, not time) or over several
calls. A test's shard is a hash of its node id, so shards are stable across runs and sizes
even out; every test is in exactly one shard."""

from __future__ import annotations

import zlib


def parse(spec: str) -> tuple[int, int]:
    """(i, n) from "i/n", 1 <= i <= n; ValueError naming the option otherwise."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected I/N with integers (e.g. 2/4), got {spec!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard: expected 1 <= I <= N, got {spec!r}")
    return i, n


def in_shard(nodeid: str, i: int, n: int) -> bool:
    return zlib.crc32(nodeid.encode()) % n == i - 1
