"""Compile, in parallel processes, the kernels a list of problems will use with the current
dispatch table (bench `--jobs N`), so the first timed call of each loads a library from the
AOT cache instead of compiling for 1-2 s."""

from __future__ import annotations

import os
import tempfile


def table_keys(problems, dtype_name: str, arch: str, gpu_arch: str) -> list:
    """The KernelKeys `peers.detgemm_call` compiles for `problems` with the live table."""
    from .. import compile as kcompile
    from ..dispatch import lookup
    from .peers import detgemm_layout

    keys = {}
    for p in problems:
        m, n, k = p.gemm_mnk
        bucket = lookup(p.op, dtype_name, arch, m, n, k)
        key = kcompile.KernelKey.for_bucket(
            bucket, dtype=dtype_name, out_dtype="fp32" if p.op == "dw" else dtype_name,
            arch=gpu_arch, **detgemm_layout(p.op, p.m, p.k, p.n, bucket.swap_ab))
        keys[key] = None
    return list(keys)


def precompile(problems, dtype_name: str, arch: str, gpu_arch: str, jobs: int, log=print):
    """Compile the keys into the AOT cache (a temporary one when the cache is off, which this
    process then uses). Returns {key: error} of the kernels the workers could not build."""
    from .. import aot_cache
    from ..parallel_compile import compile_all

    directory = aot_cache.cache_dir()
    if directory is None:
        directory = tempfile.mkdtemp(prefix="detgemm-bench-aot-")
        os.environ[aot_cache.ENV_VAR] = directory
    keys = table_keys(problems, dtype_name, arch, gpu_arch)
    log(f"compiling {len(keys)} kernels in {jobs} processes into {directory}")
    failed = compile_all(keys, directory, jobs)
    for key, why in failed.items():
        log(f"could not prebuild {key.tile} {key.dtype}->{key.out_dtype}: {why} (compiled on "
            f"first use instead)")
    return failed
