"""`bench/` on sys.path for a test module's fixtures: the bench scripts import each other as
top-level modules, so they are imported (and run) with that directory on the path."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextlib.contextmanager
def bench_on_path():
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))
