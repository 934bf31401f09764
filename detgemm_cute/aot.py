"""Ahead-of-time compilation of every bucket, with an audit of the generated PTX.

Runs on a CPU-only machine (`--gpu-arch sm_90a` for the SM90 family, `sm_80` -- or `sm_86`,
`sm_90`, ... -- for the SM80 family): CI uses it to prove that every bucket the tables
declare builds, that the kernels use the instructions of their family (WGMMA and TMA bulk
copies on SM90; mma.sync m16n8k16, cp.async and ldmatrix on SM80), and that no atomic or
reduction instruction (the usual way a GEMM becomes order-dependent) is in the code.
"""

from __future__ import annotations

import re
import tempfile
import time

from . import aot_cache
from . import compile as kcompile
from . import registry
from .batched import plan_key, reads_a_rows, with_a_loads
from .gemm import stores_direct
from .kernels import sm90_limits

_BANNED = re.compile(r"^\s*(?:@!?%p\d+\s+)?(atom|red)\.", re.M)
# A function call (printf's vprintf, an out-of-line helper): with one anywhere in a kernel,
# ptxas issues every WGMMA alone (warning C7510), 1.09x a tile's time on an H200.
_CALL = re.compile(r"^\s*(?:@!?%p\d+\s+)?call(?:\.uni)?\b", re.M)
# Per kernel family: (what the audit reports missing, pattern that must occur in the PTX).
_REQUIRED = {
    "sm90": (("wgmma.mma_async", r"wgmma\.mma_async"),
             ("cp.async.bulk.tensor", r"cp\.async\.bulk\.tensor")),
    "sm80": (("mma.sync.aligned.m16n8k16", r"mma\.sync\.aligned\.m16n8k16"),
             ("cp.async (non-bulk)", r"cp\.async\.c[ag]\.shared\.global"),
             ("ldmatrix", r"ldmatrix\.sync\.aligned")),
}

# tf32 buckets: the family's TF32 MMA in place of its 16-bit one (the first requirement).
_TF32_MMA = {"sm90": ("wgmma.mma_async ... .f32.tf32.tf32",
                      r"wgmma\.mma_async\S*\.f32\.tf32\.tf32"),
             "sm80": ("mma.sync.aligned.m16n8k8 ... .f32.tf32.tf32",
                      r"mma\.sync\.aligned\.m16n8k8\S*\.f32\.tf32\.tf32")}

# "core": one key per bucket and dtype plus an fp32-output, [K, N]-weight variant;
# "all": every dtype x output x layout x bias combination the op layer can ask for.
_LAYOUTS = (("k", "nk", "last"), ("k", "kn", "first"), ("k", "kn", "last"), ("m", "nk", "last"))


def audit_ptx(ptx: str, family: str = "sm90", dtype: str | None = None,
              pdl: bool = False, offs_report: bool = False) -> list[str]:
    """Problems with one kernel's PTX (empty when it passes); `family` is the registry arch
    of the kernel ("sm90" or "sm80"), which decides the instructions that must be there;
    `dtype` "tf32" requires the family's TF32 MMA instead of its 16-bit one; `pdl` (a kernel
    launched with programmatic dependent launch) requires `griddepcontrol.wait` before the
    first instruction that reads or writes global memory. An sm90 kernel may not call a
    function (`_CALL`), except the printf of a grouped kernel built to report a bad offs
    entry (`offs_report`, a debugging build: `compile.report_offs`)."""
    required = _REQUIRED[family]
    if dtype == "tf32":
        required = (_TF32_MMA[family],) + required[1:]
    problems = [f"missing {name}" for name, pat in required if not re.search(pat, ptx)]
    problems += [f"forbidden instruction {m.group(1)}." for m in _BANNED.finditer(ptx)][:1]
    if family == "sm90" and not offs_report and _CALL.search(ptx):
        problems.append("a function call: ptxas then serializes every WGMMA (C7510)")
    if pdl:
        problems += pdl_order_problems(ptx)
    return problems


# Instructions that read or write global memory (a TMA load or store, a thread's load,
# store, atomic or cp.async from global, with any qualifiers before `.global`): with PDL,
# none may come before griddepcontrol.wait.
_GLOBAL_ACCESS = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|atom|red)(?:\.\w+)*\.global\S*|cp\.async\.bulk\.tensor\S*|"
    r"cp\.async\.bulk\.(?!prefetch)\S*|cp\.async\.c[ag]\S*|cp\.reduce\.async\S*)", re.M)
_GRID_WAIT = re.compile(r"^\s*griddepcontrol\.wait\s*;", re.M)


def pdl_order_problems(ptx: str) -> list[str]:
    """With PDL the kernel may run under the previous kernel's tail: every global access
    must come after `griddepcontrol.wait` in the code (the kernels' prologues are straight
    line, so code order is the order of execution up to the wait)."""
    wait = _GRID_WAIT.search(ptx)
    if wait is None:
        return ["missing griddepcontrol.wait (a PDL kernel)"]
    first = _GLOBAL_ACCESS.search(ptx)
    if first is not None and first.start() < wait.start():
        return [f"{first.group(1)} before griddepcontrol.wait (a PDL kernel)"]
    return []


def _split_variants(bucket, which: str, family: str = "sm90"):
    """fp32 buckets: the split operands are K-major [rows, K'] 16-bit parts (B as [N, K']:
    fp16 for fwd/dx, bf16 for dW), the output the fp32 accumulator (bias and rounding come
    after); dW from +0.0 or continuing a buffer. On sm90 a fwd or dx bucket's B may also be
    parts split in place, N-major [K', N] (`split.scaled_columns_cuda`: dX's weight, mm's
    [K, N] one)."""
    base = dict(dtype="bf16" if bucket.op == "dw" else "fp16", out_dtype="fp32", a_major="k",
                b_form="nk", b_contig="last", has_bias=False, split=True)
    for acc in ((False, True) if bucket.op == "dw" else (False,)):
        yield dict(base, accumulate=acc)
    if bucket.op in ("fwd", "dx") and family == "sm90":
        yield dict(base, b_form="kn", accumulate=False)


def _tf32_variants(bucket, which: str):
    """tf32 buckets: fp32 operands, both K-major (the op layer stages any other layout),
    except a swapped dx bucket's A where its tile reads A through registers (the weight as
    it lies, M-major: `gemm._make_plan`);
    "core": fp32 out (with bias for fwd); "all": every output dtype, with and without bias."""
    in_regs = (bucket.op == "dx" and bucket.swap_ab  # swapped buckets are sm90's
               and sm90_limits.reads_a_in_registers(bucket.tile[0], bucket.pingpong))
    base = dict(dtype="tf32", a_major="m" if in_regs else "k", b_form="nk", b_contig="last")
    if bucket.op == "bmm":  # one launch per batch; B [L, K, N] K-first is the "kn" view
        yield dict(base, b_form="kn", b_contig="first", out_dtype="fp32", has_bias=False,
                   batched=True)
        return
    if which == "core":
        yield dict(base, out_dtype="fp32", has_bias=bucket.op == "fwd")
        return
    for out in ("fp32", "bf16", "fp16"):
        for bias in (False, True):
            yield dict(base, out_dtype=out, has_bias=bias)


def _variants(bucket, which: str, family: str = "sm90"):
    """The kernel keys to build for one bucket: per op, the layouts its calls use."""
    if "fp32" in bucket.dtypes:
        yield from _split_variants(bucket, which, family)
        return
    if "tf32" in bucket.dtypes:
        yield from _tf32_variants(bucket, which)
        return
    if bucket.op == "dw":  # fp32 out, no bias; from +0.0 or continuing a buffer
        layouts = _LAYOUTS if which == "all" else (("m", "kn", "last"), ("m", "nk", "last"))
        for dtype in bucket.dtypes:
            for a_major, b_form, b_contig in layouts:
                for acc in (False, True):
                    yield dict(dtype=dtype, out_dtype="fp32", a_major=a_major, b_form=b_form,
                               b_contig=b_contig, has_bias=False, accumulate=acc)
        return
    if bucket.op == "grouped_k":
        # grouped_mm's 2-D x 2-D form: a = x^T M-contiguous, b = dy N-contiguous (the one
        # layout the kernel reads; grouped_k copies others into it)
        for dtype in bucket.dtypes:
            for out in ((dtype,) if which == "core" else (dtype, "fp32")):
                yield dict(dtype=dtype, out_dtype=out, a_major="m", b_form="kn",
                           b_contig="last", has_bias=False, grouped_k=True)
        return
    if bucket.op in ("bmm", "grouped"):
        # bmm: one launch per batch, q @ k^T (B a transposed view) and p @ v; grouped: expert
        # weights [G, K, N] with K or N contiguous (or staged, "all"), x K-major.
        core = (("k", "kn", "first"), ("k", "kn", "last"))
        layouts = core if which == "core" else (
            _LAYOUTS if bucket.op == "bmm" else core + (("k", "nk", "last"),))
        kind = {"batched": True} if bucket.op == "bmm" else {"grouped": True}
        for dtype in bucket.dtypes:
            for out in ((dtype,) if which == "core" else (dtype, "fp32")):
                for a_major, b_form, b_contig in layouts:
                    yield dict(dtype=dtype, out_dtype=out, a_major=a_major, b_form=b_form,
                               b_contig=b_contig, has_bias=False, **kind)
        return
    core = ("k", "nk", "last", True) if bucket.op == "fwd" else ("k", "kn", "last", False)
    for dtype in bucket.dtypes:
        if which == "core":
            a_major, b_form, b_contig, bias = core
            yield dict(dtype=dtype, out_dtype=dtype, a_major=a_major, b_form=b_form,
                       b_contig=b_contig, has_bias=bias)
            continue
        for out in (dtype, "fp32"):
            for a_major, b_form, b_contig in _LAYOUTS:
                for bias in (False, True):
                    yield dict(dtype=dtype, out_dtype=out, a_major=a_major, b_form=b_form,
                               b_contig=b_contig, has_bias=bias)
    if which == "core":
        dtype = "bf16" if "bf16" in bucket.dtypes else bucket.dtypes[0]
        yield dict(dtype=dtype, out_dtype="fp32", a_major="k", b_form="kn", b_contig="last",
                   has_bias=False)


def _direct_aligns(call: dict) -> tuple:
    """`KernelKey.c_align`s of the direct-store twins of `call` (`gemm.direct_align`): bmm
    and grouped-K allocate their outputs, so their threads store 8 bytes at once where the
    row pitch allows it (8), else element by element (0); other ops always the latter."""
    return (0, 8) if call.get("batched") or call.get("grouped_k") else (0,)


def _bucket_keys(bucket, arch: str, which: str):
    """(call, kernel key) for each variant of `bucket` that `which` covers; "all" adds the
    direct-store twin of each key whose outputs at an unaligned width the kernel's threads
    store (`gemm.stores_direct`; bmm's as its plans run them: the bucket's `direct` or
    `direct_vector` kernel, `batched.plan_key`) and, for
    bmm, the twin that reads a K-major A of unaligned rows with the producer warpgroup
    (`batched.reads_a_rows`), so a warmed cache serves those widths too."""
    family = kcompile.family_of(arch)
    for call in _variants(bucket, which, family):
        if not kcompile.a_major_builds(arch, bucket.tile[0], call["a_major"]):
            continue  # never asked for: the op layer stages such an A first
        key = kcompile.KernelKey.for_bucket(bucket, arch=arch, **call)
        yield call, key
        plain = not (call.get("split") or call.get("accumulate") or call.get("grouped")
                     or call["dtype"] == "tf32")  # grouped_k stores like a plain GEMM
        if which == "all" and stores_direct(family, bucket, plain):
            for align in _direct_aligns(call):
                own = bucket.direct_kernel(align) or bucket
                twin = kcompile.KernelKey.for_bucket(own, arch=arch, c_direct=True,
                                                     c_align=align, **call)
                yield ({**call, "c_direct": True, "c_align": align},
                       plan_key(twin) if call.get("batched") else twin)
        if (which == "all" and bucket.op == "bmm" and plain and call["a_major"] == "k"
                and reads_a_rows(family, bucket)):
            yield {**call, "a_loads": True}, plan_key(with_a_loads(key))


def _label(name: str, call: dict) -> str:
    return (f"{name:24s} {call['dtype']}->{call['out_dtype']} A{call['a_major']} "
            f"B{call['b_form']}/{call['b_contig']} bias={int(call['has_bias'])}"
            + (" acc" if call.get("accumulate") else "")
            + (" batched" if call.get("batched") else "")
            + (" grouped" if call.get("grouped") else "")
            + (" grouped-k" if call.get("grouped_k") else "")
            + (" split(fp32)" if call.get("split") else "")
            + (" direct-store" if call.get("c_direct") else "")
            + (f" {call['c_align']}-byte" if call.get("c_align") else "")
            + (" tf32" if call["dtype"] == "tf32" else ""))


def _selected(reg, bucket_names, family: str) -> list:
    """The buckets of `reg` that `bucket_names` name (a base name of a bucket with
    alternatives names all of them; None: every bucket); ValueError on an unknown name."""
    from .cli_args import resolve_buckets

    if not bucket_names:
        return list(reg.buckets)
    chosen = set(resolve_buckets(bucket_names, reg.buckets, family))
    return [b for b in reg.buckets if b.name in chosen]


def _rate(done: int, total: int, seconds: float) -> str:
    """'[ 12/574, 2.1/s, ETA 4m33s]': count, kernels per second, time left."""
    rate = done / seconds if seconds > 0 else 0.0
    left = (total - done) / rate if rate > 0 else 0.0
    eta = f"{int(left // 60)}m{int(left % 60):02d}s" if done < total else "done"
    return f"[{done:{len(str(total))}d}/{total}, {rate:.1f}/s, ETA {eta}]"


# ptxas -v lines worth an engineer's look: a performance warning (C75xx: WGMMAs issued one
# at a time, and why), a wait ptxas injected itself (the info line C7517: it drains the WGMMA
# pipe where the kernel meant to keep a group in flight) and spilled registers. (The info
# line C7519, a WGMMA fence ptxas added, waits for no WGMMA and is left out.)
_PTXAS_NOTE = re.compile(r"\((C75\d\d)\) (?:Potential Performance Loss: )?(.*?)"
                         r"(?: in (?:the )?function.*)?$")
_PTXAS_INFO_NOTES = ("C7517",)
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_path() -> str | None:
    """The ptxas `--ptxas` runs (the first on PATH), or None."""
    import shutil

    return shutil.which("ptxas")


def ptxas_notes(ptx: str, arch: str) -> list[str]:
    """What `ptxas -v` (on PATH) says of one kernel's PTX that costs speed: its performance
    warnings ("C7510: wgmma.mma_async instructions are serialized due to ...") and its spill
    bytes. The library never needs ptxas (the DSL assembles its kernels itself); this is a
    diagnostic of `detgemm-cute compile --ptxas`."""
    import subprocess

    exe = ptxas_path()
    if exe is None:
        raise RuntimeError("ptxas is not on PATH (it comes with the CUDA toolkit)")
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/kernel.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", f"{tmp}/kernel.cubin"],
                             capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        return [f"ptxas failed: {last[:200]}"]
    notes = []
    for line in run.stderr.splitlines():
        warn = _PTXAS_NOTE.search(line)
        if warn and ("Performance Loss" in line or warn.group(1) in _PTXAS_INFO_NOTES):
            notes.append(f"{warn.group(1)}: {warn.group(2)}")
        spill = _PTXAS_SPILL.search(line)
        if spill and (int(spill.group(1)) or int(spill.group(2))):
            notes.append(f"spills {spill.group(1)} bytes (stores), {spill.group(2)} (loads)")
    return list(dict.fromkeys(notes))


def build_and_audit(key, ptxas: bool = False) -> tuple[list, float, list]:
    """(problems, seconds, notes): compile `key` keeping its PTX and audit it (in this
    process or a worker of `compile_buckets`); a compile error is a problem, not an
    exception. `ptxas`: the notes are `ptxas_notes` (else empty)."""
    t0 = time.time()
    family = kcompile.family_of(key.arch)
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            fn = kcompile.build(key, f"--keep-ptx --dump-dir={tmp}")
            problems = audit_ptx(fn.__ptx__ or "", family, key.dtype, key.pdl,
                                 key.offs_report)
        except Exception as e:  # report every bucket, not just the first failure
            return [f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"], time.time() - t0, []
        if ptxas:
            try:
                notes = ptxas_notes(fn.__ptx__ or "", key.arch)
            except Exception as e:  # a diagnostic: it fails no kernel
                notes = [f"ptxas not run: {type(e).__name__}: {str(e)[:160]}"]
    return problems, time.time() - t0, notes


def _built(keys, jobs: int, ptxas: bool = False):
    """(key, problems, seconds, notes) for every key, in completion order: here (jobs 1) or
    in `jobs` worker processes (spawned, no GPU, one torch thread each)."""
    if jobs <= 1:
        for key in keys:
            yield (key, *build_and_audit(key, ptxas))
        return
    import concurrent.futures as cf
    import multiprocessing

    from .parallel_compile import _init_worker

    with cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                initializer=_init_worker, initargs=("off",)) as pool:
        futures = {pool.submit(build_and_audit, key, ptxas): key for key in keys}
        try:
            for f in cf.as_completed(futures):
                yield (futures[f], *f.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def compile_buckets(arch: str, bucket_names=None, out=print, variants: str = "core",
                    jobs: int = 1, ptxas: bool = False) -> int:
    """Compile (and audit) every bucket of the family `arch` builds ('sm_90a': sm90;
    'sm_80', 'sm_86', 'sm_90', ...: sm80, see `compile.family_of`); 0 when all pass.

    `variants`: "core" (per bucket and dtype the layout its op uses: fwd with bias, dx with
    a [K, N] weight, dw to fp32 from zero and continuing a buffer; plus bf16 -> fp32 for
    fwd/dx) or "all" (dtype x output dtype x layout x bias; dw: layout x accumulate). A key
    shared by several buckets (same tile, cluster, stages, persistence) is compiled once.
    `jobs` > 1 compiles in that many processes. One line per kernel, in the order they
    finish, each starting with the count, the rate and the time left. `ptxas`: each line
    also names what `ptxas_notes` finds (a diagnostic; it fails nothing)."""
    if variants not in ("core", "all"):
        out(f"compile: unknown variants {variants!r} (core or all)")
        return 1
    if ptxas and ptxas_path() is None:
        out("compile: --ptxas needs ptxas on PATH (it comes with the CUDA toolkit)")
        return 1
    try:
        family = kcompile.family_of(arch)
        buckets = _selected(registry.get_registry(family), bucket_names, family)
    except ValueError as e:
        out(f"compile: {e}")
        return 1
    users: dict = {}  # KernelKey -> [(bucket, call)] that compile to it, in table order
    for b in buckets:
        for call, key in _bucket_keys(b, arch, variants):
            users.setdefault(key, []).append((b, call))
    total = sum(len(v) for v in users.values())
    failures = done = noted = 0
    t_all = time.time()
    for key, problems, seconds, notes in _built(list(users), jobs, ptxas):
        status = "OK" if not problems else "FAIL " + "; ".join(problems)
        if notes:
            status += " | ptxas: " + "; ".join(notes)
            noted += 1
        first = users[key][0][0].name
        for i, (b, call) in enumerate(users[key]):
            done += 1
            failures += bool(problems)
            note = f" (same kernel as {first})" if i else ""
            out(f"{_rate(done, total, time.time() - t_all)} {_label(b.name, call)}  "
                f"{seconds if not i else 0.0:5.1f}s  {status}{note}")
    if ptxas:
        out(f"compile: ptxas notes on {noted} of {len(users)} distinct kernels")
    out(f"compile: {total - failures}/{total} kernels built and audited for {arch} "
        f"({len(users)} distinct, {len(buckets)} buckets, variants={variants}, "
        f"{time.time() - t_all:.0f}s{f', {jobs} processes' if jobs > 1 else ''})")
    return 0 if failures == 0 else 1


def warmup_keys(arch: str = "sm_90a", ops=None, dtypes=None, bucket_names=None,
                variants: str = "core") -> list:
    """The distinct kernel keys that `warmup` builds: buckets of `ops` (default all),
    dtypes in `dtypes` (default the bucket's), names in `bucket_names` (default all; a base
    name selects a bucket's alternatives). An unknown op, dtype or bucket, or a selection
    with no kernel in it, raises ValueError."""
    for what, given, known in (("ops", ops, registry.OPS), ("dtypes", dtypes, registry.DTYPES)):
        bad = [v for v in given or () if v not in known]
        if bad:
            raise ValueError(f"warmup: unknown {what[:-1]} {bad[0]!r}; known: {', '.join(known)}")
    if variants not in ("core", "all"):
        raise ValueError(f"warmup: unknown variants {variants!r} (core or all)")
    family = kcompile.family_of(arch)
    reg = registry.get_registry(family)
    keys, seen = [], set()
    for b in _selected(reg, bucket_names, family):
        if ops and b.op not in ops:
            continue
        for call, key in _bucket_keys(b, arch, variants):
            if dtypes and ("fp32" if call.get("split") else call["dtype"]) not in dtypes:
                continue
            if key not in seen:
                seen.add(key)
                keys.append((b.name, key))
    if not keys:
        chosen = "; ".join(f"{k} {','.join(v)}" for k, v in (
            ("ops", ops), ("dtypes", dtypes), ("buckets", bucket_names)) if v)
        raise ValueError(f"warmup: no {family} kernel matches the selection ({chosen}); "
                         f"`detgemm-cute audit --arch {family}` lists the buckets, their ops "
                         f"and dtypes")
    return keys


def warmup(arch: str = "sm_90a", ops=None, dtypes=None, bucket_names=None,
           variants: str = "core", aot_dir=None, progress=None) -> int:
    """Compile (or load from the AOT cache in `aot_dir`) every selected kernel into this
    process's cache, exporting fresh compiles to `aot_dir`; returns the number of kernels.

    `progress(done, total, label, seconds)` is called after each kernel."""
    from pathlib import Path

    keys = warmup_keys(arch, ops, dtypes, bucket_names, variants)
    directory = Path(aot_dir).expanduser() if aot_dir else None
    for i, (name, key) in enumerate(keys):
        t0 = time.time()
        with kcompile._lock:
            if key not in kcompile._compiled:
                kcompile._compiled[key] = kcompile._load_or_build(key, directory)
        if progress is not None:
            progress(i + 1, len(keys), f"{name} {key.dtype}->{key.out_dtype} A{key.a_major} "
                     f"B{key.b_form}{' acc' if key.accumulate else ''}", time.time() - t0)
    aot_cache.flush()  # the libraries are on disk when warmup returns
    return len(keys)
