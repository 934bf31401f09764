"""The `detgemm-cute` command: audit, explain, and the lazy hand-offs (compile, demo,
bench). User mistakes exit 1 with a message, never a traceback."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from detgemm_cute import cli
from detgemm_cute import registry as R

FIXTURES = Path(__file__).resolve().parent / "fixtures"




def test_audit_prints_every_bucket(capsys):
    assert cli.main(["audit"]) == 0
    out = capsys.readouterr().out
    for b in R.load_builtin("sm90").buckets:
        assert b.name in out
        assert f"sm90.yaml:{b.line}" in out
    assert "coverage fwd bf16: every (M, N, K) >= 1 is served by exactly one" in out
    assert "coverage fwd fp16" in out
    assert out.rstrip().endswith("audit: OK")


def test_audit_with_a_user_layer_shows_shadowing(capsys):
    assert cli.main(["audit", "--arch", "sm90", "--config",
                     str(FIXTURES / "user_small_m.yaml")]) == 0
    out = capsys.readouterr().out
    assert "my_decode" in out and "user 1" in out and "user_small_m.yaml" in out
    assert "fwd_decode_m33_64_n1_1536 (" in out and "shadows the same-named bucket" in out


@pytest.mark.parametrize("fixture, words", [
    ("overlap.yaml", ["bucket 'overlapping'", "field 'm'", "overlaps bucket 'small'"]),
    ("bad_tile.yaml", ["bucket 'odd_tile'", "field 'tile'"]),
    ("malformed.yaml", ["malformed YAML"]),
    ("bad_arch.yaml", ["field 'arch'", "unknown arch 'sm75'"]),
])
def test_audit_with_a_broken_config_fails(capsys, fixture, words):
    assert cli.main(["audit", "--config", str(FIXTURES / fixture)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert fixture in captured.err
    for w in words:
        assert w in captured.err
    assert all(line.startswith("detgemm-cute: ") for line in captured.err.splitlines())


def test_audit_reports_a_broken_builtin(monkeypatch, tmp_path, capsys):
    (tmp_path / "sm90.yaml").write_text((FIXTURES / "gap.yaml").read_text())
    monkeypatch.setattr(R, "BUILTIN_DIR", tmp_path)
    assert cli.main(["audit"]) == 1
    err = capsys.readouterr().err
    assert "sm90.yaml" in err and "field 'm'" in err and "M 65..127" in err
    assert "bucket 'low'" in err


def test_explain_names_bucket_file_and_line(capsys):
    b = R.get_registry("sm90").lookup("fwd", "bf16", 40, 1000, 4096)
    assert cli.main(["explain", "--op", "fwd", "--dtype", "bf16", "40", "1000", "4096"]) == 0
    out = capsys.readouterr().out
    assert b.name in out and f"sm90.yaml:{b.line}" in out
    assert "M=40 in [33, 64], N=1000 in [1, 1536], K any" in out


def test_explain_with_config_shows_shadowed(capsys):
    path = FIXTURES / "user_small_m.yaml"
    assert cli.main(["explain", "--config", str(path), "4", "64", "64"]) == 0
    out = capsys.readouterr().out
    assert "my_decode" in out and "user_small_m.yaml:4" in out
    assert "shadows: fwd_decode_m1_16_n1_2112" in out
    # The CLI's layers do not leak into the process-wide registry.
    assert R.get_registry("sm90").lookup("fwd", "bf16", 4, 64, 64).name == "fwd_decode_m1_16_n1_2112"


@pytest.mark.parametrize("argv, words, code", [
    (["explain", "--arch", "sm80", "1", "2", "0"], "K must be an integer >= 1", 1),
    (["explain", "--arch", "sm75", "1", "2", "3"], "unknown arch 'sm75'", 2),
    (["explain", "0", "2", "3"], "M must be an integer >= 1", 1),
])
def test_explain_errors_are_one_line_messages(capsys, argv, words, code):
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("op, dims, bucket", [
    ("dx", ["8192", "4096", "1024"], "dx_prefill."),
    ("dw", ["4096", "8", "16384"], "dw_bias "),
    ("dw", ["4096", "4096", "16384"], "dw_prefill."),
])
def test_explain_backward_ops(capsys, op, dims, bucket):
    assert cli.main(["explain", "--op", op, *dims]) == 0
    out = capsys.readouterr().out
    assert f"bucket:  {bucket}" in out
    if bucket.endswith("."):  # a bucket with alternatives: each listed, the one that runs marked
        assert out.count("  option:  ") > 1 and out.count("<- runs") == 1


def test_usage_errors_return_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["explain", "--dtype", "fp64", "1", "2", "3"]) == 2
    assert cli.main(["--help"]) == 0


def test_compile_hands_off_to_aot(monkeypatch):
    calls = []
    fake = types.ModuleType("detgemm_cute.aot")

    def compile_buckets(arch, bucket_names, out=print, variants="core", jobs=1, ptxas=False):
        calls.append((arch, bucket_names, R.get_registry("sm90").table("fwd", "bf16")[0].name,
                      ptxas))
        out("compiled")
        return 3

    fake.compile_buckets = compile_buckets
    monkeypatch.setitem(sys.modules, "detgemm_cute.aot", fake)
    assert cli.main(["compile"]) == 3
    assert cli.main(["compile", "--arch", "sm_90a", "--bucket", "my_decode", "--bucket",
                     "fwd_decode_m1_16_n1_2112", "--config",
                     str(FIXTURES / "user_small_m.yaml"), "--ptxas"]) == 3
    # Names come back in table order; any arch spelling of a family builds its target.
    assert cli.main(["compile", "--arch", "sm_80"]) == 3
    assert calls == [("sm_90a", None, "fwd_decode_m1_16_n1_2112", False),
                     ("sm_90a", ["fwd_decode_m1_16_n1_2112", "my_decode"], "my_decode", True),
                     ("sm_80", None, "my_decode", False)]


def test_compile_with_a_broken_config(capsys):
    assert cli.main(["compile", "--config", str(FIXTURES / "bad_cluster.yaml")]) == 1
    assert "bucket 'big_cluster': field 'cluster'" in capsys.readouterr().err


def test_demo_hands_off(monkeypatch):
    seen = []
    fake = types.ModuleType("detgemm_cute.demo")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "detgemm_cute.demo", fake)
    assert cli.main(["demo"]) == 0
    assert cli.main(["demo", "--quick"]) == 0
    assert cli.main(["demo", "--audit"]) == 0
    assert seen == [[], ["--quick"], ["--audit"]]


def test_bench_runs_the_source_tree_script(monkeypatch, tmp_path, capsys):
    script = tmp_path / "bench_gemm.py"
    script.write_text("def main(argv=None, prog=None):\n    print('bench', prog, argv)\n"
                      "    return 5\n")
    monkeypatch.setattr(cli, "_BENCH", script)
    assert cli.main(["bench", "--quick", "--dtype", "fp16"]) == 5
    assert "bench detgemm-cute bench ['--quick', '--dtype', 'fp16']" in capsys.readouterr().out


def test_bench_without_source_tree(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "_BENCH", tmp_path / "missing.py")
    assert cli.main(["bench"]) == 1
    assert "bench/ ships with the source tree" in capsys.readouterr().out
