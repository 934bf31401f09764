"""Dispatch tables as data: load, validate and layer the YAML bucket files.

Which tile serves which problem size is a measured choice, and tiles never change a bit of
the result (one fixed K chain, no split-K), so the choice lives in `configs/<arch>.yaml`
where it can be read, audited and overridden without touching a kernel. Validation is strict
and happens at load time: a bad bucket is reported with its file, line and field, long
before anything is compiled, and the built-in table is proven to cover every (M, N, K)
exactly once.

Layers: layer 0 is the built-in table; user files (``DETGEMM_CUTE_CONFIG``, `add_config`)
stack on top of it, the last added highest. A lookup takes the first matching bucket from
the highest layer down.

A bucket may instead list `alternatives`: several kernel configurations for the same box,
each with measured wave-cost coefficients (`cost`) and the SM count they were measured on
(`sms`). A lookup then runs the alternative of least predicted time for that exact problem
(`wave_cost.py`: plain arithmetic on tiles, waves and k-blocks). Each alternative is a
Bucket of its own, named `<bucket>.<config>`, so every kernel is still one traceable line.
"""

from __future__ import annotations

import difflib
import importlib
import os
import threading
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import yaml

from . import config_yaml, device_tables, wave_cost
from .coverage import coverage_gaps, coverage_problems, fmt_range, overlap_problems
from .kernels.limits_common import config_label


def _builtin_dir() -> Path:
    """Where the built-in tables are. An installed package carries them as package data,
    `detgemm_cute/configs/*.yaml` (the build maps the repository's top-level `configs/`
    there); a package imported from a source checkout (on PYTHONPATH, or installed editable)
    reads the checkout's `configs/`, next to the package directory."""
    packaged = resources.files(__package__) / "configs"
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "configs"


BUILTIN_DIR = _builtin_dir()
ENV_VAR = "DETGEMM_CUTE_CONFIG"
OPS = ("fwd", "dx", "dw", "bmm", "grouped", "grouped_k")
DTYPES = ("bf16", "fp16", "fp32", "tf32")
# Every op of a built-in table serves these; fp32 (the split tier) is optional per arch, but
# where an op has fp32 buckets they must cover every (M, N, K) as well.
REQUIRED_DTYPES = ("bf16", "fp16")
# Ops of the fp32 tier's buckets: "fp32" buckets serve its full precision (split operands;
# fp32 bmm at "ieee" runs entry by entry on fwd buckets), "tf32" buckets its TF32 precision
# (fp32 operands read as TF32 by the tensor cores); dW runs full precision at either setting.
FP32_OPS = ("fwd", "dx", "dw")  # fp32 grouped_mm runs one GEMM per group
TF32_OPS = ("fwd", "dx", "bmm")  # fp32 bmm at "ieee" runs entry by entry on fwd buckets
# Ops whose buckets may swap operands (compute C^T); bmm/grouped do not.
SWAP_OPS = ("fwd", "dx", "dw")
# grouped buckets (grouped_mm's mixture-of-experts form in one launch; keyed by the rows per
# group on average, N and K) run the persistent cooperative grouped kernel, and grouped_k
# buckets (its 2-D x 2-D weight-gradient form; keyed by M, N and the tokens per group on
# average) the grouped-K kernel; both exist in the families whose limits module sets GROUPED.
GROUPED_OPS = ("grouped", "grouped_k")
# arch -> module (under detgemm_cute) holding `check_config` for that kernel family.
LIMITS_MODULES = {"sm90": "kernels.sm90_limits", "sm80": "kernels.sm80_limits"}
FAMILY_NAMES = {"sm90": "SM90 (TMA + WGMMA)", "sm80": "SM80 (cp.async + mma.sync)"}

_TOP_KEYS = ("arch", "buckets")
_REQUIRED = ("name", "op", "dtypes", "m", "tile", "stages")
_DEFAULTS = {"n": (1, None), "k": (1, None), "cluster": (1, 1), "persistent": False,
             "pingpong": False, "swap_ab": False, "raster_n": False, "note": ""}
# A bmm bucket's kernels for calls whose outputs the tile's threads store (rows TMA cannot
# address or would store as half sectors; `batched`): `direct`, and `direct_vector` for
# those whose threads store 8 bytes at a time (`gemm.direct_align`; `direct` where unset).
# Such calls run without a multicast cluster (`batched.plan_key`), so these have none.
DIRECT_FIELDS = ("direct", "direct_vector")
_BUCKET_KEYS = _REQUIRED + tuple(_DEFAULTS) + ("alternatives", "sms") + DIRECT_FIELDS
_DIMS = ("m", "n", "k")
# Keys of one entry of `alternatives` (the kernel fields of a bucket, plus its cost).
_KERNEL_KEYS = ("tile", "cluster", "stages", "persistent", "pingpong", "swap_ab", "raster_n")
_ALT_KEYS = _KERNEL_KEYS + ("cost",)
_DIRECT_KEYS = ("tile", "stages", "persistent")


class ConfigError(ValueError):
    """A config file is invalid. One line per problem, each naming file:line, bucket, field."""

    def __init__(self, path, problems: list[str]):
        self.path = Path(path)
        self.problems = list(problems)
        head = [] if len(problems) == 1 else [f"{len(problems)} problems in {show_path(path)}:"]
        super().__init__("\n".join(head + self.problems))


class NoBucketError(LookupError):
    """No bucket serves a problem (an op the tables do not declare, or an unknown name)."""


class ArchNotAvailable(RuntimeError):
    """The kernel family for this arch does not exist (yet)."""


@dataclass(frozen=True)
class Bucket:
    """One row of a dispatch table: the box of (M, N, K) it serves and the kernel settings."""

    name: str
    op: str
    dtypes: tuple[str, ...]
    m: tuple[int, int | None]  # inclusive (lo, hi); hi None = no upper bound
    n: tuple[int, int | None]
    k: tuple[int, int | None]
    tile: tuple[int, int, int]  # BM, BN, BK
    cluster: tuple[int, int]
    stages: int
    persistent: bool
    note: str
    source: Path
    line: int
    layer: int  # 0 = built-in, 1.. = user layers in the order added
    pingpong: bool = False  # two consumer warpgroups on alternate tiles (needs persistent)
    swap_ab: bool = False  # compute C^T = op(B)^T A^T: the tile's M runs along the caller's N
    raster_n: bool = False  # the persistent schedule walks the N tiles fastest (else M's)
    group: str = ""  # the bucket this is one alternative of ("" = a bucket of its own)
    cost: tuple = ()  # wave-cost coefficients in us (alternatives only, see wave_cost.py)
    sms: int = 0  # the SM count the costs were measured on (alternatives only)
    direct: "Bucket | None" = None  # bmm: the kernel of calls whose outputs the threads store
    direct_vector: "Bucket | None" = None  # ... 8 bytes at a time (`direct` where None)

    def direct_kernel(self, c_align: int) -> "Bucket | None":
        """bmm: the kernel of calls whose outputs the tile's threads store `c_align` bytes at
        a time (`gemm.direct_align`: 8, else 0 = element by element); None: the bucket's."""
        if c_align == 8 and self.direct_vector is not None:
            return self.direct_vector
        return self.direct

    def contains(self, m: int, n: int, k: int) -> bool:
        return _in(m, self.m) and _in(n, self.n) and _in(k, self.k)

    @property
    def where(self) -> str:
        return f"{show_path(self.source)}:{self.line}"

    @property
    def layer_label(self) -> str:
        return layer_label(self.layer)


@dataclass(frozen=True)
class ConfigFile:
    """A validated file: its arch, its buckets (in file order) and where it came from."""

    path: Path
    arch: str
    buckets: tuple[Bucket, ...]
    origin: str  # "built-in", ENV_VAR, "add_config", "--config", ...
    layer: int = 0

    def with_layer(self, layer: int) -> "ConfigFile":
        return replace(self, layer=layer, buckets=tuple(
            replace(b, layer=layer, **{f: replace(getattr(b, f), layer=layer)
                                       for f in DIRECT_FIELDS if getattr(b, f) is not None})
            for b in self.buckets))


def _in(v: int, r: tuple[int, int | None]) -> bool:
    return r[0] <= v and (r[1] is None or v <= r[1])


def layer_label(layer: int) -> str:
    return "built-in" if layer == 0 else f"user {layer}"


def show_path(path) -> str:
    """The path relative to the working directory when it lies below it, else absolute."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(p)


def limits_for(arch: str):
    """The `check_config` module of an arch's kernel family."""
    if arch not in LIMITS_MODULES:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(LIMITS_MODULES)}")
    try:
        return importlib.import_module("." + LIMITS_MODULES[arch], __package__)
    except ModuleNotFoundError as e:
        raise ArchNotAvailable(
            f"the {FAMILY_NAMES[arch]} kernel family is not available yet (no "
            f"detgemm_cute.{LIMITS_MODULES[arch]}); the installation is incomplete") from e


# ---------------------------------------------------------------------------------------
# Reading a config file (YAML with line numbers: config_yaml)
# ---------------------------------------------------------------------------------------

def _read_yaml(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(path, [f"{show_path(path)}: cannot read config file: "
                                 f"{e.strerror or e}"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError(path, [f"{show_path(path)}: cannot read config file: not UTF-8 text "
                                 f"(byte {e.object[e.start]:#04x} at offset {e.start})"]) from None
    try:
        return config_yaml.load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{show_path(path)}:{mark.line + 1}" if mark else show_path(path)
        why = ": ".join(str(x) for x in (getattr(e, "context", None),
                                         getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(path, [f"{where}: malformed YAML: {why}"]) from None


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------

class _Problems:
    def __init__(self, path: Path):
        self.path = path
        self.lines: list[str] = []

    def add(self, line, msg, bucket: str | None = None, field: str | None = None):
        parts = [f"{show_path(self.path)}:{line}" if line else show_path(self.path)]
        if bucket is not None:
            parts.append(bucket)
        if field is not None:
            parts.append(f"field {field!r}")
        self.lines.append(": ".join(parts + [msg]))


def _type_name(v) -> str:
    return "null" if v is None else type(v).__name__


def _is_int(v) -> bool:
    return type(v) is int  # bool is an int subclass; `true` is not a number here


def _int_list(v, length: int, what: str):
    """(tuple, None) or (None, error) for a list of `length` integers."""
    if not isinstance(v, list) or len(v) != length:
        return None, f"{what} must be a list of {length} integers, got {v!r}"
    bad = [x for x in v if not _is_int(x)]
    if bad:
        return None, f"{what} must be a list of {length} integers, got {bad[0]!r} " \
                     f"({_type_name(bad[0])}) in {v!r}"
    return tuple(v), None


def _range(v, dim: str):
    if not isinstance(v, list) or len(v) != 2:
        return None, f"{dim} must be [lo, hi] (hi may be null), got {v!r}"
    lo, hi = v
    if not _is_int(lo):
        return None, f"lower bound must be an integer, got {lo!r} ({_type_name(lo)})"
    if hi is not None and not _is_int(hi):
        return None, f"upper bound must be an integer or null, got {hi!r} ({_type_name(hi)})"
    if lo < 1:
        return None, f"lower bound must be >= 1, got {lo}"
    if hi is not None and hi < lo:
        return None, f"upper bound {hi} is below lower bound {lo}"
    return (lo, hi), None


def _dtypes(v):
    if not isinstance(v, list) or not v:
        return None, f"dtypes must be a non-empty list drawn from {list(DTYPES)}, got {v!r}"
    bad = [x for x in v if x not in DTYPES]
    if bad:
        return None, f"unknown dtype {bad[0]!r}; supported: {', '.join(DTYPES)}"
    if len(set(v)) != len(v):
        return None, f"dtypes lists a dtype twice: {v!r}"
    return tuple(v), None


def _check_field(key, v):
    """(value, error) for one bucket field, types and ranges only."""
    if key == "name":
        ok = isinstance(v, str) and v.strip() != ""
        return (v, None) if ok else (None, f"name must be a non-empty string, got {v!r}")
    if key == "op":
        ok = v in OPS
        return (v, None) if ok else (None, f"unknown op {v!r}; one of {', '.join(OPS)}")
    if key == "dtypes":
        return _dtypes(v)
    if key in _DIMS:
        return _range(v, key)
    if key == "tile":
        return _int_list(v, 3, "tile [BM, BN, BK]")
    if key == "cluster":
        return _int_list(v, 2, "cluster [CM, CN]")
    if key == "stages":
        return (v, None) if _is_int(v) else (None, f"stages must be an integer, got {v!r} "
                                                  f"({_type_name(v)})")
    if key in ("persistent", "pingpong", "swap_ab", "raster_n"):
        ok = isinstance(v, bool)
        return (v, None) if ok else (None, f"{key} must be true or false, got {v!r}")
    if key == "note":
        ok = isinstance(v, str)
        return (v, None) if ok else (None, f"note must be a string, got {v!r}")
    raise AssertionError(key)


def _alt_label(v: dict) -> str:
    """128x256x64_c1x2_s4_p_pingpong: an alternative's name inside its bucket."""
    s = config_label(v["tile"], v["cluster"], v["stages"], v["persistent"])
    return s + "".join(f"_{key}" for key in ("pingpong", "swap_ab", "raster_n") if v[key])


MIN_COEFFS = 4  # the oldest cost form the tables hold


def _cost(v):
    """Cost coefficients, padded with zeros to N_COEFFS (a shorter cost, from before a term
    existed: 4 numbers have no traffic term, 5 no padding term)."""
    n = wave_cost.N_COEFFS
    ok = isinstance(v, list) and MIN_COEFFS <= len(v) <= n and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf")
        for x in v)
    return (tuple(float(x) for x in v) + (0.0,) * (n - len(v)), None) if ok else (
        None, f"cost must be a list of {MIN_COEFFS} to {n} numbers >= 0 (us), got {v!r}")


def _check_kernel(values, key_lines, line, label, limits, probs: _Problems):
    for field, msg in limits.check_config(values["tile"], values["cluster"], values["stages"],
                                          values["persistent"], dtypes=values["dtypes"],
                                          pingpong=values["pingpong"],
                                          swap_ab=values["swap_ab"],
                                          raster_n=values["raster_n"]):
        probs.add(key_lines.get(field, line), msg, label, field)
    if values["swap_ab"] is True and values["op"] not in SWAP_OPS:
        probs.add(key_lines.get("swap_ab", line), f"op {values['op']} does not swap operands; "
                  f"swap_ab serves {', '.join(SWAP_OPS)}", label, "swap_ab")
    odd_ops = getattr(limits, "ODD_WIDTH_OPS", None)
    if odd_ops and values["tile"][1] % 16 and values["op"] not in odd_ops:
        probs.add(key_lines.get("tile", line), f"BN {values['tile'][1]} (an odd multiple of 8) "
                  f"serves {', '.join(odd_ops)}; op {values['op']} takes a multiple of 16",
                  label, "tile")
    if values["op"] in GROUPED_OPS:
        for field, msg in _grouped_problems(values, limits):
            probs.add(key_lines.get(field, line), msg, label, field)


def _grouped_problems(values, limits) -> list[tuple[str, str]]:
    """What a grouped bucket's kernel needs beyond `check_config` (see the grouped kernel)."""
    if not getattr(limits, "GROUPED", False):
        return [("op", "this kernel family has no grouped kernel; grouped_mm runs one GEMM "
                       "per group from the fwd/dx buckets")]
    out = []
    if values["persistent"] is not True:
        out.append(("persistent", "the grouped kernel is persistent: set persistent: true"))
    elif values["op"] == "grouped_k" and values["pingpong"] is not False:
        out.append(("persistent", "the grouped_k kernel is persistent and cooperative: set "
                                  "persistent: true (and no pingpong)"))
    if values["tile"][0] < 64:
        out.append(("tile", f"grouped tiles have BM >= 64, got {values['tile'][0]}"))
    elif values["op"] == "grouped_k" and (values["tile"][0] % 64 or values["tile"][1] % 64):
        out.append(("tile", f"grouped_k tiles have BM and BN multiples of 64 (128-byte "
                            f"swizzle lines), got {list(values['tile'])}"))
    return out


def _unknown_keys(raw, allowed, line, label, probs: _Problems):
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(allowed)}"
            probs.add(raw.key_lines.get(key, line), f"unknown key{hint}", label, str(key))


def _entry_fields(entry, keys, required, v: dict, where, probs: _Problems) -> dict:
    """`v` with the kernel fields a nested mapping (an alternative, a `direct`) gives, each
    checked; a missing required key or a bad value is a problem."""
    for key in required:
        if key not in entry:
            probs.add(entry.line, "missing (required)", where, key)
    for key in keys:
        if key in entry:
            val, err = _cost(entry[key]) if key == "cost" else _check_field(key, entry[key])
            if err:
                probs.add(entry.key_lines.get(key, entry.line), err, where, key)
            else:
                v[key] = val
    return v


def _parse_alternatives(raw, values, path, label, limits, probs: _Problems) -> list:
    """The Buckets of a bucket with `alternatives` (one per entry), or [] after problems."""
    line, before = raw.line, len(probs.lines)
    for key in _KERNEL_KEYS:
        if key in raw:
            probs.add(raw.key_lines.get(key, line), "a bucket with alternatives gives its kernel "
                      "fields in each alternative", label, key)
    sms = raw.get("sms")
    if not _is_int(sms) or sms < 1:
        probs.add(raw.key_lines.get("sms", line), f"sms (the SM count the costs were measured "
                  f"on) must be an integer >= 1, got {sms!r}", label, "sms")
    alts = raw["alternatives"]
    if not isinstance(alts, list) or not alts or not all(isinstance(a, dict) for a in alts):
        probs.add(raw.key_lines.get("alternatives", line), f"alternatives must be a non-empty "
                  f"list of mappings with keys {', '.join(_ALT_KEYS)}, got {alts!r}", label,
                  "alternatives")
        return []
    out, labels = [], set()
    for i, alt in enumerate(alts):
        where = f"{label} alternative #{i + 1}"
        mark = len(probs.lines)
        _unknown_keys(alt, _ALT_KEYS, alt.line, where, probs)
        v = _entry_fields(alt, _ALT_KEYS, ("tile", "stages", "cost"), dict(values), where,
                          probs)
        if len(probs.lines) != mark:
            continue
        _check_kernel(v, alt.key_lines, alt.line, where, limits, probs)
        name = _alt_label(v)
        if name in labels:
            probs.add(alt.line, f"the same kernel as another alternative ({name})", where, "tile")
        labels.add(name)
        out.append(Bucket(source=path, line=alt.line, layer=0, group=values["name"], sms=sms,
                          **dict(v, name=f"{values['name']}.{name}")))
    return out if len(probs.lines) == before else []


def _parse_bucket(raw, index: int, path: Path, limits, probs: _Problems) -> list:
    """The Buckets one YAML entry declares (one, or one per alternative); [] on problems."""
    if not isinstance(raw, dict):
        probs.add(None, f"buckets[{index}] must be a mapping of bucket fields, got {raw!r}")
        return []
    name = raw.get("name")
    label = f"bucket {name!r}" if isinstance(name, str) and name else f"bucket #{index + 1}"
    line, key_lines = raw.line, raw.key_lines
    before = len(probs.lines)
    choice = "alternatives" in raw
    for key, key_line in raw.repeated:
        probs.add(key_line, "given more than once in this bucket", label, key)
    _unknown_keys(raw, _BUCKET_KEYS, line, label, probs)
    for key in _REQUIRED:
        if key not in raw and not (choice and key in _KERNEL_KEYS):
            probs.add(line, "missing (required)", label, key)
    if "sms" in raw and not choice:
        probs.add(key_lines["sms"], "sms belongs to a bucket with alternatives", label, "sms")
    values = dict(_DEFAULTS)
    skip = ("alternatives", "sms") + DIRECT_FIELDS + (_KERNEL_KEYS if choice else ())
    for key in _BUCKET_KEYS:
        if key in raw and key not in skip:
            v, err = _check_field(key, raw[key])
            if err:
                probs.add(key_lines.get(key, line), err, label, key)
            else:
                values[key] = v
    if len(probs.lines) != before:
        return []
    for name, ops in (("fp32", FP32_OPS), ("tf32", TF32_OPS)):
        if name in values["dtypes"] and values["op"] not in ops:
            probs.add(key_lines.get("dtypes", line), f"op {values['op']} has no {name} kernel; "
                      f"{name} buckets serve {', '.join(ops)}", label, "dtypes")
    directs = {f: _parse_direct(raw, f, values, path, label, limits, probs)
               for f in DIRECT_FIELDS if f in raw}
    if choice:
        return _parse_alternatives(raw, values, path, label, limits, probs)
    _check_kernel(values, key_lines, line, label, limits, probs)
    if len(probs.lines) != before:
        return []
    return [Bucket(source=path, line=line, layer=0, **directs, **values)]


def _parse_direct(raw, field, values, path, label, limits, probs: _Problems):
    """The Bucket of a bmm bucket's `direct` or `direct_vector` kernel (its box, its own
    tile), or None."""
    d, line, where = raw[field], raw.key_lines.get(field, raw.line), f"{label} {field}"
    if values["op"] != "bmm" or "alternatives" in raw:
        probs.add(line, f"{field} (the kernel of calls whose outputs the tile's threads store"
                  f"{' 8 bytes at a time' if field != 'direct' else ''}) belongs to an op bmm "
                  f"bucket without alternatives", label, field)
        return None
    why = ("this kernel family stores no output by the tile's threads"
           if not getattr(limits, "DIRECT_STORE", False) else
           "a ping-pong tile's threads store no outputs (their accumulators leave no registers "
           f"for the addresses), so {field} would never run" if values["pingpong"] is True
           else None)
    if why:
        probs.add(line, why, label, field)
        return None
    if not isinstance(d, dict):
        probs.add(line, f"{field} must be a mapping with keys {', '.join(_DIRECT_KEYS)}, got "
                  f"{d!r}", label, field)
        return None
    mark = len(probs.lines)
    _unknown_keys(d, _DIRECT_KEYS, d.line, where, probs)
    v = _entry_fields(d, _DIRECT_KEYS, ("tile", "stages"), dict(
        values, cluster=(1, 1), persistent=False, pingpong=False, swap_ab=False,
        raster_n=False, name=f"{values['name']}.{field}", note=""), where, probs)
    for key, key_line in d.repeated:
        probs.add(key_line, "given more than once", where, key)
    if len(probs.lines) == mark and v["tile"][0] < 64:
        probs.add(d.key_lines.get("tile", d.line), f"{field} tiles have BM >= 64 (a row tile's "
                  f"threads store no outputs), got {list(v['tile'])}", where, "tile")
    if len(probs.lines) == mark:
        _check_kernel(v, d.key_lines, d.line, where, limits, probs)
    return Bucket(source=path, line=d.line, layer=0, **v) if len(probs.lines) == mark else None


def load_config(path, *, complete: bool = False, arch: str | None = None,
                origin: str = "user") -> ConfigFile:
    """Read and validate one file; raise ConfigError listing every problem in it.

    complete: also require exact coverage (the built-in table). arch: the file must declare
    this arch (a user layer on that arch's registry)."""
    path = Path(path).expanduser().resolve()
    doc = _read_yaml(path)
    probs = _Problems(path)
    if not isinstance(doc, dict):
        probs.add(None, f"expected a mapping with keys {', '.join(_TOP_KEYS)}, got "
                        f"{_type_name(doc)}" + (" (the file is empty)" if doc is None else ""))
        raise ConfigError(path, probs.lines)
    for key, key_line in doc.repeated:
        probs.add(key_line, "given more than once", None, key)
    for key in doc:
        if key not in _TOP_KEYS:
            probs.add(doc.key_lines.get(key), f"unknown top-level key; allowed: "
                                              f"{', '.join(_TOP_KEYS)}", None, str(key))
    file_arch = doc.get("arch")
    limits = None
    if "arch" not in doc:
        probs.add(doc.line, "missing (required)", None, "arch")
    elif file_arch not in LIMITS_MODULES:
        probs.add(doc.key_lines["arch"], f"unknown arch {file_arch!r}; known: "
                                         f"{', '.join(LIMITS_MODULES)}", None, "arch")
    elif arch is not None and file_arch != arch:
        probs.add(doc.key_lines["arch"], f"file is for {file_arch} but is used as a layer of "
                                         f"the {arch} table", None, "arch")
    else:
        try:
            limits = limits_for(file_arch)
        except ArchNotAvailable as e:
            probs.add(doc.key_lines["arch"], str(e), None, "arch")
    raw_buckets = doc.get("buckets")
    if "buckets" not in doc:
        probs.add(doc.line, "missing (required): a list of buckets", None, "buckets")
    elif not isinstance(raw_buckets, list) or not raw_buckets:
        probs.add(doc.key_lines["buckets"], f"must be a non-empty list of buckets, got "
                                            f"{raw_buckets!r}", None, "buckets")
    if limits is None or not isinstance(raw_buckets, list) or not raw_buckets:
        raise ConfigError(path, probs.lines)

    buckets, names = [], {}
    for i, raw in enumerate(raw_buckets):
        parsed = _parse_bucket(raw, i, path, limits, probs)
        if not parsed:
            continue
        name = parsed[0].group or parsed[0].name
        if name in names:
            probs.add(raw.line, f"name already used by the bucket at line {names[name]}",
                      f"bucket {name!r}", "name")
            continue
        names[name] = raw.line
        buckets.extend(parsed)
    found = overlap_problems(buckets)
    if complete and not found and not probs.lines:
        found = coverage_problems(buckets, OPS, DTYPES, REQUIRED_DTYPES)
    for line, msg, where, field in found:
        probs.add(line, msg, where, field)
    if probs.lines:
        raise ConfigError(path, probs.lines)
    return ConfigFile(path=path, arch=file_arch, buckets=tuple(buckets), origin=origin)


def builtin_path(arch: str) -> Path:
    return BUILTIN_DIR / f"{arch}.yaml"


def load_builtin(arch: str, overlay="detect") -> ConfigFile:
    """The built-in table of an arch, with coverage checked, and this device's kernels in
    place of the family's where it has a device table (`device_tables`; `overlay`: its path,
    None for none, or "detect")."""
    limits_for(arch)  # unknown arch -> ValueError, missing family -> ArchNotAvailable
    path = builtin_path(arch)
    if not path.is_file():
        raise ArchNotAvailable(
            f"no built-in table for the {FAMILY_NAMES.get(arch, arch)} kernel family: "
            f"{show_path(path)} is missing; the installation is incomplete (reinstall "
            f"detgemm-cute)")
    table = load_config(path, complete=True, arch=arch, origin="built-in")
    if overlay == "detect":
        overlay = device_tables.overlay_path(BUILTIN_DIR, arch)
    if overlay is None:
        return table
    return _with_device_kernels(table, load_config(overlay, arch=arch, origin="device table"))


def _with_device_kernels(table: ConfigFile, device: ConfigFile) -> ConfigFile:
    buckets, problems = device_tables.replace_kernels(table.buckets, device.buckets)
    if problems:
        probs = _Problems(device.path)
        for line, name, msg in problems:
            probs.add(line, msg, f"bucket {name!r}")
        raise ConfigError(device.path, probs.lines)
    return replace(table, buckets=buckets)


# ---------------------------------------------------------------------------------------
# Registry: the layered table of one arch
# ---------------------------------------------------------------------------------------

class Registry:
    """The dispatch table of one arch: the built-in layer plus user layers on top.

    Immutable; adding a config builds a new one with a new `generation`."""

    def __init__(self, arch: str, files, generation: int = 0):
        self.arch = arch
        self.files = tuple(f.with_layer(i) for i, f in enumerate(files))
        self.generation = generation
        self.buckets = tuple(b for f in self.files for b in f.buckets)
        self.ops = tuple(op for op in OPS if any(b.op == op for b in self.files[0].buckets))
        self._tables = {(op, dt): tuple(b for f in reversed(self.files) for b in f.buckets
                                        if b.op == op and dt in b.dtypes)
                        for op in OPS for dt in DTYPES}
        groups: dict = {}
        for b in self.buckets:
            if b.group:
                groups.setdefault((b.layer, b.group), []).append(b)
        # (layer, bucket name) -> its alternatives, in file order
        self._groups = {key: tuple(alts) for key, alts in groups.items()}

    def table(self, op: str, dtype: str) -> tuple[Bucket, ...]:
        """Buckets serving op/dtype in the order lookups consult them (highest layer first)."""
        try:
            return self._tables[(op, dtype)]
        except KeyError:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}") from None
            raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}") from None

    def alternatives(self, bucket: Bucket) -> tuple[Bucket, ...]:
        """The alternatives `bucket` is one of (itself alone for a plain bucket)."""
        return self._groups.get((bucket.layer, bucket.group)) or (bucket,)

    def _resolve(self, b: Bucket, m: int, n: int, k: int) -> Bucket:
        return wave_cost.choose(self._groups[(b.layer, b.group)], m, n, k) if b.group else b

    def matches(self, op: str, dtype: str, m: int, n: int, k: int) -> tuple[Bucket, ...]:
        """Every bucket containing the point, in precedence order (the first one wins); of a
        bucket with alternatives, the one chosen for this problem."""
        out, seen = [], set()
        for b in self.table(op, dtype):
            if b.contains(m, n, k) and (b.layer, b.group or b.name) not in seen:
                seen.add((b.layer, b.group or b.name))
                out.append(self._resolve(b, m, n, k))
        return tuple(out)

    def lookup(self, op: str, dtype: str, m: int, n: int, k: int) -> Bucket:
        for b in self.table(op, dtype):
            if b.contains(m, n, k):
                return self._resolve(b, m, n, k)
        if not self.table(op, dtype) and dtype not in REQUIRED_DTYPES:
            raise NoBucketError(
                f"the {self.arch} tables have no {dtype} buckets for op {op} (fp32 runs on "
                f"fwd, dx and dw; tf32 on fwd, dx and bmm)")
        raise NoBucketError(
            f"no {self.arch} bucket serves op {op} dtype {dtype} at M={m}, N={n}, K={k}; the "
            f"built-in table declares ops: {', '.join(self.ops) or 'none'}")

    def bucket(self, name: str) -> Bucket:
        """The bucket called `name`, from the highest layer that declares it."""
        for f in reversed(self.files):
            for b in f.buckets:
                if b.name == name:
                    return b
        raise NoBucketError(f"no {self.arch} bucket is named {name!r}; known: "
                            f"{', '.join(dict.fromkeys(b.name for b in self.buckets))}")

    def named(self, name: str) -> tuple[Bucket, ...]:
        """All buckets called `name`, highest layer first (more than one = shadowing)."""
        return tuple(b for f in reversed(self.files) for b in f.buckets if b.name == name)


def build_registry(arch: str, user_files=(), origin: str = "user") -> Registry:
    """A registry from the built-in table and these user files (paths or ConfigFiles), not
    cached and not touching the process-wide user layers (the CLI uses it)."""
    files = [load_builtin(arch)]
    for f in user_files:
        files.append(f if isinstance(f, ConfigFile) else
                     load_config(f, arch=arch, origin=origin))
    return Registry(arch, files, generation())


# Process-wide state: user layers (any arch, in the order added) and cached registries.
_lock = threading.RLock()
_user_layers: list[ConfigFile] = []
_env_read = False
_registries: dict[str, Registry] = {}
_builtins: dict[tuple, ConfigFile] = {}  # (arch, device table path or None) -> layer 0
_generation = 0
_listeners: list = []


def generation() -> int:
    """Changes whenever the user layers change; caches keyed by bucket compare it."""
    return _generation


def on_change(callback) -> None:
    """Call `callback()` after every change of the user layers (dispatch clears its memo)."""
    _listeners.append(callback)


def invalidate() -> None:
    """Drop every cached registry and plan, as a change of the user layers does (a launch
    setting changed: `pdl.set_enabled`)."""
    _changed()


def _changed() -> None:
    global _generation
    _generation += 1
    _registries.clear()
    for cb in _listeners:
        cb()


def env_config_paths() -> list[str]:
    return [p for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p.strip()]


def _read_env_once() -> None:
    global _env_read
    if _env_read:
        return
    files = [load_config(p, origin=ENV_VAR) for p in env_config_paths()]
    _user_layers[:0] = files
    _env_read = True
    if files:
        _changed()


def add_config(path, arch: str | None = None) -> ConfigFile:
    """Add a user layer above every layer so far; validated now (ConfigError on a problem).

    The file's own `arch` picks the table it joins; pass `arch` to insist on one."""
    f = load_config(path, arch=arch, origin="add_config")
    with _lock:
        _read_env_once()
        _user_layers.append(f)
        _changed()
    return f


def reset_user_configs() -> None:
    """Drop every user layer; DETGEMM_CUTE_CONFIG is read again at the next use."""
    global _env_read
    with _lock:
        _user_layers.clear()
        _env_read = False
        _changed()


def user_configs() -> tuple[ConfigFile, ...]:
    with _lock:
        _read_env_once()
        return tuple(_user_layers)


def get_registry(arch: str) -> Registry:
    """The registry of `arch` with the process-wide user layers, cached until they change."""
    reg = _registries.get(arch)
    if reg is not None:
        return reg
    with _lock:
        _read_env_once()
        reg = _registries.get(arch)
        if reg is None:
            overlay = device_tables.overlay_path(BUILTIN_DIR, arch)  # detected at each build
            builtin = _builtins.get((arch, overlay))
            if builtin is None:
                builtin = _builtins[(arch, overlay)] = load_builtin(arch, overlay)
            users = [f for f in _user_layers if f.arch == arch]
            reg = _registries[arch] = Registry(arch, [builtin] + users, _generation)
        return reg


__all__ = ["Bucket", "ConfigFile", "ConfigError", "NoBucketError", "ArchNotAvailable",
           "Registry", "get_registry", "build_registry", "load_config", "load_builtin",
           "add_config", "reset_user_configs", "user_configs", "generation", "on_change",
           "invalidate",
           "coverage_gaps", "fmt_range", "show_path", "layer_label", "BUILTIN_DIR", "ENV_VAR",
           "OPS", "DTYPES", "LIMITS_MODULES"]
