"""The dispatch tables as text: the audit listing (every bucket, layers, coverage) and the
explanation of one dispatch choice. Used by the `detgemm-cute audit` / `explain` commands and
by the CPU demo."""

from __future__ import annotations

from . import registry as reg

USER_ERRORS = (reg.ConfigError, reg.NoBucketError, reg.ArchNotAvailable, FileNotFoundError)

_TABLE_COLUMNS = ("name", "op", "dtypes", "M", "N", "K", "tile", "cluster", "stages",
                  "persistent", "file:line", "layer")


def _dims(r) -> str:
    return "any" if r == (1, None) else reg.fmt_range(r)


def _row(b: reg.Bucket) -> tuple[str, ...]:
    return (b.name, b.op, ",".join(b.dtypes), _dims(b.m), _dims(b.n), _dims(b.k),
            "x".join(map(str, b.tile)) + "".join(
                f" ({label} {'x'.join(map(str, d.tile))})"
                for d, label in ((b.direct, "direct"), (b.direct_vector, "vector"))
                if d is not None),
            "x".join(map(str, b.cluster)), str(b.stages),
            (("ping-pong" if b.pingpong else "yes") if b.persistent else "no")
            + (", swap" if b.swap_ab else ""), b.where, b.layer_label)


def format_table(buckets) -> str:
    """Buckets as an aligned text table (the audit listing)."""
    rows = [_TABLE_COLUMNS] + [_row(b) for b in buckets]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_TABLE_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _env_files(arch: str) -> list:
    """The DETGEMM_CUTE_CONFIG layers of `arch`, as the library would stack them."""
    files = [reg.load_config(p, origin=reg.ENV_VAR) for p in reg.env_config_paths()]
    return [f for f in files if f.arch == arch]


def audit_one(arch: str, extra: list, out) -> None:
    r = reg.build_registry(arch, _env_files(arch) + extra)
    out(f"{arch}: {len(r.buckets)} buckets in {len(r.files)} layer(s)")
    for f in r.files:
        out(f"  layer {f.layer} ({reg.layer_label(f.layer)}): "
            f"{reg.show_path(f.path)} [{f.origin}], {len(f.buckets)} buckets")
        device = [b for b in f.buckets if f.layer == 0 and b.source != f.path]
        if device:
            names = list(dict.fromkeys(b.group or b.name for b in device))
            out(f"    this device's kernels in {len(names)} of them: "
                f"{reg.show_path(device[0].source)} ({', '.join(names)})")
    out("")
    out(format_table(r.buckets))
    out("")
    for op in r.ops:
        for dtype in reg.DTYPES:
            n = sum(1 for b in r.files[0].buckets if b.op == op and dtype in b.dtypes)
            if n == 0:  # an optional dtype (fp32) this op does not serve on this arch
                out(f"coverage {op} {dtype}: not served (no built-in bucket)")
                continue
            out(f"coverage {op} {dtype}: every (M, N, K) >= 1 is served by exactly one of "
                f"{n} built-in buckets")
    for f in r.files[1:]:
        layer = f.layer
        served = sorted({f"{b.op} {d}" for b in f.buckets for d in b.dtypes})
        out(f"user layer {layer}: overrides {', '.join(served)} where its buckets match; "
            f"no overlaps inside the file")
        for b in f.buckets:
            for o in r.named(b.name):
                if o.layer < layer:
                    out(f"  {b.name} ({b.where}) shadows the same-named bucket at {o.where} "
                        f"({o.layer_label})")


def audit(arch: str | None, configs, out, err) -> int:
    """Validate and list every table (or `arch`'s) with the user `configs` layered on top.
    Every kernel family must have its built-in table: a missing or empty one is a problem,
    so an installation without its tables cannot pass. Problems go to `err` (one string);
    returns 0 when every table is valid, else 1."""
    problems, extra = [], {}
    for p in configs:
        try:
            f = reg.load_config(p, arch=arch, origin="--config")
        except USER_ERRORS as e:
            problems.append(str(e))
            continue
        extra.setdefault(f.arch, []).append(f)
    builtins = {p.stem for p in reg.BUILTIN_DIR.glob("*.yaml")}
    arches = [arch] if arch else sorted(set(reg.LIMITS_MODULES) | builtins | set(extra))
    for i, a in enumerate(arches):
        if i:
            out("")
        try:
            audit_one(a, extra.get(a, []), out)
        except USER_ERRORS as e:
            problems.append(str(e))
    if problems:
        err("\n".join(problems))
        out("")
        out("audit: FAILED (problems on stderr)")
        return 1
    out("")
    out("audit: OK")
    return 0


def explain(op: str, dtype: str, arch: str, m: int, n: int, k: int, configs=()) -> str:
    """Which bucket serves (op, dtype, arch, M, N, K) with `configs` layered on top, and why."""
    from . import dispatch
    from .split_decode import explain_note

    files = [reg.load_config(p, arch=arch, origin="--config") for p in configs]
    r = reg.build_registry(arch, _env_files(arch) + files)
    text = str(dispatch.explain(op, dtype, arch, m, n, k, registry=r))
    note = explain_note(op, dispatch.dtype_name(dtype), m, k, arch, n)
    return text if note is None else f"{text}\n{note}"
