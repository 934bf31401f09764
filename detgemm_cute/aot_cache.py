"""On-disk cache of compiled kernels as shared libraries (TVM-FFI AOT export).

A kernel compiled for a `KernelKey` is exported with the DSL's ``export_to_c`` to an object
file, linked into ``<name>.so`` against the DSL and TVM-FFI runtime libraries, and loaded in
later processes with ``cute.runtime.load_module``: no tracing, no backend compile. The file
name is a hash of the key, this package's version, the DSL version and the source of the
kernel files, so a change to any of them misses the cache instead of loading stale code.

On by default, under ``$XDG_CACHE_HOME/detgemm_cute/aot`` (``~/.cache/...``); set
``DETGEMM_CUTE_AOT_DIR`` to another directory, or to ``off`` (or an empty string) to disable.
A later process loads a library through TVM-FFI alone (``tvm_ffi.load_module``, after the
DSL's runtime libraries recorded at export time), without importing the DSL: a first call
from the cache costs tens of milliseconds. A fresh compile is exported in a background
thread, so the call that compiled does not wait for the link (`flush` waits for it).
Writes are atomic (temp file + rename), so concurrent processes never load a half-written
library; any failure to export or load falls back to compiling.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from functools import lru_cache
from pathlib import Path

ENV_VAR = "DETGEMM_CUTE_AOT_DIR"
_OFF = ("", "0", "off", "none", "false")
_SOURCES = ("compile.py", "aot_cache.py")  # plus every kernels/*.py
_RUNTIME_LIST = "runtime-libraries.txt"  # the DSL runtime libraries the .so files need
_pending: list[threading.Thread] = []
_runtime_loaded: set[str] = set()
_warned_no_cc = False


def cache_dir() -> Path | None:
    """The cache directory, or None when disabled (``DETGEMM_CUTE_AOT_DIR=off``)."""
    d = os.environ.get(ENV_VAR)
    if d is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        return Path(base).expanduser() / "detgemm_cute" / "aot"
    return None if d.strip().lower() in _OFF else Path(d).expanduser()


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
    for path in [root / rel for rel in _SOURCES] + sorted((root / "kernels").glob("*.py")):
        h.update(path.name.encode() + path.read_bytes())
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
        fn = _load_with_tvm_ffi(lib, symbol(key), directory)
        if fn is not None:
            return fn
        import cutlass.cute as cute  # no runtime list recorded: the DSL's own loader

        module = cute.runtime.load_module(str(lib), enable_tvm_ffi=True)
        return getattr(module, symbol(key))
    except Exception as e:  # noqa: BLE001 - a bad file must not stop the GEMM
        warnings.warn(f"detgemm_cute: could not load cached kernel {lib} ({e}); recompiling",
                      stacklevel=3)
        return None


def _load_with_tvm_ffi(lib: Path, name: str, directory: Path):
    """Load `lib` without the DSL: its runtime libraries (global symbols), then the module.
    None when the runtime list is missing or stale (a DSL upgrade moved the files)."""
    try:
        runtime = (directory / _RUNTIME_LIST).read_text().split("\n")
    except OSError:
        return None
    runtime = [p for p in runtime if p]
    if not runtime or not all(os.path.exists(p) for p in runtime):
        return None
    import tvm_ffi

    for path in runtime:
        if path not in _runtime_loaded:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _runtime_loaded.add(path)
    return tvm_ffi.load_module(str(lib)).get_function(name)


def flush() -> None:
    """Wait for background exports to finish (warmup and tests call this)."""
    while _pending:
        _pending.pop().join()


def store(key, fn, directory: Path, wait: bool = False):
    """Export compiled `fn` for `key` into `directory`, in a background thread unless
    `wait` (then returns the library path, or None with a warning when export/link fails)."""
    if wait:
        return _store(key, fn, directory)
    t = threading.Thread(target=_store, args=(key, fn, directory), name="detgemm-aot-export")
    t.start()  # not a daemon: an exiting interpreter lets the export finish
    _pending.append(t)
    return None


def _store(key, fn, directory: Path) -> Path | None:
    global _warned_no_cc
    try:
        import cutlass.cute as cute

        name = symbol(key)
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            if not _warned_no_cc:
                _warned_no_cc = True
                warnings.warn("detgemm_cute: no C compiler (cc/gcc) to link cached kernels; "
                              "the AOT cache is not written", stacklevel=3)
            return None
        directory.mkdir(parents=True, exist_ok=True)
        return _export(cute, key, fn, name, cc, directory)
    except Exception as e:  # noqa: BLE001 - caching is best effort, never an error
        warnings.warn(f"detgemm_cute: could not write to the AOT cache {directory} ({e})",
                      stacklevel=3)
        return None


def _export(cute, key, fn, name, cc, directory: Path) -> Path | None:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        obj, lib = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
        try:
            fn.export_to_c(str(obj), function_name=name)
            libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
            subprocess.run([cc, "-shared", "-o", str(lib), str(obj), *libs], check=True,
                           capture_output=True)
            listing = Path(tmp) / _RUNTIME_LIST
            listing.write_text("\n".join(libs) + "\n")
            os.replace(listing, directory / _RUNTIME_LIST)
            final = path_for(key, directory)
            os.replace(lib, final)
            return final
        except Exception as e:  # noqa: BLE001
            detail = getattr(e, "stderr", b"") or b""
            warnings.warn(f"detgemm_cute: could not write cached kernel {name} ({e}"
                          f"{': ' + detail.decode(errors='replace')[:200] if detail else ''})",
                          stacklevel=3)
            return None
