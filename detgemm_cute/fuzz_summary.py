"""The fuzzer's bookkeeping: outcome kinds, a run's summary (counts per op and kind,
failures), its printed table and JSON form. Shared by one fuzzing process (`fuzz`) and a
campaign of several (`fuzz_campaign`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

KINDS = ("ok", "wrong_bits", "crash", "refused")


@dataclass
class Summary:
    seed: int
    device: str
    seconds: float = 0.0
    nan_bits: str = "compared as NaN"
    per_op: dict = field(default_factory=dict)  # op -> {kind: count}
    failures: list = field(default_factory=list)  # {case, kind, detail, shrunk, reproducer}
    fatal: str | None = None

    @property
    def problems(self) -> int:
        return sum(sum(c.values()) for c in self.per_op.values())

    @property
    def failed(self) -> int:
        return len(self.failures)

    def count(self, op: str, kind: str) -> None:
        self.per_op.setdefault(op, dict.fromkeys(KINDS, 0))[kind] += 1


def print_summary(summary: Summary, out, label: str | None = None) -> None:
    """The per-op table of `summary`, headed by `label` (default: its seed)."""
    out(f"\nfuzz: {label or f'seed {summary.seed}'}, device {summary.device}, "
        f"{summary.problems} problems in {summary.seconds:.0f} s; NaN bits {summary.nan_bits}")
    out(f"  {'op':12s} {'problems':>9s} {'ok':>8s} {'wrong':>6s} {'crash':>6s} "
        f"{'refused':>8s}")
    totals = dict.fromkeys(KINDS, 0)
    for op in sorted(summary.per_op):
        c = summary.per_op[op]
        for k in KINDS:
            totals[k] += c[k]
        out(f"  {op:12s} {sum(c.values()):9d} {c['ok']:8d} {c['wrong_bits']:6d} "
            f"{c['crash']:6d} {c['refused']:8d}")
    out(f"  {'all':12s} {sum(totals.values()):9d} {totals['ok']:8d} "
        f"{totals['wrong_bits']:6d} {totals['crash']:6d} {totals['refused']:8d}")
    if summary.fatal:
        out(f"  stopped: {summary.fatal}")
    out(f"  {summary.failed} failures (wrong bits: {totals['wrong_bits']}, crashes: "
        f"{totals['crash']})")


def summary_json(summary: Summary) -> dict:
    d = asdict(summary)
    d["failures"] = [{k: v for k, v in f.items() if not k.startswith("_")}
                     for f in summary.failures]
    d["problems"] = summary.problems
    return d


__all__ = ["KINDS", "Summary", "print_summary", "summary_json"]
