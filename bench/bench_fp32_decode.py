"""The fp32 "ieee" tier at decode sizes (M <= 64) vs cuBLAS SGEMM (needs an SM80+ GPU).

Per (M, K, N), in one interleaved CUDA-graph run (`time_units`, fresh random inputs):
- `detgemm_fp32`: `dg.linear` as it runs (M <= 64: the fused path, `split_decode`);
- `split_path`: the same call with the fused path off (split both operands to memory, the
  chunked GEMM over 3x K, unscale): what it replaces;
- `stream` / `cluster`: the two fused kernels at their default shapes, forced
  (`SplitGemvFp32`; `ClusterGemvFp32` on sm_90 where M <= CLUSTER_M or with the cluster
  sweep), whichever the path picks;
- `stream_twopass` / `tile_twopass`: the streaming kernel at its default shape, and the
  tile kernel where the path runs it, with W's row maxima taken before each block (no
  guessed scales: what `w_guess` replaced); `stream_cold`: with
  guessed scales that are all wrong (the buffer zeroed before each call, so every block
  runs twice: a weight whose every block changed scale since its last call);
- `fused_*` / `cluster_*` / `tile_*` / `inline_*` / `guess_*` (``--sweep``): the kernels at
  each shape `SWEEP`, `CLUSTER_BUDGETS`, `TILE_SWEEP`, `INLINE_SWEEP` and `GUESS_SWEEP`
  give, forced;
- `cublas_sgemm`: `F.linear` with TF32 off; `read_w`: one read of W (a row maximum), the
  floor of any kernel that reads the fp32 weight.
Bits: every detgemm unit against `split_path` on the first input set.

With ``--op dx``, dX = dY [M, N] @ W [N, K] per weight (K -> N) instead (`measure_dx`):
`detgemm_fp32` (`dg.input_grad`: the fused path, `split_decode.applies_kn`, reading W's
columns in place where `kn_in_place`), `split_path` (W split in place down its columns,
the chunked GEMM), `via_copy` (the fused path on W's K-major copy), `transpose` (the copy
alone), `cublas_sgemm` (dY @ W, TF32 off), `read_w`, and with ``--sweep kn`` the in-place
kernel at each `KN_SWEEP` launch shape (`kn_*`).

``--sweep tile_guess`` (fwd or dX): the tile kernel with guessed scales (dX: in place) at
each `TILE_GUESS_SWEEP` launch shape (`tileg_*`) beside the call as it runs, the split
path, SGEMM and one read of W (the other forced units left out).

    python bench/bench_fp32_decode.py --out $OUT
        [--op dx] [--sweep [cluster|stream|tile|inline|guess|kn|tile_guess]]
        [--max-seconds 300]
"""

import argparse
import sys
from pathlib import Path

import torch

import detgemm_cute as dg
from detgemm_cute import split_decode, staging
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.fmt import device_slug
from detgemm_cute.benchlib.runner import run_time_boxed
from detgemm_cute.benchlib.stats import geomean
from detgemm_cute.benchlib.timing import TimingPlan, n_sets_for, time_units
from bench_fp32 import mm_tf32, sgemm

DECODE_M = (1, 2, 4, 8, 16, 32, 64)
# Public-model projections (hidden -> out), several families and tensor-parallel shards.
DECODE_KN = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 1280), (5120, 5120),
             (3584, 18944), (18944, 3584), (2048, 8192), (8192, 8192), (1024, 4096),
             (4096, 1024), (7168, 2048)]
# (rows, group, stages, CTAs per SM, X staged as fp32) of the sweep; X's rows follow M.
SWEEP = [(8, 2, 4, 2, False), (8, 2, 3, 2, False), (8, 4, 2, 2, False), (8, 1, 6, 2, False),
         (8, 2, 2, 3, False), (8, 2, 3, 1, False), (16, 2, 2, 2, False), (16, 1, 2, 1, False),
         (4, 2, 4, 2, False), (16, 1, 2, 1, True), (16, 1, 3, 1, True), (8, 2, 2, 1, True),
         (8, 2, 2, 2, True), (8, 1, 2, 1, True), (8, 1, 2, 2, True), (8, 2, 3, 2, True),
         (8, 2, 4, 2, True)]
# (rows, group, stages, CTAs per SM) of the tile sweep (`SplitTileFp32`, M 9..64).
TILE_SWEEP = [(r, g, s, c) for r in (16, 32, 64)
              for g, s in ((2, 4), (2, 3), (2, 2), (4, 3), (4, 2)) for c in (1, 2)]
# (rows, group, stages, CTAs per SM) of the guessing tile sweep (``--sweep tile_guess``, fwd
# and dX at 17..64 rows of X: the launches the path runs).
TILE_GUESS_SWEEP = [(16, 4, 2, 1), (32, 4, 2, 1), (32, 2, 2, 1), (32, 2, 2, 2), (64, 4, 2, 1),
                    (64, 2, 2, 2)]
# (rows, group, stages, CTAs per SM) of the streaming kernel with X's scales taken in the
# kernel (X in fp32, M <= 16).
INLINE_SWEEP = [(8, 2, 4, 2), (8, 2, 3, 2), (8, 2, 2, 2), (8, 1, 4, 2), (8, 4, 2, 2),
                (8, 2, 3, 1), (16, 1, 3, 1), (16, 2, 2, 1)]
# (rows, group, stages, CTAs per SM) of the streaming kernel with guessed W scales (X in fp32
# from 8 rows of X, with its scales taken in the kernel up to 4).
GUESS_SWEEP = [(8, 2, 3, 2), (8, 2, 4, 2), (8, 2, 5, 2), (8, 4, 3, 2), (8, 1, 6, 2),
               (8, 2, 2, 2), (16, 1, 4, 1), (8, 2, 6, 1), (16, 1, 3, 1), (16, 1, 2, 1),
               (8, 1, 4, 1), (4, 2, 2, 2), (4, 2, 3, 2), (4, 2, 2, 3), (2, 2, 2, 2), (2, 2, 3, 3)]
# Per-CTA byte targets of the cluster sweep (`split_decode.cluster_shape`).
CLUSTER_BUDGETS = (32 * 1024, 44 * 1024, 56 * 1024, 72 * 1024, 100 * 1024)
PLAN = TimingPlan(target_ms=0.5, reps=7, min_reps=3, budget_ms=20.0, warm_rounds=1,
                  warm_replays=1, est_min_ms=0.3)


# Units that force one kernel and shape.
FORCED = ("fused_", "cluster", "stream", "tile", "inline", "guess_")


def split_path(s):
    with split_decode.fused(False):
        return dg.linear(s[0], s[1])


def forced(m, n, rows, group, stages, per_sm, sms, x_fp32=False):
    if m > split_decode.MAX_M:
        return None
    m_rows = split_decode.m_rows_for(m)
    smem = split_decode.smem_bytes(m_rows, rows, group, stages, x_fp32)
    if smem * per_sm > split_decode.SMEM_LIMIT:
        return None
    shape = split_decode.StreamShape(m_rows, rows, group, stages,
                                     min(-(-n // rows), per_sm * sms), x_fp32)
    return lambda s: split_decode.decode_gemm(s[0], s[1], None, shape)


def forced_inline(m, n, rows, group, stages, per_sm, sms):
    """The streaming kernel with X in fp32 and its row scales taken in the kernel."""
    if m > 16:
        return None
    m_rows = split_decode.m_rows_for(m)
    smem = split_decode.smem_bytes(m_rows, rows, group, stages, True, True)
    if smem * per_sm > split_decode.SMEM_LIMIT:
        return None
    shape = split_decode.StreamShape(m_rows, rows, group, stages,
                                     min(-(-n // rows), per_sm * sms), True, True)
    return lambda s: split_decode.decode_gemm(s[0], s[1], None, shape)


def forced_guess(m, n, rows, group, stages, per_sm, sms):
    """The streaming kernel with guessed W scales at one launch shape."""
    m_rows = split_decode.m_rows_for(m)
    inline = m_rows <= split_decode.X_INLINE_M
    x_fp32 = inline or m_rows >= split_decode.X_FP32_M
    smem = split_decode.smem_bytes(m_rows, rows, group, stages, x_fp32, inline, True)
    if m > split_decode.MAX_M or smem * per_sm > split_decode.SMEM_LIMIT:
        return None
    shape = split_decode.StreamShape(m_rows, rows, group, stages,
                                     min(-(-n // rows), per_sm * sms), x_fp32, inline, True)
    return lambda s: split_decode.decode_gemm(s[0], s[1], None, shape)


def cold(shape):
    """`shape` with guessed scales that are all wrong: the weight's buffer zeroed first."""
    def run(s):
        split_decode.guesses(s[1]).zero_()
        return split_decode.decode_gemm(s[0], s[1], None, shape)
    return run


def forced_tile(m, n, rows, group, stages, per_sm, sms, guess=False, kn=False):
    """The tile kernel at one launch shape (`guess`: W's scales guessed; `kn`: dX's W read
    in place), or None where the shape does not fit M or `per_sm` CTAs' shared memory."""
    m_rows = max(16, split_decode.m_rows_for(m))
    if (m > split_decode.MAX_M or (m_rows // 16) * (rows // 8) < 8
            or split_decode.tile_smem_bytes(m_rows, rows, group, stages, guess, kn) * per_sm
            > split_decode.SMEM_LIMIT):
        return None
    shape = split_decode.TileShape(m_rows, rows, group, stages,
                                   min(-(-n // rows), per_sm * sms), guess)
    if kn:
        return lambda s: split_decode.decode_gemm_kn(s[0], s[1], None, False, shape)
    return lambda s: split_decode.decode_gemm(s[0], s[1], None, shape)


def forced_cluster(m, k, budget=split_decode.CLUSTER_CTA_BYTES):
    if m > split_decode.MAX_M or torch.cuda.get_device_capability() < (9, 0):
        return None, None
    shape = split_decode.cluster_shape(m, k, budget)
    if shape is None:
        return None, None
    return shape, lambda s: split_decode.decode_gemm(s[0], s[1], None, shape)


def tile_guess_units(m, n, sms, kn) -> dict:
    """``--sweep tile_guess``: the guessing tile kernel at each `TILE_GUESS_SWEEP` shape
    that fits (`kn`: dX's in-place read)."""
    return {"tileg_" + "_".join(map(str, shape)): forced_tile(m, n, *shape, sms, True, kn)
            for shape in TILE_GUESS_SWEEP}


def measure(m, k, n, sweep, l2, cap, sms) -> dict:
    sets = [(torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"))
            for _ in range(min(8, n_sets_for(4 * (m + n) * k, l2, PLAN)))]
    for s in sets:  # the weights' guess buffers, as a call before capture would make them
        split_decode.guesses(s[1])
    units = {"detgemm_fp32": lambda s: dg.linear(s[0], s[1]), "split_path": split_path,
             "cublas_sgemm": lambda s: sgemm(s[0], s[1], False),
             "read_w": lambda s: torch.linalg.vector_norm(s[1], float("inf"), dim=-1)}
    stream_shape = split_decode.stream_shape(m, n, k, sets[0][0].device)
    if m <= split_decode.MAX_M and sweep != "tile_guess":
        units["stream"] = lambda s: split_decode.decode_gemm(s[0], s[1], None, stream_shape)
        twopass = stream_shape._replace(w_guess=False)
        units["stream_twopass"] = lambda s: split_decode.decode_gemm(s[0], s[1], None, twopass)
        if stream_shape.w_guess:
            units["stream_cold"] = cold(stream_shape)
        tile = split_decode.default_shape(m, n, k, sets[0][0].device)
        if isinstance(tile, split_decode.TileShape):
            tile_twopass = tile._replace(w_guess=False)
            units["tile_twopass"] = lambda s: split_decode.decode_gemm(s[0], s[1], None,
                                                                       tile_twopass)
        if m <= split_decode.CLUSTER_M or sweep in ("all", "cluster"):
            units["cluster"] = forced_cluster(m, k)[1]
    if sweep in ("all", "cluster"):
        for budget in CLUSTER_BUDGETS:
            shape, fn = forced_cluster(m, k, budget)
            if fn is not None:
                units[f"cluster_{'_'.join(map(str, shape[1:]))}"] = fn
    if sweep in ("all", "stream"):
        for rows, group, stages, per_sm, x_fp32 in SWEEP:
            fn = forced(m, n, rows, group, stages, per_sm, sms, x_fp32)
            if fn is not None:
                x = "_x" if x_fp32 else ""
                units[f"fused_r{rows}_g{group}_s{stages}_c{per_sm}{x}"] = fn
    if sweep in ("all", "inline"):
        for rows, group, stages, per_sm in INLINE_SWEEP:
            units[f"inline_r{rows}_g{group}_s{stages}_c{per_sm}"] = forced_inline(
                m, n, rows, group, stages, per_sm, sms)
    if sweep in ("all", "guess"):
        for rows, group, stages, per_sm in GUESS_SWEEP:
            units[f"guess_r{rows}_g{group}_s{stages}_c{per_sm}"] = forced_guess(
                m, n, rows, group, stages, per_sm, sms)
    if sweep in ("all", "tile"):
        for rows, group, stages, per_sm in TILE_SWEEP:
            units[f"tile_r{rows}_g{group}_s{stages}_c{per_sm}"] = forced_tile(
                m, n, rows, group, stages, per_sm, sms)
    if sweep == "tile_guess":
        units.update(tile_guess_units(m, n, sms, False))
    units = {nm: fn for nm, fn in units.items() if fn is not None}
    res = time_units(units, sets, PLAN, cap)
    us = {nm: r.get("us") for nm, r in res.items()}
    ref = split_path(sets[0]).view(torch.int32)
    same = {nm: torch.equal(units[nm](sets[0]).view(torch.int32), ref)
            for nm in units if nm not in ("split_path", "cublas_sgemm", "read_w")}
    shape = split_decode.default_shape(m, n, k, sets[0][0].device)
    row = {"M": m, "K": k, "N": n, "cluster": isinstance(shape, split_decode.ClusterShape),
           "tile": isinstance(shape, split_decode.TileShape),
           "fused": split_decode.applies(sets[0][0], sets[0][1], None, "fwd"),
           "launch_shape": shape, "us": us,
           "bits_equal_split_path": same,
           "errors": {nm: r["error"] for nm, r in res.items() if "error" in r}}
    gpu.log(f"{m}x{k}x{n}: fp32 {us['detgemm_fp32']} us (split path {us['split_path']}); "
            f"sgemm {us['cublas_sgemm']}; read W {us['read_w']}; bits {same}; "
            + " ".join(f"{nm}={v}" for nm, v in us.items() if nm.startswith(FORCED)))
    del sets
    return row


# (rows, group, stages, CTAs per SM) of the in-place [K, N] sweep (``--op dx --sweep kn``).
KN_SWEEP = [(8, 2, 2, 2), (8, 2, 3, 2), (8, 1, 4, 2), (16, 1, 2, 1), (16, 1, 3, 1),
            (16, 1, 4, 1), (16, 2, 2, 1), (8, 2, 4, 1)]


def forced_kn(m, n, k, rows, group, stages, per_sm, sms):
    """The in-place [K, N] streaming kernel at one launch shape (X's form as its guessing
    `launch_shape` takes it), or None where its shared memory does not fit `per_sm` CTAs."""
    base = split_decode.launch_shape(m, n, k, sms, split_decode.SMEM_LIMIT, True)
    smem = split_decode.smem_bytes(base.m_rows, rows, group, stages, base.x_fp32,
                                   base.x_inline, True, True)
    if smem > (split_decode.SMEM_LIMIT if per_sm == 1 else split_decode._SMEM_BYTES):
        return None
    shape = base._replace(rows=rows, group=group, stages=stages,
                          ctas=min(-(-n // rows), per_sm * sms))
    return lambda s: split_decode.decode_gemm_kn(s[0], s[1], None, False, shape)


def measure_dx(m, k, n, sweep, l2, cap, sms) -> dict:
    """dX of the weight W [N, K] at M rows of dY (see the module docstring)."""
    sets = []
    for _ in range(min(8, n_sets_for(4 * (m + k) * n, l2, PLAN))):
        dy, w = torch.randn(m, n, device="cuda"), torch.randn(n, k, device="cuda")
        split_decode.guesses(w.t(), of=w)  # as a call before capture would make it
        sets.append((dy, w))
    units = {"detgemm_fp32": lambda s: dg.input_grad(s[0], s[1]), "split_path": split_path_dx,
             "via_copy": lambda s: split_decode.decode_gemm_kn(s[0], s[1], None, True),
             "transpose": lambda s: staging.transposed(s[1], n),
             "cublas_sgemm": lambda s: mm_tf32(s[0], s[1], False),
             "read_w": lambda s: torch.linalg.vector_norm(s[1], float("inf"), dim=-1)}
    if sweep == "kn" and m <= split_decode.MAX_M:
        for shape in KN_SWEEP:
            fn = forced_kn(m, k, n, *shape, sms)
            if fn is not None:
                units["kn_" + "_".join(map(str, shape))] = fn
    if sweep == "tile_guess" and split_decode.kn_in_place(sets[0][1]):
        del units["via_copy"], units["transpose"]
        units.update({nm: fn for nm, fn in tile_guess_units(m, k, sms, True).items()
                      if fn is not None})
    res = time_units(units, sets, PLAN, cap)
    us = {nm: r.get("us") for nm, r in res.items()}
    ref = split_path_dx(sets[0]).view(torch.int32)
    same = {nm: torch.equal(units[nm](sets[0]).view(torch.int32), ref) for nm in units
            if nm not in ("split_path", "transpose", "cublas_sgemm", "read_w")}
    row = {"M": m, "K": k, "N": n, "fused": split_decode.applies_kn(sets[0][0], sets[0][1],
                                                                    None, "dx"),
           "in_place": split_decode.kn_in_place(sets[0][1]),
           "launch_shape": split_decode.kn_shape(m, k, n, sms),
           "us": us, "bits_equal_split_path": same,
           "errors": {nm: r["error"] for nm, r in res.items() if "error" in r}}
    gpu.log(f"dx {m}x{k}x{n}: fp32 {us['detgemm_fp32']} us (split path {us['split_path']}; "
            f"via copy {us.get('via_copy')}, transpose {us.get('transpose')}); sgemm "
            f"{us['cublas_sgemm']}; read W {us['read_w']}; bits {same}; "
            + " ".join(f"{nm}={v}" for nm, v in us.items() if nm.startswith(("kn_", "tileg_"))))
    del sets
    return row


def split_path_dx(s):
    with split_decode.fused_kn(False):
        return dg.input_grad(s[0], s[1])


def _vs_sgemm(us, t) -> str:
    """SGEMM's time over `t` (a row's `us`), or "-"."""
    return "-" if not (t and us["cublas_sgemm"]) else f"{us['cublas_sgemm'] / t:.2f}"


def report_dx(rows, meta) -> list[str]:
    f = lambda v: "-" if not v else f"{v:.1f}"  # noqa: E731
    timed = [r for r in rows if r["us"].get("cublas_sgemm") and r["us"].get("detgemm_fp32")
             and r["us"].get("split_path")]
    speed = [r["us"]["cublas_sgemm"] / r["us"]["detgemm_fp32"] for r in timed]
    before = [r["us"]["cublas_sgemm"] / r["us"]["split_path"] for r in timed]
    gain = [r["us"]["split_path"] / r["us"]["detgemm_fp32"] for r in timed]
    copy = [r["us"]["via_copy"] / r["us"]["detgemm_fp32"] for r in timed
            if r["us"].get("via_copy")]
    bits = all(all(r["bits_equal_split_path"].values()) for r in rows)
    lines = [f"# fp32 \"ieee\" dX at decode sizes ({meta['device']})", "",
             f"torch {torch.__version__}; CUDA-graph medians, us; one run. dX = dY [M, N] @ W "
             "[N, K] for a weight K -> N. `detgemm fp32`: `dg.input_grad` (the fused path "
             "where `applies_kn`, reading W's columns in place where `kn_in_place`); `split "
             "path`: W split in place down its columns, then the chunked GEMM; `via copy`: the "
             "fused path on W's K-major copy; `transpose`: that copy alone; `read W`: one read "
             "of W.", "",
             f"vs SGEMM (dY @ W, TF32 off): detgemm {geomean(speed) or 0:.2f}x (min "
             f"{min(speed) if speed else 0:.2f}x, {sum(v < 0.8 for v in speed)} below 0.8x), "
             f"the split path {geomean(before) or 0:.2f}x ({sum(v < 0.8 for v in before)} "
             f"below 0.8x) over {len(timed)} problems; detgemm {geomean(gain) or 0:.2f}x the "
             f"split path's speed (min {min(gain) if gain else 0:.2f}x), "
             f"{geomean(copy) or 0:.2f}x via the copy's (min {min(copy) if copy else 0:.2f}x); "
             f"bits equal the split path on every problem: {bits}.", "",
             "| M | weight K -> N | fused | detgemm fp32 | split path | via copy | transpose "
             "| SGEMM | read W | vs SGEMM | split path vs SGEMM | best forced |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = r["us"]
        forced_us = {nm: v for nm, v in us.items() if nm.startswith(("kn_", "tileg_")) and v}
        best = min(forced_us, key=forced_us.get) if forced_us else None
        fused = ("in place" if r.get("in_place") else "copy") if r["fused"] else "no"
        lines.append(f"| {r['M']} | {r['K']} -> {r['N']} | {fused} | "
                     f"{f(us['detgemm_fp32'])} | {f(us['split_path'])} | "
                     f"{f(us.get('via_copy'))} | {f(us.get('transpose'))} | "
                     f"{f(us['cublas_sgemm'])} | {f(us['read_w'])} | "
                     f"{_vs_sgemm(us, us['detgemm_fp32'])} | "
                     f"{_vs_sgemm(us, us['split_path'])} | {best or '-'} "
                     f"{f(forced_us.get(best))} |")
    return lines


def report(rows, meta) -> list[str]:
    f = lambda v: "-" if not v else f"{v:.1f}"  # noqa: E731
    speed = [r["us"]["cublas_sgemm"] / r["us"]["detgemm_fp32"] for r in rows
             if r["us"].get("cublas_sgemm") and r["us"].get("detgemm_fp32")]
    low = [r for r in rows if r["us"].get("cublas_sgemm") and r["us"].get("detgemm_fp32")
           and r["us"]["cublas_sgemm"] / r["us"]["detgemm_fp32"] < 0.8]
    bits = all(all(r["bits_equal_split_path"].values()) for r in rows)
    guessed = [r["us"]["stream_twopass"] / r["us"]["stream"] for r in rows
               if r["us"].get("stream_twopass") and r["us"].get("stream")
               and r["us"].get("stream_cold")]
    tiled = [r["us"]["tile_twopass"] / r["us"]["detgemm_fp32"] for r in rows
             if r["us"].get("tile_twopass") and r["us"].get("detgemm_fp32")]
    cold = [r["us"]["stream_twopass"] / r["us"]["stream_cold"] for r in rows
            if r["us"].get("stream_twopass") and r["us"].get("stream_cold")]
    lines = [f"# fp32 \"ieee\" at decode sizes ({meta['device']})", "",
             f"torch {torch.__version__}; CUDA-graph medians, us; one run. `read W`: one read of "
             "the fp32 weight (its row maxima), the floor of any kernel that reads it.", "",
             f"detgemm vs SGEMM: geomean {geomean(speed) or 0:.2f}x over {len(speed)} "
             f"problems, min {min(speed) if speed else 0:.2f}x, {len(low)} below 0.8x; bits "
             f"equal the split path on every problem: {bits}.", "",
             f"Streaming kernel with guessed W scales vs the same launch taking W's row maxima "
             f"first (`stream` vs `stream_twopass`): {geomean(guessed) or 0:.3f}x the speed "
             f"over {len(guessed)} problems (min {min(guessed) if guessed else 0:.2f}x); every "
             f"guess wrong (`stream_cold`): {geomean(cold) or 0:.3f}x. The tile kernel where "
             f"the path runs it, vs `tile_twopass`: {geomean(tiled) or 0:.3f}x over "
             f"{len(tiled)} problems.", "",
             "| M | K | N | detgemm fp32 | launch: cluster (X rows, CTAs, cap, groups), tile (X "
             "rows, W rows, group, stages, CTAs) or stream (X rows, W rows, group, stages, CTAs, "
             "X fp32, X scales inline) "
             "| stream | two-pass | cold | cluster | split path | SGEMM | read W | vs SGEMM "
             "| split path vs SGEMM | best forced |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = r["us"]
        forced_us = {nm: v for nm, v in us.items()
                     if nm.startswith(FORCED) and nm != "stream_cold" and v}
        best = min(forced_us, key=forced_us.get) if forced_us else None
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {f(us['detgemm_fp32'])} | "
                     f"{_launch(r)} | {f(us.get('stream'))} | {f(us.get('stream_twopass'))} | "
                     f"{f(us.get('stream_cold'))} | {f(us.get('cluster'))} | "
                     f"{f(us['split_path'])} | {f(us['cublas_sgemm'])} | {f(us['read_w'])} | "
                     f"{_vs_sgemm(us, us['detgemm_fp32'])} | "
                     f"{_vs_sgemm(us, us['split_path'])} | {best or '-'} "
                     f"{f(forced_us.get(best))} |")
    return lines


def _launch(r) -> str:
    if not r["fused"]:
        return "split path"
    shape = tuple(r["launch_shape"])
    kind = "cluster" if r.get("cluster") else "tile" if r.get("tile") else "stream"
    return f"{kind} {shape}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--m-list", help="comma-separated M (default: 1..64 in powers of two)")
    ap.add_argument("--kn", help="comma-separated KxN pairs (default: DECODE_KN)")
    ap.add_argument("--op", choices=["fwd", "dx"], default="fwd",
                    help="dx: dY @ W per weight (`measure_dx`) instead of the forward")
    ap.add_argument("--sweep", nargs="?", const="all",
                    choices=["all", "cluster", "stream", "tile", "inline", "guess", "kn",
                             "tile_guess"],
                    help="also time the forced shapes of both kernels (or of one)")
    ap.add_argument("--max-seconds", type=float, default=300.0)
    args = ap.parse_args()
    err, _ = gpu.gpu_check()
    if err:
        print(f"bench_fp32_decode: {err}", file=sys.stderr)
        return 1
    ms = [int(v) for v in args.m_list.split(",")] if args.m_list else DECODE_M
    kns = ([tuple(int(x) for x in p.split("x")) for p in args.kn.split(",")] if args.kn
           else DECODE_KN)
    meta, l2, cap = gpu.device_meta(), gpu.l2_bytes(), torch.cuda.Stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    slug = device_slug(meta["device"])
    if args.op == "dx":
        run_time_boxed([(k, n, m) for k, n in kns for m in ms],
                       lambda p: measure_dx(p[2], p[0], p[1], args.sweep, l2, cap, sms),
                       Path(args.out) / f"fp32-decode-dx_{slug}", meta, args.max_seconds,
                       report_dx)
        return 0
    run_time_boxed([(k, n, m) for k, n in kns for m in ms],
                   lambda p: measure(p[2], p[0], p[1], args.sweep, l2, cap, sms),
                   Path(args.out) / f"fp32-decode_{slug}", meta, args.max_seconds, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
