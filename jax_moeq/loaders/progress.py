"""A tiny progress printer for long conversions (no dependency).

On a terminal it redraws one line (`\\r`); elsewhere (logs, CI, pytest) it
prints a line at most every 10 % so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Iterable, Iterator, TypeVar

T = TypeVar("T")

_BAR_WIDTH = 24


class Progress:
  """Counts finished steps of `total` and shows a bar with a rate and ETA.

  Use as a context manager (`with Progress(n, "layers") as p: ... p.update()`)
  or wrap an iterable with `progress(items, desc)`. `enabled=False` silences it.
  """

  def __init__(self, total: int, desc: str = "", *, stream: IO[str] | None = None,
               enabled: bool = True):
    if total < 0:
      raise ValueError(f"total must be >= 0, got {total}")
    self.total = int(total)
    self.desc = desc
    self.count = 0
    self.enabled = enabled
    self._stream = stream if stream is not None else sys.stderr
    self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
    self._start = time.perf_counter()
    self._last_decile = -1

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def update(self, n: int = 1, note: str = "") -> None:
    self.count = min(self.total, self.count + n)
    if not self.enabled:
      return
    decile = 10 * self.count // max(self.total, 1)
    if self._tty or decile != self._last_decile or self.count == self.total:
      self._last_decile = decile
      self._draw(note)

  def _draw(self, note: str) -> None:
    frac = self.count / self.total if self.total else 1.0
    filled = int(round(frac * _BAR_WIDTH))
    elapsed = time.perf_counter() - self._start
    rate = self.count / elapsed if elapsed > 0 else 0.0
    eta = (self.total - self.count) / rate if rate > 0 else 0.0
    line = (f"{self.desc} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] "
            f"{self.count}/{self.total} {elapsed:.1f}s eta {eta:.1f}s {note}").rstrip()
    if self._tty:
      self._stream.write("\r" + line)
    else:
      self._stream.write(line + "\n")
    self._stream.flush()

  def close(self) -> None:
    if self.enabled and self._tty:
      self._stream.write("\n")
      self._stream.flush()


def track_progress(items: Iterable[T], desc: str = "", *, total: int | None = None,
             stream: IO[str] | None = None, enabled: bool = True) -> Iterator[T]:
  """Yields `items`, advancing a `Progress` bar after each."""
  if total is None:
    items = list(items)
    total = len(items)
  with Progress(total, desc, stream=stream, enabled=enabled) as bar:
    for item in items:
      yield item
      bar.update()
