"""Programmatic dependent launch (PDL) of the SM90 GEMM kernels: on or off.

With PDL a kernel is launched while the previous kernel in its stream is still draining: its
CTAs allocate shared memory, initialise their barriers and prefetch their TMA descriptors
under the previous kernel's tail, then wait (`griddepcontrol.wait`) until that kernel has
completed and its writes are visible, before their first read or write of global memory.
Right after that, each CTA lets the next PDL kernel in the stream start its own set-up. So
no value a kernel reads or writes changes, only when its set-up runs.

Off by default. Measured on an H100 in CUDA graphs (`bench/bench_pdl.py`,
`bench/results/pdl_*`): a GEMM whose predecessor is another detgemm kernel launched with PDL
takes 0.66-1.21 us less on 28 of 30 decode rows (M = 1, 768 x 768: 3.8 -> 2.6 us; 4096 x
4096: 14.1 -> 13.1 us) and 0.17-0.33 us on most prefill rows (4 of 42 rows were slower); one
whose predecessor is any other kernel (a torch elementwise op, attention) takes 0.45-0.61 us
more on 39 of 42 rows (the cause is not isolated: without the early signal to the next
kernel that penalty stays and the gain falls to 0.2 us). In a transformer most GEMMs follow
such a kernel, so turn it on where detgemm's kernels run back to back (stacked linear
layers, separate q/k/v projections, an expert loop). ``DETGEMM_CUTE_PDL=1`` (read at
import) or `set_enabled(True)` turns it on; each setting is its own compiled kernel
(`compile.KernelKey.pdl`), so switching compiles (or loads) the other one on the next call.
"""

from __future__ import annotations

from . import registry
from .env import env_flag

ENV_VAR = "DETGEMM_CUTE_PDL"

_enabled = env_flag(ENV_VAR, False)


def enabled() -> bool:
    """Whether the SM90 kernels of the calls that follow are launched with PDL."""
    return _enabled


def set_enabled(flag: bool) -> None:
    """Turn PDL on or off for the calls that follow (the cached plans are dropped)."""
    global _enabled
    if not isinstance(flag, bool):
        raise TypeError(f"set_enabled: flag must be a bool, got {type(flag).__name__}")
    if flag != _enabled:
        _enabled = flag
        registry.invalidate()
