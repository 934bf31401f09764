"""On-disk cache of compiled kernels as shared libraries (TVM-FFI AOT export).

A kernel compiled for a `KernelKey` is exported with the DSL's ``export_to_c`` to an object
file, linked into ``<name>.so`` against the DSL and TVM-FFI runtime libraries, and loaded in
later processes with ``cute.runtime.load_module``: no tracing, no backend compile. The file
name is a hash of the key, this package's version, the DSL version and the source of the
kernel files, so a change to any of them misses the cache instead of loading stale code.

Opt-in while its GPU timings are pending: set ``DETGEMM_CUTE_AOT_DIR`` (or pass ``--aot-dir``
to ``detgemm-cute warmup``). Writes are atomic (temp file + rename), so concurrent processes
never load a half-written library; any failure to export or load falls back to compiling.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

ENV_VAR = "DETGEMM_CUTE_AOT_DIR"
_SOURCES = ("kernels/sm90.py", "kernels/sm90_limits.py", "compile.py", "aot_cache.py")


def cache_dir() -> Path | None:
    d = os.environ.get(ENV_VAR)
    return Path(d).expanduser() if d else None


@lru_cache(maxsize=1)
def _fingerprint() -> str:
    """Package version, DSL version and kernel sources: what makes a library valid."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    for dist in ("detgemm-cute", "nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            h.update(f"{dist}={version(dist)};".encode())
        except PackageNotFoundError:
            h.update(f"{dist}=?;".encode())
    root = Path(__file__).parent
    for rel in _SOURCES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def symbol(key) -> str:
    """File stem and exported function name of `key` (a C identifier)."""
    digest = hashlib.sha256((repr(key) + _fingerprint()).encode()).hexdigest()[:24]
    return f"detgemm_{digest}"


def path_for(key, directory: Path) -> Path:
    return directory / f"{symbol(key)}.so"


def load(key, directory: Path):
    """The cached kernel for `key`, or None when there is none (or it cannot be loaded)."""
    lib = path_for(key, directory)
    if not lib.exists():
        return None
    try:
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(lib), enable_tvm_ffi=True)
        return getattr(module, symbol(key))
    except Exception as e:  # noqa: BLE001 - a bad file must not stop the GEMM
        warnings.warn(f"detgemm_cute: could not load cached kernel {lib} ({e}); recompiling",
                      stacklevel=3)
        return None


def store(key, fn, directory: Path) -> Path | None:
    """Export compiled `fn` for `key` into `directory`; returns the library path, or None
    (with a warning) when the export or the link fails."""
    import cutlass.cute as cute

    name = symbol(key)
    directory.mkdir(parents=True, exist_ok=True)
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        warnings.warn("detgemm_cute: no C compiler (cc/gcc) to link cached kernels; the AOT "
                      "cache is not written", stacklevel=3)
        return None
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        obj, lib = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
        try:
            fn.export_to_c(str(obj), function_name=name)
            libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
            subprocess.run([cc, "-shared", "-o", str(lib), str(obj), *libs], check=True,
                           capture_output=True)
            final = path_for(key, directory)
            os.replace(lib, final)
            return final
        except Exception as e:  # noqa: BLE001
            detail = getattr(e, "stderr", b"") or b""
            warnings.warn(f"detgemm_cute: could not write cached kernel {name} ({e}"
                          f"{': ' + detail.decode(errors='replace')[:200] if detail else ''})",
                          stacklevel=3)
            return None
