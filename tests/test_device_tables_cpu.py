"""Device tables (`configs/devices/<device>/<arch>.yaml`, `device_tables.py`): which one a
process takes, what it may change, and that it changes only the kernels of buckets the
family table already has (its op, dtypes and box; so coverage and the bits hold)."""

from __future__ import annotations

import pytest

from detgemm_cute import device_tables as D
from detgemm_cute import dispatch
from detgemm_cute import registry as R

QK_4000 = (4000, 4000, 128)  # q @ k^T, S = 4000, head_dim 128: (M, N, K)


@pytest.fixture
def device(monkeypatch):
    """Set DETGEMM_CUTE_DEVICE_TABLE (None: unset) with no table or registry cached."""
    def use(value):
        if value is None:
            monkeypatch.delenv(D.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(D.ENV_VAR, value)
        monkeypatch.setattr(R, "_builtins", {})
        R.invalidate()
    yield use
    R.invalidate()


def test_slug_of_device_names():
    assert D.slug("NVIDIA H200") == "nvidia-h200"
    assert D.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_every_device_table_loads_and_replaces_only_kernels(device):
    devices = D.known(R.BUILTIN_DIR)
    assert "nvidia-h200" in devices
    device("off")
    family = D._by_bucket(R.load_builtin("sm90").buckets)
    for dev in devices:
        device(dev)
        table = D._by_bucket(R.load_builtin("sm90").buckets)
        assert list(table) == list(family)  # the same buckets, in the same order
        changed = [name for name in table if table[name] != family[name]]
        assert changed
        for name in changed:
            f = family[name][0]
            for b in table[name]:
                assert (b.op, b.dtypes, b.m, b.n, b.k) == (f.op, f.dtypes, f.m, f.n, f.k)
                assert b.source.parent.name == dev and b.source.parent.parent.name == D.SUBDIR
        buckets = [b for entries in table.values() for b in entries]
        for op in R.OPS:  # the boxes are the family's, so every (M, N, K) is still served
            for dt in R.REQUIRED_DTYPES:
                assert not R.coverage_gaps([b for b in buckets if b.op == op and dt in b.dtypes])


def test_the_h200_table_picks_its_own_qk_tile(device):
    device("nvidia-h200")
    b = dispatch.lookup("bmm", "bf16", "sm90", *QK_4000)
    assert (b.name, b.tile, b.cluster) == ("bmm_m513_wide_n1024", (128, 256, 64), (2, 1))
    assert b.direct is not None and b.direct.tile == (64, 256, 64)  # the family's, kept
    device("off")
    b = dispatch.lookup("bmm", "bf16", "sm90", *QK_4000)
    assert (b.name, b.tile, b.cluster) == ("bmm_m513_wide_n1024", (128, 128, 64), (2, 1))


def test_no_cuda_device_means_the_family_table(device, monkeypatch):
    """CPU CI: unset and no usable CUDA device -> no device table."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device(None)
    assert D.current_device() == (None, False)
    assert D.overlay_path(R.BUILTIN_DIR, "sm90") is None
    assert dispatch.lookup("bmm", "bf16", "sm90", *QK_4000).tile == (128, 128, 64)


def test_a_device_without_tables_for_a_family_takes_the_family_table(device):
    device("nvidia-h200")
    assert D.overlay_path(R.BUILTIN_DIR, "sm80") is None  # it has sm90 choices only
    assert R.load_builtin("sm80").buckets == R.load_config(R.builtin_path("sm80")).buckets


def test_an_unknown_named_device_is_a_clear_error(device):
    device("NVIDIA Z900")
    with pytest.raises(ValueError, match=r"DETGEMM_CUTE_DEVICE_TABLE='NVIDIA Z900': no device "
                                         r"tables for 'nvidia-z900'; devices with tables: .*"
                                         r"nvidia-h200"):
        R.load_builtin("sm90")


def _device_dir(tmp_path, monkeypatch, text):
    """BUILTIN_DIR copied to tmp_path with a device table `text` for device 'test-gpu'."""
    (tmp_path / "sm90.yaml").write_text(R.builtin_path("sm90").read_text())
    (tmp_path / D.SUBDIR / "test-gpu").mkdir(parents=True)
    (tmp_path / D.SUBDIR / "test-gpu" / "sm90.yaml").write_text(text)
    monkeypatch.setattr(R, "BUILTIN_DIR", tmp_path)


BUCKET = """arch: sm90
buckets:
  - name: {name}
    op: bmm
    dtypes: [bf16, fp16]
    m: [{m_lo}, null]
    n: [1024, null]
    k: [113, 128]
    tile: [128, 192, 64]
    stages: 4
    persistent: true
"""


@pytest.mark.parametrize("name, m_lo, words", [
    ("bmm_no_such_bucket", 513, "this one names no bucket of the built-in table"),
    ("bmm_m513_wide_n1024", 600, r"keeps the built-in bucket's op, dtypes and box \(.*sm90.yaml:"
                                 r"\d+\): m \(600, None\) \(built-in: \(513, None\)\)"),
])
def test_a_device_bucket_must_match_a_family_bucket(device, tmp_path, monkeypatch, name,
                                                    m_lo, words):
    _device_dir(tmp_path, monkeypatch, BUCKET.format(name=name, m_lo=m_lo))
    device("test-gpu")
    with pytest.raises(R.ConfigError, match=words) as e:
        R.load_builtin("sm90")
    assert "test-gpu" in str(e.value) and name in str(e.value)


def test_a_matching_device_bucket_replaces_the_kernel(device, tmp_path, monkeypatch):
    _device_dir(tmp_path, monkeypatch, BUCKET.format(name="bmm_m513_wide_n1024", m_lo=513))
    device("test-gpu")
    b = R.get_registry("sm90").lookup("bmm", "bf16", *QK_4000)
    assert (b.name, b.tile, b.layer) == ("bmm_m513_wide_n1024", (128, 192, 64), 0)
    assert b.direct is None  # the device's bucket, whole: it declared no direct kernel


ALTERNATIVES = """arch: sm90
buckets:
  - name: fwd_mid
    op: fwd
    dtypes: [bf16, fp16]
    m: [768, 1535]
    n: [2305, null]
    k: [1, null]
    sms: 132
    alternatives:
      - {tile: [128, 256, 64], cluster: [1, 2], stages: 4, persistent: true, cost: [0, 1, 0, 0]}
      - {tile: [128, 128, 64], cluster: [2, 1], stages: 6, persistent: true, cost: [0, 9, 0, 0]}
  - name: bmm_m513_wide_n1024
    op: bmm
    dtypes: [bf16, fp16]
    m: [513, null]
    n: [1024, null]
    k: [113, 128]
    sms: 132
    alternatives:
      - {tile: [128, 192, 64], stages: 4, persistent: true, cost: [0, 1, 0, 0]}
"""


def test_a_device_bucket_may_bring_alternatives(device, tmp_path, monkeypatch):
    """A bucket with alternatives replaces the family's alternatives as a whole, in the
    family bucket's place; one replaces a plain bucket too (its box stays the family's)."""
    device("off")
    family = R.load_builtin("sm90").buckets
    _device_dir(tmp_path, monkeypatch, ALTERNATIVES)
    device("test-gpu")
    table = R.load_builtin("sm90").buckets
    mid = [b for b in table if b.group == "fwd_mid"]
    assert [(b.tile, b.cluster) for b in mid] == [((128, 256, 64), (1, 2)),
                                                   ((128, 128, 64), (2, 1))]
    assert all(b.source.parent.name == "test-gpu" for b in mid)
    names = [b.group or b.name for b in table]
    assert list(dict.fromkeys(names)) == list(dict.fromkeys(b.group or b.name for b in family))
    def others(buckets):  # the kernels of every other bucket (the copy's path aside)
        return [(b.name, b.tile, b.cluster, b.stages, b.cost, b.line) for b in buckets
                if not {"fwd_mid", "bmm_m513_wide_n1024"} & {b.group, b.name}]
    assert others(table) == others(family)
    b = R.get_registry("sm90").lookup("fwd", "bf16", 1000, 4096, 4096)
    assert (b.group, b.tile) == ("fwd_mid", (128, 256, 64))  # the lower cost
    b = R.get_registry("sm90").lookup("bmm", "bf16", *QK_4000)
    assert (b.group, b.tile, b.direct) == ("bmm_m513_wide_n1024", (128, 192, 64), None)


def test_a_plain_device_bucket_may_replace_one_with_alternatives(device, tmp_path,
                                                                 monkeypatch):
    plain = (BUCKET.format(name="fwd_mid", m_lo=768)
             .replace("op: bmm", "op: fwd").replace("m: [768, null]", "m: [768, 1535]")
             .replace("n: [1024, null]", "n: [2305, null]")
             .replace("k: [113, 128]", "k: [1, null]"))
    _device_dir(tmp_path, monkeypatch, plain)
    device("test-gpu")
    mid = [b for b in R.load_builtin("sm90").buckets if "fwd_mid" in (b.group, b.name)]
    assert [(b.name, b.group, b.tile) for b in mid] == [("fwd_mid", "", (128, 192, 64))]
    b = R.get_registry("sm90").lookup("fwd", "bf16", 1000, 4096, 4096)
    assert (b.name, b.tile, b.source.parent.name) == ("fwd_mid", (128, 192, 64), "test-gpu")
    text = str(dispatch.explain("fwd", "bf16", "sm90", 1000, 4096, 4096))
    assert "option:" not in text and "devices/test-gpu/sm90.yaml" in text


def test_a_device_bucket_with_alternatives_keeps_the_box(device, tmp_path, monkeypatch):
    _device_dir(tmp_path, monkeypatch, ALTERNATIVES.replace("m: [768, 1535]", "m: [768, 1600]"))
    device("test-gpu")
    with pytest.raises(R.ConfigError, match=r"'fwd_mid'.*keeps the built-in bucket's op, "
                                            r"dtypes and box .*m \(768, 1600\) \(built-in: "
                                            r"\(768, 1535\)\)"):
        R.load_builtin("sm90")


def test_audit_names_the_device_table(device, capsys):
    from detgemm_cute import cli

    device("nvidia-h200")
    assert cli.main(["audit", "--arch", "sm90"]) == 0
    out = capsys.readouterr().out
    assert "this device's kernels in 8 of them: " in out
    assert ("devices/nvidia-h200/sm90.yaml (fwd_mid, fwd_prefill_narrow, dw_small, bmm_k1_64, "
            "bmm_m257_512_wide") in out
    device("off")
    assert cli.main(["audit", "--arch", "sm90"]) == 0
    assert "this device's kernels" not in capsys.readouterr().out


def test_every_table_file_ships_in_the_wheel():
    """pyproject's package data for the tables' package must match every YAML under
    configs/, the device tables included (a wheel without them would run the family table)."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["detgemm_cute.configs"]
    files = [p.relative_to(root / "configs").as_posix() for p in (root / "configs").rglob("*.yaml")]
    assert "devices/nvidia-h200/sm90.yaml" in files
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) and f.count("/") == pat.count("/")
                   for pat in patterns), f


def test_invalidate_detects_the_device_again(monkeypatch):
    """The built-in layer is cached per device table: after `invalidate()` a changed
    DETGEMM_CUTE_DEVICE_TABLE takes effect without clearing any cache by hand."""
    monkeypatch.setenv(D.ENV_VAR, "off")
    R.invalidate()
    assert dispatch.lookup("bmm", "bf16", "sm90", *QK_4000).tile == (128, 128, 64)
    monkeypatch.setenv(D.ENV_VAR, "nvidia-h200")
    R.invalidate()
    assert dispatch.lookup("bmm", "bf16", "sm90", *QK_4000).tile == (128, 256, 64)
    monkeypatch.setenv(D.ENV_VAR, "off")
    R.invalidate()
    assert dispatch.lookup("bmm", "bf16", "sm90", *QK_4000).tile == (128, 128, 64)
