"""Argument checks shared by the `detgemm-cute` subcommands.

One spelling rule for the kernel family (`--arch`): ``sm90``, ``sm_90``, ``sm_90a`` and
``sm90a`` all name the SM90 family (TMA + WGMMA, built for ``sm_90a``); ``sm80`` and
``sm_80`` the SM80 family (cp.async + mma.sync, built for ``sm_80``); another target from
8.0 up (``sm_86``, ``sm_89``, ``sm_120``, ...) builds the SM80 family for that GPU. Bucket
names: a bucket with alternatives is accepted by its base name (``fwd_prefill`` means every
``fwd_prefill.<kernel>``); an unknown name gets a few close names, not the whole table.
Comma lists (``--ops``, ``--dtypes``) are checked item by item.

Every check raises `ArgError` (a ValueError) with a one-line message; the argparse `type=`
wrappers turn it into argparse's usage error.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass

FAMILIES = ("sm90", "sm80")
ARCH_HELP = ("kernel family: sm90 (also sm_90, sm_90a: TMA + WGMMA, H100/H200) or sm80 (also "
             "sm_80: cp.async + mma.sync, A100 and newer)")


class ArgError(ValueError):
    """A command-line argument that cannot be used (one line, naming the argument)."""


@dataclass(frozen=True)
class Arch:
    """A kernel family and the GPU target its kernels are built for."""

    family: str  # registry arch: "sm90" | "sm80"
    target: str  # the --gpu-arch of the compile: "sm_90a", "sm_80", "sm_86", ...


def parse_arch(text: str) -> Arch:
    """'sm90' / 'sm_90' / 'sm_90a' / 'sm90a' -> SM90 family for sm_90a; 'sm80' / 'sm_80' ->
    SM80 family for sm_80; 'sm_86', 'sm_120', ... (8.0 and up) -> SM80 family for that GPU."""
    name = str(text).strip().lower().replace("_", "")
    digits = name[2:].rstrip("af") if name.startswith("sm") else ""
    if name in ("sm90", "sm90a"):
        return Arch("sm90", "sm_90a")
    if digits.isdigit() and int(digits) >= 80 and not name.endswith(("a", "f")):
        return Arch("sm80", f"sm_{digits}")
    raise ArgError(f"unknown arch {text!r}: expected sm90 (also sm_90, sm_90a) or sm80 (also "
                   f"sm_80; sm_86, sm_89, ... build the SM80 family for that GPU)")


def parse_family(text: str) -> str:
    return parse_arch(text).family


def with_target(arch: Arch, target: str | None) -> Arch:
    """`--target`: the GPU an SM80-family build is for (e.g. sm_90: an H100 running the SM80
    family); the SM90 family has one target, sm_90a."""
    if target is None:
        return arch
    name = str(target).strip().lower().replace("_", "")
    digits = name[2:] if name.startswith("sm") else ""
    if not (digits.isdigit() and int(digits) >= 80):
        raise ArgError(f"--target {target!r}: expected an SM80-family GPU target such as "
                       f"sm_80, sm_86 or sm_90")
    if arch.family != "sm80":
        raise ArgError(f"--target {target} applies to the SM80 family (--arch sm80); the SM90 "
                       f"family is always built for sm_90a")
    return Arch("sm80", f"sm_{digits}")


def argparse_type(check, what: str):
    """An argparse `type=` from a check that raises ArgError (argparse prints the message)."""
    def convert(text):
        try:
            return check(text)
        except ArgError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = what  # argparse names the type in some messages
    return convert


arch_type = argparse_type(parse_arch, "arch")
family_type = argparse_type(parse_family, "arch")


def close_names(name: str, known, n: int = 5) -> str:
    """' (did you mean a, b?)' with up to n names close to `name`, or ''."""
    close = difflib.get_close_matches(name, sorted(set(known)), n=n, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def comma_list(text: str | None, allowed) -> tuple[str, ...] | None:
    """'a,b' -> ('a', 'b') with every item in `allowed`; None for None. An empty list or an
    unknown item raises ArgError."""
    if text is None:
        return None
    items = tuple(dict.fromkeys(s.strip() for s in str(text).split(",") if s.strip()))
    if not items:
        raise ArgError(f"{text!r}: expected a comma-separated list of {', '.join(allowed)}")
    for item in items:
        if item not in allowed:
            raise ArgError(f"unknown {item!r}{close_names(item, allowed, 3)}; expected a "
                           f"comma-separated list of {', '.join(allowed)}")
    return items


def resolve_buckets(names, buckets, family: str) -> list[str]:
    """Bucket names as given (a base name of a bucket with alternatives stands for all of
    them) -> the names of the buckets they select, in table order. An unknown name raises
    ArgError with a few close names."""
    known = [b.name for b in buckets]
    bases = {n.split(".", 1)[0] for n in known if "." in n}
    chosen = set()
    for name in names:
        if name in known:
            chosen.add(name)
        elif name in bases:
            chosen.update(n for n in known if n.split(".", 1)[0] == name)
        else:
            raise ArgError(f"--bucket: no bucket {name!r} in the {family} table"
                           f"{close_names(name, set(known) | bases)}; `detgemm-cute audit "
                           f"--arch {family}` lists them")
    return [n for n in known if n in chosen]


def at_least(kind, low):
    """An argparse `type=`: `kind` (int or float) of `text`, refused below `low`."""
    what = "an integer" if kind is int else "a number"

    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {text!r}") from None
        if not value >= low:  # also refuses nan
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {value}")
        return value

    convert.__name__ = kind.__name__
    return convert


positive_int = at_least(int, 1)


__all__ = ["Arch", "ArgError", "ARCH_HELP", "FAMILIES", "parse_arch", "parse_family",
           "with_target", "arch_type", "family_type", "argparse_type", "close_names",
           "comma_list", "resolve_buckets", "at_least", "positive_int"]
