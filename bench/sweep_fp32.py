"""Time the fp32 "ieee" tier's tiles at M 65..512 (needs an SM90 GPU): the data the
`*_fp32_m65_512` buckets of configs/sm90.yaml are fitted from (`detgemm-cute tune-fit`).

At M <= 64 the fused decode kernels serve fp32 "ieee" (`split_decode`); above, both operands
are split into fp16 parts and one chunked GEMM (BK 96: a chunk of 32 values of K) runs over
3x the K. At small M that GEMM has few tiles (M = 128, N = 1280: 20 of 64x128 on 132 SMs)
and no split-K to add more, so the tile decides most of its time. Per problem (op, M, K, N),
in one `time_units` call (CUDA graphs, interleaved rounds, medians, fresh random inputs):

- every candidate (`CANDIDATES`, declared as the alternatives of one user bucket serving
  K = 1 only, each forced by name), running the whole call (`dg.linear` for fwd,
  `dg.input_grad` for dX: the splits, the GEMM, the unscale);
- `table`: the call unforced (the table's own choice);
- `cublas_sgemm`: `F.linear` / `dY @ W` with TF32 off;
- `split_only` (fwd): splitting both operands alone, the part no tile changes.

Every candidate's output must have the table's bits (`bits_ok`); `out_sha1` hashes the
table's output on the first set, whose inputs are seeded by the problem, so two runs (an
A/B of two trees, `--table-only`) can show they computed the same bits. Records are written in the
format of `detgemm-cute tune --json` (`op`, `gemm` = the kernel's [M, N, K] as the table
keys it, `cands`, `peers` with SGEMM under "cublaslt", `fields`), so `tune-fit` reads them:

    python bench/sweep_fp32.py --out "$OUT/fp32_sweep.json" --jobs 14 --max-seconds 420
    detgemm-cute tune-fit fp32_sweep.json --ops fwd --m-min 65 --m-max 512 \\
        --bucket-dtypes fp32 --name fp32_m65_512 --out fp32.yaml

Fit each op from records of the code it will run: a dX record says how its weight was split
(`w_split`: "columns", in place, or "rows", the transposed copy; the committed
`fp32_sweep_nvidia-h200.json.xz` predates the in-place split, and its dX records are
"rows"), and `tune-fit` lets a later file's times of a problem win.

Problems run in a fixed shuffled order, so a run cut by --max-seconds keeps a spread of M,
weights and ops.
"""

import argparse
import hashlib
import random
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

import detgemm_cute as dg
from detgemm_cute import compile as kcompile
from detgemm_cute import dispatch, split
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.timing import TUNE_PLAN, n_sets_for
from detgemm_cute.kernels import sm90_limits
from detgemm_cute.tune.candidates import Candidate
from sweep_common import candidate_layer, no_gpu, time_candidates, write_records

F32 = torch.float32
M_LIST = (65, 96, 128, 192, 256, 384, 512)
# (K, N) of public models' projections (hidden -> out), several families and TP shards; dX
# runs on the same weights (its GEMM: N = K, K = N).
WEIGHTS = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144), (5120, 5120),
           (3584, 18944), (8192, 1280), (2048, 8192), (768, 3072), (3072, 768), (1024, 1024),
           (8192, 896), (5120, 3456), (2048, 5632), (1536, 8960), (7168, 2048)]
# BK 96 (the chunk), BN <= 128 (sum and chunk fragments), BM 64 or 128 (split tier limits).
CANDIDATES = [
    {"tile": [bm, bn, 96], "cluster": list(c), "stages": s, "persistent": p}
    for bm, bn, c, s, p in (
        (64, 128, (1, 1), 5, False), (64, 128, (1, 1), 5, True), (64, 128, (2, 1), 4, False),
        (64, 96, (1, 1), 6, False),
        (64, 64, (1, 1), 8, False), (64, 64, (1, 1), 8, True), (64, 64, (2, 1), 6, False),
        (64, 64, (1, 2), 6, False), (64, 64, (4, 1), 6, False),
        (64, 48, (1, 1), 8, False),
        (64, 32, (1, 1), 10, False), (64, 32, (2, 1), 8, False), (64, 32, (4, 1), 8, False),
        (64, 16, (1, 1), 12, False), (64, 16, (2, 1), 10, False),
        (128, 128, (1, 1), 4, False), (128, 64, (1, 1), 5, False), (128, 32, (1, 1), 6, False))]


def problems(weights, m_list, ops, seed=0) -> list:
    """(op, M, weight K, weight N) of the run, shuffled with a fixed seed."""
    out = [(op, m, k, n) for op in ops for (k, n) in weights for m in m_list]
    random.Random(seed).shuffle(out)
    return out


def gemm_dims(op, m, k, n) -> tuple:
    """The kernel's (M, N, K) as the fp32 table keys it: dX reduces over the weight's N."""
    return (m, n, k) if op == "fwd" else (m, k, n)


def make_sets(op, m, k, n, l2) -> list:
    """Fresh random (x or dY, W) sets: enough that the replays do not run from L2."""
    rows = k if op == "fwd" else n
    nbytes = 4 * (m * rows + n * k + m * (n if op == "fwd" else k))
    return [((torch.randn(m, rows, device="cuda")), torch.randn(n, k, device="cuda") * k ** -0.5)
            for _ in range(n_sets_for(nbytes, l2, TUNE_PLAN))]


def sgemm(op, s):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return F.linear(s[0], s[1]) if op == "fwd" else s[0] @ s[1]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def call(op):
    return (lambda s: dg.linear(s[0], s[1])) if op == "fwd" else (
        lambda s: dg.input_grad(s[0], s[1]))


def timed_calls(op, names) -> dict:
    run = call(op)

    def forced(nm):
        def fn(s):
            with dg.force_bucket(nm):
                return run(s)
        return fn

    fns = {nm: forced(nm) for nm in names}
    fns["table"] = run
    fns["cublas_sgemm"] = lambda s: sgemm(op, s)
    if op == "fwd":
        fns["split_only"] = lambda s: (split.scaled_operand_cuda(s[0], "a"),
                                       split.scaled_operand_cuda(s[1], "b"))
    return fns


def bits_ok(op, names, s) -> bool:
    """Every candidate's output has the bits of the table's (unforced) call."""
    fns = timed_calls(op, names)
    ref = fns["table"](s).view(torch.int32)
    return all(torch.equal(fns[nm](s).view(torch.int32), ref) for nm in names)


def columns_split(w) -> bool:
    """Whether dX splits this weight in place (`gemm._gemm_fp32`'s rule)."""
    from detgemm_cute import gemm

    return gemm.arch_of(w.device) == "sm90" and split.columns_apply(w)


def kernel_key(bucket, b_form="nk"):
    """The chunked kernel a bucket runs on the fp32 tier's parts (gemm's split plan: K-major
    parts, fp32 out, no bias; B K-major, or N-major where dX splits its weight in place)."""
    arch = kcompile.gpu_arch_for("sm90", torch.cuda.get_device_capability())
    return kcompile.KernelKey.for_bucket(
        bucket, dtype="fp16", out_dtype="fp32", a_major="k", b_form=b_form, b_contig="last",
        has_bias=False, arch=arch, split=True)


def precompile(names, todo, jobs, log):
    """Every candidate's kernel and the table's picks for the problems `todo`, in `jobs`
    processes (into the AOT cache; a temporary one when it is off)."""
    import os

    from detgemm_cute import aot_cache
    from detgemm_cute.parallel_compile import compile_all

    forms = {"nk" if op == "fwd" else "kn" for op, *_ in todo}
    buckets = [dispatch.bucket_by_name("sm90", nm) for nm in names]
    buckets += [dispatch.lookup(op, "fp32", "sm90", *gemm_dims(op, m, k, n))
                for op, m, k, n in todo]
    keys = list(dict.fromkeys(kernel_key(b, f) for b in buckets for f in sorted(forms)))
    directory = aot_cache.cache_dir()
    if directory is None:
        directory = tempfile.mkdtemp(prefix="detgemm-sweep-aot-")
        os.environ[aot_cache.ENV_VAR] = directory
    log(f"compiling {len(keys)} kernels in {jobs} processes into {directory}")
    for key, why in compile_all(keys, directory, jobs).items():
        log(f"could not prebuild {key.tile} c{key.cluster}: {why} (compiled on first use)")


def measure(op, m, k, n, names, fields, l2, cap, device) -> dict:
    """One problem: candidates, the table's choice, SGEMM (and the splits) timed together."""
    torch.manual_seed(zlib.crc32(f"{op},{m},{k},{n}".encode()))  # the same inputs each run
    sets = make_sets(op, m, k, n, l2)
    us, errors, best = time_candidates(timed_calls(op, names), sets, TUNE_PLAN, cap,
                                       names or ["table"])
    ok = bits_ok(op, names, sets[0])
    out = call(op)(sets[0]).view(torch.int32).cpu().numpy().tobytes()
    gm, gn, gk = gemm_dims(op, m, k, n)
    short = {nm: nm.split(".", 1)[1] for nm in names}
    rec = {"device": device, "arch": "sm90", "dtype": "fp32", "op": op, "m": gm, "n": gn,
           "k": gk, "gemm": [gm, gn, gk], "label": f"W {k}->{n}",
           "cands": {short[nm]: us.get(nm) for nm in names},
           "peers": {"cublaslt": us.get("cublas_sgemm")},
           "fields": {short[nm]: fields[nm] for nm in names},
           "table": dispatch.lookup(op, "fp32", "sm90", gm, gn, gk).name,
           "table_us": us.get("table"), "split_only_us": us.get("split_only"),
           "sgemm_us": us.get("cublas_sgemm"), "bits_ok": ok, "errors": errors,
           "out_sha1": hashlib.sha1(out).hexdigest()}
    if op == "dx":
        rec["w_split"] = "columns" if columns_split(sets[0][1]) else "rows"
    if not ok:
        rec["bad_bits"] = list(rec["cands"])
    peer = us.get("cublas_sgemm") or float("nan")
    print(f"{op:3s} M={m:4d} W {k:5d}->{n:5d}  best {short.get(best[1], best[1]):26s} "
          f"{best[0]:8.1f} us  "
          f"table {us.get('table') or float('nan'):8.1f}  sgemm {peer:8.1f}  "
          f"split {us.get('split_only') or float('nan'):7.1f}  "
          f"best/sgemm {peer / best[0]:.2f}x  table/sgemm "
          f"{peer / (us.get('table') or float('nan')):.2f}x  bits {ok}", flush=True)
    return rec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ops", default="fwd,dx")
    p.add_argument("--m-list", default=",".join(map(str, M_LIST)))
    p.add_argument("--weights", default="", help="KxN,... instead of WEIGHTS")
    p.add_argument("--jobs", type=int, default=0, help="prebuild the kernels in N processes")
    p.add_argument("--max-seconds", type=float, default=420.0)
    p.add_argument("--table-only", action="store_true",
                   help="no candidates: the table's choice, SGEMM and the splits (an A/B side)")
    args = p.parse_args(argv)
    args.ops = tuple(o for o in args.ops.split(",") if o)
    if not args.ops or not set(args.ops) <= {"fwd", "dx"}:
        p.error(f"--ops takes fwd and/or dx, got {args.ops}")
    try:
        args.m_list = tuple(int(v) for v in args.m_list.split(","))
        args.weights = ([tuple(int(v) for v in w.split("x")) for w in args.weights.split(",")]
                        if args.weights else list(WEIGHTS))
    except ValueError:
        p.error("--m-list takes integers, --weights KxN pairs")
    if "fwd" in args.ops and min(args.m_list) <= 64:
        p.error("--m-list: fwd at M <= 64 runs the fused decode kernels, not these tiles")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    for c in CANDIDATES:  # each a kernel the split tier can build (no GPU needed to say so)
        bad = sm90_limits.check_config(c["tile"], c["cluster"], c["stages"], c["persistent"],
                                       dtypes=("fp32",))
        if bad:
            raise ValueError(f"candidate {Candidate.from_fields(c).name}: {bad}")
    if no_gpu():
        return 1
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        layer = Path(tmp) / "candidates.yaml"
        fwd_names = candidate_layer(layer, "fwd", "fcand", CANDIDATES, dtypes=("fp32",))
        dx_names = candidate_layer(Path(tmp) / "candidates_dx.yaml", "dx", "dcand", CANDIDATES,
                                   dtypes=("fp32",))
    if args.table_only:
        fwd_names, dx_names = [], []
    names = {"fwd": fwd_names, "dx": dx_names}
    fields = {nm: c for v in names.values() for nm, c in zip(v, CANDIDATES)}
    cands = [nm.split(".", 1)[1] for nm in fwd_names]  # the records' names (either op)
    todo = problems(args.weights, args.m_list, args.ops)
    if args.jobs > 1:
        precompile(fwd_names, todo, args.jobs, lambda msg: print(msg, flush=True))
    l2, cap, device = gpu.l2_bytes(), torch.cuda.Stream(), torch.cuda.get_device_name()
    records = []
    for op, m, k, n in todo:
        if time.time() - t0 > args.max_seconds:
            print(f"time box reached after {len(records)} of {len(todo)} problems", flush=True)
            break
        records.append(measure(op, m, k, n, names[op], fields, l2, cap, device))
        # a run cut off later keeps these rows
        write_records(args.out, cands, records, rows_key="records")
    write_records(args.out, cands, records, rows_key="records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
