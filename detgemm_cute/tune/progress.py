"""A small progress bar on stderr (count, elapsed time, rate, time left): redrawn in place on
a terminal, a line every ~5 % (and at least every 30 s) otherwise, so captured logs stay
readable."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, what: str = "", stream=None, width: int = 28):
        self.total, self.what, self.width = max(0, int(total)), what, width
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.time()
        self._last_pct = -100.0
        self._last_t = 0.0

    def text(self, done: int, label: str = "") -> str:
        frac = done / self.total if self.total else 1.0
        fill = int(self.width * frac)
        elapsed = time.time() - self.t0
        eta = elapsed / done * (self.total - done) if done else None
        eta_s = f", ETA {eta:.0f}s" if eta is not None and done < self.total else ""
        rate = f", {done / elapsed:.1f}/s" if done and elapsed > 0 else ""
        return (f"[{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} {self.what} "
                f"{elapsed:.0f}s{rate}{eta_s} {label}").rstrip()

    def update(self, done: int, label: str = "") -> None:
        pct = 100.0 * done / self.total if self.total else 100.0
        now = time.time()
        if self.tty:
            self.stream.write("\r" + self.text(done, label)[:160].ljust(100))
            if done >= self.total:
                self.stream.write("\n")
        elif pct - self._last_pct >= 5 or now - self._last_t >= 30 or done >= self.total:
            self.stream.write(self.text(done, label) + "\n")
            self._last_pct, self._last_t = pct, now
        self.stream.flush()
