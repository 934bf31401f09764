"""Random GEMM problems for the differential fuzzer (`fuzz`).

A `Case` names one problem completely -- op, dtype, fp32 precision, dims, each operand's
storage layout, bias / accumulation buffer / output dtype, special values, and a seed for
the values -- so ``eval(repr(case))`` rebuilds it on any machine and `evaluate` runs it on
any device. Values are drawn on the CPU from the seed and copied, so a GPU run and a CPU run
of one case see the same numbers.

Layouts (per operand, the same values stored differently): ``contig``; ``t`` (the last two
dims stored transposed); ``offset`` (an odd storage offset: a misaligned base); ``wider``
(a window of a buffer one element in and three wider); ``bcast`` (equal entries along the
first dim, stored once with stride 0: a batch of equal matrices, or equal rows). Special values: ``wide`` (exponents spread over the dtype's range),
``nan`` (NaNs of several payloads and signs), ``inf``, ``huge`` (near the largest finite
value: sums overflow), ``tiny`` (the smallest normal), ``subnormal``, ``zero`` (+-0),
``mixed`` (all of them).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from . import batched_ops, functional, split

OPS = ("mm", "addmm", "linear", "input_grad", "weight_grad", "bias_grad", "bmm", "baddbmm",
       "grouped_mm")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("contig", "t", "offset", "wider")
SPECIALS = ("none", "wide", "nan", "inf", "huge", "tiny", "subnormal", "zero", "mixed")
_SPECIAL_WEIGHTS = (40, 20, 8, 6, 6, 4, 6, 4, 6)
_EDGES = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257)
# A dim drawn as a multiple of 32 this often: the widths of real layers, which reach the
# aligned paths (the fp32 tier's fused kernels need K a multiple of 32, dX's in-place read
# N a multiple of 4) that log-uniform sizes rarely draw.
_ALIGNED_P = 0.2
# NaN bit patterns put into inputs: quiet, negative, with payload, signalling.
_NAN_BITS = {torch.float32: (0x7FC00000, -0x00400000, 0x7FC12345, 0x7F800001),
             torch.bfloat16: (0x7FC0, -0x0040, 0x7FC1, 0x7F81),
             torch.float16: (0x7E00, -0x0200, 0x7E01, 0x7C01)}
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass(frozen=True)
class Case:
    """One problem. `dims`: (name, size) pairs (group sizes of grouped_mm as g0, g1, ...);
    `layouts`: (operand, layout) pairs; `extra`: op options as (name, value) pairs."""

    op: str
    dtype: str
    dims: tuple
    layouts: tuple = ()
    out_dtype: str | None = None
    bias: bool = False
    acc: bool = False
    precision: str = "ieee"
    specials: str = "none"
    extra: tuple = ()
    seed: int = 0

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    def option(self, name: str, default=None):
        return dict(self.extra).get(name, default)

    def layout(self, operand: str) -> str:
        return dict(self.layouts).get(operand, "contig")

    def with_dims(self, dims) -> "Case":
        return Case(self.op, self.dtype, tuple(dims), self.layouts, self.out_dtype, self.bias,
                    self.acc, self.precision, self.specials, self.extra, self.seed)

    def macs(self) -> int:
        """Multiply-adds of the problem (what the CPU reference's time grows with)."""
        return _macs(self.dims)


def _macs(dims) -> int:
    d = dict(dims)
    if "tail" in d:  # grouped_mm's 2x3 (T x K x N) and 2x2 (M x T x N) forms
        rows = sum(v for k, v in d.items() if k.startswith("g") or k == "tail")
        return rows * d["N"] * d.get("K", 1) * d.get("M", 1)
    return math.prod(v for k, v in d.items() if k in ("L", "M", "N", "K", "T", "B", "S"))


# ---------------------------------------------------------------------------------------
# Drawing cases

def draw(rng: random.Random, ops=OPS, max_macs: int = 1 << 22, max_dim: int = 4096) -> Case:
    """A random case among `ops`, its problem at most `max_macs` multiply-adds."""
    op = rng.choice(ops)
    dtype = rng.choice(("bf16", "bf16", "fp16", "fp32", "fp32"))
    precision = rng.choice(("ieee", "tf32")) if dtype == "fp32" else "ieee"
    specials = rng.choices(SPECIALS, _SPECIAL_WEIGHTS)[0]
    fields = _OP_DRAW[op](rng, max_dim)
    dims = _capped(fields.pop("dims"), max_macs)
    named = dict(fields.get("layouts", ()))
    side = [n for n, on in (("bias", fields.get("bias")), ("acc", fields.get("acc")),
                            ("input", op == "baddbmm")) if on and n not in named]
    fields["layouts"] = tuple(named.items()) + _layouts(rng, side)
    return Case(op=op, dtype=dtype, dims=dims, precision=precision, specials=specials,
                seed=rng.getrandbits(31), **fields)


def _dim(rng, hi, zero=False) -> int:
    r = rng.random()
    if zero and r < 0.04:
        return 0
    if r < 0.35:
        return min(hi, rng.choice(_EDGES))
    if r < 0.35 + _ALIGNED_P and hi >= 32:
        return 32 * max(1, int(2 ** rng.uniform(0, math.log2(hi // 32 + 1))))
    return max(1, min(hi, int(2 ** rng.uniform(0, math.log2(hi)))))


def _capped(dims, max_macs):
    """Halve the largest problem dim (not a group size) until the problem fits `max_macs`."""
    dims = list(dims)
    free = [i for i, (k, _) in enumerate(dims) if not k.startswith("g") and k != "tail"]
    while _macs(dims) > max_macs and any(dims[i][1] > 1 for i in free):
        i = max(free, key=lambda j: dims[j][1])
        dims[i] = (dims[i][0], dims[i][1] // 2)
    return tuple(dims)


def _layouts(rng, names):
    """A layout per operand (an accumulation buffer may not share memory: no bcast)."""
    out = []
    for name in names:
        choices = LAYOUTS + (() if name == "acc" else ("bcast",))
        out.append((name, rng.choice(choices) if rng.random() < 0.6 else "contig"))
    return tuple(out)


def _out_dtype(rng, allowed=("bf16", "fp16", "fp32")):
    return rng.choice(allowed) if rng.random() < 0.5 else None


def _draw_mm(rng, hi, bias=False):
    return {"dims": (("M", _dim(rng, hi, True)), ("K", _dim(rng, hi)), ("N", _dim(rng, hi))),
            "layouts": _layouts(rng, ("a", "b")), "out_dtype": _out_dtype(rng), "bias": bias}


def _draw_linear(rng, hi):
    if rng.random() < 0.25:  # x [B, S, K]
        lead = (("B", _dim(rng, 8)), ("S", _dim(rng, hi, True)))
    else:
        lead = (("M", _dim(rng, hi, True)),)
    return {"dims": (*lead, ("K", _dim(rng, hi)), ("N", _dim(rng, hi))),
            "layouts": _layouts(rng, ("x", "w")), "out_dtype": _out_dtype(rng),
            "bias": rng.random() < 0.5}


def _draw_input_grad(rng, hi):
    return {"dims": (("M", _dim(rng, hi, True)), ("N", _dim(rng, hi)), ("K", _dim(rng, hi))),
            "layouts": _layouts(rng, ("dy", "w")), "out_dtype": _out_dtype(rng)}


def _draw_weight_grad(rng, hi):
    acc = rng.random() < 0.5
    return {"dims": (("T", _dim(rng, hi, True)), ("N", _dim(rng, hi)), ("K", _dim(rng, hi))),
            "layouts": _layouts(rng, ("dy", "x", "acc") if acc else ("dy", "x")), "acc": acc,
            "out_dtype": None if acc else _out_dtype(rng)}


def _draw_bias_grad(rng, hi):
    acc = rng.random() < 0.5
    return {"dims": (("T", _dim(rng, hi, True)), ("N", _dim(rng, hi))),
            "layouts": _layouts(rng, ("dy",)), "acc": acc}


def _draw_bmm(rng, hi, addend=False):
    dims = (("L", _dim(rng, 64, True)), ("M", _dim(rng, hi, True)), ("K", _dim(rng, hi)),
            ("N", _dim(rng, hi)))
    fields = {"dims": dims, "layouts": _layouts(rng, ("a", "b")),
              "out_dtype": _out_dtype(rng)}
    if not addend:
        fields["bias"] = rng.random() < 0.3
        return fields
    beta, alpha = rng.choice(((1, 1), (1, 1), (0.5, 2.0), (0, 1), (1, 0.25)))
    fields["extra"] = (("addend", rng.choice(("full", "row", "row3", "mn"))), ("beta", beta),
                       ("alpha", alpha))
    return fields


def _draw_grouped(rng, hi):
    form = rng.choice(("2x3", "2x3", "2x3", "2x2", "3x3"))
    if form == "3x3":
        fields = _draw_bmm(rng, hi)
        fields.pop("bias")
        return {**fields, "extra": (("form", form),)}
    groups = [rng.choice((0, 0, 1, 2, 3)) if rng.random() < 0.4 else _dim(rng, 300)
              for _ in range(rng.randint(1, 9))]
    dims = tuple((f"g{i}", g) for i, g in enumerate(groups))
    dims += (("tail", rng.choice((0, 0, 0, 1, 5))),)
    if form == "2x3":  # x [T, K] sorted by group, w [G, K, N]
        dims += (("K", _dim(rng, hi)), ("N", _dim(rng, hi)))
        names = ("x", "w")
    else:  # a [M, T], b [T, N]: a group per token range
        dims += (("M", _dim(rng, hi)), ("N", _dim(rng, hi)))
        names = ("a", "b")
    return {"dims": dims, "layouts": _layouts(rng, names), "out_dtype": _out_dtype(rng),
            "extra": (("form", form),)}


_OP_DRAW = {
    "mm": _draw_mm, "addmm": lambda rng, hi: _draw_mm(rng, hi, bias=True),
    "linear": _draw_linear, "input_grad": _draw_input_grad, "weight_grad": _draw_weight_grad,
    "bias_grad": _draw_bias_grad, "bmm": _draw_bmm,
    "baddbmm": lambda rng, hi: _draw_bmm(rng, hi, addend=True), "grouped_mm": _draw_grouped,
}


# ---------------------------------------------------------------------------------------
# Building the inputs

def values(shape, dtype: torch.dtype, gen: torch.Generator, specials: str) -> torch.Tensor:
    """Random values of `shape` in `dtype` with `specials` mixed in (CPU, contiguous)."""
    x = torch.randn(shape, generator=gen)
    if specials == "wide" or (specials == "mixed" and x.numel()):
        spread = 20 if dtype != torch.float16 else 6
        x = x * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=gen).float())
    x = x.to(dtype)
    if specials in ("none", "wide") or x.numel() == 0:
        return x
    flat = x.view(-1)
    count = 1 + int(torch.randint(0, 1 + flat.numel() // 50, (1,), generator=gen))
    where = torch.randint(0, flat.numel(), (count,), generator=gen)
    kinds = (("nan", "inf", "huge", "tiny", "subnormal", "zero") if specials == "mixed"
             else (specials,))
    for i, pos in enumerate(where.tolist()):
        kind = kinds[i % len(kinds)]
        flat[pos] = _special(kind, dtype, int(torch.randint(0, 4, (1,), generator=gen)))
    return x


def _special(kind: str, dtype: torch.dtype, pick: int) -> torch.Tensor:
    sign = -1.0 if pick % 2 else 1.0
    info = torch.finfo(dtype)
    if kind == "nan":
        return torch.tensor(_NAN_BITS[dtype][pick], dtype=_INT[dtype]).view(dtype)
    value = {"inf": math.inf, "huge": info.max * (0.5 + 0.125 * pick), "tiny": info.tiny,
             "subnormal": info.tiny * 2.0 ** -(1 + 2 * pick), "zero": 0.0}[kind]
    return torch.tensor(sign * value, dtype=torch.float64).to(dtype)


def place(t: torch.Tensor, layout: str, device) -> torch.Tensor:
    """`t`'s values on `device` stored as `layout` says."""
    if layout == "contig" or t.numel() == 0:
        return t.to(device)
    if layout == "t" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().to(device).transpose(-1, -2)
    if layout == "offset":
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
        return buf[1:].view(t.shape).copy_(t)
    if layout == "wider":
        buf = torch.empty((*t.shape[:-1], t.shape[-1] + 3), dtype=t.dtype, device=device)
        return buf[..., 1:1 + t.shape[-1]].copy_(t)
    if layout == "bcast":  # entries along dim 0 equal (drawn so): one entry, stride 0
        return t[:1].to(device).expand(t.shape)
    return t.to(device)


def inputs(case: Case) -> dict:
    """The case's input tensors (CPU, contiguous values) by operand name, plus `offs`."""
    gen = torch.Generator().manual_seed(case.seed)
    dt = DTYPES[case.dtype]
    shapes = _shapes(case)

    def draw_values(name, shape):
        if case.layout(name) == "bcast":  # equal entries
            return values((1, *shape[1:]), dt, gen, case.specials).expand(shape).contiguous()
        return values(shape, dt, gen, case.specials)

    out = {name: draw_values(name, shape) for name, shape in shapes.items() if name != "acc"}
    if "acc" in shapes:
        out["acc"] = values(shapes["acc"], torch.float32, gen, case.specials)
    if case.op == "grouped_mm" and case.option("form") != "3x3":
        sizes = [v for k, v in case.dims if k.startswith("g")]
        out["offs"] = torch.tensor(list(_cumsum(sizes)), dtype=torch.int32)
    return out


def _cumsum(sizes):
    total = 0
    for s in sizes:
        total += s
        yield total


def _shapes(case: Case) -> dict:
    d = dict(case.dims)
    op = case.op
    if op in ("mm", "addmm"):
        shapes = {"a": (d["M"], d["K"]), "b": (d["K"], d["N"])}
    elif op == "linear":
        lead = (d["B"], d["S"]) if "B" in d else (d["M"],)
        shapes = {"x": (*lead, d["K"]), "w": (d["N"], d["K"])}
    elif op == "input_grad":
        shapes = {"dy": (d["M"], d["N"]), "w": (d["N"], d["K"])}
    elif op == "weight_grad":
        shapes = {"dy": (d["T"], d["N"]), "x": (d["T"], d["K"])}
        if case.acc:
            shapes["acc"] = (d["N"], d["K"])
    elif op == "bias_grad":
        shapes = {"dy": (d["T"], d["N"])}
        if case.acc:
            shapes["acc"] = (d["N"],)
    elif op in ("bmm", "baddbmm") or case.option("form") == "3x3":
        shapes = {"a": (d["L"], d["M"], d["K"]), "b": (d["L"], d["K"], d["N"])}
        if op == "baddbmm":
            addend = {"full": (d["L"], d["M"], d["N"]), "row": (d["N"],),
                      "row3": (1, 1, d["N"]), "mn": (d["M"], d["N"])}
            shapes["input"] = addend[case.option("addend")]
    else:  # grouped_mm, 2x3 / 2x2
        rows = sum(v for k, v in d.items() if k.startswith("g")) + d["tail"]
        groups = sum(1 for k in d if k.startswith("g"))
        if case.option("form") == "2x3":
            shapes = {"x": (rows, d["K"]), "w": (groups, d["K"], d["N"])}
        else:
            shapes = {"a": (d["M"], rows), "b": (rows, d["N"])}
    if case.bias:
        shapes["bias"] = (d["N"],)
    return shapes


# ---------------------------------------------------------------------------------------
# Running a case

def evaluate(case: Case, device, layouts: bool = True) -> torch.Tensor:
    """The case's result on `device` (a CPU tensor), its operands stored as the case says
    (`layouts`) or contiguous. Raises whatever the call raises."""
    raw = inputs(case)
    t = {name: place(v, case.layout(name) if layouts else "contig", device)
         for name, v in raw.items()}
    od = DTYPES.get(case.out_dtype)
    with split.fp32_precision(case.precision):
        y = _CALLS[case.op](t, od, case)
    return y.to("cpu")


def _call_grouped(t, od, case):
    if case.option("form") == "2x3":
        return batched_ops.grouped_mm(t["x"], t["w"], t["offs"], out_dtype=od)
    if case.option("form") == "2x2":
        return batched_ops.grouped_mm(t["a"], t["b"], t["offs"], out_dtype=od)
    return batched_ops.grouped_mm(t["a"], t["b"], out_dtype=od)


_F, _B = functional, batched_ops
_CALLS = {
    "mm": lambda t, od, c: _F.mm(t["a"], t["b"], out_dtype=od),
    "addmm": lambda t, od, c: _F.addmm(t["bias"], t["a"], t["b"], out_dtype=od),
    "linear": lambda t, od, c: _F.linear(t["x"], t["w"], t.get("bias"), out_dtype=od),
    "input_grad": lambda t, od, c: _F.input_grad(t["dy"], t["w"], out_dtype=od),
    "weight_grad": lambda t, od, c: _F.weight_grad(t["dy"], t["x"], acc=t.get("acc"),
                                                   out_dtype=od),
    "bias_grad": lambda t, od, c: _F.bias_grad(t["dy"], acc=t.get("acc")),
    "bmm": lambda t, od, c: _B.bmm(t["a"], t["b"], bias=t.get("bias"), out_dtype=od),
    "baddbmm": lambda t, od, c: _B.baddbmm(t["input"], t["a"], t["b"], beta=c.option("beta"),
                                           alpha=c.option("alpha"), out_dtype=od),
    "grouped_mm": _call_grouped,
}

__all__ = ["Case", "OPS", "DTYPES", "LAYOUTS", "SPECIALS", "draw", "values", "place",
           "inputs", "evaluate"]
