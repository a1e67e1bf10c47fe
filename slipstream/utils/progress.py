"""Progress on rank 0: a bar in a terminal (tqdm's when it is installed, a one-line bar otherwise), plain
lines at each quarter when the output is a file or a pipe, so logs of batch jobs stay readable."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """`advance(n)` as work completes, `finish()` at the end. `total=None` counts without a percentage."""

    def __init__(
        self,
        label: str,
        total: float | None = None,
        *,
        unit: str = "",
        scale: float = 1.0,
        enabled: bool = True,
        lines: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0.0
        self.started = time.monotonic()
        self.terminal = enabled and self.stream.isatty()
        self.lines = enabled and lines and not self.terminal and total is not None
        self._next_quarter = 1
        self._bar: Any = None
        if self.terminal:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                shown_total = None if total is None else total / scale
                self._bar = tqdm(total=shown_total, desc=label, unit=unit, file=self.stream, dynamic_ncols=True)

    def advance(self, amount: float = 1.0, note: str = "") -> None:
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount / self.scale)
            if note:
                self._bar.set_postfix_str(note, refresh=False)
        elif self.terminal:
            self._draw(note)
        elif self.lines and self.total:
            while self._next_quarter <= 4 and self.done >= self.total * self._next_quarter / 4:
                self.stream.write(f"{self.label}: {25 * self._next_quarter}% {self._figures()}\n")
                self.stream.flush()
                self._next_quarter += 1

    def _figures(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        done, total = self.done / self.scale, None if self.total is None else self.total / self.scale
        shown = f"{done:,.0f}" + ("" if total is None else f"/{total:,.0f}")
        return f"{shown} {self.unit} ({done / elapsed:,.1f} {self.unit}/s)".replace("  ", " ")

    def _draw(self, note: str) -> None:
        if self.total:
            filled = int(30 * min(self.done / self.total, 1.0))
            head = f"[{'#' * filled}{'.' * (30 - filled)}] {100 * self.done / self.total:5.1f}%"
        else:
            head = ""
        self.stream.write(f"\r{self.label} {head} {self._figures()} {note[:40]:<40}")
        self.stream.flush()

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.terminal:
            self.stream.write("\n")
            self.stream.flush()
