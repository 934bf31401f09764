"""The on/off switches read from the environment share one spelling rule (`env.env_flag`)."""

import pytest

from detgemm_cute.env import env_flag


@pytest.mark.parametrize("value, off_default, on_default", [
    (None, False, True), ("", False, True), ("1", True, True), (" ON ", True, True),
    ("true", True, True), ("yes", True, True), ("0", False, False), ("Off", False, False),
    ("false", False, False), ("maybe", False, True)])
def test_env_flag_keeps_its_default_unless_spelled_the_other_way(monkeypatch, value,
                                                                   off_default, on_default):
    if value is None:
        monkeypatch.delenv("DETGEMM_CUTE_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("DETGEMM_CUTE_TEST_SWITCH", value)
    assert env_flag("DETGEMM_CUTE_TEST_SWITCH", False) is off_default
    assert env_flag("DETGEMM_CUTE_TEST_SWITCH", True) is on_default
