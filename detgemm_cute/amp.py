"""Autocast (automatic mixed precision) for the detgemm forward ops.

``detgemm::mm``, ``detgemm::addmm`` and ``detgemm::linear`` follow the rule PyTorch applies
to ``aten::mm`` / ``addmm`` / ``linear`` inside ``torch.autocast(device_type, dtype)``: every
floating-point tensor argument on that device type, except float64 ones, is cast to the
autocast dtype, and the op runs on the cast tensors with autocast off. The casts are
ordinary ``Tensor.to`` calls recorded by autograd, so an fp32 parameter stays fp32 and its
gradient arrives in fp32 (the op's 16-bit gradient, converted exactly), and the bits are
those of the same call with the casts written out by hand.

Unlike ``torch.library.register_autocast`` (one fixed dtype), the kernels read the dtype of
the active autocast region, so ``torch.autocast("cuda", dtype=torch.float16)`` computes in
fp16 and ``dtype=torch.bfloat16`` in bf16. The kernels are registered for the CPU and CUDA
autocast keys. The gradient ops (``input_grad``, ``weight_grad``, ``bias_grad`` and the
accumulating forms) are not autocast, like aten's backward ops: they run in the dtype of
their operands, which the forward chose.
"""

from __future__ import annotations

import torch

from .errors import IN_DTYPES

DEVICE_TYPES = ("cpu", "cuda")
_F64 = torch.float64
_libs: list = []  # keeps the registrations alive


def cast(t, device_type: str, dtype: torch.dtype):
    """`t` cast to `dtype` where autocast would cast it: a floating-point tensor on
    `device_type` that is not float64. Anything else is returned unchanged."""
    if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not _F64
            and t.device.type == device_type):
        return t.to(dtype)
    return t


def active_dtype(device_type: str, op: str) -> torch.dtype | None:
    """The dtype of the autocast region active for `device_type` (None when there is none).
    A region whose dtype detgemm does not compute in is refused, naming it."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if dtype not in IN_DTYPES:
        raise TypeError(f"{op}: the {device_type} autocast dtype is {dtype}; detgemm computes "
                        f"in torch.bfloat16 or torch.float16 (torch.autocast(..., dtype=...))")
    return dtype


def _kernel(op: torch._ops.OpOverload, name: str, device_type: str, key: str):
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(_keyset, *args, **kwargs):
        dtype = active_dtype(device_type, name)
        if dtype is not None:
            args = tuple(cast(a, device_type, dtype) for a in args)
            kwargs = {k: cast(v, device_type, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(keys):
            return op(*args, **kwargs)

    kernel.__name__ = f"detgemm_autocast_{name.split('::')[-1]}_{device_type}"
    return kernel


def register(names) -> None:
    """Register the autocast kernels of the ops `names` (in the ``detgemm`` namespace) for
    every device type in `DEVICE_TYPES`."""
    lib = torch.library.Library("detgemm", "IMPL")
    for name in names:
        op = getattr(torch.ops.detgemm, name).default
        for device_type in DEVICE_TYPES:
            key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
            lib.impl(name, _kernel(op, f"detgemm::{name}", device_type, key), key,
                     with_keyset=True)
    _libs.append(lib)


def cast_like_autocast(device_type: str, op: str, *ts):
    """`ts` as the autocast kernels would pass them on (unchanged outside autocast)."""
    dtype = active_dtype(device_type, op)
    if dtype is None:
        return ts
    return tuple(cast(t, device_type, dtype) for t in ts)


__all__ = ["register", "cast", "active_dtype", "cast_like_autocast", "DEVICE_TYPES"]
