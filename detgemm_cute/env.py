"""On/off switches read from the environment (``DETGEMM_CUTE_*``): one spelling rule for all."""

from __future__ import annotations

import os

_ON = ("1", "on", "true", "yes")
_OFF = ("0", "off", "false")


def env_flag(name: str, default: bool) -> bool:
    """The switch `name`: a default-off switch is on for 1/on/true/yes, a default-on one off
    for 0/off/false (any case, spaces ignored); unset or anything else keeps `default`."""
    value = os.environ.get(name, "").strip().lower()
    return value not in _OFF if default else value in _ON
