"""SIGTERM/SIGINT as a request to stop: the step finishes, a checkpoint is saved, train()
returns (a scheduler's preemption, Ctrl-C)."""

import signal
import threading


class StopSignals:
    """While entered, SIGTERM and SIGINT set `.signum` instead of killing the process (only in
    the main thread, where Python delivers signals); the old handlers come back on exit."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def _handler(self, signum, frame):
        self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        return False

    @property
    def name(self):
        return signal.Signals(self.signum).name if self.signum else "signal"
