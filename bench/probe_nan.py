"""What detgemm writes for NaN results on this GPU, measured against the reference.

Inputs carry NaNs of four bit patterns (quiet, negative, with a payload, signalling) in
separate rows of X and separate rows of W, NaNs in the bias and the dW buffer, and Inf - Inf
and Inf * 0 products. Every path that computes an output runs: the 16-bit kernels (bf16 and
fp16 in; bf16, fp16 and fp32 out; with bias), fp32 at "ieee" (the split tier, whose unscale,
bias and output rounding are PyTorch kernels) and at "tf32", dX, dW continuing a buffer, the
bias gradient, bmm with a bias and its K = 0 path, baddbmm with alpha/beta, grouped_mm
(one launch and one GEMM per group), on each kernel family the GPU runs. Per path and input
kind it records the distinct NaN bit patterns the GPU wrote, and checks NaN positions and
every other bit against the CPU path of the same call (the reference).

    python bench/probe_nan.py [--family sm90|sm80|all] [--out DIR]

Prints a table and a verdict: whether every NaN the GPU computed is the canonical NaN of
its dtype (fp32 0x7FFFFFFF, bf16/fp16 0x7FFF): what `reference.ChainModel(nan_bits=
"canonical")` models. Writes nan_probe.json to DIR (default: $OUT when set). On a CPU-only
machine, `--device cpu` runs the same table on the CPU path (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

import torch

import detgemm_cute as dg

BF, FP, F32 = torch.bfloat16, torch.float16, torch.float32
_INT = {F32: torch.int32, BF: torch.int16, FP: torch.int16}
_CANONICAL = {F32: 0x7FFFFFFF, BF: 0x7FFF, FP: 0x7FFF}
# The four NaN inputs: quiet, negative quiet, quiet with a payload, signalling.
_NANS = {F32: (0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001),
         BF: (0x7FC0, 0xFFC0, 0x7FC1, 0x7F81), FP: (0x7E00, 0xFE00, 0x7E01, 0x7C01)}
M, K, N = 24, 64, 24  # rows 0-3: X NaNs; row 4: Inf - Inf; row 5: Inf * 0; cols 8-11: W NaNs


def _nan(dtype, i):
    bits = _NANS[dtype][i]
    width = 32 if dtype == F32 else 16
    signed = bits - (1 << width) if bits >= 1 << (width - 1) else bits
    return torch.tensor(signed, dtype=_INT[dtype]).view(dtype)


def _bits(t):
    width = 8 * t.element_size()
    return t.contiguous().view(_INT[t.dtype]).to(torch.int64) & ((1 << width) - 1)


def problem(dtype, seed=0):
    """X [M, K], W [N, K], bias [N] with the NaN / Inf layout above (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(M, K, generator=g) + 0.5).to(dtype)
    w = (torch.rand(N, K, generator=g) + 0.5).to(dtype)
    for i in range(4):
        x[i, 3] = _nan(dtype, i)  # a NaN of pattern i in row i of X
        w[8 + i, 5] = _nan(dtype, i)  # ... in row 8 + i of W (output column 8 + i)
    x[4, 7], x[4, 9] = math.inf, -math.inf  # Inf - Inf on every column
    x[5, 11] = math.inf
    w[2, 11] = 0.0  # Inf * 0 at output (5, 2); Inf elsewhere in row 5
    bias = (torch.rand(N, generator=g) + 0.5).to(dtype)
    bias[14] = _nan(dtype, 2)
    return x, w, bias


# Which output positions of the [M, N] forward each input kind makes NaN: (rows, cols),
# None for all.
KINDS = {**{f"x nan {i}": ((i,), None) for i in range(4)},
         **{f"w nan {i}": (None, (8 + i,)) for i in range(4)},
         "inf - inf": ((4,), None), "inf * 0": ((5,), (2,)), "bias nan": (None, (14,))}
NO_BIAS = {k: v for k, v in KINDS.items() if k != "bias nan"}
# dW [N, M] = (W^T as dY [K, N])^T (X^T as [K, M]): W's NaN rows are dW rows, X's columns.
DW_KINDS = {**{f"x nan {i}": (None, (i,)) for i in range(4)},
            **{f"w nan {i}": ((8 + i,), None) for i in range(4)},
            "inf - inf": (None, (4,)), "acc nan": ((1,), (1,))}


def _paths(dtype):
    """{name: (fn(device) -> output, {input kind: (rows, cols)})} for one input dtype."""
    x, w, bias = problem(dtype)
    dt = {"bf16": BF, "fp16": FP, "fp32": F32}
    paths = {}
    for od in [None] + [dt[o] for o in ("bf16", "fp16", "fp32") if dt[o] != dtype]:
        label = "same" if od is None else str(od).replace("torch.", "")
        paths[f"linear bias out={label}"] = (
            lambda d, od=od: dg.linear(x.to(d), w.to(d), bias.to(d), out_dtype=od), KINDS)
    wt = w.t().contiguous()
    paths["mm"] = (lambda d: dg.mm(x.to(d), wt.to(d)), NO_BIAS)
    paths["input_grad"] = (lambda d: dg.input_grad(x.to(d), wt.to(d)), NO_BIAS)
    acc = torch.rand(N, M, generator=torch.Generator().manual_seed(1)) + 0.5
    acc[1, 1] = _nan(F32, 2)
    paths["weight_grad acc"] = (lambda d: dg.weight_grad(wt.to(d), x.t().contiguous().to(d),
                                                         acc=acc.to(d)), DW_KINDS)
    acc_b = torch.ones(K)
    acc_b[1] = _nan(F32, 1)
    paths["bias_grad acc"] = (lambda d: dg.bias_grad(x.to(d), acc=acc_b.to(d)), {})
    a3, b3 = x.view(2, M // 2, K), wt.view(1, K, N).expand(2, K, N)
    paths["bmm bias"] = (lambda d: dg.bmm(a3.to(d), b3.to(d), bias=bias.to(d)).view(M, N),
                         KINDS)
    paths["bmm K=0 bias"] = (
        lambda d: dg.bmm(a3[:, :, :0].to(d), b3[:, :0].to(d), bias=bias.to(d)).view(M, N),
        {"bias nan": KINDS["bias nan"]})
    paths["baddbmm beta=.5 alpha=2"] = (
        lambda d: dg.baddbmm(bias.view(1, 1, N).to(d), a3.to(d), b3.to(d), beta=0.5,
                             alpha=2.0).view(M, N), KINDS)
    offs = torch.tensor([5, 5, 17, M], dtype=torch.int32)  # groups of 5, 0, 12, 7 rows
    wg = wt.unsqueeze(0).expand(4, K, N).contiguous()
    paths["grouped_mm"] = (lambda d: dg.grouped_mm(x.to(d), wg.to(d), offs.to(d)), NO_BIAS)
    return paths


def _mask(shape, rows, cols):
    r = torch.ones(shape[0], dtype=torch.bool) if rows is None else torch.zeros(
        shape[0], dtype=torch.bool).index_fill_(0, torch.tensor(rows), True)
    c = torch.ones(shape[1], dtype=torch.bool) if cols is None else torch.zeros(
        shape[1], dtype=torch.bool).index_fill_(0, torch.tensor(cols), True)
    return r[:, None] & c[None, :]


def _hex(values, dtype):
    return [f"0x{v:0{2 * dtype.itemsize}x}" for v in values]


def probe(device, dtype, precision):
    """Rows {path, dtype, out, precision, nan_positions_equal, other_bits_equal,
    nan_outputs, patterns {input kind: GPU NaN bits}, all_patterns, canonical}."""
    rows = []
    with dg.fp32_precision(precision):
        for name, (fn, kinds) in _paths(dtype).items():
            if name.startswith(("weight_grad", "bias_grad")) and precision == "tf32":
                continue  # dW and db run "ieee" at either precision: probed once
            got, want = fn(device).cpu(), fn("cpu")
            nan_g, nan_w = torch.isnan(got), torch.isnan(want)
            same = ~nan_g & ~nan_w
            patterns = {kind: _hex(_bits(got)[_mask(got.shape, *rc) & nan_g].unique().tolist(),
                                   got.dtype) for kind, rc in kinds.items()}
            found = _bits(got)[nan_g].unique().tolist()
            rows.append({"path": name, "dtype": str(dtype).replace("torch.", ""),
                         "out": str(got.dtype).replace("torch.", ""), "precision": precision,
                         "nan_positions_equal": bool(torch.equal(nan_g, nan_w)),
                         "other_bits_equal": bool(torch.equal(_bits(got)[same],
                                                              _bits(want)[same])),
                         "nan_outputs": int(nan_g.sum()), "patterns": patterns,
                         "all_patterns": _hex(found, got.dtype),
                         "canonical": all(v == _CANONICAL[got.dtype] for v in found)})
    return rows


def run(device, families, out_dir=None, out=print) -> dict:
    setups = [(BF, "ieee"), (FP, "ieee"), (F32, "ieee"), (F32, "tf32")]
    rows = []
    for family in families:
        with dg.use_family(family) if family else contextlib.nullcontext():
            for dtype, precision in setups:
                for r in probe(device, dtype, precision):
                    r["family"] = family or "-"
                    rows.append(r)
    out(f"{'family':6s} {'in':5s} {'prec':5s} {'path':24s} {'out':9s} {'NaNs':>5s} "
        f"{'pos':4s} {'rest':4s} NaN bits written (all; by input kind)")
    for r in rows:
        kinds = "; ".join([",".join(r["all_patterns"]) or "-"] + [
            f"{k}: {','.join(v)}" for k, v in r["patterns"].items() if v])
        pos = "ok" if r["nan_positions_equal"] else "DIFF"
        rest = "ok" if r["other_bits_equal"] else "DIFF"
        out(f"{r['family']:6s} {r['dtype']:5s} {r['precision']:5s} {r['path']:24s} "
            f"{r['out']:9s} {r['nan_outputs']:5d} {pos:4s} {rest:4s} {kinds}")
    canonical = all(r["canonical"] for r in rows)
    positions = all(r["nan_positions_equal"] and r["other_bits_equal"] for r in rows)
    verdict = ("canonical: every NaN written is the canonical NaN of its dtype (fp32 "
               "0x7FFFFFFF, bf16/fp16 0x7FFF) whatever the inputs' payloads and signs; "
               "reference.ChainModel(nan_bits='canonical') models it"
               if canonical else "not canonical: see the rows whose patterns differ")
    out(f"\nVERDICT ({device}): {verdict}; NaN positions and all other bits "
        f"{'equal the reference' if positions else 'DIFFER from the reference'} "
        f"({len(rows)} paths)")
    result = {"device": torch.cuda.get_device_name() if device != "cpu" else "cpu",
              "torch": torch.__version__, "canonical": canonical,
              "positions_and_bits_equal": positions, "rows": rows}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "nan_probe.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="all", help="sm90, sm80 or all (default: every "
                    "family this GPU runs)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        families = [None]
    elif not torch.cuda.is_available():
        print("probe_nan: needs a CUDA GPU (or --device cpu)")
        return 1
    elif args.family == "all":
        families = ["sm90", "sm80"] if torch.cuda.get_device_capability() >= (9, 0) \
            else ["sm80"]
    else:
        families = [args.family]
    result = run(args.device, families, args.out)
    return 0 if result["positions_and_bits_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
