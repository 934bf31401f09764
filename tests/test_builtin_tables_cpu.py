"""The built-in tables: where the package finds them, and what happens without them.

An installed wheel carries them as package data (`detgemm_cute/configs/*.yaml`); a source
checkout reads its top-level `configs/`. A missing or empty table is a broken installation:
every command that needs one ends with exit status 1 and one line naming the family and the
file, and `audit` cannot pass on nothing. (CI also builds the wheel and sdist and runs the
commands from an installed wheel outside the checkout: `.ci/run`.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from detgemm_cute import cli
from detgemm_cute import registry as R

CHECKOUT_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_builtin_dir_is_the_checkout_configs_here():
    assert R.BUILTIN_DIR == CHECKOUT_CONFIGS
    assert {p.name for p in R.BUILTIN_DIR.glob("*.yaml")} >= {"sm90.yaml", "sm80.yaml"}
    assert set(R.LIMITS_MODULES) == {"sm90", "sm80"}  # one table per family, both present


def test_builtin_dir_prefers_the_tables_inside_the_package(monkeypatch, tmp_path):
    """An installed package: `configs/` inside the package directory wins."""
    (tmp_path / "configs").mkdir()
    seen = []

    def files(package):
        seen.append(package)
        return tmp_path

    monkeypatch.setattr(R.resources, "files", files)
    assert R._builtin_dir() == tmp_path / "configs"
    assert seen == ["detgemm_cute"]
    (tmp_path / "configs").rmdir()  # no package data: the source checkout's configs/
    assert R._builtin_dir() == CHECKOUT_CONFIGS


@pytest.fixture
def tables_dir(monkeypatch, tmp_path):
    """BUILTIN_DIR pointed at an empty folder, with no built-in table cached."""
    monkeypatch.setattr(R, "BUILTIN_DIR", tmp_path)
    monkeypatch.setattr(R, "_builtins", {})
    monkeypatch.setattr(R, "_registries", {})
    return tmp_path


def _one_line_per_problem(err: str, want: list[str]) -> None:
    lines = err.splitlines()
    assert "Traceback" not in err
    assert len(lines) == len(want), lines
    for line, words in zip(lines, want):
        assert line.startswith("detgemm-cute: "), line
        assert words in line, line


def test_audit_fails_without_any_table(tables_dir, capsys):
    assert cli.main(["audit"]) == 1
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("audit: FAILED (problems on stderr)")
    _one_line_per_problem(captured.err, [
        f"no built-in table for the SM80 (cp.async + mma.sync) kernel family: "
        f"{R.show_path(tables_dir / 'sm80.yaml')} is missing; the installation is incomplete",
        f"no built-in table for the SM90 (TMA + WGMMA) kernel family: "
        f"{R.show_path(tables_dir / 'sm90.yaml')} is missing; the installation is incomplete"])


def test_audit_fails_when_one_family_lacks_its_table(tables_dir, capsys):
    (tables_dir / "sm90.yaml").write_text((CHECKOUT_CONFIGS / "sm90.yaml").read_text())
    assert cli.main(["audit"]) == 1
    captured = capsys.readouterr()
    assert "sm90: " in captured.out and "layer 0 (built-in)" in captured.out
    _one_line_per_problem(captured.err, ["SM80 (cp.async + mma.sync) kernel family: "])
    assert cli.main(["audit", "--arch", "sm90"]) == 0  # the family that has one passes


@pytest.mark.parametrize("text, words", [
    ("", "sm90.yaml: expected a mapping with keys arch, buckets, got null (the file is empty)"),
    ("# no buckets yet\n", "got null (the file is empty)"),
    ("arch: sm90\nbuckets: []\n", "sm90.yaml:2: field 'buckets': must be a non-empty list"),
])
def test_audit_and_explain_fail_on_an_empty_table(tables_dir, capsys, text, words):
    (tables_dir / "sm80.yaml").write_text((CHECKOUT_CONFIGS / "sm80.yaml").read_text())
    (tables_dir / "sm90.yaml").write_text(text)
    assert cli.main(["audit"]) == 1
    _one_line_per_problem(capsys.readouterr().err, [words])
    assert cli.main(["explain", "100", "4096", "4096"]) == 1
    _one_line_per_problem(capsys.readouterr().err, [words])


@pytest.mark.parametrize("argv", [
    ["explain", "100", "4096", "4096"],
    ["explain", "--arch", "sm80", "1", "64", "64"],
    ["compile"],
    ["compile", "--arch", "sm_80"],
    ["warmup", "--quiet"],
    ["tune", "--preset", "decode-models", "--ops", "fwd", "--dry-run"],
])
def test_commands_that_need_a_table_fail_with_one_line(tables_dir, capsys, argv):
    assert cli.main(argv) == 1
    family = "SM80 (cp.async + mma.sync)" if "sm80" in argv or "sm_80" in argv else \
        "SM90 (TMA + WGMMA)"
    _one_line_per_problem(capsys.readouterr().err,
                          [f"no built-in table for the {family} kernel family"])


def test_demo_fails_without_tables(tables_dir, capsys):
    """The CPU demo audits the tables and explains two problems first."""
    assert cli.main(["demo", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "no built-in table for the SM90 (TMA + WGMMA) kernel family" in err


def test_every_subpackage_is_in_the_wheel():
    """pyproject lists packages explicitly: a new subpackage left out would be missing from
    the installed wheel though every test of the checkout passes."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(root).parts)
             for p in (root / "detgemm_cute").rglob("__init__.py")}
    assert found <= listed, f"not packaged: {sorted(found - listed)}"
