"""Candidates as a user layer of the registry, so `gemm.force_bucket(name)` can run each one.

Every candidate becomes a bucket named ``tune_<candidate name>`` whose M range is a single
value no GEMM can have (10**12 + i), so the layer never changes what dispatch picks; only
`force_bucket` reaches its buckets. The file is validated by the registry like any user
layer (extra bucket keys included); candidates it rejects are dropped and reported.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .candidates import Candidate

PREFIX = "tune_"
UNREACHABLE_M = 10**12  # M of a real GEMM is < 2**31
_YAML_WORDS = ("true", "false", "yes", "no", "on", "off", "null", "y", "n", "~")


def bucket_name(cand: Candidate) -> str:
    return PREFIX + cand.name


def yaml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(yaml_value(x) for x in v) + "]"
    if isinstance(v, (int, float)):
        return repr(v)
    text = str(v)
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", text) and text.lower() not in _YAML_WORDS:
        return text
    return json.dumps(text)


def bucket_lines(fields: dict) -> list[str]:
    """One YAML list item (a bucket) with its fields in the schema's order."""
    order = ("name", "op", "dtypes", "m", "n", "k", "tile", "cluster", "stages", "persistent",
             "pingpong", "swap_ab")
    keys = [k for k in order if k in fields] + [k for k in fields if k not in order
                                                and k != "note"]
    if "note" in fields:
        keys.append("note")
    lines = []
    for i, key in enumerate(keys):
        value = fields[key]
        text = json.dumps(str(value)) if key == "note" else yaml_value(value)
        lines.append(f"{'  - ' if i == 0 else '    '}{key}: {text}")
    return lines


def layer_text(arch: str, candidates, header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()] + [f"arch: {arch}", "buckets:"]
    for i, c in enumerate(candidates):
        lines += bucket_lines({"name": bucket_name(c), "op": "fwd", "dtypes": ["bf16", "fp16"],
                               "m": [UNREACHABLE_M + i, UNREACHABLE_M + i], **c.fields()})
    return "\n".join(lines) + "\n"


def rejected_names(problems) -> set[str]:
    """Bucket names the registry's problem lines name ("bucket 'tune_...'")."""
    return set(re.findall(r"bucket '([^']+)'", "\n".join(problems)))


def prepare(arch: str, candidates, path, log=print):
    """Write the layer to `path` and validate it with the registry (not yet active).

    Returns (accepted candidates, {rejected name: reason}, {candidate name: registry Bucket});
    candidates the registry rejects are dropped. The Buckets carry every field the registry
    fills in (defaults of keys a candidate does not set included)."""
    from .. import registry

    cands = list(dict.fromkeys(candidates))
    rejected: dict = {}
    for _attempt in range(3):
        if not cands:
            break
        Path(path).write_text(layer_text(arch, cands, "candidate buckets of detgemm-cute tune "
                                                      "(unreachable M: forced by name only)"))
        try:
            f = registry.load_config(path, arch=arch)
        except registry.ConfigError as e:
            bad = rejected_names(e.problems)
            if not bad:
                raise
            for c in [c for c in cands if bucket_name(c) in bad]:
                rejected[c.name] = "; ".join(p for p in e.problems if bucket_name(c) in p)[:300]
                cands.remove(c)
            continue
        for name, why in rejected.items():
            log(f"candidate {name} rejected by the registry: {why}")
        by_name = {b.name: b for b in f.buckets}
        return cands, rejected, {c.name: by_name[bucket_name(c)] for c in cands}
    raise RuntimeError(f"could not build a valid candidate layer in {path}")


def activate(arch: str, path) -> None:
    """Add the prepared layer to the live registry, so `force_bucket` finds its buckets."""
    from .. import registry

    registry.add_config(path, arch=arch)


def install(arch: str, candidates, path, log=print):
    """prepare + activate; returns (accepted candidates, {rejected name: reason})."""
    accepted, rejected, _buckets = prepare(arch, candidates, path, log)
    activate(arch, path)
    return accepted, rejected
