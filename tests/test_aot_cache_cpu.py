"""The opt-in AOT kernel cache and `detgemm-cute warmup`, on a CPU-only machine: kernels are
cross-compiled for sm_90a, exported as shared libraries, and loaded by a second process
without tracing or compiling (running them needs the GPU; loading does not)."""

import subprocess
import sys
import textwrap

import pytest

from detgemm_cute import aot, aot_cache, cli
from detgemm_cute import compile as kcompile

pytestmark = pytest.mark.skipif(aot_cache.shutil.which("cc") is None
                                and aot_cache.shutil.which("gcc") is None,
                                reason="needs a C compiler to link the libraries")


def _keys():
    return aot.warmup_keys("sm_90a", ops=("fwd",), dtypes=("bf16",),
                           bucket_names=("fwd_decode_m33_64_n1_1536", "fwd_decode_m1_16_n1_2112"))


def test_warmup_exports_and_a_second_process_loads_without_compiling(tmp_path, capsys):
    assert cli.main(["warmup", "--ops", "fwd", "--dtypes", "bf16",
                     "--bucket", "fwd_decode_m33_64_n1_1536",
                     "--bucket", "fwd_decode_m1_16_n1_2112", "--aot-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "warmup: 4 kernels ready for sm_90a" in out.out and "4/4" in out.err
    keys = _keys()
    assert len(keys) == 4
    assert sorted(p.name for p in tmp_path.glob("*.so")) == sorted(
        aot_cache.path_for(k, tmp_path).name for _, k in keys)
    script = textwrap.dedent(f"""
        import os, time
        os.environ["{aot_cache.ENV_VAR}"] = {str(tmp_path)!r}
        from detgemm_cute import aot, compile as kc
        def no_compile(*a, **k):
            raise AssertionError("compiled instead of loading")
        kc.build = no_compile
        t = time.time()
        fns = [kc.get(k) for _, k in aot.warmup_keys("sm_90a", ops=("fwd",), dtypes=("bf16",),
               bucket_names=("fwd_decode_m33_64_n1_1536", "fwd_decode_m1_16_n1_2112"))]
        import sys
        print("loaded", len(fns), type(fns[0]).__name__, round(time.time() - t, 3),
              "dsl-imported" if "cutlass" in sys.modules else "dsl-not-imported")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("loaded 4 Function"), r.stdout
    assert "dsl-not-imported" in r.stdout  # TVM-FFI alone loads them: no DSL import cost


def test_names_follow_key_and_sources(monkeypatch):
    (_, k1), (_, k2) = _keys()[:2]
    assert aot_cache.symbol(k1) != aot_cache.symbol(k2)
    assert aot_cache.symbol(k1).isidentifier()
    before = aot_cache.symbol(k1)
    aot_cache._fingerprint.cache_clear()
    monkeypatch.setattr(aot_cache, "_SOURCES", aot_cache._SOURCES[:1])
    assert aot_cache.symbol(k1) != before  # other sources: another name, no stale load
    monkeypatch.undo()
    aot_cache._fingerprint.cache_clear()
    assert aot_cache.symbol(k1) == before


def test_a_corrupt_library_is_rebuilt_with_a_warning(tmp_path, monkeypatch):
    _, key = _keys()[0]
    aot_cache.path_for(key, tmp_path).write_bytes(b"not a shared library")
    built = []
    monkeypatch.setattr(kcompile, "build", lambda k, *a: built.append(k) or object())
    monkeypatch.setattr(aot_cache, "store", lambda *a: None)
    with pytest.warns(UserWarning, match="could not load cached kernel"):
        fn = kcompile._load_or_build(key, tmp_path)
    assert built == [key] and fn is not None


def test_without_a_c_compiler_nothing_is_written(tmp_path, monkeypatch):
    _, key = _keys()[0]
    monkeypatch.setattr(aot_cache.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="no C compiler"):
        assert aot_cache.store(key, object(), tmp_path, wait=True) is None
    assert not list(tmp_path.glob("*.so"))


def test_the_cache_is_on_by_default_and_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.delenv(aot_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert aot_cache.cache_dir() == tmp_path / "detgemm_cute" / "aot"
    for off in ("off", "", "0", "OFF"):
        monkeypatch.setenv(aot_cache.ENV_VAR, off)
        assert aot_cache.cache_dir() is None
    monkeypatch.setenv(aot_cache.ENV_VAR, "~/kernels")
    assert str(aot_cache.cache_dir()).endswith("kernels") and "~" not in str(aot_cache.cache_dir())
