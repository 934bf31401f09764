"""Shared fixtures: every test starts and ends with no user config layers.

The on-disk kernel cache is off for the suite (tests that exercise it pass their own
directory), so no run depends on, or leaves behind, libraries in the user's cache."""

import os

import pytest

os.environ.setdefault("DETGEMM_CUTE_AOT_DIR", "off")

from detgemm_cute import registry as R


@pytest.fixture(autouse=True)
def _clean_user_layers(monkeypatch):
    monkeypatch.delenv(R.ENV_VAR, raising=False)
    R.reset_user_configs()
    yield
    R.reset_user_configs()
