"""The resume file: one JSON line per measured (problem, op), appended as the run goes.

A line holds the problem, the device it was measured on, each candidate's time in us (or its
error), the peers' times, the incumbent (the table's bucket for the problem) and candidates
whose output bits differed. A run killed at any point loses at most the problem it was
timing; `--resume FILE` skips the problems already in the file (same device, dtype and arch)
whose candidates were all measured."""

from __future__ import annotations

import json
import os
import time


def record_key(rec: dict) -> tuple:
    return (rec.get("device"), rec.get("arch"), rec.get("dtype"), rec.get("op"), rec.get("m"),
            rec.get("k"), rec.get("n"))


def load(path) -> list[dict]:
    """Records of a resume file; a truncated last line (killed mid-write) is ignored."""
    if not path or not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "op" in rec and "cands" in rec:
                out.append(rec)
    return out


def latest(records) -> dict:
    """The last record per key (a re-measured problem replaces the earlier one)."""
    out = {}
    for rec in records:
        out[record_key(rec)] = rec
    return out


def covers(rec: dict, names) -> bool:
    """True when the record measured (or failed) every candidate in `names`."""
    done = set(rec.get("cands") or {}) | set(rec.get("errors") or {})
    return set(names) <= done


def append(path, rec: dict) -> None:
    if not path:
        return
    from ..benchlib.fmt import json_clean

    rec = json_clean(dict(rec, time=rec.get("time") or time.strftime("%Y-%m-%d %H:%M:%S")))
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, allow_nan=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
