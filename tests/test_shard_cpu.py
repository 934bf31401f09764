"""`--shard I/N` (tests/shard.py, conftest.py): the shards of a selection are disjoint, cover
it, and a bad spec is a usage error naming the option."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shard

HERE = Path(__file__).resolve().parent


def test_shards_partition_node_ids():
    ids = [f"tests/test_x.py::test_{i}[{p}]" for i in range(300) for p in ("a", "b")]
    parts = [[x for x in ids if shard.in_shard(x, i, 4)] for i in range(1, 5)]
    assert sorted(sum(parts, [])) == sorted(ids)
    assert all(len(p) > len(ids) / 8 for p in parts)  # no shard near empty


@pytest.mark.parametrize("spec", ["0/3", "4/3", "a/b", "2", "1/0"])
def test_bad_spec(spec):
    with pytest.raises(ValueError, match="--shard"):
        shard.parse(spec)


def _collected(*args) -> tuple[int, list[str], str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", str(HERE / "test_shard_cpu.py"), *args],
                         capture_output=True, text=True, cwd=HERE.parent)
    return out.returncode, [ln for ln in out.stdout.splitlines() if "::" in ln], out.stderr


def test_the_option_splits_a_real_collection():
    rc, everything, _ = _collected()
    assert rc == 0 and len(everything) == 7
    got = []
    for i in (1, 2, 3):
        rc, part, _ = _collected("--shard", f"{i}/3")
        assert rc in (0, 5)  # 5: this shard happens to hold none of these 7
        got += part
    assert sorted(got) == sorted(everything)
    rc, _, err = _collected("--shard", "3/2")
    assert rc == 4 and "--shard: expected 1 <= I <= N" in err
