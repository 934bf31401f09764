"""Batched and grouped GEMMs: the `torch.library` ops detgemm::bmm and detgemm::grouped_mm
with fakes and autograd, and the public `bmm`, `baddbmm`, `grouped_mm`.

`bmm` is one launch for the whole batch (see `batched`); every entry is the chain `dg.mm`
computes for it alone. `grouped_mm` follows ``torch._grouped_mm``'s forms:

- 2-D x 3-D with ``offs`` (mixture-of-experts): a [T, K] rows sorted by group, b [G, K, N],
  offs [G] int32 cumulative row ends -> [T, N]; rows of group g use b[g]. Each row is the
  chain of that row alone, so a token's output does not depend on how many tokens its group
  received. Rows past offs[-1] are zero.
- 2-D x 2-D with ``offs`` (the weight-gradient form): a [M, T], b [T, N], offs along T
  -> [G, M, N], out[g] = a[:, group g] @ b[group g, :], each a chain over its group alone.
- 3-D x 3-D without offs: `bmm`.

The 2-D x 3-D form with bf16/fp16 inputs on SM90 is one launch of the grouped kernel (see
`grouped`), and the 2-D x 2-D form one launch of the grouped-K kernel (see `grouped_k`);
both read ``offs`` on the device only: no sync, and a CUDA graph captures the call. The
kernels check offs themselves (a device-side assert: a bad entry traps, so the launch fails;
with ``DETGEMM_CUTE_REPORT_OFFS=1`` the kernels print the entry first).
Other grouped calls (SM80, fp32 inputs, more groups than the grouped kernel's table holds)
read ``offs`` on the host (one device sync per call; not capturable in a CUDA
graph) and launch one GEMM per non-empty group, spread over a few side streams so
consecutive groups overlap (disjoint outputs: each row's bits are its group's GEMM alone).
Measured on an H100 (probes summarised in bench/results/README.md): four side streams
against one took the 8-expert layer from 727/820 us to 562/575 us at 256 tokens and 831 to
726 us at 1024 (down); gathering small groups into one padded bmm launch was not faster past
64 rows per expert and was not kept. Their backward (2-D x 3-D form): dA is the 2-D x 3-D
form against b^T, dB the 2-D x 2-D form.

fp32 inputs run the fp32 tier per group (`split`): the 2-D x 3-D form at the current
precision ("tf32": each expert weight not stored K-major is staged per call), the 2-D x 2-D
form -- dW's GEMM -- at full precision always. The backward runs at the forward's precision.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from . import batched, grouped, grouped_k, split
from .errors import GEMM_DTYPES, check_bmm_args, check_operand_dtypes, check_out_and_bias
from .gemm import gemm

_NAMES = ("a", "b", "bias")


# ------------------------------------------------------------------------------- bmm
@torch.library.custom_op("detgemm::bmm", mutates_args=())
def bmm_op(a: Tensor, b: Tensor, bias: Optional[Tensor] = None,
           out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """a [L, M, K] @ b [L, K, N] (+ bias [N]) -> [L, M, N], one launch."""
    check_bmm_args(a, b, bias, out_dtype, "detgemm::bmm", _NAMES)
    return batched.bmm(a, b, bias, out_dtype)


@bmm_op.register_fake
def _bmm_fake(a, b, bias=None, out_dtype=None):
    check_bmm_args(a, b, bias, out_dtype, "detgemm::bmm", _NAMES, check_device=False)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=out_dtype or a.dtype)


def _setup_bmm(ctx, inputs, output):
    a, b, bias, _ = inputs
    ctx.in_dtype = a.dtype
    ctx.fp32_precision = split.forward_precision(a.dtype)  # backward runs at it too
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None,
                          b if ctx.needs_input_grad[0] else None)


def _backward_bmm(ctx, grad):
    a, b = ctx.saved_tensors
    g = grad if grad.dtype == ctx.in_dtype else grad.to(ctx.in_dtype)
    ga = gb = gbias = None
    with split.at_precision(ctx.fp32_precision):
        if ctx.needs_input_grad[0]:
            ga = torch.ops.detgemm.bmm(g, b.transpose(1, 2), None, ctx.in_dtype)
        if ctx.needs_input_grad[1]:
            gb = torch.ops.detgemm.bmm(a.transpose(1, 2), g, None, ctx.in_dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        gbias = torch.ops.detgemm.bias_grad(g).to(ctx.bias_dtype)
    return ga, gb, gbias, None


bmm_op.register_autograd(_backward_bmm, setup_context=_setup_bmm)


def _direct(ts) -> bool:
    """Plain tensors, no grad needed, not tracing: call the implementation directly."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in ts:
        if t is None:
            continue
        if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
            if isinstance(t, Tensor):
                return False  # a subclass (fake tensor, DTensor, ...): through the op
            continue  # not a tensor: the direct path's checks name it
        if grad and t.requires_grad:
            return False
    return True


def bmm(a: Tensor, b: Tensor, *, bias: Tensor | None = None,
        out_dtype: torch.dtype | None = None, precision: str | None = None) -> Tensor:
    """``a [L, M, K] @ b [L, K, N]`` (+ ``bias [N]``, added in fp32 before the one rounding)
    -> ``[L, M, N]`` in ``out_dtype`` (default: a's dtype). One launch for all entries;
    each entry's bits equal ``mm(a[l], b[l])``. Any batch stride, including 0 (broadcast).
    `precision` ("ieee" | "tf32", fp32 inputs): this call's fp32 precision."""
    if precision is not None:
        with split.call_precision(precision, a, "detgemm_cute.bmm"):
            return bmm(a, b, bias=bias, out_dtype=out_dtype)
    if _direct((a, b, bias)) and not (isinstance(a, Tensor) and a.is_meta):
        return batched.checked_bmm(a, b, bias, out_dtype, "detgemm_cute.bmm", _NAMES)
    return torch.ops.detgemm.bmm(a, b, bias, out_dtype)


def bias_row(t: Tensor, n: int) -> Tensor | None:
    """`t` as a length-N bias when it broadcasts one row over [L, M, N] (else None)."""
    if t.dim() == 1 and t.shape[0] == n:
        return t
    if t.dim() in (2, 3) and t.shape[-1] == n and all(
            s == 1 or st == 0 for s, st in zip(t.shape[:-1], t.stride()[:-1])):
        return t[(0,) * (t.dim() - 1)]
    return None


def broadcasts_to(t: Tensor, shape) -> bool:
    """t broadcasts to `shape` without changing it (torch's rule for baddbmm's input)."""
    if t.dim() > len(shape):
        return False
    return all(s == 1 or s == o for s, o in zip(reversed(t.shape), reversed(shape)))


def check_addend(input: Tensor, shape, device, op) -> None:
    if not broadcasts_to(input, shape):
        raise ValueError(f"{op}: input of shape {tuple(input.shape)} does not broadcast to the "
                         f"product's shape {tuple(shape)}")
    if input.device != device:
        raise ValueError(f"{op}: input is on {input.device} but the product is on {device}")


def scaled_sum(y32: Tensor, input: Tensor, beta, alpha, dtype) -> Tensor:
    """alpha * y + beta * input in fp32 (beta == 0 ignores input, as PyTorch does), one
    rounding to dtype."""
    r = y32 if alpha == 1 else y32 * alpha
    if beta != 0:
        r = r + (input.float() if beta == 1 else input.float() * beta)
    return batched._cpu_nans(r.to(dtype))


def baddbmm(input: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1,
            out_dtype: torch.dtype | None = None) -> Tensor:
    """``beta * input + alpha * (a @ b)`` per entry, like ``torch.baddbmm``. With beta = alpha
    = 1 and an input that is one broadcast row of N values, it is the bias of `bmm` (added in
    fp32 before the one rounding); otherwise the fp32 product is scaled and summed in fp32
    and rounded once."""
    op = "detgemm_cute.baddbmm"
    if not isinstance(input, Tensor):
        raise TypeError(f"{op}: input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in GEMM_DTYPES:  # added in fp32: a float of detgemm's dtypes
        raise TypeError(f"{op}: input must be torch.bfloat16, torch.float16 or torch.float32, "
                        f"got {input.dtype}")
    for name, value in (("beta", beta), ("alpha", alpha)):
        if not isinstance(value, numbers.Real):
            raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__}")
    check_bmm_args(a, b, None, out_dtype, op, _NAMES, check_device=False)
    check_addend(input, (a.shape[0], a.shape[1], b.shape[2]), a.device, op)
    dtype = out_dtype or a.dtype
    if beta == 1 and alpha == 1:
        row = bias_row(input, b.shape[2])
        if row is not None and row.dtype == a.dtype:
            return bmm(a, b, bias=row, out_dtype=out_dtype)
    y32 = bmm(a, b, out_dtype=torch.float32)
    return scaled_sum(y32, input, beta, alpha, dtype)


# ------------------------------------------------------------------------ grouped_mm
def _group_ends(offs: Tensor, total: int, op: str) -> list[int]:
    """offs on the host (checked by `check_grouped_args`), non-decreasing and <= total."""
    if offs.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{op}: this grouped call runs one GEMM per group, which reads "
                           f"offs on the host and cannot be captured in a CUDA graph (the "
                           f"2-D x 3-D form in one launch can: bf16/fp16 on SM90)")
    ends = offs.tolist()
    prev = 0
    for g, e in enumerate(ends):
        if e < prev or e > total:
            raise ValueError(f"{op}: offs must be non-decreasing and <= {total}; offs[{g}]={e} "
                             f"after {prev}")
        prev = e
    return ends


def check_grouped_args(a, b, offs, out_dtype, op):
    check_operand_dtypes(a, b, "a", "b", op, GEMM_DTYPES)
    check_out_and_bias(out_dtype, None, 0, a.dtype, "a", "bias", op)
    if b.device != a.device:
        raise ValueError(f"{op}: b is on {b.device} but a is on {a.device}")
    forms = {(2, 3): "2-D x 3-D", (2, 2): "2-D x 2-D", (3, 3): "3-D x 3-D"}
    form = forms.get((a.dim(), b.dim()))
    if form is None:
        raise ValueError(f"{op}: takes a [T, K] with b [G, K, N] (offs), a [M, T] with "
                         f"b [T, N] (offs) or a [L, M, K] with b [L, K, N]; got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    k_a, k_b = a.shape[-1], b.shape[-2]
    if k_a != k_b:
        raise ValueError(f"{op}: inner dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if (form == "3-D x 3-D") != (offs is None):
        raise ValueError(f"{op}: offs is {'' if offs is None else 'not '}expected for the "
                         f"{form} form")
    if form == "3-D x 3-D":
        check_bmm_args(a, b, None, out_dtype, op, _NAMES, check_device=False)
        return form
    if not isinstance(offs, Tensor) or offs.dim() != 1 or offs.dtype != torch.int32:
        got = (f"a {offs.dim()}-D {offs.dtype} tensor" if isinstance(offs, Tensor)
               else type(offs).__name__)
        raise TypeError(f"{op}: offs must be a 1-D torch.int32 tensor of cumulative group ends "
                        f"(as torch._grouped_mm takes them), got {got}"
                        + ("; use offs.to(torch.int32)" if isinstance(offs, Tensor)
                           and offs.dim() == 1 and not offs.dtype.is_floating_point else ""))
    if form == "2-D x 3-D" and offs.shape[0] != b.shape[0]:
        raise ValueError(f"{op}: offs has {offs.shape[0]} entries but b has {b.shape[0]} groups")
    if offs.device != a.device:
        raise ValueError(f"{op}: offs is on {offs.device} but a is on {a.device}")
    return form


def _table_for(w: Tensor) -> str:
    """Expert weights [G, K, N] stored row-major (N contiguous) are the layout the dx table
    was tuned for; column-major ones ([G, N, K] storage, K contiguous) the fwd table's."""
    return "dx" if w.stride(-1) == 1 else "fwd"


def _grouped_impl(a, b, offs, out_dtype, op):
    if offs is not None:  # a warm one-launch call: its key passed the checks before
        y = (grouped_k.planned if getattr(b, "ndim", 0) == 2 else grouped.planned)(
            a, b, offs, out_dtype)
        if y is not None:
            return y
    form = check_grouped_args(a, b, offs, out_dtype, op)
    dt = out_dtype or a.dtype
    if form == "3-D x 3-D":
        return batched.bmm(a, b, None, out_dtype)
    empty = a.shape[-1] == 0 or b.shape[-1] == 0  # K or N = 0: zeros, nothing to launch
    launches = []
    if form == "2-D x 3-D":
        t, n = a.shape[0], b.shape[2]
        if a.is_cuda and not empty:
            y = grouped.grouped_mm(a, b, offs, dt)  # one launch; offs checked on the device
            if y is not None:
                return y
        ends = _group_ends(offs, t, op)
        out = torch.empty((t, n), dtype=dt, device=a.device)
        out[ends[-1] if ends else 0:].zero_()  # rows past the last group
        start, table = 0, _table_for(b)
        for g, end in enumerate(ends):
            if end > start and not empty:
                launches.append((a[start:end], b[g], table, out[start:end]))
            elif end > start:
                out[start:end].zero_()
            start = end
    else:
        m, t, n = a.shape[0], a.shape[1], b.shape[1]  # 2-D x 2-D: groups along T
        if a.is_cuda and m and n:
            y = grouped_k.grouped_mm_k(a, b, offs, dt)  # one launch; offs checked on the device
            if y is not None:
                return y
        ends = _group_ends(offs, t, op)
        out = torch.zeros((len(ends), m, n), dtype=dt, device=a.device)
        start = 0
        for g, end in enumerate(ends):
            if end > start and m and n:
                launches.append((a[:, start:end], b[start:end], "dw", out[g]))
            start = end
    _run_groups(launches, dt)
    return out


_GROUP_STREAMS = 4  # side streams the groups of one grouped call are spread over
_side_streams: dict = {}


def _run_groups(launches, out_dtype):
    """One GEMM per group, each into its own rows of the output. On CUDA the groups run on
    `_GROUP_STREAMS` side streams (round robin, after the caller's stream and before its
    next work), so the last, partial wave of one group's GEMM overlaps the next group's:
    groups write disjoint outputs and each GEMM's chain is its own, so no bit changes."""
    if len(launches) < 2 or launches[0][0].device.type != "cuda":
        for a, b, table, out in launches:
            gemm(a, b, "kn", None, out_dtype, op=table, out=out)
        return
    device = launches[0][0].device
    main = torch.cuda.current_stream(device)
    streams = _streams_for(device)[:len(launches)]
    for s in streams:
        s.wait_stream(main)
    for i, (a, b, table, out) in enumerate(launches):
        with torch.cuda.stream(streams[i % len(streams)]):
            gemm(a, b, "kn", None, out_dtype, op=table, out=out)
    for s in streams:
        main.wait_stream(s)


def _streams_for(device: torch.device) -> list:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    streams = _side_streams.get(idx)
    if streams is None:
        streams = _side_streams[idx] = [torch.cuda.Stream(device=idx)
                                        for _ in range(_GROUP_STREAMS)]
    return streams


@torch.library.custom_op("detgemm::grouped_mm", mutates_args=())
def grouped_mm_op(a: Tensor, b: Tensor, offs: Optional[Tensor] = None,
                  out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Grouped GEMM in ``torch._grouped_mm``'s forms (see the module docstring)."""
    return _grouped_impl(a, b, offs, out_dtype, "detgemm::grouped_mm")


@grouped_mm_op.register_fake
def _grouped_fake(a, b, offs=None, out_dtype=None):
    form = check_grouped_args(a, b, offs, out_dtype, "detgemm::grouped_mm")
    dt = out_dtype or a.dtype
    if form == "2-D x 3-D":
        return a.new_empty((a.shape[0], b.shape[2]), dtype=dt)
    if form == "2-D x 2-D":
        return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=dt)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=dt)


def _setup_grouped(ctx, inputs, output):
    a, b, offs, _ = inputs
    ctx.form = (a.dim(), b.dim())
    ctx.in_dtype = a.dtype
    ctx.fp32_precision = split.forward_precision(a.dtype)  # backward runs at it too
    ctx.save_for_backward(a, b, offs)


def _backward_grouped(ctx, grad):
    a, b, offs = ctx.saved_tensors
    g = grad if grad.dtype == ctx.in_dtype else grad.to(ctx.in_dtype)
    op = torch.ops.detgemm.grouped_mm
    if ctx.form not in ((3, 3), (2, 3)):
        raise RuntimeError("detgemm::grouped_mm: backward is implemented for the 2-D x 3-D "
                           "(mixture-of-experts) and 3-D x 3-D forms")
    a_t = a.transpose(-1, -2)
    offs = None if ctx.form == (3, 3) else offs
    with split.at_precision(ctx.fp32_precision):
        ga = op(g, b.transpose(-1, -2), offs, ctx.in_dtype) if ctx.needs_input_grad[0] else None
        gb = op(a_t, g, offs, ctx.in_dtype) if ctx.needs_input_grad[1] else None
    return ga, gb, None, None


grouped_mm_op.register_autograd(_backward_grouped, setup_context=_setup_grouped)


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor | None = None, *,
               out_dtype: torch.dtype | None = None, precision: str | None = None) -> Tensor:
    """Grouped GEMM in ``torch._grouped_mm``'s forms; each row (2-D x 3-D) or group (2-D x
    2-D) is the chain of that row or group alone. See the module docstring.
    `precision` ("ieee" | "tf32", fp32 inputs): this call's fp32 precision (the 2-D x 2-D
    weight-gradient form runs full precision at either, as dW does)."""
    if precision is not None:
        with split.call_precision(precision, a, "detgemm_cute.grouped_mm"):
            return grouped_mm(a, b, offs, out_dtype=out_dtype)
    if _direct((a, b, offs)) and not (isinstance(a, Tensor) and a.is_meta):
        return _grouped_impl(a, b, offs, out_dtype, "detgemm_cute.grouped_mm")
    return torch.ops.detgemm.grouped_mm(a, b, offs, out_dtype)


__all__ = ["bmm", "baddbmm", "grouped_mm", "bmm_op", "grouped_mm_op"]
