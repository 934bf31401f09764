"""Faulty config files, through every way a file gets in: `registry.load_config`,
`registry.add_config`, `DETGEMM_CUTE_CONFIG`, and `detgemm-cute audit/explain --config`.

What is covered elsewhere and not repeated here: field-level validation, the fixtures,
a missing file, an empty file and a top-level list through `load_config`, a duplicate name
inside one file, and layering through `add_config`/the environment (tests/test_registry.py);
precedence, same-name shadowing through `dispatch.explain` and a broken environment layer
at lookup (tests/test_dispatch.py); `audit`/`explain` with the fixtures and the exit status
of user mistakes (tests/test_cli.py)."""

from __future__ import annotations

import os
import re

import pytest

from detgemm_cute import cli
from detgemm_cute import dispatch as D
from detgemm_cute import registry as R
from detgemm_cute.kernels import sm90_limits

ENTRIES = ("load_config", "add_config", "env", "audit", "explain")


def bucket(name="b", m="[1, 64]", tile="[64, 64, 64]", stages=4):
    return (f"  - name: {name}\n    op: fwd\n    dtypes: [bf16]\n    m: {m}\n"
            f"    tile: {tile}\n    stages: {stages}\n")


def cfg(*buckets):
    return "arch: sm90\nbuckets:\n" + "".join(buckets)


def load_via(entry, path, monkeypatch, capsys, words):
    """Load `path` through `entry`; the failure must name every one of `words`."""
    if entry in ("audit", "explain", "compile"):
        argv = {"audit": ["audit", "--config", str(path)],
                "explain": ["explain", "--config", str(path), "20", "8", "8"],
                "compile": ["compile", "--config", str(path)]}[entry]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and err
        assert all(line.startswith("detgemm-cute: ") for line in err.splitlines())
        text = err
    else:
        with pytest.raises(R.ConfigError) as info:
            if entry == "load_config":
                R.load_config(path)
            elif entry == "add_config":
                R.add_config(path)
            else:
                monkeypatch.setenv(R.ENV_VAR, str(path))
                R.reset_user_configs()
                R.get_registry("sm90")
        text = str(info.value)
        monkeypatch.delenv(R.ENV_VAR, raising=False)
    for w in words:
        assert w in text, (w, text)
    assert R.user_configs() == ()  # a refused file leaves no layer behind


# name, file content (None: a directory; absent: nothing written), words the error must have
FAULTS = [
    ("dir.yaml", None, ["dir.yaml", "cannot read config file: Is a directory"]),
    ("missing.yaml", "absent", ["missing.yaml", "cannot read config file: No such file"]),
    ("tab.yaml", "arch: sm90\nbuckets:\n  - name: b\n\top: fwd\n",
     ["tab.yaml:4: malformed YAML", "cannot start any token"]),
    ("indent.yaml", "arch: sm90\nbuckets:\n  - name: b\n   op: fwd\n",
     ["indent.yaml:4: malformed YAML", "expected <block end>"]),
    ("quote.yaml", "arch: sm90\nbuckets:\n  - name: 'b\n    op: fwd\n",
     ["quote.yaml:5: malformed YAML", "quoted scalar"]),
    ("two_docs.yaml", cfg(bucket()) + "---\narch: sm90\n",
     ["two_docs.yaml:9: malformed YAML", "expected a single document"]),
    ("pytag.yaml", "arch: !!python/object/apply:os.getcwd []\nbuckets:\n" + bucket(),
     ["pytag.yaml:1: malformed YAML", "could not determine a constructor"]),
    ("listkey.yaml", "arch: sm90\nbuckets:\n  - ? [a, b]\n    : 1\n",
     ["listkey.yaml:3: malformed YAML: a mapping key must be a plain value"]),
    ("empty.yaml", "", ["empty.yaml: expected a mapping with keys arch, buckets, got null"]),
    ("comments.yaml", "# only a comment\n\n", ["comments.yaml: expected a mapping", "got null"]),
    ("toplist.yaml", "- name: b\n  op: fwd\n", ["toplist.yaml: expected a mapping", "got list"]),
    ("scalar.yaml", "sm90\n", ["scalar.yaml: expected a mapping", "got str"]),
    ("twice_arch.yaml", "arch: sm90\narch: sm90\nbuckets:\n" + bucket(),
     ["twice_arch.yaml:2: field 'arch': given more than once"]),
    ("dup_name.yaml", cfg(bucket("twice"), bucket("twice", m="[65, 128]")),
     ["dup_name.yaml:9: bucket 'twice': field 'name': name already used by the bucket at "
      "line 3"]),
    ("tile96.yaml", cfg(bucket("odd", tile="[96, 64, 64]")),
     ["tile96.yaml:7: bucket 'odd': field 'tile': tile M must be one of "
      "(8, 16, 32, 64, 128, 256), got 96"]),
    ("deep.yaml", cfg(bucket("deep", tile="[128, 256, 64]", stages=5)),
     ["deep.yaml:8: bucket 'deep': field 'stages'", "more than 232448", "at most 4 stages fit"]),
]


def _make(tmp_path, name, content):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    elif content != "absent":
        path.write_text(content)
    return path


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name, content, words", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_is_refused_naming_file_line_and_bucket(tmp_path, monkeypatch, capsys, entry,
                                                      name, content, words):
    load_via(entry, _make(tmp_path, name, content), monkeypatch, capsys, words)


def test_broken_env_layer_fails_audit_and_explain(tmp_path, monkeypatch, capsys):
    path = _make(tmp_path, "env_bad.yaml", FAULTS[3][1])
    monkeypatch.setenv(R.ENV_VAR, str(path))
    for argv in (["audit"], ["explain", "1", "8", "8"]):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "env_bad.yaml:4: malformed YAML" in err and "Traceback" not in err


def test_missing_config_for_compile_exits_1(tmp_path, capsys):
    load_via("compile", tmp_path / "gone.yaml", None, capsys,
             ["gone.yaml", "cannot read config file"])


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root reads files whatever their mode")
@pytest.mark.parametrize("entry", ENTRIES)
def test_file_without_read_permission(tmp_path, monkeypatch, capsys, entry):
    path = _make(tmp_path, "locked.yaml", cfg(bucket()))
    path.chmod(0)
    try:
        load_via(entry, path, monkeypatch, capsys,
                 ["locked.yaml", "cannot read config file: Permission denied"])
    finally:
        path.chmod(0o644)


@pytest.mark.parametrize("entry", ENTRIES + ("compile",))
def test_undecodable_file_is_a_config_error(tmp_path, monkeypatch, capsys, entry):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(("# caf\xe9\n" + cfg(bucket())).encode("latin-1"))
    load_via(entry, path, monkeypatch, capsys, ["latin1.yaml"])


def test_env_failure_does_not_stick(tmp_path, monkeypatch):
    monkeypatch.setenv(R.ENV_VAR, str(tmp_path / "later.yaml"))
    R.reset_user_configs()
    for _ in range(2):  # refused on every use, not once
        with pytest.raises(R.ConfigError, match="later.yaml: cannot read config file"):
            D.lookup("fwd", "bf16", "sm90", 5, 8, 8)
    _make(tmp_path, "later.yaml", cfg(bucket("late", m="[1, 8]")))
    assert D.lookup("fwd", "bf16", "sm90", 5, 8, 8).name == "late"  # no reset needed


def test_env_skips_empty_entries(tmp_path, monkeypatch):
    a = _make(tmp_path, "a.yaml", cfg(bucket("env_a", m="[1, 4]")))
    b = _make(tmp_path, "b.yaml", cfg(bucket("env_b", m="[1, 2]")))
    monkeypatch.setenv(R.ENV_VAR, os.pathsep.join(["", str(a), " ", str(b), ""]))
    R.reset_user_configs()
    assert [f.path.name for f in R.user_configs()] == ["a.yaml", "b.yaml"]


# --- one bucket name in several layers ----------------------------------------------------

def _two_layers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # messages show paths relative to the working directory
    a = _make(tmp_path, "a.yaml", cfg(bucket("mine", m="[1, 100]")))
    b = _make(tmp_path, "b.yaml", cfg(bucket("mine", m="[50, 60]", tile="[128, 128, 64]")))
    return a, b


@pytest.mark.parametrize("how", ["add_config", "env"])
def test_same_name_in_two_user_layers(tmp_path, monkeypatch, how):
    """Allowed (names are unique only within a file): the higher layer wins by name and
    where it matches; the lower one still serves the rest of its range."""
    a, b = _two_layers(tmp_path, monkeypatch)
    if how == "env":
        monkeypatch.setenv(R.ENV_VAR, os.pathsep.join([str(a), str(b)]))
        R.reset_user_configs()
    else:
        R.add_config(a)
        R.add_config(b)
    reg = R.get_registry("sm90")
    assert [(x.source.name, x.layer) for x in reg.named("mine")] == [("b.yaml", 2), ("a.yaml", 1)]
    assert D.bucket_by_name("sm90", "mine").tile == (128, 128, 64)
    assert D.lookup("fwd", "bf16", "sm90", 55, 8, 8).source.name == "b.yaml"
    assert D.lookup("fwd", "bf16", "sm90", 20, 8, 8).source.name == "a.yaml"
    text = str(D.explain("fwd", "bf16", "sm90", 55, 8, 8))
    assert "bucket:  mine (b.yaml:3, layer 2 = user 2)" in text
    assert "shadows: mine (a.yaml:3, layer 1 = user 1)" in text


def test_same_file_added_twice_is_two_layers(tmp_path, monkeypatch):
    a, b = _two_layers(tmp_path, monkeypatch)
    for p in (a, b, a):
        R.add_config(p)
    ex = D.explain("fwd", "bf16", "sm90", 55, 8, 8)
    assert (ex.source.name, ex.layer) == ("a.yaml", 3)  # the last added wins
    assert [(s.source.name, s.layer) for s in ex.shadowed][:2] == [("b.yaml", 2), ("a.yaml", 1)]


def test_audit_names_the_shadowed_user_bucket(tmp_path, monkeypatch, capsys):
    a, b = _two_layers(tmp_path, monkeypatch)
    assert cli.main(["audit", "--arch", "sm90", "--config", str(a), "--config", str(b)]) == 0
    out = capsys.readouterr().out
    assert "mine (b.yaml:3) shadows the same-named bucket at a.yaml:3 (user 1)" in out
    assert out.rstrip().endswith("audit: OK")


def test_explain_never_says_the_winner_hides_itself(tmp_path, monkeypatch, capsys):
    a, b = _two_layers(tmp_path, monkeypatch)
    R.add_config(a)
    R.add_config(b)
    ex = D.explain("fwd", "bf16", "sm90", 20, 8, 8)
    assert ex.bucket.source.name == "a.yaml"
    assert ex.bucket not in ex.same_name
    assert cli.main(["explain", "--config", str(a), "--config", str(b), "20", "8", "8"]) == 0
    assert "hides:   mine (a.yaml:3" not in capsys.readouterr().out


def test_merge_key_override_is_not_a_repeated_key(tmp_path):
    path = _make(tmp_path, "merge.yaml", cfg(bucket("a", m="[1, 8]"))
                 .replace("  - name: a", "  - &base\n    name: a")
                 + "  - <<: *base\n    name: c\n    m: [9, 16]\n")
    f = R.load_config(path)
    assert [(b.name, b.m, b.tile) for b in f.buckets] == [("a", (1, 8), (64, 64, 64)),
                                                          ("c", (9, 16), (64, 64, 64))]


# --- kernels that cannot be built ----------------------------------------------------------

@pytest.mark.parametrize("tile", [(128, 256, 64), (64, 64, 128), (128, 128, 128),
                                  (128, 256, 128)])
def test_stages_at_the_shared_memory_boundary(tmp_path, capsys, tile):
    fit = sm90_limits.max_stages(tile)
    assert 2 <= fit < 16
    ok = _make(tmp_path, "ok.yaml", cfg(bucket("edge", tile=list(tile), stages=fit)))
    assert R.load_config(ok).buckets[0].stages == fit
    bad = _make(tmp_path, "bad.yaml", cfg(bucket("edge", tile=list(tile), stages=fit + 1)))
    assert cli.main(["audit", "--arch", "sm90", "--config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml:8: bucket 'edge': field 'stages'" in err
    assert f"at most {fit} stages fit" in err


@pytest.mark.parametrize("tile, stages, words", [
    ("[64, 40, 64]", 4, "field 'tile': tile N must be one of (16, 32, 48, 64, 72, 80, 88, 96, "
                        "104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184, 192, 200, 208, "
                        "216, 224, 232, 240, 248, 256), got 40"),
    ("[32, 72, 128]", 4, "field 'tile': BN 72 (an odd multiple of 8) needs 16-bit operands and "
                         "BM >= 64"),
    ("[64, 64, 32]", 4, "field 'tile': tile K must be one of (64, 128), got 32"),
    ("[8, 16, 128]", 4, "field 'tile': a BM 8 row tile needs BN a multiple of 32, got 16"),
    ("[64, 64, 64]", 1, "field 'stages': stages must be in [2, 16], got 1"),
    ("[64, 16, 64]", 17, "field 'stages': stages must be in [2, 16], got 17"),
])
def test_unbuildable_bucket_in_a_user_layer(tmp_path, tile, stages, words):
    path = _make(tmp_path, "u.yaml", cfg(bucket("ok"), bucket("nope", m="[65, 80]", tile=tile,
                                                              stages=stages)))
    with pytest.raises(R.ConfigError, match="bucket 'nope': " + words.replace("[", r"\[")
                       .replace("(", r"\(").replace(")", r"\)")):
        R.add_config(path)
    assert R.user_configs() == ()


# --- a user bucket that shadows a built-in one ---------------------------------------------

def test_user_bucket_shadows_builtin_until_reset(tmp_path, monkeypatch, capsys):
    builtin = R.load_builtin("sm90")
    small = next(b for b in builtin.buckets if b.name == "fwd_decode_m33_64_n1_1536")
    user = _make(tmp_path, "retune.yaml", "arch: sm90\nbuckets:\n"
                 "  - name: fwd_decode_m33_64_n1_1536\n"
                 "    op: fwd\n    dtypes: [bf16, fp16]\n    m: [17, 128]\n    n: [1, 8192]\n"
                 "    tile: [128, 128, 64]\n    stages: 4\n")
    monkeypatch.setenv(R.ENV_VAR, str(user))
    R.reset_user_configs()
    assert cli.main(["explain", "--op", "fwd", "--dtype", "bf16", "40", "1000", "4096"]) == 0
    out = capsys.readouterr().out
    assert "bucket:  fwd_decode_m33_64_n1_1536 (" in out
    assert "retune.yaml:3, layer 1 = user 1)" in out
    assert "tile 128x128x64" in out
    assert f"shadows: fwd_decode_m33_64_n1_1536 ({small.where}, layer 0 = built-in)" in out
    assert cli.main(["audit", "--arch", "sm90"]) == 0
    out = capsys.readouterr().out
    assert f"retune.yaml [{R.ENV_VAR}]" in out
    assert f"shadows the same-named bucket at {small.where} (built-in)" in out
    assert D.lookup("fwd", "bf16", "sm90", 40, 1000, 4096).tile == (128, 128, 64)
    R.reset_user_configs()  # the variable is still set: read again
    assert D.bucket_by_name("sm90", "fwd_decode_m33_64_n1_1536").layer == 1
    monkeypatch.delenv(R.ENV_VAR)
    g = R.generation()
    R.reset_user_configs()
    assert R.generation() > g
    assert D.lookup("fwd", "bf16", "sm90", 40, 1000, 4096) == small
    assert D.bucket_by_name("sm90", "fwd_decode_m33_64_n1_1536") == small
    assert cli.main(["explain", "40", "1000", "4096"]) == 0
    out = capsys.readouterr().out
    assert f"fwd_decode_m33_64_n1_1536 ({small.where}, layer 0 = built-in)" in out
    assert "retune" not in out


# --- grouped buckets: the grouped kernel's own rules ------------------------------------------

def _grouped(extra, arch="sm90", op="grouped", tile="[128, 128, 64]"):
    return (f"arch: {arch}\nbuckets:\n  - name: g\n    op: {op}\n    dtypes: [bf16]\n"
            f"    m: [1, null]\n    tile: {tile}\n    stages: 4\n" + extra)


@pytest.mark.parametrize("op, tile, extra, words", [
    ("grouped", "[128, 128, 64]", "", "field 'persistent': the grouped kernel is persistent"),
    ("grouped_k", "[128, 128, 64]", "    persistent: true\n    pingpong: true\n",
     "field 'persistent': the grouped_k kernel is persistent and cooperative"),
    ("grouped_k", "[128, 160, 64]", "    persistent: true\n",
     r"field 'tile': grouped_k tiles have BM and BN multiples of 64"),
])
def test_grouped_bucket_rules(tmp_path, op, tile, extra, words):
    path = _make(tmp_path, "g.yaml", _grouped(extra, op=op, tile=tile))
    with pytest.raises(R.ConfigError, match="bucket 'g': " + words):
        R.add_config(path)
    assert R.user_configs() == ()


@pytest.mark.parametrize("op, dtypes, words", [
    ("grouped", "[bf16]", "field 'tile': BN 104 (an odd multiple of 8) serves fwd, dx, dw; op "
                          "grouped takes a multiple of 16"),
    ("bmm", "[bf16]", "field 'tile': BN 104 (an odd multiple of 8) serves fwd, dx, dw; op bmm"),
    ("fwd", "[tf32]", "field 'tile': BN 104 (an odd multiple of 8) needs 16-bit operands"),
])
def test_odd_multiple_of_8_widths_serve_the_16_bit_gemms_only(tmp_path, op, dtypes, words):
    extra = "    persistent: true\n"
    tile = "[128, 104, 32]" if dtypes == "[tf32]" else "[128, 104, 64]"
    text = _grouped(extra, op=op, tile=tile).replace("[bf16]", dtypes)
    with pytest.raises(R.ConfigError, match=re.escape("bucket 'g': " + words)):
        R.add_config(_make(tmp_path, "odd.yaml", text))
    ok = _make(tmp_path, "ok.yaml", _grouped(extra, op="dx", tile="[128, 104, 64]"))
    R.add_config(ok)
    assert D.bucket_by_name("sm90", "g").tile == (128, 104, 64)


def test_grouped_bucket_in_a_family_without_the_kernel(tmp_path):
    path = _make(tmp_path, "g80.yaml", _grouped("", arch="sm80").replace(
        "[128, 128, 64]", "[128, 128, 32]"))
    with pytest.raises(R.ConfigError, match="bucket 'g': field 'op': this kernel family has no "
                                            "grouped kernel"):
        R.add_config(path)


@pytest.mark.parametrize("cluster", ["[1, 2]", "[2, 1]", "[2, 2]"])
def test_a_grouped_user_bucket_loads_and_builds_grouped_keys(tmp_path, cluster):
    from detgemm_cute import aot

    path = _make(tmp_path, "ok.yaml", _grouped(f"    persistent: true\n    cluster: {cluster}\n"))
    layer = R.add_config(path)
    try:
        (b,) = layer.buckets
        calls = list(aot._variants(b, "all"))
        assert calls and all(c["grouped"] and not c["has_bias"] for c in calls)
        assert {(c["b_form"], c["b_contig"]) for c in calls} == {
            ("kn", "first"), ("kn", "last"), ("nk", "last")}
        assert {c["out_dtype"] for c in calls} == {"bf16", "fp32"}
    finally:
        R.reset_user_configs()
