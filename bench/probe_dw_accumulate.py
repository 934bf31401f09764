"""What `dW +=` (the chain continued from an fp32 buffer) costs over a fresh dW, per kernel
(needs an SM90 GPU). Issue 40's target: accumulating costs only its extra bytes, one fp32
read of the [N, K] buffer.

For each problem 'MxKxN' (M tokens, K in_features, N out_features; dW [N, K] = dY^T X) and
each kernel (the dW tables' 128x192 ping-pong kernels, a cooperative 128x256 one, each
forced by name, and the table's own pick), in one interleaved `time_units` run:

- `fresh`: `weight_grad(dy, x)`, a new fp32 [N, K] from +0.0;
- `acc`: `weight_grad(dy, x, acc=buf)`, continuing buf's values in place;
- `read`: half of `buf.clone()` (one read and one write of the buffer), the bytes' time.

Before timing, each kernel's continued chain is checked bit for bit: dW of the first half
of the tokens, continued with the second half, equals dW of all tokens at once.

    python bench/probe_dw_accumulate.py --out F.json [--shapes MxKxN ...]
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.timing import TimingPlan, time_units
from sweep_common import candidate_layer, write_probe

PLAN = TimingPlan(target_ms=0.5, reps=9, min_reps=5, budget_ms=30.0, warm_rounds=1,
                  warm_replays=1, est_min_ms=0.3)
PINGPONG = {"persistent": True, "pingpong": True}
KERNELS = {
    "128x192 pp c1x2": {"tile": (128, 192, 64), "cluster": (1, 2), "stages": 5, **PINGPONG},
    "128x192 pp c2x1": {"tile": (128, 192, 64), "cluster": (2, 1), "stages": 5, **PINGPONG},
    "128x192 pp swap": {"tile": (128, 192, 64), "cluster": (1, 1), "stages": 4, **PINGPONG,
                        "swap_ab": True},
    "128x256 c1x2": {"tile": (128, 256, 64), "cluster": (1, 2), "stages": 4,
                     "persistent": True},
}
# Tiles inside [N, K] on both axes for 128x192 (K a multiple of 192, N of 128), and edges.
SHAPES = ["8192x3072x4096", "4096x4608x1024", "4096x5760x1280", "8192x3584x4096",
          "2048x8192x8192", "8192x2048x3072", "8192x18944x3584", "16384x1536x512"]


def forced(name):
    """(fresh, acc) calls of kernel `name` (None: the table's pick)."""
    def run(fn):
        if name is None:
            return fn()
        with dg.force_bucket(name):
            return fn()

    def fresh(s):
        return run(lambda: dg.weight_grad(s[0], s[1]))

    def acc(s):
        return run(lambda: dg.weight_grad(s[0], s[1], acc=s[2]))
    return fresh, acc


def chain_holds(fresh, acc, s) -> bool:
    """dW(first half) continued by the second half == dW(all tokens), bit for bit (the
    split at a multiple of 16 tokens, as the contract asks of micro-batches)."""
    h = s[0].shape[0] // 32 * 16
    buf = fresh((s[0][:h], s[1][:h]))
    acc((s[0][h:], s[1][h:], buf))
    return torch.equal(buf.view(torch.int32), fresh(s).view(torch.int32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    args = p.parse_args(argv)
    err, _ = gpu.gpu_check()
    if err:
        print(err, file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    rows, cap = [], torch.cuda.Stream()
    with tempfile.TemporaryDirectory() as tmp:
        names = candidate_layer(Path(tmp) / "dw.yaml", "dw", "dw_acc_probe",
                                list(KERNELS.values()))
        kernels = dict(zip(KERNELS, names)) | {"table": None}
        for spec in args.shapes:
            m, k, n = (int(v) for v in spec.split("x"))
            dy = torch.randn(m, n, generator=gen).to("cuda", torch.bfloat16)
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            s = (dy, x, torch.randn(n, k, generator=gen).to("cuda"))
            fns = {"read": lambda s_: s_[2].clone()}
            bits = {}
            for label, name in kernels.items():
                fresh, acc = forced(name)
                bits[label] = chain_holds(fresh, acc, s)
                fns[f"{label} fresh"], fns[f"{label} acc"] = fresh, acc
            us = {nm: r.get("us") for nm, r in time_units(fns, [s], PLAN, cap).items()}
            read = us["read"] / 2 if us.get("read") else None
            for label in kernels:
                f, a = us.get(f"{label} fresh"), us.get(f"{label} acc")
                row = {"shape": spec, "kernel": label, "fresh_us": f, "acc_us": a,
                       "read_us": read, "chain_bits_equal": bits[label]}
                rows.append(row)
                extra = f"{a - f:7.1f} us extra ({(a - f) / read:5.2f}x the read)" \
                    if f and a and read else "n/a"
                print(f"{spec:18s} {label:16s} fresh {f or 0:8.1f}  acc {a or 0:8.1f}  "
                      f"{extra}  bits {bits[label]}", flush=True)
    return write_probe(args.out, rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
