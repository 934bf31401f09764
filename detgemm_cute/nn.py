"""Drop-in modules: `Linear` (a `torch.nn.Linear` whose forward and backward GEMMs are
detgemm's), `convert(model)` to swap them in, and an fp32 gradient accumulation buffer.

Default mode: the forward is `detgemm_cute.linear`, whose autograd formula runs the dX, dW
and bias-gradient kernels; dW is computed in fp32 and rounded once to the parameter dtype,
and `.grad` accumulates across backward calls as PyTorch does (in the parameter dtype).

``fp32_grad_accum=True`` (as large-scale trainers keep a "main grad"): each parameter gets
an fp32 buffer ``param.main_grad`` and backward continues the dW chain *inside* it, so
gradient accumulation over micro-batches whose token counts are multiples of 16 gives the
bits of one big batch. ``.grad`` is left alone until `finalize_grads` writes
``main_grad.to(param.dtype)`` (the single rounding); `zero_main_grads` clears the buffers.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterator

import torch

from . import amp, split
from .functional import linear as _linear

_FP32 = torch.float32
_autocast_on = torch._C._is_any_autocast_enabled


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` with deterministic, batch-invariant GEMMs (same parameters, same
    `state_dict`). Inputs and parameters are bf16, fp16 or fp32 (the same dtype; fp32 runs
    the fp32 tier), or run inside ``torch.autocast`` (then fp32 parameters are cast to the
    autocast dtype for the GEMMs, like torch.nn.Linear under autocast, and stay fp32 with
    fp32 gradients). `repr` names it ``detgemm_cute.nn.Linear``."""

    # Set by `detgemm_cute.distributed` (fp32_grad_accum only): a callable taking (dY, X,
    # sync) that takes over this layer's dW / db work from backward; its ``owner`` is
    # flushed by `finalize_grads` and checked by `zero_main_grads`, its ``token`` (a 0-d
    # tensor given a zero gradient) tells when the layer's backward calls are all done, and
    # ``sync_now()`` whether a forward now belongs to a synchronizing backward.
    dw_deferral = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, fp32_grad_accum: bool = False):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.fp32_grad_accum = fp32_grad_accum

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, fp32_grad_accum: bool = False) -> "Linear":
        """A detgemm Linear that shares `linear`'s Parameter objects (no copy), so optimizers
        and references to the old parameters stay valid."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear: expected a torch.nn.Linear, got "
                            f"{type(linear).__name__}")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", dtype=linear.weight.dtype, fp32_grad_accum=fp32_grad_accum)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_grad_accum and torch.is_grad_enabled() and _any_grad(self):
            _refuse_ddp(self)
            for p in self._grad_params():
                _main_grad(p)
            x, compute = _autocast_inputs(x, self.weight, self.bias)
            defer = self.dw_deferral
            token = None if defer is None else defer.token
            return _LinearMainGrad.apply(x, self.weight, self.bias, defer, compute, token)
        return _linear(x, self.weight, self.bias)

    def _grad_params(self) -> Iterator[torch.nn.Parameter]:
        for p in (self.weight, self.bias):
            if p is not None and p.requires_grad:
                yield p

    def extra_repr(self) -> str:
        return super().extra_repr() + (", fp32_grad_accum=True" if self.fp32_grad_accum else "")

    def _get_name(self) -> str:  # the name `repr(module)` shows: not torch's Linear
        return "detgemm_cute.nn.Linear"


def _any_grad(m: Linear) -> bool:
    return m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad)


def _main_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 accumulation buffer of `p`, created (zeroed) on first use."""
    buf = getattr(p, "main_grad", None)
    if buf is None or buf.shape != p.shape or buf.device != p.device:
        buf = torch.zeros(p.shape, dtype=_FP32, device=p.device)
        p.main_grad = buf
    return buf


def _autocast_inputs(x, weight, bias):
    """Inside torch.autocast: x cast as the autocast kernels cast it (recorded by autograd,
    so x's gradient comes back in x's dtype) and detached casts of the parameters to compute
    with, since their gradients go to main_grad. Outside autocast: (x, None)."""
    if not (_autocast_on() and isinstance(x, torch.Tensor)):
        return x, None
    dev = x.device.type
    dtype = amp.active_dtype(dev, "detgemm_cute.nn.Linear")
    if dtype is None:
        return x, None
    with torch.no_grad():
        compute = (amp.cast(weight, dev, dtype), amp.cast(bias, dev, dtype))
    return amp.cast(x, dev, dtype), compute


def _refuse_ddp(m: Linear) -> None:
    """DDP all-reduces ``.grad``, which this mode leaves empty (dW goes to main_grad): the
    ranks would step on unreduced gradients."""
    ddp = _ddp_class()
    if ddp is not None and getattr(ddp, "_active_ddp_module", None) is not None:
        raise RuntimeError(
            "detgemm_cute.nn.Linear(fp32_grad_accum=True) inside torch DistributedDataParallel: "
            "DDP all-reduces .grad, but this mode accumulates dW in param.main_grad and leaves "
            ".grad to finalize_grads, so gradients would not be reduced. Use "
            "fp32_grad_accum=False under DDP (fp32 parameters + torch.autocast keep fp32 "
            "gradients), or detgemm_cute.distributed for fp32 main_grad data parallelism")


def _ddp_class():
    mod = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(mod, "DistributedDataParallel", None)


class _LinearMainGrad(torch.autograd.Function):
    """Linear whose backward accumulates dW and db into ``param.main_grad`` (fp32, one
    continued chain per micro-batch) and returns no gradient for the parameters.
    `compute`: the (weight, bias) to compute with when autocast cast them (else None).
    With a deferral, `token` gets a zero gradient from every backward call, so that its
    gradient hook runs once all of them are done."""

    @staticmethod
    def forward(ctx, x, weight, bias, defer=None, compute=None, token=None):
        ctx.params, ctx.defer = (weight, bias), defer
        ctx.sync = defer is not None and defer.sync_now()
        ctx.token = token is not None
        cw, cb = compute if compute is not None else (weight, bias)
        ctx.save_for_backward(x if weight.requires_grad else None,
                              cw if ctx.needs_input_grad[0] else None)
        ctx.dtype = cw.dtype
        ctx.fp32_precision = split.forward_precision(cw.dtype)  # backward runs at it too
        return torch.ops.detgemm.linear(x, cw, cb, None)

    @staticmethod
    def backward(ctx, grad):
        x, weight_saved = ctx.saved_tensors
        weight, bias = ctx.params
        g = grad if grad.dtype == ctx.dtype else grad.to(ctx.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            with split.at_precision(ctx.fp32_precision):
                gx = torch.ops.detgemm.input_grad(g, weight_saved, None)
        if ctx.defer is not None:
            ctx.defer(g, x, ctx.sync)  # dW and db later, in a rank-ordered chain
            done = torch.zeros((), dtype=_FP32, device=g.device) if ctx.token else None
            return gx, None, None, None, None, done
        if weight.requires_grad:
            torch.ops.detgemm.weight_grad_acc_(weight.main_grad, g, x)
        if bias is not None and bias.requires_grad:
            torch.ops.detgemm.bias_grad_acc_(bias.main_grad, g)
        return gx, None, None, None, None, None


def convert(model: torch.nn.Module, *, fp32_grad_accum: bool = False,
            filter: Callable[[str, torch.nn.Module], bool] | None = None) -> torch.nn.Module:
    """Replace every plain `torch.nn.Linear` in `model` (or those `filter(name, module)`
    accepts) by a detgemm `Linear` sharing its parameters; returns `model` (changed in
    place). A model that is itself a Linear is returned converted. Subclasses of
    nn.Linear are left alone by default: modules such as MultiheadAttention read their
    weights directly and would bypass the swap."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"detgemm_cute.nn.convert: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")

    def swap(name, module):
        return type(module) is torch.nn.Linear and (filter is None or filter(name, module))

    for name, module in model.named_modules():
        if swap(name, module) or isinstance(module, Linear):
            _check_dtype(name, module)
    if swap("", model):
        return Linear.from_linear(model, fp32_grad_accum=fp32_grad_accum)
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if swap(full, child):
                setattr(parent, child_name,
                        Linear.from_linear(child, fp32_grad_accum=fp32_grad_accum))
            elif isinstance(child, Linear):
                child.fp32_grad_accum = fp32_grad_accum
    return model


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_dtype(name: str, module: torch.nn.Linear) -> None:
    """convert() refuses a Linear whose parameters detgemm cannot compute with (float64,
    integer, ...) now, rather than at its first forward."""
    for pname, p in module.named_parameters(recurse=False):
        if p.dtype not in _DTYPES:
            raise ValueError(f"detgemm_cute.nn.convert: {name or 'model'}.{pname} is {p.dtype}; "
                             f"detgemm Linears take bf16, fp16 or fp32 parameters (convert the "
                             f"model with .to(dtype) first, or leave this layer out with "
                             f"filter=)")


def _accum_params(model: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    for m in model.modules():
        if isinstance(m, Linear) and m.fp32_grad_accum:
            for p in m._grad_params():
                _refuse_sharded(p)
                yield p


def _refuse_sharded(p: torch.nn.Parameter) -> None:
    """FSDP2 (fully_shard) keeps DTensor shards as the module's parameters between forward
    and backward and reduce-scatters ``.grad``; main_grad lives on its unsharded copies, so
    the sharded parameters would never see it."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is not None and isinstance(p, mod.DTensor):
        raise RuntimeError(
            "detgemm_cute.nn: fp32_grad_accum=True does not work with DTensor parameters "
            "(fully_shard / FSDP2 reduce-scatters .grad, which this mode leaves empty); use "
            "fp32_grad_accum=False with fully_shard, e.g. "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")


def _deferral_owners(model: torch.nn.Module) -> list:
    """The data-parallel engines that defer dW work for Linears of `model`, each once."""
    owners = {}
    for m in model.modules():
        d = m.dw_deferral if isinstance(m, Linear) else None
        if d is not None:
            owners.setdefault(id(d.owner), d.owner)
    return list(owners.values())


def finalize_grads(model: torch.nn.Module) -> None:
    """Set ``p.grad = p.main_grad.to(p.dtype)`` (the one rounding) for every parameter that
    accumulates in fp32; parameters whose buffer was never written are left unchanged.
    Deferred dW work of a data-parallel wrapper (`detgemm_cute.distributed`) runs first,
    and writes the ``.grad`` of the parameters it handles itself. A model with no Linear
    converted with ``fp32_grad_accum=True`` (and no such wrapper) raises RuntimeError: its
    gradients are already in ``.grad`` and there is nothing to finalize."""
    owners = _deferral_owners(model)
    handled = set()
    for owner in owners:
        handled |= owner.finalize()
    params = list(_accum_params(model))
    if not params and not owners:
        raise RuntimeError(
            "detgemm_cute.nn.finalize_grads: no detgemm Linear of this model accumulates in "
            "fp32 (convert it with detgemm_cute.nn.convert(model, fp32_grad_accum=True)); "
            "without fp32_grad_accum, backward already wrote .grad and there is nothing to "
            "finalize")
    for p in params:
        if id(p) in handled:
            continue
        buf = getattr(p, "main_grad", None)
        if buf is not None:
            p.grad = buf.to(p.dtype)


def zero_main_grads(model: torch.nn.Module) -> None:
    """Zero every fp32 accumulation buffer (call it with ``optimizer.zero_grad()``)."""
    for owner in _deferral_owners(model):
        owner.before_zero()
    for p in _accum_params(model):
        buf = getattr(p, "main_grad", None)
        if buf is not None:
            buf.zero_()


__all__ = ["Linear", "convert", "finalize_grads", "zero_main_grads"]
