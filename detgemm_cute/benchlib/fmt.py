"""Formatting helpers: numbers, bucket descriptions, file-safe names, strict JSON."""

from __future__ import annotations

import math

from .. import device_tables


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (safe for file names): the slug
    the device tables are found by (`device_tables.slug`)."""
    return device_tables.slug(name) or "unknown-device"


def fmt_num(v, fmt: str = "{:.1f}", none: str = "-") -> str:
    if v is None:
        return none
    try:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return fmt.format(v)
    except (TypeError, ValueError):
        return str(v)


def fmt_us(us) -> str:
    if us is None:
        return "-"
    return fmt_num(us, "{:.2f}" if us < 100 else "{:.1f}" if us < 10000 else "{:.0f}")


def fmt_bucket(b) -> str:
    """Bucket object (name, tile, stages, cluster) -> short string; robust to missing attrs."""
    if b is None:
        return "?"
    if isinstance(b, str):
        return b

    def dims(v):
        if isinstance(v, (tuple, list)):
            return "x".join(str(x) for x in v)
        return str(v)

    parts = [str(getattr(b, "name", b))]
    tile = getattr(b, "tile", None)
    if tile is not None:
        parts.append(dims(tile))
    stages = getattr(b, "stages", None)
    if stages is not None:
        parts.append(f"s{stages}")
    cluster = getattr(b, "cluster", None)
    if cluster is not None:
        parts.append(f"c{dims(cluster)}")
    if getattr(b, "persistent", False) is True:
        parts.append("pp" if getattr(b, "pingpong", False) is True else "p")
    if getattr(b, "swap_ab", False) is True:
        parts.append("sw")
    return " ".join(parts)


def cell(text) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "/").replace("\n", " ")


def short(text, n: int = 60) -> str:
    text = cell(text)
    return text if len(text) <= n else text[: n - 3] + "..."


def err_str(e: BaseException, n: int = 200) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def json_clean(o):
    """Non-finite floats -> None (strict JSON), tuples -> lists, recursively."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): json_clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_clean(v) for v in o]
    return o


def json_default(o):
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
