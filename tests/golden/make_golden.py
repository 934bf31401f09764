"""Record golden GPU bits: `python tests/golden/make_golden.py --out DIR` (on a GPU machine).

Runs a fixed list of seeded problems through `detgemm_cute.linear` on CUDA, through every
bucket it can force, and writes one JSON file (well under 1 MiB) with per-row SHA-256
hashes of the output bits, a few small outputs in full, and the GPU / torch / library
versions. Inputs are not stored: each problem is a recipe (seed, shape, dtype, exponent
spread, special values) that `make_inputs` turns into the same tensors on any machine with
torch's CPU generator; an input hash in the file catches a generator that changed.

tests/test_reference.py recomputes every problem with `detgemm_cute.reference` on CPU and
compares bit-for-bit, so the CPU model is pinned to what a GPU really returned.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys

import torch

FORMAT = 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL_HEX_MAX = 128  # problems with at most this many outputs are also stored in full


def P(name, seed, m, n, k, dtype="bf16", out="bf16", bias=False, tags=(), precision=None,
      **recipe):
    """One problem. Recipe keys (all optional), applied to x and weight:
    spread: exponents 2^randint(-spread, spread) per element; scale: 2^scale on all;
    zeros / neg_zeros / subnormals / specials: fractions of elements set to +0, -0, random
    subnormals, NaN/+Inf/-Inf; zero_rows: fraction of rows all +-0; cancel: fraction of
    K column pairs whose products cancel exactly. "x_" / "w_" prefixes set a key for one
    operand only; "bias_" keys (bias_scale, bias_neg_zeros, ...) apply to the bias.
    `precision` ("ieee" | "tf32", fp32 inputs only) is the fp32 precision it runs at."""
    rec = {"name": name, "seed": seed, "M": m, "N": n, "K": k, "dtype": dtype,
           "out_dtype": out, "bias": bias, "tags": list(tags), "recipe": dict(recipe)}
    if precision:
        rec["precision"] = precision
    return rec


PROBLEMS = [
    P("plain_bf16", 1, 64, 96, 256, bias=True),
    P("plain_fp16", 2, 64, 96, 256, "fp16", "fp16", bias=True),
    P("spread20_bf16_fp32out", 3, 48, 80, 1024, out="fp32", spread=20),
    P("spread20_bf16_bias", 4, 37, 72, 512, bias=True, spread=20, bias_scale=4),
    P("spread3_fp16", 5, 33, 72, 1000, "fp16", "fp16", bias=True, spread=3),
    P("spread8_fp16_fp32out", 6, 20, 40, 777, "fp16", "fp32", spread=8),
    P("zeros_bf16", 7, 40, 64, 320, spread=6, zeros=0.3, neg_zeros=0.1),
    P("zeros_fp16_fp32out", 8, 40, 64, 320, "fp16", "fp32", zeros=0.3, neg_zeros=0.2),
    P("zero_rows_bf16", 9, 8, 16, 48, bias=True, x_zero_rows=0.5, neg_zeros=0.2,
      bias_neg_zeros=0.5),
    P("zero_rows_nobias_fp16", 29, 8, 16, 48, "fp16", "fp32", x_zero_rows=0.5),
    P("subnormal_bf16", 10, 32, 64, 512, out="fp32", spread=10, subnormals=0.1),
    P("subnormal_fp16", 11, 32, 64, 512, "fp16", "fp32", spread=4, subnormals=0.1),
    P("subnormal_lead_bf16", 12, 24, 40, 256, out="fp32", x_spread=2, x_scale=-124,
      x_subnormals=0.7, w_spread=12, w_scale=90),
    P("subnormal_lead_fp16", 30, 24, 40, 256, "fp16", "fp32", x_spread=2, x_scale=-12,
      x_subnormals=0.7, w_spread=6, w_scale=8),
    P("tiny_acc_subnormal_bf16", 13, 24, 40, 256, out="fp32", spread=4, scale=-68),
    P("cancel_bf16", 14, 32, 48, 512, out="fp32", spread=16, cancel=0.6),
    P("cancel_fp16", 15, 32, 48, 512, "fp16", "fp32", spread=6, cancel=0.6),
    P("k1_bf16", 16, 17, 24, 1, out="fp32", spread=20),
    P("k7_fp16", 17, 17, 24, 7, "fp16", "fp16", bias=True, spread=6),
    P("k17_bf16", 18, 17, 24, 17, bias=True, spread=20),
    P("k100_bf16", 19, 19, 40, 100, out="fp16", spread=3),
    P("k4096_bf16", 20, 16, 128, 4096, spread=10, bias=True),
    P("k4096_fp16_fp32out", 21, 8, 64, 4096, "fp16", "fp32", spread=6),
    P("m1_bf16", 22, 1, 264, 1000, bias=True, spread=12),
    P("m129_bf16", 23, 129, 136, 200, out="fp32", spread=12),
    P("m300_bf16", 24, 300, 264, 640, spread=5, bias=True),
    P("fp16_out_overflow", 25, 16, 32, 256, "bf16", "fp16", scale=6, tags=["out_overflow"]),
    P("small_full_bf16", 26, 4, 8, 40, bias=True, spread=20, zeros=0.2, neg_zeros=0.2),
    P("small_full_fp16", 27, 4, 8, 40, "fp16", "fp32", spread=8, subnormals=0.2),
    P("small_full_tiny_bf16", 28, 4, 8, 48, out="fp32", scale=-70, neg_zeros=0.3),
    # Special values: the model's choices here await GPU confirmation; tagged apart.
    P("special_bf16", 40, 32, 64, 256, bias=True, specials=0.0008, tags=["special"]),
    P("special_fp16_fp32out", 41, 32, 64, 256, "fp16", "fp32", specials=0.0008,
      tags=["special"]),
    P("special_bias_bf16", 42, 8, 32, 64, bias=True, bias_specials=0.3, tags=["special"]),
    P("special_small_full", 43, 4, 8, 40, out="fp32", specials=0.02, tags=["special"]),
    P("overflow_bf16_fp32out", 44, 8, 32, 64, out="fp32", scale=100, spread=4,
      tags=["special", "overflow"]),
    P("overflow_small_full", 45, 2, 8, 32, out="fp32", scale=110, tags=["special", "overflow"]),
]

# fp32 inputs at each precision: "tf32" (TF32 rounding of the inputs, the chain in 8-wide
# blocks) and "ieee" (the split tier). One list of recipes, seeds 101.. (tf32) and 201..
# (ieee); each precision is recorded to its own file (`--set tf32`, `--set ieee`).
_FP32_RECIPES = (  # name, seed, M, N, K, out dtype, bias, tags, recipe
    ("plain", 101, 64, 96, 256, "fp32", True, (), {}),
    ("spread20", 102, 48, 80, 1024, "fp32", False, (), {"spread": 20}),
    ("k1000_bias", 103, 33, 72, 1000, "fp32", True, (), {"spread": 3, "bias_scale": 4}),
    ("k13", 104, 17, 24, 13, "fp32", False, (), {"spread": 20}),
    ("zeros", 105, 40, 64, 320, "fp32", False, (),
     {"spread": 6, "zeros": 0.3, "neg_zeros": 0.1}),
    ("zero_rows", 106, 8, 16, 48, "fp32", True, (),
     {"x_zero_rows": 0.5, "neg_zeros": 0.2, "bias_neg_zeros": 0.5}),
    ("subnormal", 107, 32, 64, 512, "fp32", False, (), {"spread": 10, "subnormals": 0.1}),
    ("subnormal_lead", 108, 24, 40, 256, "fp32", False, (),
     {"x_spread": 2, "x_scale": -124, "x_subnormals": 0.7, "w_spread": 12, "w_scale": 90}),
    ("tiny_acc", 109, 24, 40, 256, "fp32", False, (), {"spread": 4, "scale": -68}),
    ("cancel", 110, 32, 48, 512, "fp32", False, (), {"spread": 16, "cancel": 0.6}),
    ("near_max", 111, 16, 24, 64, "fp32", False, (), {"scale": 127, "spread": 1}),
    ("special", 112, 32, 64, 256, "fp32", True, ("special",),
     {"specials": 0.0008, "spread": 4}),
    ("overflow", 113, 8, 32, 64, "fp32", False, ("special", "overflow"),
     {"scale": 100, "spread": 4}),
    ("small_full", 114, 4, 8, 40, "fp32", False, (), {"spread": 8, "subnormals": 0.2}),
    ("bf16_out", 115, 40, 72, 640, "bf16", True, (), {"spread": 4}),
)
TF32_PROBLEMS = [P("tf32_" + name, seed, m, n, k, "fp32", out, bias, tags, "tf32", **recipe)
                 for name, seed, m, n, k, out, bias, tags, recipe in _FP32_RECIPES]
IEEE_PROBLEMS = [P("ieee_" + name, seed + 100, m, n, k, "fp32", out, bias, tags, "ieee",
                   **recipe) for name, seed, m, n, k, out, bias, tags, recipe in _FP32_RECIPES]
SETS = {"main": ("", PROBLEMS, None), "tf32": ("_tf32", TF32_PROBLEMS, "tf32"),
        "ieee": ("_ieee", IEEE_PROBLEMS, "fp32")}  # file suffix, problems, bucket dtype


# ---------------------------------------------------------------------------------------
# Inputs from recipes (CPU generators only: the same bits on every machine)


def _gen(seed, part):
    return torch.Generator().manual_seed(seed * 1009 + part)


def _fill(shape, dtype, seed, part, r, prefix):
    """One operand: randn, exponent spread and scale, then the special-element recipes.

    A recipe key is looked up as prefix + key first ("x_scale"), then as key, except for
    the bias, which only takes "bias_" keys."""
    def get(key):
        if prefix == "bias_":
            return r.get(prefix + key, 0)
        return r.get(prefix + key, r.get(key, 0))

    g = _gen(seed, part)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    spread = get("spread")
    if spread:
        e = torch.randint(-spread, spread + 1, shape, generator=g)
        x = x * torch.pow(2.0, e.to(torch.float32))
    x = x.to(torch.float64) * 2.0 ** get("scale")
    big = torch.finfo(dtype).max
    x = x.clamp(-big, big).to(dtype)  # spreads never create infinities by accident
    tiny = torch.finfo(dtype).tiny
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]  # stored bits

    def where(frac):
        return torch.rand(shape, generator=g) < frac

    for key, value in (("zeros", 0.0), ("neg_zeros", -0.0)):
        if get(key):
            x = torch.where(where(get(key)), torch.tensor(value, dtype=dtype), x)
    if get("zero_rows") and len(shape) == 2:
        rows = torch.rand((shape[0], 1), generator=g) < get("zero_rows")
        signs = torch.randint(0, 2, shape, generator=g).to(dtype) * -2 + 1
        x = torch.where(rows, torch.zeros((), dtype=dtype) * signs, x)
    if get("subnormals"):
        m = torch.randint(1, 2 ** mant, shape, generator=g).to(torch.float64)
        sign = torch.randint(0, 2, shape, generator=g).to(torch.float64) * 2 - 1
        sub = (sign * m * tiny * 2.0 ** -mant).to(dtype)
        x = torch.where(where(get("subnormals")), sub, x)
    if get("specials"):
        pick = torch.randint(0, 3, shape, generator=g)
        vals = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)[pick]
        x = torch.where(where(get("specials")), vals, x)
    return x


def make_inputs(p):
    """(x [M, K], weight [N, K], bias [N] or None) of problem p, on CPU."""
    dt = DTYPES[p["dtype"]]
    r, s = p["recipe"], p["seed"]
    x = _fill((p["M"], p["K"]), dt, s, 1, r, "x_")
    w = _fill((p["N"], p["K"]), dt, s, 2, r, "w_")
    if r.get("cancel"):  # a fraction of column pairs cancel exactly: x[2j+1]=-x[2j], w same
        g = _gen(s, 4)
        pairs = torch.nonzero(torch.rand(p["K"] // 2, generator=g) < r["cancel"])[:, 0] * 2
        x[:, pairs + 1] = -x[:, pairs]
        w[:, pairs + 1] = w[:, pairs]
    bias = _fill((p["N"],), dt, s, 3, r, "bias_") if p["bias"] else None
    return x, w, bias


def _raw_bytes(t):
    u8 = t.detach().to("cpu").contiguous().view(torch.uint8).flatten()
    try:
        return u8.numpy().tobytes()
    except (ImportError, RuntimeError):  # torch built without numpy
        return bytes(u8.tolist())


def input_hash(x, w, bias):
    h = hashlib.sha256()
    for t in (x, w) + ((bias,) if bias is not None else ()):
        h.update(_raw_bytes(t))
    return h.hexdigest()[:16]


def row_hashes(out):
    """SHA-256 (16 hex chars) per output row of its canonical bits: every NaN as one NaN
    (payloads differ between CPU and GPU and are not promised), as int64 little-endian."""
    from detgemm_cute.reference import bits

    b = bits(out.reshape(out.shape[0], -1))
    return [hashlib.sha256(_raw_bytes(row)).hexdigest()[:16] for row in b]


def full_hex(out):
    """Raw bit patterns (NaN payloads included), one string per row."""
    digits = 8 if out.dtype == torch.float32 else 4
    ints = {torch.float32: torch.int32}.get(out.dtype, torch.int16)
    raw = out.detach().to("cpu").contiguous().view(ints).to(torch.int64) & ((1 << 4 * digits) - 1)
    return [" ".join(f"{v:0{digits}x}" for v in row) for row in raw.tolist()]


def hex_to_canonical(rows, dtype):
    """Parse `full_hex` rows back into canonical bits (int64), as `reference.bits` gives."""
    from detgemm_cute.reference import bits

    ints = {torch.float32: torch.int32}.get(dtype, torch.int16)
    width = 32 if dtype == torch.float32 else 16
    vals = [[int(v, 16) for v in row.split()] for row in rows]
    t = torch.tensor(vals, dtype=torch.int64)
    t = torch.where(t >= 2 ** (width - 1), t - 2 ** width, t).to(ints).view(dtype)
    return bits(t)


# ---------------------------------------------------------------------------------------
# Running on the GPU


def precision_of(p):
    """The fp32 precision problem p runs at (a no-op context for 16-bit problems)."""
    import contextlib

    import detgemm_cute

    prec = p.get("precision")
    return detgemm_cute.fp32_precision(prec) if prec else contextlib.nullcontext()


def _bucket_names(dtype=None):
    """Every forward bucket the library can force on this GPU (of `dtype` if given), if it
    says which it has."""
    try:
        from detgemm_cute import gemm, registry
        arch = gemm.arch_of(torch.device("cuda"))
        buckets = registry.get_registry(arch).buckets
    except Exception:
        return []
    return sorted({b.name for b in buckets if getattr(b, "op", "fwd") == "fwd"
                   and (dtype is None or dtype in b.dtypes)})


def _force(name):
    import detgemm_cute

    ctx = getattr(detgemm_cute, "force_bucket", None)
    ops = getattr(detgemm_cute, "ops", None)
    ctx = ctx or getattr(ops, "force_bucket", None)
    return None if ctx is None else ctx(name)


def run_problem(p, buckets, check_reference):
    import detgemm_cute

    x, w, bias = make_inputs(p)
    od = DTYPES[p["out_dtype"]]
    dev = lambda t: None if t is None else t.cuda()  # noqa: E731
    with precision_of(p):
        out = detgemm_cute.linear(dev(x), dev(w), dev(bias), out_dtype=od).cpu()
    rec = dict(p, input_sha=input_hash(x, w, bias), row_sha=row_hashes(out))
    if out.numel() <= FULL_HEX_MAX:
        rec["full_hex"] = full_hex(out)
    rec["buckets"] = {}
    for name in buckets:
        ctx = _force(name)
        if ctx is None:
            break
        try:
            with ctx, precision_of(p):
                o = detgemm_cute.linear(dev(x), dev(w), dev(bias), out_dtype=od).cpu()
            rec["buckets"][name] = "same" if row_hashes(o) == rec["row_sha"] else "DIFFERS"
        except Exception as e:  # a bucket may reject a shape; record, do not stop
            rec["buckets"][name] = f"error: {type(e).__name__}: {str(e)[:120]}"
    if check_reference:
        from detgemm_cute import reference

        with precision_of(p):
            r = reference.verify(x, w, out, bias)
        rec["reference"] = "ok" if r.ok else str(r)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the JSON file")
    ap.add_argument("--buckets", default=None,
                    help="comma-separated bucket names to force (default: all the library "
                         "lists; 'none' to skip)")
    ap.add_argument("--no-reference", action="store_true",
                    help="do not also compare with detgemm_cute.reference here")
    ap.add_argument("--only", default=None, help="comma-separated problem names")
    ap.add_argument("--set", default="main", choices=tuple(SETS),
                    help="which problem list: the 16-bit one (golden_<gpu>.json) or fp32 inputs "
                         "at precision tf32 / ieee (golden_<gpu>_tf32.json / _ieee.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("make_golden.py needs a CUDA GPU")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    import detgemm_cute
    from detgemm_cute import reference

    torch.set_num_threads(os.cpu_count() or 1)
    if args.buckets == "none":
        buckets = []
    elif args.buckets:
        buckets = args.buckets.split(",")
    else:
        buckets = _bucket_names(SETS[args.set][2])
    suffix, probs = SETS[args.set][:2]
    if args.only:
        keep = set(args.only.split(","))
        probs = [p for p in probs if p["name"] in keep]
    gpu = torch.cuda.get_device_name()
    cap = torch.cuda.get_device_capability()
    doc = {"format": FORMAT, "generated_by": "tests/golden/make_golden.py",
           "date": datetime.date.today().isoformat(), "gpu": gpu,
           "capability": f"{cap[0]}.{cap[1]}", "torch": torch.__version__,
           "cuda": torch.version.cuda, "detgemm_cute": getattr(detgemm_cute, "__version__", "?"),
           "reference_model": reference.MODEL.__dict__.copy(),
           "forced_buckets": buckets, "problems": []}
    bad = 0
    for p in probs:
        rec = run_problem(p, buckets, not args.no_reference)
        doc["problems"].append(rec)
        flags = [v for v in rec["buckets"].values() if v != "same"]
        ref = rec.get("reference", "-")
        bad += ref not in ("ok", "-") or any(f == "DIFFERS" for f in flags)
        print(f"{p['name']:28s} ref={ref[:90]} buckets={len(rec['buckets'])} "
              f"not-same={flags[:3]}", flush=True)
    slug = "".join(c if c.isalnum() else "_" for c in gpu.lower()).strip("_")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"golden_{slug}{suffix}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=0, separators=(",", ":"))
    print(f"wrote {path} ({os.path.getsize(path)} bytes); {bad} problem(s) with a mismatch")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
