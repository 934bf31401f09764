"""Programmatic dependent launch (PDL) of the SM90 GEMM kernels: on or off.

With PDL a kernel is launched while the previous kernel in its stream is still draining: its
CTAs allocate shared memory, initialise their barriers and prefetch their TMA descriptors
under the previous kernel's tail, then wait (`griddepcontrol.wait`) until that kernel has
completed and its writes are visible, before their first read or write of global memory.
So no value a kernel reads or writes changes, only when its set-up runs; a kernel launched
after one that takes no part in PDL simply waits for it as before.

On by default for the SM90 family. ``DETGEMM_CUTE_PDL=0`` (read at import) or
`set_enabled(False)` turns it off; each setting is its own compiled kernel
(`compile.KernelKey.pdl`), so switching compiles (or loads) the other one on the next call.
"""

from __future__ import annotations

import os

from . import registry

ENV_VAR = "DETGEMM_CUTE_PDL"
_OFF = ("0", "off", "false", "no")

_enabled = os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF


def enabled() -> bool:
    """Whether SM90 kernels compiled from now on are launched with PDL."""
    return _enabled


def set_enabled(flag: bool) -> None:
    """Turn PDL on or off for the calls that follow (the cached plans are dropped)."""
    global _enabled
    if not isinstance(flag, bool):
        raise TypeError(f"set_enabled: flag must be a bool, got {type(flag).__name__}")
    if flag != _enabled:
        _enabled = flag
        registry.invalidate()
