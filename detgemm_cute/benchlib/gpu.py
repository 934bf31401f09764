"""The GPU in use: whether detgemm can run on it, and what it is (for reports).

Importing this module touches no CUDA state; the functions do."""

from __future__ import annotations

import datetime as _dt
import os
import sys

import torch

from .fmt import err_str

DEVICE = "cuda"  # where inputs are made (tests run the GPU code on "cpu" with a fake CUDA)


def log(msg: str, prefix: str = "[bench]") -> None:
    print(f"{prefix} {msg}", file=sys.stdout, flush=True)


def gpu_check() -> tuple[str | None, str | None]:
    """(None, arch) when a GPU with a detgemm kernel family is usable, else (reason, None).

    arch is the registry arch ("sm90" or "sm80") of device 0, honouring
    DETGEMM_CUTE_FAMILY."""
    try:
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)", None
        major, minor = torch.cuda.get_device_capability(0)
        name = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        return f"CUDA not usable ({err_str(e)})", None
    try:
        from ..dispatch import FAMILY_ENV, arch_for_capability

        arch = arch_for_capability(major, minor, os.environ.get(FAMILY_ENV) or None)
    except Exception as e:  # noqa: BLE001
        return f"found {name} (sm_{major}{minor}): {e}", None
    return None, arch


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def device_meta() -> dict:
    """Device, versions and date, for the report header and the JSON."""
    props = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability(0)
    meta = {
        "device": torch.cuda.get_device_name(0),
        "capability": f"{major}{minor}",
        "sm_count": getattr(props, "multi_processor_count", None),
        "l2_mb": l2_bytes() / 1e6,
        "memory_gb": getattr(props, "total_memory", 0) / 1e9,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "argv": sys.argv[1:],
    }
    meta["detgemm"] = getattr(sys.modules.get(__name__.split(".")[0]), "__version__", "?")
    try:
        import cutlass

        meta["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except Exception:  # noqa: BLE001
        meta["cutlass_dsl"] = None
    return meta


def safe_sync() -> None:
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass
