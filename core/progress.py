"""A dependency-free progress bar for long work (weight creation, loading, JIT warmup, tuning)."""
from __future__ import annotations

import sys
import time


class Progress:
    """``Progress(desc)(done, total)``: a bar on a terminal, a line every ~10% otherwise."""

    def __init__(self, desc: str, stream=None, enabled: bool = True):
        self.desc, self.stream, self.enabled = desc, stream or sys.stderr, enabled
        self.t0 = time.perf_counter()
        self.last_decile = -1
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        frac = min(1.0, done / total)
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r{self.desc} [{bar:<30}] {frac:6.1%} {elapsed:6.1f}s")
            if done >= total:
                self.stream.write("\n")
        elif elapsed > 1.0 and (int(frac * 4) > self.last_decile or done >= total):
            # not a terminal (CI logs, pipes): a line per quarter, and only for work that takes a while
            self.last_decile = int(frac * 4)
            self.stream.write(f"{self.desc}: {frac:.0%} ({elapsed:.1f}s)\n")
        self.stream.flush()
