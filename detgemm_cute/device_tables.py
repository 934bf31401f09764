"""Kernel choices for one GPU model on top of its family's built-in table.

Two GPUs of one kernel family can want different tiles for the same problem. An H100 and an
H200 are both SM90 with 132 SMs, but the H200's memory is 1.4x faster: on output-bound
q @ k^T (S = 1024..4096, TMA-stored rows) a 128x256 tile on a 2x1 cluster runs 1.11x
faster there (0.96-1.20x, 16 rows) than the family table's 128x128
(bench/results/bmm-h200-table-ab_*), while on an H100 the 128x256 takes 1.1-1.25x the
128x128's time
(bench/results/tune/bmm_qk_cluster_nvidia-h100-*). A tile never changes bits (every kernel
runs the same ascending K chain), so such a choice is speed only.

`configs/devices/<device>/<arch>.yaml` holds those choices: buckets of the built-in table
(same name, op, dtypes and box) with other kernels (a kernel, or alternatives with costs).
`registry.load_builtin` puts them in place of the family's when the process runs on that
device, so coverage, layers and user tables work as before. <device> is the CUDA device name
as a slug ("NVIDIA H200" -> "nvidia-h200"), taken from the current device when the table is
first loaded.

`DETGEMM_CUTE_DEVICE_TABLE` overrides the detection: `off` (the family table alone, e.g. for
an A/B), or a device slug (that device's choices, e.g. to audit them on a CPU).

This module reads no YAML and imports nothing of the registry: `registry.load_builtin` asks
it for the path and the merge (`replace_kernels`) and reports problems as ConfigErrors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV_VAR = "DETGEMM_CUTE_DEVICE_TABLE"
OFF = "off"
SUBDIR = "devices"


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (the directory name of a device's tables)."""
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")


def known(builtin_dir: Path) -> list[str]:
    """Device slugs that have tables."""
    d = Path(builtin_dir) / SUBDIR
    return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


def current_device() -> tuple[str | None, bool]:
    """(device slug, whether the user named it): DETGEMM_CUTE_DEVICE_TABLE if set, else the
    current CUDA device's name; (None, ...) when it is `off` or no CUDA device is usable."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return (None, True) if env.lower() == OFF else (slug(env), True)
    try:
        import torch

        if not torch.cuda.is_available():
            return None, False
        return slug(torch.cuda.get_device_name(torch.cuda.current_device())), False
    except Exception:  # a CPU-only torch, or a driver that cannot be queried
        return None, False


def overlay_path(builtin_dir: Path, arch: str) -> Path | None:
    """The device table of `arch` for this process, or None (no device, `off`, or a device
    without tables for that family). A device named in DETGEMM_CUTE_DEVICE_TABLE that has
    no tables at all is a ValueError naming the variable and the devices that have some."""
    device, named = current_device()
    if device is None:
        return None
    path = Path(builtin_dir) / SUBDIR / device / f"{arch}.yaml"
    if path.is_file():
        return path
    if named and device not in known(builtin_dir):
        raise ValueError(
            f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}: no device tables for {device!r}; devices "
            f"with tables: {', '.join(known(builtin_dir)) or 'none'} (or '{OFF}')")
    return None


def _by_bucket(buckets) -> dict:
    """{bucket name: its entries}: one for a plain bucket, one per alternative of a bucket
    with alternatives (their `group`), in table order."""
    out = {}
    for b in buckets:
        out.setdefault(b.group or b.name, []).append(b)
    return out


def replace_kernels(table, device):
    """(the buckets of `table` with each one `device` declares replaced by the device's,
    [(line, bucket name, problem)]). A device bucket names a bucket of the table and keeps
    its op, dtypes and box, so the table's coverage holds; its kernel (or its alternatives
    and their costs) is its own: a plain bucket may replace one with alternatives and the
    other way round."""
    mine, family = _by_bucket(device), _by_bucket(table)
    problems = []
    for name, entries in mine.items():
        d, b = entries[0], family.get(name, [None])[0]
        if b is None:
            problems.append((d.line, name, "a device table replaces the kernels of a bucket "
                             "of the built-in table; this one names no bucket of the built-in "
                             "table"))
            continue
        differ = [f"{f} {getattr(d, f)} (built-in: {getattr(b, f)})"
                  for f in ("op", "dtypes", "m", "n", "k")
                  if (set(getattr(d, f)) if f == "dtypes" else getattr(d, f))
                  != (set(getattr(b, f)) if f == "dtypes" else getattr(b, f))]
        if differ:
            problems.append((d.line, name, f"a device bucket keeps the built-in bucket's op, "
                             f"dtypes and box ({b.where}): {'; '.join(differ)}"))
    out = []
    for name, entries in family.items():
        out.extend(mine.get(name, entries))
    return tuple(out), problems
