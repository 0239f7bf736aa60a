"""Progress of long work on stderr: a tqdm bar on a terminal; elsewhere (a log file, a pipe, a CI job) a plain
bracketed line every PLAIN_INTERVAL_S seconds, so a run that is alive says so without filling a log with
carriage-return redraws."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

PLAIN_INTERVAL_S = 5.0  # seconds between plain progress lines
Item = TypeVar("Item")


class Progress:
    """count/total of `unit`s done; `enabled=False` shows nothing (other ranks, quiet library calls); `transient`:
    a terminal's bar appears after a second and is erased when done (short steps such as loading weights)."""

    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool = True, transient: bool = False):
        self.total, self.desc, self.unit = total, desc, unit
        self.count, self.note = 0, ""
        self.enabled = enabled
        self.start = self.last = time.perf_counter()
        self.printed = False
        self.shown = None  # (count, note) of the last plain line
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm  # only for a terminal; progress.py stays light to import

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=not transient,
                            delay=1.0 if transient else 0.0)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, note: str | None = None) -> None:
        """Count n more units done; `note` (e.g. a rate) replaces the text shown after the count."""
        self.count += n
        if note is not None:
            self.note = note
        if self.bar is not None:
            if note is not None:
                self.bar.set_postfix_str(note, refresh=n == 0)
            if n:
                self.bar.update(n)
        elif self.enabled and time.perf_counter() - self.last >= PLAIN_INTERVAL_S:
            self._line()

    def write(self, text: str) -> None:
        """A line of its own on stderr (above a terminal's bar), whether or not progress is shown."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    def set_total(self, total: int) -> None:
        """The work turned out to be `total` units (a budget cut it short)."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def close(self) -> None:
        """End the bar; in plain mode a last line with the final count, if any line was printed."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.printed:
            if self.shown != (self.count, self.note):  # the final count, unless the last line showed it
                self._line()
            self.printed = False

    def _line(self) -> None:
        now = time.perf_counter()
        done = f"{self.count}/{self.total}" if self.total is not None else str(self.count)
        note = f", {self.note}" if self.note else ""
        sys.stderr.write(f"[{self.desc}: {done} {self.unit}{note}, {now - self.start:.0f} s]\n")
        sys.stderr.flush()
        self.last, self.printed, self.shown = now, True, (self.count, self.note)


def track(items: Sequence[Item], desc: str, unit: str, enabled: bool = True,
          transient: bool = False) -> Iterator[Item]:
    """Each of `items` in turn, counted by a Progress (closed when the loop ends or leaves early)."""
    with Progress(len(items), desc, unit, enabled, transient) as bar:
        for item in items:
            yield item
            bar.update(1)
