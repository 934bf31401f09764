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
"""

from __future__ import annotations

import difflib
import importlib
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "configs"
ENV_VAR = "DETGEMM_CUTE_CONFIG"
OPS = ("fwd", "dx", "dw", "bmm")
DTYPES = ("bf16", "fp16", "fp32")
# Every op of a built-in table serves these; fp32 (the split tier) is optional per arch, but
# where an op has fp32 buckets they must cover every (M, N, K) as well.
REQUIRED_DTYPES = ("bf16", "fp16")
# Ops the fp32 tier has (bmm takes 16-bit inputs only).
FP32_OPS = ("fwd", "dx", "dw")
# Ops whose buckets may swap operands (compute C^T); bmm/grouped do not.
SWAP_OPS = ("fwd", "dx", "dw")
# arch -> module (under detgemm_cute) holding `check_config` for that kernel family.
LIMITS_MODULES = {"sm90": "kernels.sm90_limits", "sm80": "kernels.sm80_limits"}
FAMILY_NAMES = {"sm90": "SM90 (TMA + WGMMA)", "sm80": "SM80 (cp.async + mma.sync)"}

_TOP_KEYS = ("arch", "buckets")
_REQUIRED = ("name", "op", "dtypes", "m", "tile", "stages")
_DEFAULTS = {"n": (1, None), "k": (1, None), "cluster": (1, 1), "persistent": False,
             "pingpong": False, "swap_ab": False, "note": ""}
_BUCKET_KEYS = _REQUIRED + tuple(_DEFAULTS)
_DIMS = ("m", "n", "k")


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
        return replace(self, layer=layer,
                       buckets=tuple(replace(b, layer=layer) for b in self.buckets))


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


def fmt_range(r: tuple[int, int | None]) -> str:
    lo, hi = r
    return f"{lo}.." if hi is None else f"{lo}..{hi}"


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
# YAML with line numbers
# ---------------------------------------------------------------------------------------

class _Mapping(dict):
    """A YAML mapping that remembers its line, each key's line and repeated keys."""

    line = 0
    key_lines: dict = {}
    repeated: tuple = ()


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader, node):
    # A key written twice is an error, but a key that overrides one pulled in by a YAML
    # merge (`<<: *base`) is what merges are for: look for repeats among written keys only.
    written, repeated = set(), []
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        try:
            key = loader.construct_object(key_node, deep=True)
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark)
        if key in written:
            repeated.append((key, key_node.start_mark.line + 1))
        written.add(key)
    loader.flatten_mapping(node)
    out, lines = _Mapping(), {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        out[key] = loader.construct_object(value_node, deep=True)
        lines[key] = key_node.start_mark.line + 1
    out.line, out.key_lines, out.repeated = node.start_mark.line + 1, lines, tuple(repeated)
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


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
        return yaml.load(text, Loader=_Loader)
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
    if key in ("persistent", "pingpong", "swap_ab"):
        ok = isinstance(v, bool)
        return (v, None) if ok else (None, f"{key} must be true or false, got {v!r}")
    if key == "note":
        ok = isinstance(v, str)
        return (v, None) if ok else (None, f"note must be a string, got {v!r}")
    raise AssertionError(key)


def _parse_bucket(raw, index: int, path: Path, limits, probs: _Problems) -> Bucket | None:
    if not isinstance(raw, dict):
        probs.add(None, f"buckets[{index}] must be a mapping of bucket fields, got {raw!r}")
        return None
    name = raw.get("name")
    label = f"bucket {name!r}" if isinstance(name, str) and name else f"bucket #{index + 1}"
    line, key_lines = raw.line, raw.key_lines
    before = len(probs.lines)
    for key, key_line in raw.repeated:
        probs.add(key_line, "given more than once in this bucket", label, key)
    for key in raw:
        if key not in _BUCKET_KEYS:
            close = difflib.get_close_matches(str(key), _BUCKET_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else \
                f"; allowed: {', '.join(_BUCKET_KEYS)}"
            probs.add(key_lines.get(key, line), f"unknown key{hint}", label, str(key))
    for key in _REQUIRED:
        if key not in raw:
            probs.add(line, "missing (required)", label, key)
    values = dict(_DEFAULTS)
    for key in _BUCKET_KEYS:
        if key in raw:
            v, err = _check_field(key, raw[key])
            if err:
                probs.add(key_lines.get(key, line), err, label, key)
            else:
                values[key] = v
    if len(probs.lines) != before:
        return None
    for field, msg in limits.check_config(values["tile"], values["cluster"], values["stages"],
                                          values["persistent"], dtypes=values["dtypes"],
                                          pingpong=values["pingpong"],
                                          swap_ab=values["swap_ab"]):
        probs.add(key_lines.get(field, line), msg, label, field)
    if values["swap_ab"] is True and values["op"] not in SWAP_OPS:
        probs.add(key_lines.get("swap_ab", line), f"op {values['op']} does not swap operands; "
                  f"swap_ab serves {', '.join(SWAP_OPS)}", label, "swap_ab")
    if "fp32" in values["dtypes"] and values["op"] not in FP32_OPS:
        probs.add(key_lines.get("dtypes", line), f"op {values['op']} has no fp32 kernel; fp32 "
                  f"buckets serve {', '.join(FP32_OPS)}", label, "dtypes")
    if len(probs.lines) != before:
        return None
    return Bucket(source=path, line=line, layer=0, **values)


def _meet(a, b):
    """The intersection of two inclusive ranges (hi None = unbounded), or None."""
    lo = max(a[0], b[0])
    his = [h for h in (a[1], b[1]) if h is not None]
    hi = min(his) if his else None
    return None if hi is not None and hi < lo else (lo, hi)


def _boxes_meet(a: Bucket, b: Bucket):
    """The (M, N, K) box two buckets share, or None."""
    box = tuple(_meet(getattr(a, d), getattr(b, d)) for d in _DIMS)
    return None if None in box else box


def _box_text(box) -> str:
    return ", ".join(f"{d.upper()} {fmt_range(r)}" for d, r in zip(_DIMS, box))


def _check_overlaps(buckets, probs: _Problems):
    for i, b in enumerate(buckets):
        for a in buckets[:i]:
            shared = [d for d in a.dtypes if d in b.dtypes]
            if a.op != b.op or not shared:
                continue
            box = _boxes_meet(a, b)
            if box is not None:
                field = next((d for d in _DIMS if getattr(a, d) != getattr(b, d)), "m")
                probs.add(b.line, f"overlaps bucket {a.name!r} (line {a.line}) for op {b.op} "
                                  f"dtype {'/'.join(shared)} at {_box_text(box)}",
                          f"bucket {b.name!r}", field)


# ---------------------------------------------------------------------------------------
# Coverage: every (M, N, K) >= 1 served by exactly one bucket, computed on the cell grid
# ---------------------------------------------------------------------------------------

def _cells(buckets, dim):
    """Split [1, inf) at every bucket boundary: cells no bucket edge crosses."""
    bounds = {1}
    for b in buckets:
        lo, hi = getattr(b, dim)
        bounds.add(lo)
        if hi is not None:
            bounds.add(hi + 1)
    starts = sorted(bounds)
    return [(s, e - 1) for s, e in zip(starts, starts[1:])] + [(starts[-1], None)]


def _cell_span(r, cells):
    """Index range (first, last) of the cells inside range r."""
    lo, hi = r
    first = next(i for i, c in enumerate(cells) if c[0] == lo)
    last = len(cells) - 1 if hi is None else next(i for i, c in enumerate(cells) if c[1] == hi)
    return first, last


def _merge(boxes):
    """Merge index boxes that abut along one dim and agree on the others (K, then N, M)."""
    for d in (2, 1, 0):
        groups: dict = {}
        for box in boxes:
            groups.setdefault(box[:d] + box[d + 1:], []).append(box)
        merged = []
        for group in groups.values():
            group.sort(key=lambda bx: bx[d][0])
            cur = group[0]
            for box in group[1:]:
                if box[d][0] == cur[d][1] + 1:
                    cur = cur[:d] + ((cur[d][0], box[d][1]),) + cur[d + 1:]
                else:
                    merged.append(cur)
                    cur = box
            merged.append(cur)
        boxes = merged
    return sorted(boxes)


def coverage_gaps(buckets) -> list[tuple]:
    """Boxes ((lo, hi) per M, N, K) of points no bucket serves; buckets of one op/dtype."""
    cells = [_cells(buckets, d) for d in _DIMS]
    nm, nn, nk = (len(c) for c in cells)
    count = [0] * (nm * nn * nk)
    for b in buckets:
        (m0, m1), (n0, n1), (k0, k1) = (_cell_span(getattr(b, d), c) for d, c in zip(_DIMS, cells))
        for i in range(m0, m1 + 1):
            for j in range(n0, n1 + 1):
                base = (i * nn + j) * nk
                for l in range(k0, k1 + 1):
                    count[base + l] += 1
    gaps = [((i, i), (j, j), (l, l)) for i in range(nm) for j in range(nn) for l in range(nk)
            if count[(i * nn + j) * nk + l] == 0]
    return [tuple((cells[d][box[d][0]][0], cells[d][box[d][1]][1]) for d in range(3))
            for box in _merge(gaps)]


def _gap_problem(op, dtype, gap, buckets):
    """(field, text) for one uncovered box, naming the buckets that border it."""
    dims = [d for d in range(3) if gap[d] != (1, None)] or [0]
    d = dims[0]
    others = ", ".join(f"{_DIMS[o].upper()} {fmt_range(gap[o])}" for o in range(3) if o != d)
    text = (f"op {op} dtype {dtype}: {_DIMS[d].upper()} {fmt_range(gap[d])} ({others}) is "
            f"covered by no bucket")
    near = []
    for b in buckets:
        for e in dims:
            lo, hi = getattr(b, _DIMS[e])
            touches = hi == gap[e][0] - 1 or (gap[e][1] is not None and lo == gap[e][1] + 1)
            if touches and all(_meet(getattr(b, _DIMS[o]), gap[o]) is not None
                               for o in range(3) if o != e):
                near.append(f"bucket {b.name!r} (line {b.line}, {_DIMS[e]} {fmt_range((lo, hi))})")
                break
    if near:
        text += "; next to " + ", ".join(near)
    return _DIMS[d], text


def _check_coverage(buckets, probs: _Problems):
    for op in sorted({b.op for b in buckets}, key=OPS.index):
        for dtype in DTYPES:
            serving = [b for b in buckets if b.op == op and dtype in b.dtypes]
            if not serving:
                if dtype in REQUIRED_DTYPES:
                    probs.add(None, f"op {op} dtype {dtype} has no bucket; every op in the "
                                    f"built-in table must serve {' and '.join(REQUIRED_DTYPES)}",
                              "coverage", "dtypes")
                continue
            gaps = coverage_gaps(serving)
            for gap in gaps[:20]:
                field, text = _gap_problem(op, dtype, gap, serving)
                probs.add(None, text, "coverage", field)
            if len(gaps) > 20:
                probs.add(None, f"op {op} dtype {dtype}: {len(gaps) - 20} more gaps",
                          "coverage", None)


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
                        f"{_type_name(doc)}")
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
        b = _parse_bucket(raw, i, path, limits, probs)
        if b is None:
            continue
        if b.name in names:
            probs.add(b.line, f"name already used by the bucket at line {names[b.name]}",
                      f"bucket {b.name!r}", "name")
            continue
        names[b.name] = b.line
        buckets.append(b)
    _check_overlaps(buckets, probs)
    if complete and not probs.lines:
        _check_coverage(buckets, probs)
    if probs.lines:
        raise ConfigError(path, probs.lines)
    return ConfigFile(path=path, arch=file_arch, buckets=tuple(buckets), origin=origin)


def builtin_path(arch: str) -> Path:
    return BUILTIN_DIR / f"{arch}.yaml"


def load_builtin(arch: str) -> ConfigFile:
    """The built-in table of an arch, with coverage checked."""
    limits_for(arch)  # unknown arch -> ValueError, missing family -> ArchNotAvailable
    path = builtin_path(arch)
    if not path.is_file():
        raise ArchNotAvailable(
            f"the {FAMILY_NAMES.get(arch, arch)} kernel family is not available yet: no "
            f"built-in table {show_path(path)}; the installation is incomplete")
    return load_config(path, complete=True, arch=arch, origin="built-in")


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

    def table(self, op: str, dtype: str) -> tuple[Bucket, ...]:
        """Buckets serving op/dtype in the order lookups consult them (highest layer first)."""
        try:
            return self._tables[(op, dtype)]
        except KeyError:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}") from None
            raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}") from None

    def matches(self, op: str, dtype: str, m: int, n: int, k: int) -> tuple[Bucket, ...]:
        """Every bucket containing the point, in precedence order (the first one wins)."""
        return tuple(b for b in self.table(op, dtype) if b.contains(m, n, k))

    def lookup(self, op: str, dtype: str, m: int, n: int, k: int) -> Bucket:
        for b in self.table(op, dtype):
            if b.contains(m, n, k):
                return b
        if not self.table(op, dtype) and dtype not in REQUIRED_DTYPES:
            raise NoBucketError(
                f"the {self.arch} tables have no {dtype} buckets for op {op} (fp32 runs on the "
                f"sm90 family's fwd, dx and dw only)")
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
_builtins: dict[str, ConfigFile] = {}
_generation = 0
_listeners: list = []


def generation() -> int:
    """Changes whenever the user layers change; caches keyed by bucket compare it."""
    return _generation


def on_change(callback) -> None:
    """Call `callback()` after every change of the user layers (dispatch clears its memo)."""
    _listeners.append(callback)


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
            builtin = _builtins.get(arch)
            if builtin is None:
                builtin = _builtins[arch] = load_builtin(arch)
            users = [f for f in _user_layers if f.arch == arch]
            reg = _registries[arch] = Registry(arch, [builtin] + users, _generation)
        return reg


__all__ = ["Bucket", "ConfigFile", "ConfigError", "NoBucketError", "ArchNotAvailable",
           "Registry", "get_registry", "build_registry", "load_config", "load_builtin",
           "add_config", "reset_user_configs", "user_configs", "generation", "on_change",
           "coverage_gaps", "fmt_range", "show_path", "layer_label", "BUILTIN_DIR", "ENV_VAR",
           "OPS", "DTYPES", "LIMITS_MODULES"]
