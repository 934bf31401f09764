"""A newcomer's first session, scripted: every `detgemm-cute` subcommand with good and bad
arguments. Targets: no traceback, no bad usage that exits 0 (a silent no-op), every error one
short message naming what is wrong. Kernel compiles are stubbed here (they are real in
test_compile_cpu.py / test_sm80_cpu.py); everything else runs for real."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import aot, cli
from detgemm_cute import compile as kcompile

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Every instruction the PTX audit asks for, so the stubbed kernels pass it.
_PTX = ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 wgmma.mma_async.x.f32.tf32.tf32 "
        "cp.async.bulk.tensor mma.sync.aligned.m16n8k16 mma.sync.aligned.m16n8k8.x.f32.tf32.tf32 "
        "cp.async.ca.shared.global ldmatrix.sync.aligned")


@pytest.fixture
def stub_compiles(monkeypatch):
    built = []

    def build(key, options=""):
        built.append(key)
        return SimpleNamespace(__ptx__=_PTX)

    monkeypatch.setattr(kcompile, "build", build)
    monkeypatch.setattr(kcompile, "_load_or_build", lambda key, directory: build(key))
    monkeypatch.setattr(kcompile, "_compiled", {})  # the process cache is left as it was
    return built


@pytest.fixture
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).bfloat16()
    w = torch.randn(24, 48, generator=g).bfloat16()
    paths = {n: tmp_path / f"{n}.pt" for n in ("x", "w", "y", "wrong_shape", "ints", "dict")}
    torch.save(x, paths["x"])
    torch.save(w, paths["w"])
    torch.save(dg.linear(x, w), paths["y"])
    torch.save(dg.linear(x, w)[:, :7], paths["wrong_shape"])
    torch.save(torch.ones(5, 24, dtype=torch.int32), paths["ints"])
    torch.save({"x": x}, paths["dict"])
    (tmp_path / "corrupt.pt").write_bytes(b"not a pickle" * 20)
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "empty.json").write_text(json.dumps({"records": []}))
    (tmp_path / "shapes.txt").write_text("128x256x256 one\n")
    return {k: str(v) for k, v in paths.items()} | {
        k: str(tmp_path / f) for k, f in (("corrupt", "corrupt.pt"), ("garbage", "garbage.json"),
                                         ("empty", "empty.json"), ("shapes", "shapes.txt"),
                                         ("out", "out.yaml"))}


def run(argv, capsys):
    """(exit status, stdout, stderr) of one command; an exception escaping main would be a
    traceback for the user, so it fails the test here."""
    try:
        rc = cli.main(argv)
    except BaseException as e:  # noqa: BLE001
        pytest.fail(f"{argv}: {type(e).__name__} escaped main (a traceback): {e}")
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, argv
    return rc, out, err


GOOD = [
    (["--help"], "audit"),
    (["audit", "--arch", "sm_80"], "audit: OK"),
    (["explain", "--arch", "sm90", "1", "4096", "4096"], "fwd bf16 sm90 M=1"),
    (["explain", "--arch", "sm_90", "--op", "dx", "100", "64", "64"], "dx bf16 sm90 M=100"),
    (["explain", "--arch", "sm_90a", "--dtype", "fp32", "7", "8", "9"], "fwd fp32 sm90"),
    (["explain", "--arch", "sm_80", "--dtype", "fp16", "3", "8", "9"], "fwd fp16 sm80"),
    (["explain", "--arch", "SM80", "3", "8", "9"], "bf16 sm80"),
    (["compile", "--arch", "sm_90a", "--bucket", "fwd_prefill"], "compile: "),
    (["compile", "--arch", "sm80", "--bucket", "fwd_decode"], "built and audited for sm_80"),
    (["compile", "--arch", "sm80", "--target", "sm_90", "--bucket", "fwd_decode"],
     "built and audited for sm_90"),
    (["warmup", "--arch", "sm_90", "--ops", "fwd", "--dtypes", "bf16", "--bucket",
      "fwd_decode_m1_16_n1_2112", "--quiet"], "warmup: 2 kernels ready for sm_90a (sm90 family)"),
    (["warmup", "--arch", "sm_86", "--ops", "dw", "--dtypes", "fp16"], "(sm80 family)"),
    (["tune", "--dry-run", "--shapes", "128x256x256", "--arch", "sm_80"], "1 problems"),
    (["tune", "--dry-run", "--shapes-file", "{shapes}"], "1 problems"),
    (["verify", "{x}", "{w}", "{y}"], "ok: all 120 outputs bit-identical"),
    (["bench", "--help"], "usage: detgemm-cute bench"),
]

BAD = [  # (argv, words the error names)
    ([], "required: COMMAND"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["audit", "--arch", "sm75"], "unknown arch 'sm75'"),
    (["audit", "--config", "/no/such.yaml"], "/no/such.yaml: cannot read config file"),
    (["audit", "--config", str(FIXTURES / "malformed.yaml")], "malformed YAML"),
    (["explain", "1", "2"], "the following arguments are required: K"),
    (["explain", "x", "2", "3"], "argument M: invalid int value: 'x'"),
    (["explain", "0", "2", "3"], "M must be an integer >= 1"),
    (["explain", "--arch", "sm_75", "1", "2", "3"], "unknown arch 'sm_75'"),
    (["explain", "--op", "gemv", "1", "2", "3"], "invalid choice: 'gemv'"),
    (["explain", "--dtype", "int8", "1", "2", "3"], "invalid choice: 'int8'"),
    (["compile", "--arch", "sm70"], "unknown arch 'sm70'"),
    (["compile", "--bucket", "nosuch"], "no bucket 'nosuch' in the sm90 table"),
    (["compile", "--bucket", "fwd_prefil"], "did you mean fwd_prefill"),
    (["compile", "--arch", "sm80", "--bucket", "fwd_prefill"], "no bucket 'fwd_prefill' in the sm80"),
    (["compile", "--variants", "most"], "invalid choice: 'most'"),
    (["compile", "--target", "sm_90"], "--target sm_90 applies to the SM80 family"),
    (["compile", "--arch", "sm80", "--target", "sm_75"], "--target 'sm_75'"),
    (["compile", "--config", "/no/such.yaml"], "/no/such.yaml"),
    (["warmup", "--ops", "foo"], "unknown 'foo'"),
    (["warmup", "--ops", ","], "expected a comma-separated list"),
    (["warmup", "--dtypes", "int8"], "unknown 'int8'"),
    (["warmup", "--dtypes", "bf61"], "did you mean bf16"),
    (["warmup", "--bucket", "nosuch"], "no bucket 'nosuch'"),
    (["warmup", "--ops", "bmm", "--dtypes", "fp32"], "no sm90 kernel matches the selection"),
    (["warmup", "--jobs", "0"], "argument --jobs: expected an integer >= 1, got 0"),
    (["warmup", "--arch", "sm_75"], "unknown arch"),
    (["tune"], "give problems with --preset, --shapes or --shapes-file"),
    *([] if torch.cuda.is_available() else [  # on a GPU this starts a real tune
        (["tune", "--preset", "decode-models"], "tune needs a CUDA GPU")]),
    (["tune", "--preset", "nosuch"], "invalid choice: 'nosuch'"),
    (["tune", "--dry-run", "--shapes", "1x2"], "shape '1x2': expected MxKxN"),
    (["tune", "--dry-run", "--shapes", "16x16x16", "--ops", "foo"], "ops 'foo'"),
    (["tune", "--dry-run", "--shapes-file", "/no/such.txt"], "/no/such.txt: no such file"),
    (["tune", "--dry-run", "--shapes", "16x16x16", "--max-candidates", "0"], "expected an integer"),
    (["tune", "--dry-run", "--shapes", "16x16x16", "--tiles", "3"], "--tiles '3'"),
    (["tune", "--shapes", "16x16x16", "--arch", "sm80"], "--arch applies to --dry-run only"),
    (["tune", "--dry-run", "--shapes", "16x16x16", "--arch", "sm75"], "unknown arch"),
    (["tune-fit", "--out", "{out}", "{garbage}"], "not a JSON file of `detgemm-cute tune --json`"),
    (["tune-fit", "--out", "{out}", "{x}"], "not a JSON file"),
    (["tune-fit", "--out", "{out}", "{empty}"], "nothing written"),
    (["tune-fit", "--out", "{out}", "/no/such.json"], "no such records file"),
    (["tune-fit", "--ops", "foo", "--out", "{out}", "{empty}"], "unknown op 'foo'"),
    (["tune-fit", "--arch", "sm_75", "--out", "{out}", "{empty}"], "unknown arch"),
    (["tune-fit", "{empty}"], "the following arguments are required: --out"),
    (["demo", "--fast"], "unrecognized arguments: --fast"),
    (["verify", "{x}", "{w}", "{wrong_shape}"], "result has shape (5, 7), expected (5, 24)"),
    (["verify", "{x}", "{w}", "{dict}"], "result {dict}: holds a dict, not a tensor"),
    (["verify", "{x}", "{w}", "{corrupt}"], "not a tensor file written by torch.save"),
    (["verify", "{x}", "{w}", "/no/such.pt"], "result /no/such.pt: no such file"),
    (["verify", "{x}", "{w}", "{ints}"], "result must be bf16, fp16 or fp32"),
    (["verify", "{x}", "{x}", "{y}"], "result has shape (5, 24), expected (5, 5)"),
    (["verify", "{x}", "{w}", "{y}", "--bias", "{dict}"], "--bias {dict}: holds a dict"),
    (["verify", "{x}", "{w}"], "the following arguments are required: result"),
    (["bench", "--suite", "nosuch"], "invalid choice: 'nosuch'"),
]


def _fill(argv, files):
    return [a.format(**files) for a in argv]


@pytest.mark.parametrize("argv, words", GOOD, ids=[" ".join(a) for a, _ in GOOD])
def test_good_usage_works(argv, words, files, stub_compiles, capsys):
    rc, out, err = run(_fill(argv, files), capsys)
    assert rc == 0, err
    assert words in out


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) or "(nothing)" for a, _ in BAD])
def test_bad_usage_is_one_clear_error_and_a_nonzero_exit(argv, words, files, stub_compiles,
                                                          capsys):
    rc, out, err = run(_fill(argv, files), capsys)
    assert rc != 0, f"exit 0: a silent no-op\n{out}"
    assert words.format(**files) in err, err
    assert not stub_compiles, "an error must come before any compile"
    lines = [line for line in err.splitlines() if line.strip()]
    # argparse's usage lines, then its one-line error; or our own one line
    message = [line for line in lines if line.startswith("detgemm-cute")]
    assert len(message) == 1 and len(message[0]) < 400, err


def test_compile_bucket_base_name_means_every_alternative(stub_compiles, capsys):
    from detgemm_cute import registry

    alts = [b.name for b in registry.get_registry("sm90").buckets
            if b.name.startswith("fwd_prefill.")]
    assert len(alts) > 1
    rc, out, _ = run(["compile", "--bucket", "fwd_prefill"], capsys)
    assert rc == 0
    for name in alts:
        assert name in out
    assert "dx_prefill." not in out
    # each line carries count, rate and time left
    first = out.splitlines()[0]
    assert first.startswith("[") and "/s, ETA" in first


def test_warmup_progress_has_count_rate_and_eta(stub_compiles, capsys):
    rc, _, err = run(["warmup", "--ops", "fwd", "--dtypes", "bf16", "--bucket",
                      "fwd_decode_m1_16_n1_2112", "--bucket", "fwd_small"], capsys)
    assert rc == 0
    last = err.strip().splitlines()[-1]
    assert "kernels" in last and "/s" in last and f"{len(stub_compiles)}/{len(stub_compiles)}" in last


def _module_run(argv, block_numpy=False):
    code = ("import sys; sys.modules['numpy'] = None; " if block_numpy else "") + (
        "import runpy; sys.argv = ['detgemm-cute'] + sys.argv[1:]; "
        "runpy.run_module('detgemm_cute.cli', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", "import sys; " + code, *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_command_exits_with_its_status_and_without_numpy_noise():
    """The module entry point returns main's status; without numpy (a plain install) torch's
    'Failed to initialize NumPy' warning does not reach the user."""
    bad = _module_run(["explain", "0", "1", "1"], block_numpy=True)
    assert bad.returncode == 1 and "M must be an integer >= 1" in bad.stderr
    assert "NumPy" not in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    good = _module_run(["explain", "--arch", "sm_80", "1", "1", "1"], block_numpy=True)
    assert good.returncode == 0 and "fwd bf16 sm80" in good.stdout
    assert good.stderr == "", good.stderr
