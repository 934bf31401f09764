"""Shared fixtures: every test starts and ends with no user config layers. `--shard I/N`
runs one of N disjoint parts of the selected tests (tests/shard.py).

The on-disk kernel cache is off for the suite (tests that exercise it pass their own
directory), so no run depends on, or leaves behind, libraries in the user's cache. Tests not
marked `gpu` run with DETGEMM_CUTE_DEVICE_TABLE=off (the family tables on any machine)."""

import os

import pytest

os.environ.setdefault("DETGEMM_CUTE_AOT_DIR", "off")

from detgemm_cute import device_tables
from detgemm_cute import registry as R


@pytest.fixture(autouse=True)
def _clean_user_layers(monkeypatch, request):
    monkeypatch.delenv(R.ENV_VAR, raising=False)
    if request.node.get_closest_marker("gpu") is None:
        # CPU tests check the family tables, whatever GPU the machine has; GPU tests run
        # this device's table (configs/devices/), as users do.
        monkeypatch.setenv(device_tables.ENV_VAR, device_tables.OFF)
    R.reset_user_configs()
    yield
    R.reset_user_configs()


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N disjoint parts of the selected tests (tests/shard.py)")


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    import shard

    try:
        i, n = shard.parse(spec)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    keep = [shard.in_shard(it.nodeid, i, n) for it in items]
    config.hook.pytest_deselected(items=[it for it, k in zip(items, keep) if not k])
    items[:] = [it for it, k in zip(items, keep) if k]
