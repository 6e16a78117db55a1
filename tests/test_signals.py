"""`serve`, `node` and `lb run` wait for SIGTERM or Ctrl-C on a flag their signal handler
sets without a lock (poolpipe_cli/serve.py SignalStop): a handler that set a
threading.Event while the main thread waited on it could wait forever for the lock the
interrupted wait held, and `serve` then ignored SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
import time

from poolpipe_cli.serve import _stop_on_signals, _wait_for_signal


def test_signals_at_any_moment_of_the_wait_end_it():
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for k in range(60):
            told = []
            stop = _stop_on_signals(also=lambda: told.append(True))  # noqa: B023
            sig = signal.SIGTERM if k % 2 else signal.SIGINT
            threading.Timer(0.0007 * (k % 11), os.kill, (os.getpid(), sig)).start()
            t0 = time.monotonic()
            _wait_for_signal(stop)
            assert stop.is_set() and told == [True]
            assert time.monotonic() - t0 < 2.0
        # and the wait also ends when `also` says so, without a signal
        stop = _stop_on_signals()
        t0 = time.monotonic()
        _wait_for_signal(stop, also=lambda: time.monotonic() - t0 > 1.5)
        assert not stop.is_set() and 1.5 < time.monotonic() - t0 < 4.0
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
