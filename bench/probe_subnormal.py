"""How each kernel family treats subnormal inputs and subnormal sums, measured against the
reference's `ChainModel` choices.

Inputs whose products and sums land near and below fp32's (and 16-bit's) smallest normal
number: X rows of subnormal values against W of ordinary ones, rows mixing subnormal and
tiny normal values, sums that cancel into the subnormal range. Every precision runs (bf16,
fp16, fp32 at "ieee" and "tf32") on every kernel family the GPU runs, and each output is
compared with the reference under every value of the subnormal-related choices
(`subnormal_inputs`, `acc_subnormals`, `zero_acc`, `underflow_sign`). A family and precision
is modelled when the default model matches every output. A second table (`sub_ulp_sets`)
takes blocks whose products all lie far below 2^-126 and whose sums land within a few
subnormal steps of zero, against `align_floor` (the lowest alignment position).

    python bench/probe_subnormal.py [--family sm90|sm80|all] [--out DIR]

Writes subnormal_probe.json to DIR (default: $OUT when set). With `--case "Case(...)"`, it
also reruns one fuzz case on each family (the case's dims and seed, as the fuzzer printed it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch

import detgemm_cute as dg
from detgemm_cute import reference as R

BF, FP, F32 = torch.bfloat16, torch.float16, torch.float32
FIELDS = ("subnormal_inputs", "acc_subnormals", "zero_acc", "underflow_sign")
M, K, N = 32, 64, 32


def inputs(kind: str, dtype: torch.dtype, seed: int):
    """x [M, K], w [N, K] in `dtype`, values chosen so results are subnormal or near it."""
    g = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(dtype if dtype != F32 else F32).tiny
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64)
    sub = torch.rand(M, K, generator=g, dtype=torch.float64) * tiny  # subnormal magnitudes
    if kind == "subnormal_x":  # every X value subnormal: products below tiny
        x = sub * torch.sign(x)
    elif kind == "mixed_x":  # half subnormal, half small normal values
        pick = torch.rand(M, K, generator=g) < 0.5
        x = torch.where(pick, sub * torch.sign(x), x * tiny * 2.0 ** torch.randint(
            0, 6, (M, K), generator=g).double())
    elif kind == "leading_subnormal":  # a subnormal value leads each 8/16-wide block
        x = x * tiny * 4
        x[:, ::8] = sub[:, ::8] * 0.5
    elif kind == "cancel":  # sums that cancel into the subnormal range
        x = x * tiny * 8
        x[:, 1::2] = -x[:, ::2]
        w[:, 1::2] = w[:, ::2] * (1 + 2.0 ** -torch.randint(5, 20, (N, K // 2), generator=g))
    return x.to(dtype), w.to(dtype)


KINDS = ("subnormal_x", "mixed_x", "leading_subnormal", "cancel")


def sub_ulp_sets(seed: int = 7) -> dict:
    """Blocks whose products all lie far below fp32's normal range and whose sums land a
    few subnormal steps (2^-149) from zero: where the alignment's lowest position shows.
    4096 x 8 outputs each: K = 16 with subnormal bf16 W, K = 16 with normal bf16 inputs
    around 2^-75, K = 32 (two blocks) with subnormal W."""
    g = torch.Generator().manual_seed(seed)
    m, n, sets = 4096, 8, {}
    for kind, k in (("subnormal_w", 16), ("normal_tiny", 16), ("subnormal_w_2_blocks", 32)):
        if kind == "normal_tiny":
            x = (torch.randn(m, k, generator=g) * 2.0 ** -75).to(BF)
            w = (torch.randn(k, n, generator=g) * 2.0 ** -75).to(BF)
        else:
            x = (torch.randn(m, k, generator=g) * 2.0 ** -17).to(BF)
            steps = torch.randint(1, 128, (k, n), generator=g).float()
            w = (steps * torch.sign(torch.randn(k, n, generator=g)) * 2.0 ** -133).to(BF)
        sets[kind] = (x, w)
    return sets


def probe_sub_ulp(family: str, device: str) -> list:
    rows = []
    for kind, (x, w) in sub_ulp_sets().items():
        with dg.use_family(family) if device != "cpu" else contextlib.nullcontext():
            got = dg.mm(x.to(device), w.to(device), out_dtype=F32).cpu()
        row = {"family": family, "precision": "bf16", "inputs": kind, "matches": {}}
        for value, model in R.MODEL.variants("align_floor").items():
            same = int((R.bits(R.mm(x, w, out_dtype=F32, model=model)) == R.bits(got)).sum())
            row["matches"][f"align_floor={value}"] = f"{same}/{got.numel()}"
        want = R.mm(x, w, out_dtype=F32)
        row["default_matches"] = bool((R.bits(want) == R.bits(got)).all())
        rows.append(row)
        print(f"{family} bf16      {kind:22s} default={'yes' if row['default_matches'] else 'NO '} "
              + " ".join(f"{k}:{v}" for k, v in row["matches"].items()), flush=True)
    return rows
PRECISIONS = (("bf16", BF, None), ("fp16", FP, None), ("fp32-ieee", F32, "ieee"),
              ("fp32-tf32", F32, "tf32"))


def probe(family: str, device: str) -> list:
    rows = []
    for pname, dtype, precision in PRECISIONS:
        for kind in KINDS:
            x, w = inputs(kind, dtype, seed=sum(map(ord, pname + kind)))
            with dg.fp32_precision(precision) if precision else contextlib.nullcontext():
                with dg.use_family(family) if device != "cpu" else contextlib.nullcontext():
                    got = dg.linear(x.to(device), w.to(device), out_dtype=F32).cpu()
                row = {"family": family, "precision": pname, "inputs": kind,
                       "subnormal_outputs": int(((got != 0) & (got.abs() < F32_TINY)).sum()),
                       "matches": {}}
                for field in FIELDS:
                    for value, model in R.MODEL.variants(field).items():
                        want = R.linear(x, w, out_dtype=F32, model=model)
                        same = int((R.bits(want) == R.bits(got)).sum())
                        row["matches"][f"{field}={value}"] = f"{same}/{got.numel()}"
                want = R.linear(x, w, out_dtype=F32)
                diff = R.bits(want) != R.bits(got)
                if diff.any():
                    i = tuple(int(v) for v in torch.nonzero(diff)[0])
                    row["first_mismatch"] = (f"{i}: gpu {float(got[i])!r} "
                                             f"model {float(want[i])!r}")
                row["default_matches"] = not bool(diff.any())
            rows.append(row)
            print(f"{family} {pname:9s} {kind:18s} default={'yes' if row['default_matches'] else 'NO '} "
                  f"subnormal outs {row['subnormal_outputs']:4d}  "
                  + " ".join(f"{k}:{v}" for k, v in row["matches"].items()
                             if not k.endswith(_defaults())), flush=True)
            if "first_mismatch" in row:
                print(f"    first mismatch {row['first_mismatch']}", flush=True)
    return rows


F32_TINY = torch.finfo(F32).tiny


def _defaults() -> tuple:
    return tuple(f"={getattr(R.MODEL, f)}" for f in FIELDS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="all", help="sm90, sm80 or all")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--case", help="a fuzz Case(...) to rerun on each family")
    args = ap.parse_args(argv)
    families = ["sm90", "sm80"] if args.family == "all" else [args.family]
    if args.device == "cpu":
        families = families[:1]
    rows = []
    for fam in families:
        rows += probe(fam, args.device)
        rows += probe_sub_ulp(fam, args.device)
    if args.case:
        from detgemm_cute.fuzz import Case, check  # noqa: F401 - Case is eval'd below

        case = eval(args.case, {"Case": Case})  # noqa: S307 - a case the fuzzer printed
        for fam in families:
            print(f"case on {fam}: {check(case, args.device, family=fam)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "subnormal_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if not r["default_matches"]]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} (family, precision, inputs) rows match the "
          f"default model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
