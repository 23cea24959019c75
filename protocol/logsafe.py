"""Keeping floods of bad input cheap: rate-limited logging and per-key reply budgets.

A stranger on an open broker can publish hundreds of malformed messages per second.
Logging each rejection in full (topics can be 64 KiB long) fills disks, and answering
each one floods the device it names. Both sides use these helpers:

- :func:`clip` shortens untrusted text (topics, ids, reasons) for a log line.
- :class:`LogLimiter` logs the first few lines of each kind per interval and counts the
  rest, then emits one summary line per interval.
- :class:`RateLimiter` is a bounded set of token buckets keyed by a name (a device id):
  at most ``burst`` events at once and ``rate`` per second after that.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Callable

OTHER = "other"
"""Key under which a :class:`LogLimiter` counts lines once ``max_keys`` keys are tracked."""


def clip(text: Any, limit: int = 80) -> str:
    """``text`` (``str()`` of it) cut to ``limit`` characters, noting the original length.

    >>> clip("a" * 100, 10)
    'aaaaaaaaaa...(100 chars)'
    """
    s = text if isinstance(text, str) else str(text)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}...({len(s)} chars)"


class LogLimiter:
    """Rate-limits one family of repetitive log lines (e.g. rejections of bad messages).

    Within each interval of ``interval_s`` seconds, the first ``per_key`` lines of each key
    (and at most ``total`` lines over all keys) are logged; the rest are counted. The
    first call after an interval ends (or :meth:`flush`) logs one summary, e.g.
    ``suppressed 1234 similar rejections in the last 60 s: 1000x stats: not valid JSON, ...``.
    Keys should have few distinct values (a message kind and a reason class, never a
    device id or topic); past ``max_keys`` per interval they are counted as ``other``.
    Thread-safe.

    Args:
        logger: the logger lines and summaries go to.
        what: plural noun for the summary (``"rejections"``).
        per_key: lines logged per key per interval.
        total: lines logged per interval over all keys.
        interval_s: length of an interval, in seconds.
        max_keys: distinct keys counted per interval.
        summary_level: level of the summary line.
        clock: monotonic time source (tests).
    """

    def __init__(self, logger: logging.Logger, what: str = "messages", per_key: int = 3, total: int = 20,
                 interval_s: float = 60.0, max_keys: int = 64, summary_level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.what = what
        self.per_key = per_key
        self.total = total
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.summary_level = summary_level
        self.clock = clock
        self.suppressed_total = 0
        """Lines counted instead of logged, over the limiter's life."""
        self._lock = threading.Lock()
        self._start = clock()
        self._logged: Counter[str] = Counter()
        self._suppressed: Counter[str] = Counter()

    def log(self, key: str, level: int, msg: str, *args: Any, **kwargs: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` is over its budget (then count it).

        ``kwargs`` go to :meth:`logging.Logger.log` (``exc_info``). Returns whether it was logged.
        """
        with self._lock:
            summary = self._roll()
            if key not in self._logged and key not in self._suppressed and \
                    len(self._logged) + len(self._suppressed) >= self.max_keys:
                key = OTHER
            allowed = self._logged[key] < self.per_key and sum(self._logged.values()) < self.total
            if allowed:
                self._logged[key] += 1
            else:
                self._suppressed[key] += 1
                self.suppressed_total += 1
        if summary:
            self.logger.log(self.summary_level, "%s", summary)
        if allowed:
            kwargs.setdefault("stacklevel", 2)  # the record names the caller, not this module
            self.logger.log(level, msg, *args, **kwargs)
        return allowed

    def flush(self, force: bool = False) -> None:
        """Emit the summary if the interval is over (or now, with ``force``) and start a new
        interval. Cheap: call it from a main loop so a summary comes even after a flood ends."""
        with self._lock:
            summary = self._roll(force)
        if summary:
            self.logger.log(self.summary_level, "%s", summary)

    def _roll(self, force: bool = False) -> str | None:
        now = self.clock()
        elapsed = now - self._start
        if not force and elapsed < self.interval_s:
            return None
        summary = None
        if self._suppressed:
            n = sum(self._suppressed.values())
            top = ", ".join(f"{c}x {k}" for k, c in self._suppressed.most_common(5))
            more = len(self._suppressed) - 5
            summary = (f"suppressed {n} similar {self.what} in the last {elapsed:.0f} s: {top}"
                       + (f" (and {more} more kinds)" if more > 0 else ""))
        self._start = now
        self._logged.clear()
        self._suppressed.clear()
        return summary


class RateLimiter:
    """Token buckets keyed by name: each key may pass ``burst`` times at once, then
    ``rate`` times per second. At most ``max_keys`` buckets are kept (least recently
    used forgotten first, so a flood of made-up keys cannot grow memory). Thread-safe.

    Args:
        rate: tokens added per second to each bucket.
        burst: bucket size.
        max_keys: buckets kept.
        clock: monotonic time source (tests).
    """

    def __init__(self, rate: float, burst: float, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self.clock = clock
        self.denied = 0
        """Events refused over the limiter's life."""
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str) -> bool:
        """Take one token from ``key``'s bucket; False (and counted) if it is empty."""
        with self._lock:
            now = self.clock()
            tokens, last = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            ok = tokens >= 1.0
            if ok:
                tokens -= 1.0
            else:
                self.denied += 1
            self._buckets[key] = (tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return ok


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"\d+")


def reason_class(reason: str, clauses: int = 1) -> str:
    """A reason's class, for log de-duplication keys and metric labels: its first
    ``clauses`` clauses (``": "``-separated) with quoted values and numbers blanked, at most
    80 characters (``"over budget: the plan needs 900 MiB"`` -> ``"over budget"``)."""
    head = ": ".join(str(reason)[:200].split(": ", clauses)[:clauses])
    return _NUMBER.sub("N", _QUOTED.sub("'...'", head)).strip()[:80] or "unspecified"
