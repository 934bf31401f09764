"""The README's and docs' examples run, their sample outputs are what the commands print,
and every repository path they name exists.

Conventions for a ```python block in README.md or docs/*.md (HTML comments: invisible when
the markdown is rendered), on the lines just before its fence:
- ``<!-- docs-check: context`` ... ``-->``: code run first in the block's namespace (the
  model, tensors or files the block takes as given);
- ``<!-- docs-check: skip (reason) -->``: the block is not run (say why).
A block that mentions ``cuda`` or ``nccl`` runs only where CUDA is available.
A ``` block whose first line is ``$ detgemm-cute audit ...`` or ``$ detgemm-cute explain ...``
is a sample output: the command runs, and every line shown (``...`` elides lines) must be
in its output, up to runs of spaces and the line numbers of `.yaml` files.
"""

import contextlib
import glob
import io
import re
import shlex
from pathlib import Path

import pytest
import torch

from detgemm_cute import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"<!-- docs-check: (\w+)(.*?)(?:-->|$)", re.S)
# Paths under these top-level folders (or, for kernels/ tune/ benchlib/, under detgemm_cute/).
_PATH = re.compile(r"(?<![\w./-])((?:\.ci|configs|detgemm_cute|bench|tests|docs|examples|"
                   r"kernels|tune|benchlib)/[\w./*{},-]*[\w*}])")


def _blocks(path: Path):
    """(line, language, code, directives) of every fenced block; directives are the
    docs-check comments between the previous block and this fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i, since = [], 0, 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        directives = _DIRECTIVE.findall("\n".join(lines[since:start]))
        out.append((start + 1, lang, "\n".join(lines[start + 1:j]), directives))
        i = since = j + 1
    return out


def _cases(lang_ok):
    return [pytest.param(p, line, code, d, id=f"{p.relative_to(ROOT)}:{line}")
            for p in DOCS for line, lang, code, d in _blocks(p) if lang_ok(lang, code)]


PYTHON = _cases(lambda lang, code: lang == "python")
SAMPLES = _cases(lambda lang, code: lang == "" and re.match(
    r"\$ detgemm-cute (audit|explain)\b", code))


def test_the_docs_have_examples_to_check():
    assert len(PYTHON) >= 10 and len(SAMPLES) >= 3


# On a PyTorch built without CUDA the mode's example warns that it routes nothing (documented).
@pytest.mark.filterwarnings("ignore:detgemm batch_invariant_mode. this PyTorch build has no")
@pytest.mark.parametrize("path, line, code, directives", PYTHON)
def test_python_block_runs(path, line, code, directives, tmp_path, monkeypatch):
    kinds = [kind for kind, _ in directives]
    assert set(kinds) <= {"context", "skip"}, f"unknown docs-check directive in {kinds}"
    if "skip" in kinds:
        reason = dict(directives)["skip"].strip()
        assert reason, "a skipped block says why"
        pytest.skip(reason)
    if re.search(r"cuda|nccl", code) and not torch.cuda.is_available():
        pytest.skip("a GPU block (mentions cuda/nccl)")
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    namespace = {"__name__": "docs_block"}
    for kind, text in directives:
        if kind == "context":
            exec(compile(text, f"{path.name}:{line} context", "exec"), namespace)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, f"{path.name}:{line}", "exec"), namespace)


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"\.yaml:\d+", ".yaml:N", text)).strip()


@pytest.mark.parametrize("path, line, code, directives", SAMPLES)
def test_sample_output_is_what_the_command_prints(path, line, code, directives, monkeypatch,
                                                  capsys):
    command, *shown = code.splitlines()
    monkeypatch.chdir(ROOT)
    cli.main(shlex.split(command)[2:])
    got = capsys.readouterr()
    printed = {_normal(x) for x in (got.out + "\n" + got.err).splitlines()}
    missing = [x for x in shown if x.strip() not in ("", "...") and _normal(x) not in printed]
    assert not missing, "lines the command no longer prints:\n" + "\n".join(missing)


def _expand(path: str):
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",")
            for q in _expand(path[:m.start()] + alt + path[m.end():])]


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for n, text in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for name in _PATH.findall(text):
                if not any(glob.glob(str(ROOT / base / p)) for p in _expand(name)
                           for base in ("", "detgemm_cute")):
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {name}")
    assert not missing, "\n".join(missing)
