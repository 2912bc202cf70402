"""A heartbeat line for long work that prints nothing of its own (engine start-up, a training step).

Every ``every`` seconds (default 30, env ``OPD_HEARTBEAT_S``) a background thread prints
``[what] still running: Ns`` until the block ends, so a log never goes silent for minutes.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator


def heartbeat_seconds() -> float:
    """Seconds between heartbeat lines: ``$OPD_HEARTBEAT_S`` or 30."""
    return float(os.environ.get("OPD_HEARTBEAT_S") or 30)


class Heartbeat:
    """Print ``message()`` every ``every`` seconds from a daemon thread until :meth:`stop`."""

    def __init__(self, message: Callable[[float], str], every: float | None = None):
        self.message, self.every = message, heartbeat_seconds() if every is None else every
        self._stop = threading.Event()
        self._t0 = time.time()
        self._thread = threading.Thread(target=self._run, daemon=True, name="opd-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            print(self.message(time.time() - self._t0), flush=True)

    def stop(self) -> None:
        self._stop.set()


@contextmanager
def heartbeat(what: str, every: float | None = None) -> Iterator[None]:
    """``with heartbeat("vLLM start-up"):`` prints ``[vLLM start-up] still running: 30s`` every 30 s."""
    hb = Heartbeat(lambda s: f"[{what}] still running: {s:.0f}s", every)
    try:
        yield
    finally:
        hb.stop()
