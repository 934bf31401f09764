"""Compile kernels in parallel processes into the AOT cache, for the main process to load.

Compiling one kernel in the CuTe DSL takes 1-2 s of one CPU core. `CompilePool` runs
`jobs` worker processes (the 'spawn' start method: a fresh interpreter, no CUDA state
inherited); each compiles a `KernelKey` with fake tensors (no GPU needed; the workers see no
GPU) and exports it as a shared library into the AOT cache directory (`aot_cache`). The main
process then gets each kernel with `compile.get(key)`, which loads the library in tens of
milliseconds instead of compiling. Keys already in the directory are not compiled again.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
from pathlib import Path


def _init_worker(directory: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # compiling needs no GPU; keep off it
    os.environ["DETGEMM_CUTE_AOT_DIR"] = directory
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def compile_to_cache(key, directory: str) -> tuple[bool, float, str]:
    """(ok, seconds, message): compile `key` and export it into `directory` (worker side)."""
    from . import aot_cache
    from . import compile as kcompile

    d = Path(directory)
    if aot_cache.path_for(key, d).exists():
        return True, 0.0, "cached"
    t0 = time.time()
    try:
        fn = kcompile.build(key)
        path = aot_cache.store(key, fn, d, wait=True)
    except Exception as e:  # noqa: BLE001 - reported per key
        return False, time.time() - t0, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if path is None:
        return False, time.time() - t0, "compiled, but the export to the cache failed"
    return True, time.time() - t0, "compiled"


def default_jobs() -> int:
    """CPU cores minus two (one for the process timing the GPU), at least 1."""
    return max(1, (os.cpu_count() or 2) - 2)


class CompilePool:
    """Parallel compiles into `directory`; `submit(keys)` then `wait(keys)`."""

    def __init__(self, jobs: int, directory, log=print):
        self.directory = str(Path(directory).expanduser())
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        self.log = log
        self.jobs = max(1, int(jobs))
        self.futures: dict = {}
        self.results: dict = {}  # key -> (ok, seconds, message)
        ctx = multiprocessing.get_context("spawn")
        self.pool = cf.ProcessPoolExecutor(max_workers=self.jobs, mp_context=ctx,
                                           initializer=_init_worker,
                                           initargs=(self.directory,))

    def submit(self, keys) -> int:
        """Queue the keys not queued yet and not in the cache; returns how many were queued."""
        from . import aot_cache

        n = 0
        for key in keys:
            if key in self.futures or key in self.results:
                continue
            if aot_cache.path_for(key, Path(self.directory)).exists():
                self.results[key] = (True, 0.0, "cached")
                continue
            self.futures[key] = self.pool.submit(compile_to_cache, key, self.directory)
            n += 1
        return n

    def wait(self, keys, timeout: float | None = None) -> dict:
        """Wait for `keys`; returns {key: message} of those that failed (or timed out)."""
        pending = [self.futures[k] for k in keys if k in self.futures and k not in self.results]
        if pending:
            cf.wait(pending, timeout=timeout)
        failed = {}
        for key in keys:
            if key not in self.results and key in self.futures:
                fut = self.futures[key]
                if not fut.done():
                    failed[key] = "not finished in time"
                    continue
                try:
                    self.results[key] = fut.result()
                except Exception as e:  # noqa: BLE001 - a crashed worker
                    self.results[key] = (False, 0.0, f"worker failed: {type(e).__name__}: {e}")
            res = self.results.get(key)
            if res is not None and not res[0]:
                failed[key] = res[2]
        return failed

    def stats(self) -> dict:
        done = [r for r in self.results.values() if r[2] == "compiled"]
        return {"compiled": len(done), "cached": sum(r[2] == "cached" for r in self.results.values()),
                "failed": sum(not r[0] for r in self.results.values()),
                "compile_seconds": round(sum(r[1] for r in done), 1),
                "queued": len(self.futures), "jobs": self.jobs}

    def close(self, cancel: bool = False) -> None:
        self.pool.shutdown(wait=not cancel, cancel_futures=cancel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(cancel=exc[0] is not None)
        return False


def compile_all(keys, directory, jobs: int, log=print, progress=None) -> dict:
    """Compile every key into `directory` with `jobs` processes; {key: error} of failures.
    `progress(done, total, label, seconds)` after each key."""
    keys = list(dict.fromkeys(keys))
    with CompilePool(jobs, directory, log) as pool:
        pool.submit(keys)
        failed, done = {}, 0
        t0 = time.time()
        futures = {pool.futures[k]: k for k in keys if k in pool.futures}
        done = len(keys) - len(futures)
        for fut in cf.as_completed(futures):
            key = futures[fut]
            failed.update(pool.wait([key]))
            done += 1
            if progress is not None:
                progress(done, len(keys), f"{key.tile} {key.dtype}->{key.out_dtype}",
                         time.time() - t0)
        failed.update(pool.wait(keys))
    return failed
