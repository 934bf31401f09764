"""A/B of two kernel paths for rows TMA cannot take well, in one run, bits compared, with
torch (and cuBLASLt, split-K off, for linear layers) as peers. JSON keys: "direct" is the
path detgemm takes, "padded" the one it replaces.

- `--suite unaligned` (default): outputs whose rows TMA cannot address (a width not a
  multiple of 8 at 16 bits) stored by the kernel's threads ("direct") against padded rows
  copied out after ("padded"). Rows: q @ k^T at sequence lengths not a multiple of 8, and
  linear layers of odd width.
- `--suite half-sector`: outputs TMA can address whose row pitch is 16 mod 32 bytes (a width
  of 8 mod 16 at 16 bits), direct against TMA stores ("padded": the kernel's TMA store; such
  rows need no padding).
- `--suite a-rows`: p @ v at sequence lengths whose rows of P are not 16-byte aligned, P read
  by the producer threads' own loads ("direct") against P copied into padded rows for TMA
  ("padded"), over the attention shapes of public models.
- `--suite vector-store`: q @ k^T whose rows the threads store (a half-sector pitch, or one
  TMA cannot address) with a pitch of 8 bytes: 8 bytes a store from 128-column sub-tiles
  (`KernelKey.c_align`, "vector") against one element a store from 32-column ones
  ("element": `c_align` 0), on the broad attention sweep's slowest such rows and the
  half-sector suite's.

    python bench/ab_paths.py --out bench/results [--suite half-sector|a-rows|vector-store]
"""
import argparse
import json
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute import gemm
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.peers import LtNoSplit
from detgemm_cute.benchlib.timing import BENCH_PLAN, time_units
from sweep_common import policy_replaced, staged_a_rows

# (batch x heads, sequence, head_dim): q @ k^T, K a transposed view, as eager attention runs it.
QK = [(288, 333, 64), (128, 555, 64), (96, 777, 128), (64, 1001, 128), (80, 1500, 64),
      (80, 1500, 256), (32, 2047, 128), (24, 2500, 128), (16, 3500, 128)]
# (M, K, N): linear layers of odd output width (GPT-2's vocabulary, padded vocabularies, a
# classifier head), decode and prefill.
LINEAR = [(1, 768, 50257), (16, 4096, 32001), (450, 768, 50257), (2048, 768, 50257),
          (4096, 1024, 50257), (700, 4096, 1001), (3000, 2048, 1001), (777, 5120, 32003)]
# (batch x heads, sequence, head_dim): p @ v at a sequence length not a multiple of 8, as
# eager attention runs it (P [B*H, S, S] contiguous): Llama-3 8B (32 heads of 128), Qwen2.5
# 7B (28), Mistral 7B at TP 2 (16), Llama-3 70B at TP 8 (8), Phi-3 mini (32 of 96), Gemma-2
# 9B (16 of 256), GPT-2 (12 of 64), BERT-large (16 of 64); batch 1..16, S 9..4095.
PV = [(320, 777, 128), (672, 333, 128), (160, 777, 128), (192, 333, 128), (320, 777, 96),
      (80, 1500, 256), (288, 333, 64), (80, 1500, 64), (64, 1001, 128), (32, 2047, 128),
      (24, 3001, 128), (8, 4095, 128), (16, 4095, 64), (512, 129, 128), (1024, 77, 64),
      (448, 201, 128), (96, 555, 64), (32, 9, 128)]
# The half-sector suite: S and N of 8 mod 16.
QK_HALF = [(48, 1000, 64), (48, 1000, 128), (24, 3000, 64), (24, 3000, 128), (32, 2008, 128),
           (16, 4088, 128), (80, 1512, 64), (96, 776, 128)]
LINEAR_HALF = [(512, 4096, 1000), (4096, 4096, 1000), (8192, 1024, 3000), (2048, 4096, 11000),
               (1024, 5120, 5000), (16384, 768, 2312), (777, 4096, 11000), (128, 8192, 1528)]

# The vector-store suite: q @ k^T at S of 8 mod 16 (a half-sector pitch) and 4 mod 8 (a
# pitch TMA cannot address), the broad sweep's rows below 0.95x torch.bmm among them
# (batch x heads, S, d).
QK_VECTOR = [(256, 3000, 128), (64, 3000, 80), (256, 1000, 80), (256, 1000, 96),
             (96, 2500, 80), (64, 1000, 128), (96, 2500, 96), (64, 3000, 128), (8, 3000, 128),
             (256, 1000, 128), (32, 3000, 128), (16, 3000, 128), (160, 1500, 128),
             (80, 1500, 64), (24, 2500, 128), *QK_HALF]


def element_stores():
    """The threads' direct stores one element at a time (`c_align` 0)."""
    from detgemm_cute import batched
    return policy_replaced(batched, "direct_align", lambda *a: 0)


def padded_rows():
    """The direct store switched off: padded output rows, copied out after (what
    gemm.output_rows asks, for both paths)."""
    return policy_replaced(gemm, "stores_direct", lambda *a: False)


def timed_row(op, shape, torch_fn, dg_fn, sets, cap, lt=None, baseline=padded_rows) -> dict:
    """One row: torch, detgemm's path ("direct") and the one it replaces ("padded", run
    inside `baseline`) (and Lt) timed together; bits compared."""
    def padded(st):
        with baseline():
            return dg_fn(st)
    fns = {"torch": torch_fn, "padded": padded, "direct": dg_fn}
    if lt is not None:
        def lt_fn(st):
            with lt:
                return torch_fn(st)
        fns["lt"] = lt_fn
    res = time_units(fns, sets, BENCH_PLAN, cap)
    got = dg_fn(sets[0]).view(torch.int16)
    row = {"op": op, "shape": list(shape), **{k: v.get("us") for k, v in res.items()},
           "bits_padded": torch.equal(got, padded(sets[0]).view(torch.int16))}
    if lt is not None:
        row["bits_lt"] = torch.equal(got, fns["lt"](sets[0]).view(torch.int16))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--suite", choices=("unaligned", "half-sector", "a-rows", "vector-store"),
                    default="unaligned")
    args = ap.parse_args()
    half = args.suite == "half-sector"
    cap, bf, lt, rows = torch.cuda.Stream(), torch.bfloat16, LtNoSplit(), []
    if args.suite == "a-rows":
        for lb, s, d in PV:
            sets = [(torch.randn(lb, s, s, device="cuda", dtype=bf).softmax(-1),
                     torch.randn(lb, s, d, device="cuda", dtype=bf)) for _ in range(3)]
            rows.append(timed_row("bmm p@v", (lb, s, s, d), lambda st: torch.bmm(*st),
                                  lambda st: dg.bmm(*st), sets, cap, baseline=staged_a_rows))
            gpu.log(rows[-1])
        write(rows, Path(args.out), "a-rows-ab")
        return
    vector = args.suite == "vector-store"
    for lb, s, d in QK_VECTOR if vector else QK_HALF if half else QK:
        sets = [(torch.randn(lb, s, d, device="cuda", dtype=bf),
                 torch.randn(lb, s, d, device="cuda", dtype=bf).transpose(1, 2))
                for _ in range(3)]
        rows.append(timed_row("bmm q@k^T", (lb, s, s, d), lambda st: torch.bmm(*st),
                              lambda st: dg.bmm(*st), sets, cap,
                              baseline=element_stores if vector else padded_rows))
        gpu.log(rows[-1])
    if vector:
        write(rows, Path(args.out), "vector-store-ab")
        return
    for m, k, n in LINEAR_HALF if half else LINEAR:
        sets = [(torch.randn(m, k, device="cuda", dtype=bf),
                 torch.randn(n, k, device="cuda", dtype=bf)) for _ in range(2)]
        rows.append(timed_row("fwd", (m, k, n), lambda st: torch.mm(st[0], st[1].t()),
                              lambda st: dg.mm(st[0], st[1].t()), sets, cap, lt))
        gpu.log(rows[-1])
    write(rows, Path(args.out), "half-sector-ab" if half else "direct-store-ab")


def write(rows, out: Path, name: str):
    meta = gpu.device_meta()
    # What the new path replaces, and what it is called.
    base, new = {"half-sector-ab": ("TMA", "direct"), "a-rows-ab": ("staged", "threads"),
                 "vector-store-ab": ("element", "vector")}.get(name, ("padded", "direct"))
    lines = [f"# Kernel path A/B: {name} ({meta['device']})", "",
             f"Median us per call (CUDA graphs). {new}/{base}: {base} time / {new} time. "
             f"Bits: {new} against {base}, and against cuBLASLt split-K off.", "",
             f"| op | shape | torch | Lt | {base} | {new} | {new}/{base} | vs torch | vs Lt "
             f"| bits = {base} | bits = Lt |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lt, direct = r.get("lt"), r["direct"]
        lines.append(
            f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['torch']:.1f} | "
            f"{f'{lt:.1f}' if lt else '-'} | {r['padded']:.1f} | {r['direct']:.1f} | "
            f"{r['padded'] / r['direct']:.2f}x | {r['torch'] / r['direct']:.2f}x | "
            f"{f'{lt / direct:.2f}x' if lt else '-'} | "
            f"{'equal' if r['bits_padded'] else 'DIFFER'} | "
            f"{'-' if 'bits_lt' not in r else 'equal' if r['bits_lt'] else 'differ'} |")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{name}_{meta['device'].lower().replace(' ', '-')}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
