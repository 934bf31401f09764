"""What the candidate sweeps (`sweep_grouped.py`, `sweep_bmm.py`), the path A/Bs
(`ab_paths.py`, `bench_fp32.py`) and the probes share: the candidates declared as the alternatives of one user
bucket (so each is forced by name), one timed row of candidates and peers, the records file,
a dispatch policy replaced for a comparison, and a probe's `--out` argument."""

import argparse
import contextlib
import json
import sys
from pathlib import Path

from detgemm_cute import batched, gemm, registry
from detgemm_cute.benchlib import gpu
from detgemm_cute.benchlib.timing import time_units
from detgemm_cute.tune.layer import yaml_value


@contextlib.contextmanager
def policy_replaced(module, name: str, replacement):
    """Within: `module.name` (a plan policy of `gemm` or `batched`, e.g. `stores_direct`) is
    `replacement`; the plans are dropped on entry and on exit, so each side builds its own."""
    saved = getattr(module, name)
    setattr(module, name, replacement)
    gemm._plans.clear(), batched._plans.clear()
    try:
        yield
    finally:
        setattr(module, name, saved)
        gemm._plans.clear(), batched._plans.clear()


def staged_a_rows():
    """Within: A's unaligned rows copied into padded rows for TMA instead of read by the
    producer warpgroup (`batched.reads_a_rows` off); plans dropped on entry and exit."""
    return policy_replaced(batched, "reads_a_rows", lambda *a: False)


# The candidates' bucket serves K = 1 only, a K no swept problem has: each candidate runs
# where it is forced by name, and an unforced call still runs the built-in table. (A bucket
# serving every M shadowed the table: the broad bmm sweep of 2026-11-26 timed its first
# candidate, a 64x64 tile, as the table's own choice.)
CANDIDATE_K = (1, 1)


def candidate_layer(path: Path, op: str, name: str, candidates,
                    dtypes=("bf16", "fp16")) -> list[str]:
    """Write `candidates` (dicts of kernel fields: tile, cluster, stages, persistent, ...) as
    the alternatives of one bucket `name` of `op` (for `dtypes`) serving only K = 1
    (`CANDIDATE_K`), add the layer, and return the alternatives' bucket names (each is forced
    by name)."""
    alts = "".join("      - {" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in c.items())
                   + f", cost: [{int(i > 0)}, 0, 0, 0]}}\n" for i, c in enumerate(candidates))
    path.write_text(f"arch: sm90\nbuckets:\n  - name: {name}\n    op: {op}\n"
                    f"    dtypes: [{', '.join(dtypes)}]\n    m: [1, null]\n"
                    f"    k: {list(CANDIDATE_K)}\n    sms: 132\n"
                    "    alternatives:\n" + alts)
    layer = registry.add_config(path)
    return [b.name for b in layer.buckets]


def time_candidates(fns: dict, sets, plan, cap_stream, names):
    """Time every call of `fns` on `sets` in one interleaved `time_units` run: ({name: us},
    {name: error}, (best candidate's us, its name))."""
    res = time_units(fns, sets, plan, cap_stream)
    us = {nm: r.get("us") for nm, r in res.items()}
    errors = {nm: r["error"] for nm, r in res.items() if "error" in r}
    return us, errors, min((v, nm) for nm, v in us.items() if v and nm in names)


def write_records(out: str, names, rows, fields=None, rows_key="rows", **meta) -> None:
    """The sweep's JSON: the device (and `meta`), the candidates' names (and with `fields`
    their kernel fields, {name: {tile, cluster, stages, ...}}), one row per problem (under
    `rows_key`: "records" is what `detgemm-cute tune-fit` reads)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    record = {"meta": {**gpu.device_meta(), **meta}, "candidates": names, rows_key: rows}
    if fields is not None:
        record["candidate_fields"] = fields
    tmp = Path(f"{out}.tmp")  # rewritten after every problem: a run killed mid-write keeps
    tmp.write_text(json.dumps(record, indent=1))  # the previous complete file
    tmp.replace(out)


def write_probe(out: str, rows) -> int:
    """A probe's JSON: the device and one row per problem; 0 (the probe's exit status)."""
    with open(out, "w") as f:
        json.dump({"meta": gpu.device_meta(), "rows": rows}, f, indent=1)
    return 0


def no_gpu() -> bool:
    """True, after printing why, when this machine cannot run a sweep or probe (no usable
    GPU)."""
    err, _ = gpu.gpu_check()
    if err:
        print(err, file=sys.stderr)
    return bool(err)


def probe_args(doc: str, argv=None):
    """A probe's arguments (`--out FILE`), or None after printing why this machine cannot run
    it (no usable GPU)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return None if no_gpu() else args
