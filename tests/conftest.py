"""Shared fixtures: every test starts and ends with no user config layers."""

import pytest

from detgemm_cute import registry as R


@pytest.fixture(autouse=True)
def _clean_user_layers(monkeypatch):
    monkeypatch.delenv(R.ENV_VAR, raising=False)
    R.reset_user_configs()
    yield
    R.reset_user_configs()
