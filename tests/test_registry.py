"""The YAML registry: the built-in table loads and covers everything; every kind of bad
file is refused with a message naming the file, the bucket and the field."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from detgemm_cute import registry as R, wave_cost
from detgemm_cute.kernels import sm90_limits

FIXTURES = Path(__file__).resolve().parent / "fixtures"




def _write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _bucket(name="b", m="[1, 64]", extra=""):
    return (f"  - name: {name}\n    op: fwd\n    dtypes: [bf16]\n    m: {m}\n"
            f"    tile: [64, 64, 64]\n    stages: 4\n{extra}")


# --- the built-in table ------------------------------------------------------------------

def test_builtin_table_loads_and_is_complete():
    f = R.load_builtin("sm90")
    assert f.path == R.BUILTIN_DIR / "sm90.yaml"
    assert f.origin == "built-in"
    names = [b.name for b in f.buckets]
    assert len(names) == len(set(names)) >= 1
    for dtype in R.DTYPES:
        serving = [b for b in f.buckets if b.op == "fwd" and dtype in b.dtypes]
        assert R.coverage_gaps(serving) == []


def test_builtin_buckets_pass_kernel_limits_and_carry_lines():
    text = (R.BUILTIN_DIR / "sm90.yaml").read_text().splitlines()
    for b in R.load_builtin("sm90").buckets:
        assert sm90_limits.check_config(b.tile, b.cluster, b.stages, b.persistent,
                                        dtypes=b.dtypes, pingpong=b.pingpong,
                                        swap_ab=b.swap_ab) == []
        if b.group:  # an alternative: its own line inside its bucket's list
            assert text[b.line - 1].strip().startswith("- {tile: ")
            assert b.name.startswith(b.group + ".") and len(b.cost) == wave_cost.N_COEFFS and b.sms == 132
        else:
            assert text[b.line - 1].strip() == f"- name: {b.name}"
        assert b.layer == 0 and b.source.name == "sm90.yaml"


def test_get_registry_is_cached_and_ordered():
    r = R.get_registry("sm90")
    assert R.get_registry("sm90") is r
    assert r.ops == ("fwd", "dx", "dw", "bmm", "grouped", "grouped_k")
    assert r.buckets == R.load_builtin("sm90").buckets
    for dtype in R.DTYPES:
        assert [b.name for b in r.table("fwd", dtype)] == \
            [b.name for b in r.buckets if b.op == "fwd" and dtype in b.dtypes]
    assert r.table("fwd", "fp32") and r.table("bmm", "fp32") == ()
    with pytest.raises(ValueError, match="unknown op"):
        r.table("bwd", "bf16")
    with pytest.raises(ValueError, match="unknown dtype"):
        r.table("fwd", "fp64")


def test_sm80_and_unknown_arches():
    r = R.get_registry("sm80")
    assert r.arch == "sm80" and r.lookup("dw", "fp16", 1, 1, 1).op == "dw"
    with pytest.raises(ValueError, match="unknown arch 'sm75'"):
        R.get_registry("sm75")


# --- fixtures: each names the file, the bucket and the field ------------------------------

@pytest.mark.parametrize("fixture, complete, bucket, field, words", [
    ("overlap.yaml", False, "bucket 'overlapping'", "field 'm'",
     ["overlaps bucket 'small'", "M 48..64"]),
    ("gap.yaml", True, "bucket 'low'", "field 'm'",
     ["op fwd dtype bf16: M 65..127 (N 1.., K 1..) is covered by no bucket", "bucket 'high'"]),
    ("unknown_key.yaml", False, "bucket 'typo'", "field 'stage'", ["did you mean 'stages'"]),
    ("bad_tile.yaml", False, "bucket 'odd_tile'", "field 'tile'", ["tile M", "96"]),
    ("bad_cluster.yaml", False, "bucket 'big_cluster'", "field 'cluster'", ["[4, 4]"]),
    ("too_many_stages.yaml", False, "bucket 'deep'", "field 'stages'",
     ["shared memory", "at most 4 stages fit"]),
    ("duplicate_name.yaml", False, "bucket 'twice'", "field 'name'",
     ["already used by the bucket at line 3"]),
    ("wrong_type.yaml", False, "bucket 'stringy'", "field 'm'",
     ["upper bound must be an integer or null, got 'x' (str)"]),
    ("missing_field.yaml", False, "bucket 'no_tile'", "field 'tile'", ["missing (required)"]),
    ("bad_arch.yaml", False, None, "field 'arch'", ["unknown arch 'sm75'"]),
    ("malformed.yaml", False, None, None, ["malformed YAML"]),
])
def test_bad_fixture_is_refused(fixture, complete, bucket, field, words):
    path = FIXTURES / fixture
    with pytest.raises(R.ConfigError) as info:
        R.load_config(path, complete=complete)
    msg = str(info.value)
    assert fixture in msg
    for part in [bucket, field] + words:
        if part is not None:
            assert part in msg, (part, msg)
    assert info.value.path == path
    assert all(fixture in line for line in info.value.problems)


def test_problem_lines_carry_the_line_of_the_field():
    with pytest.raises(R.ConfigError) as info:
        R.load_config(FIXTURES / "bad_tile.yaml")
    assert "bad_tile.yaml:7:" in str(info.value)  # the `tile:` line
    with pytest.raises(R.ConfigError) as info:
        R.load_config(FIXTURES / "malformed.yaml")
    assert "malformed.yaml:6:" in str(info.value)


def test_every_problem_of_a_file_is_reported_together(tmp_path):
    p = _write(tmp_path, "arch: sm90\nextra: 1\nbuckets:\n"
               + _bucket("a", extra="    colour: red\n")
               + _bucket("b", m="[0, 8]")
               + "  - name: c\n    op: bwd\n    dtypes: [fp64]\n    m: [1, 2]\n"
                 "    tile: [64, 64]\n    stages: true\n")
    with pytest.raises(R.ConfigError) as info:
        R.load_config(p)
    problems = info.value.problems
    assert str(info.value).startswith(f"{len(problems)} problems in ")
    expected = ["field 'extra': unknown top-level key",
                "bucket 'a': field 'colour': unknown key",
                "bucket 'b': field 'm': lower bound must be >= 1",
                "bucket 'c': field 'op': unknown op 'bwd'",
                "bucket 'c': field 'dtypes': unknown dtype 'fp64'",
                "bucket 'c': field 'tile': tile [BM, BN, BK] must be a list of 3 integers",
                "bucket 'c': field 'stages': stages must be an integer, got True (bool)"]
    for want in expected:
        assert sum(want in line for line in problems) == 1, (want, problems)
    assert len(problems) == len(expected)


@pytest.mark.parametrize("field_text, field, words", [
    ("m: [64, 1]", "m", "upper bound 1 is below lower bound 64"),
    ("m: [1]", "m", "must be [lo, hi]"),
    ("m: [1.5, 4]", "m", "lower bound must be an integer"),
    ("m: [true, 4]", "m", "lower bound must be an integer"),
    ("n: [1, 0]", "n", "below lower bound"),
    ("dtypes: []", "dtypes", "non-empty list"),
    ("dtypes: [bf16, bf16]", "dtypes", "twice"),
    ("cluster: [1, 1, 1]", "cluster", "list of 2 integers"),
    ("persistent: 1", "persistent", "true or false"),
    ("note: 3", "note", "must be a string"),
    ("name: ''", "name", "non-empty string"),
])
def test_field_types_and_ranges(tmp_path, field_text, field, words):
    key = field_text.split(":")[0]
    lines = {"name": "name: b", "op": "op: fwd", "dtypes": "dtypes: [bf16]", "m": "m: [1, 64]",
             "tile": "tile: [64, 64, 64]", "stages": "stages: 4"}
    lines[key] = field_text
    first, *rest = lines.values()
    p = _write(tmp_path, "arch: sm90\nbuckets:\n  - " + first + "\n"
               + "".join(f"    {v}\n" for v in rest))
    with pytest.raises(R.ConfigError) as info:
        R.load_config(p)
    assert f"field {field!r}" in str(info.value) and words in str(info.value)
    assert "cfg.yaml" in str(info.value)


def test_repeated_key_and_top_level_shape(tmp_path):
    p = _write(tmp_path, "arch: sm90\nbuckets:\n" + _bucket(extra="    stages: 5\n"))
    with pytest.raises(R.ConfigError, match="bucket 'b': field 'stages': given more than once"):
        R.load_config(p)
    for text, words in [("", "expected a mapping"), ("- 1\n", "expected a mapping"),
                        ("arch: sm90\n", "field 'buckets': missing"),
                        ("arch: sm90\nbuckets: []\n", "non-empty list"),
                        ("buckets:\n" + _bucket(), "field 'arch': missing"),
                        ("arch: sm90\nbuckets:\n  - 3\n", "buckets[0] must be a mapping")]:
        with pytest.raises(R.ConfigError, match=re.escape(words)):
            R.load_config(_write(tmp_path, text))


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(R.ConfigError, match="cannot read config file"):
        R.load_config(tmp_path / "nope.yaml")


def test_overlap_needs_shared_op_and_dtype(tmp_path):
    other_dtype = _bucket("a").replace("[bf16]", "[fp16]")
    p = _write(tmp_path, "arch: sm90\nbuckets:\n" + _bucket("b") + other_dtype)
    assert len(R.load_config(p).buckets) == 2
    other_op = _bucket("a").replace("op: fwd", "op: dw")
    p = _write(tmp_path, "arch: sm90\nbuckets:\n" + _bucket("b") + other_op)
    assert len(R.load_config(p).buckets) == 2
    disjoint_n = (_bucket("a", extra="    n: [1, 128]\n")
                  + _bucket("c", extra="    n: [129, null]\n"))
    p = _write(tmp_path, "arch: sm90\nbuckets:\n" + disjoint_n)
    assert len(R.load_config(p).buckets) == 2


def test_coverage_is_exact_on_a_split_grid(tmp_path):
    # M 1..64 split by N, M 65.. split by K: complete, no overlaps.
    text = ("arch: sm90\nbuckets:\n"
            + _bucket("a", "[1, 64]", "    n: [1, 4096]\n").replace("[bf16]", "[bf16, fp16]")
            + _bucket("b", "[1, 64]", "    n: [4097, null]\n").replace("[bf16]", "[bf16, fp16]")
            + _bucket("c", "[65, null]", "    k: [1, 511]\n").replace("[bf16]", "[bf16, fp16]")
            + _bucket("d", "[65, null]", "    k: [512, null]\n").replace("[bf16]", "[bf16, fp16]"))
    assert len(R.load_config(_write(tmp_path, text), complete=True).buckets) == 4
    # Drop bucket b: one gap, in N, next to bucket a.
    text = text.replace(_bucket("b", "[1, 64]", "    n: [4097, null]\n")
                        .replace("[bf16]", "[bf16, fp16]"), "")
    with pytest.raises(R.ConfigError) as info:
        R.load_config(_write(tmp_path, text), complete=True)
    msg = str(info.value)
    assert "field 'm': op fwd dtype bf16: M 1..64 (N 4097.., K 1..) is covered by no bucket" in msg
    assert "bucket 'a' (line 3, n 1..4096)" in msg


def test_coverage_requires_every_dtype(tmp_path):
    p = _write(tmp_path, "arch: sm90\nbuckets:\n" + _bucket("only_bf16", "[1, null]"))
    with pytest.raises(R.ConfigError, match="op fwd dtype fp16 has no bucket"):
        R.load_config(p, complete=True)
    assert len(R.load_config(p).buckets) == 1  # fine as a user layer


def test_coverage_gaps_merges_cells():
    def b(m, n=(1, None), k=(1, None)):
        return R.Bucket("x", "fwd", ("bf16",), m, n, k, (64, 64, 64), (1, 1), 4, False, "",
                        Path("x"), 1, 0)
    assert R.coverage_gaps([b((1, None))]) == []
    assert R.coverage_gaps([b((1, 10)), b((21, None))]) == [((11, 20), (1, None), (1, None))]
    # Gap split by an N boundary elsewhere still comes out as one box.
    gaps = R.coverage_gaps([b((1, 10)), b((21, None), n=(1, 7)), b((21, None), n=(8, None))])
    assert gaps == [((11, 20), (1, None), (1, None))]
    assert R.coverage_gaps([b((2, None))]) == [((1, 1), (1, None), (1, None))]


# --- user layers --------------------------------------------------------------------------

def test_add_config_bumps_generation_and_rebuilds():
    r0 = R.get_registry("sm90")
    g0 = R.generation()
    f = R.add_config(FIXTURES / "user_small_m.yaml")
    assert f.arch == "sm90" and f.origin == "add_config"
    r1 = R.get_registry("sm90")
    assert r1 is not r0 and R.generation() > g0 and r1.generation == R.generation()
    assert [x.layer for x in r1.files] == [0, 1]
    assert r1.table("fwd", "bf16")[0].name == "my_decode"
    # the user bucket shadows the built-in name
    assert r1.bucket("fwd_decode_m33_64_n1_1536").layer == 1
    assert [b.layer for b in r1.named("fwd_decode_m33_64_n1_1536")] == [1, 0]
    R.reset_user_configs()
    assert len(R.get_registry("sm90").files) == 1
    with pytest.raises(R.NoBucketError, match="no sm90 bucket is named 'nope'"):
        R.get_registry("sm90").bucket("nope")


def test_user_layer_is_validated_and_must_match_arch(tmp_path):
    with pytest.raises(R.ConfigError, match="overlapping"):
        R.add_config(FIXTURES / "overlap.yaml")
    assert R.user_configs() == ()
    p = _write(tmp_path, "arch: sm80\nbuckets:\n" + _bucket())
    with pytest.raises(R.ConfigError, match="field 'arch': file is for sm80 but is used as a "
                                            "layer of the sm90 table"):
        R.add_config(p, arch="sm90")
    assert R.add_config(p).arch == "sm80"  # joins the sm80 table
    assert R.get_registry("sm80").lookup("fwd", "bf16", 3, 8, 8).name == "b"


def test_env_var_layers(monkeypatch, tmp_path):
    a = _write(tmp_path, "arch: sm90\nbuckets:\n" + _bucket("env_a", "[1, 4]"), "a.yaml")
    b = _write(tmp_path, "arch: sm90\nbuckets:\n" + _bucket("env_b", "[1, 2]"), "b.yaml")
    monkeypatch.setenv(R.ENV_VAR, f"{a}{os.pathsep}{b}")
    R.reset_user_configs()
    r = R.get_registry("sm90")
    assert [(f.path.name, f.origin) for f in r.files[1:]] == [("a.yaml", R.ENV_VAR),
                                                            ("b.yaml", R.ENV_VAR)]
    assert r.lookup("fwd", "bf16", 2, 8, 8).name == "env_b"  # the later file is higher
    assert r.lookup("fwd", "bf16", 3, 8, 8).name == "env_a"
    assert r.lookup("fwd", "fp16", 3, 8, 8).layer == 0
    # The variable is read once: changing it does nothing until reset.
    monkeypatch.setenv(R.ENV_VAR, str(a))
    assert len(R.get_registry("sm90").files) == 3
    R.reset_user_configs()
    assert len(R.get_registry("sm90").files) == 2


@pytest.mark.parametrize("arch, extra, words", [
    ("sm90", "", ["field 'raster_n'", "set persistent: true"]),
    ("sm80", "", ["field 'raster_n'", "no persistent schedule"]),
    ("sm90", "    persistent: true\n", []),
])
def test_raster_n_needs_a_persistent_sm90_kernel(tmp_path, arch, extra, words):
    bk = 64 if arch == "sm90" else 32
    path = tmp_path / "raster.yaml"
    path.write_text(f"arch: {arch}\nbuckets:\n  - name: x\n    op: fwd\n    dtypes: [bf16]\n"
                    f"    m: [1, 64]\n    tile: [64, 64, {bk}]\n    stages: 3\n{extra}"
                    f"    raster_n: true\n")
    if not words:
        (b,) = R.load_config(path, arch=arch).buckets
        assert b.raster_n is True and b.name == "x"
        return
    with pytest.raises(R.ConfigError) as info:
        R.load_config(path, arch=arch)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_wide_tiles_and_cluster_sizes():
    """BM 256 takes BN <= 192 and 16-bit operands; clusters have at most eight CTAs, at most
    four along a dimension."""
    ok = sm90_limits.check_config
    assert ok((256, 192, 64), (1, 1), 3, True) == []
    assert ok((256, 128, 64), (2, 2), 4, True) == []
    assert ok((64, 208, 64), (4, 1), 6, True, swap_ab=True) == []
    assert [f for f, _ in ok((256, 208, 64), (1, 1), 3, True)] == ["tile"]
    assert [f for f, _ in ok((256, 128, 32), (1, 1), 3, True, dtypes=("tf32",))] == ["tile"]
    assert [f for f, _ in ok((256, 128, 96), (1, 1), 2, True, dtypes=("fp32",))] == ["tile"]
    assert ok((64, 128, 64), (4, 2), 8, True, swap_ab=True) == []
    assert ok((128, 64, 64), (2, 4), 8, False) == []
    assert [f for f, _ in ok((128, 128, 64), (4, 4), 4, True)] == ["cluster"]
    assert [f for f, _ in ok((128, 128, 64), (8, 1), 4, True)] == ["cluster"]
    assert sm90_limits.warpgroups(256, 128) == 2 and sm90_limits.warpgroups(128, 128) == 1


@pytest.mark.parametrize("tile, vector, out_bytes, want", [
    ((64, 256, 64), 4, 2, (64, 128)), ((128, 128, 64), 4, 2, (64, 128)),
    ((64, 256, 64), 2, 4, (64, 64)), ((64, 192, 64), 4, 2, (64, 64)),
    ((128, 80, 64), 4, 2, (64, 16)), ((256, 128, 64), 4, 2, (128, 128)),
    ((64, 256, 64), 1, 2, (64, 32))])
def test_8_byte_direct_stores_stage_wider_sub_tiles_in_the_same_shared_memory(
        tile, vector, out_bytes, want):
    """A kernel whose threads store C 8 bytes at a time stages sub-tiles 32 x that many
    elements wide where BN allows (one 256-byte run of a row per warp's store), in fewer
    stages: the epilogue's shared memory stays what `smem_bytes` counts for every bucket."""
    from detgemm_cute.kernels import sm90_limits as lim

    rows, cols = lim.epilogue_tile(tile[0], tile[1], direct_vector=vector)
    assert (rows, cols) == want
    staged = rows * cols * out_bytes * lim.epi_stages(out_bytes, cols)
    er, ec = lim.epilogue_tile(tile[0], tile[1])
    assert staged <= lim.EPI_BYTES_PER_ROWCOL * er * ec


def test_the_gpu_tile_tests_layer_loads(tmp_path):
    """The user layer `test_gpu_tile_shapes.py` forces its specs through is one the registry
    accepts (a refused bucket there would fail every test of that file on the GPU), and it
    declares a bmm bucket for exactly the specs the file runs bmm on."""
    import tile_specs

    path = tmp_path / "tiles.yaml"
    path.write_text(tile_specs.layer_text())
    layer = R.load_config(path)
    names = {b.name for b in layer.buckets if b.op == "bmm"}
    want = {f"bmm_{tile_specs.name(*s)}" for s in tile_specs.ALL if tile_specs.serves_bmm(s)}
    assert names == want and want
    assert not any(s[0][1] % 16 for s in tile_specs.ALL if tile_specs.serves_bmm(s))
    assert any(s[0][1] % 16 for s in tile_specs.ODD8)
