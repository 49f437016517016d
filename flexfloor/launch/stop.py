"""A stop signal that ends a tool's work as an exception, and is never lost.

Python runs a signal's handler between two bytecodes of the main thread, wherever that thread
is: also inside a weakref callback, a `__del__` or an import lock's clean-up. An exception
raised there is printed as "Exception ignored in ..." and dropped, and the work goes on as if
no signal had come. So the handler also keeps each signal in `got`, which the caller reads when
the work ends, however it ends:

    with StopSignals((signal.SIGTERM,)) as stop:
        try:
            result = work()
        except BaseException:
            if not stop.got:  # a failure, not a stop
                raise
        finally:
            stop.ignore()  # from here on nothing cuts the clean-up short
        if stop.got:
            ...  # clean up, return 128 + stop.signum
"""

from __future__ import annotations

import signal


class Stopped(KeyboardInterrupt):
    """A stop signal (args[0]: its number). An interrupt, so that a checkpoint save it cuts
    short raises it, not a disk's failure."""


class StopSignals:
    """While entered, each of `signals` raises `Stopped` and is kept in `got`; the handlers
    there before are back on exit."""

    def __init__(self, signals):
        self.signals = tuple(signals)
        self.got: list[int] = []
        self._previous: dict = {}
        self._ignoring = False

    def __enter__(self) -> "StopSignals":
        self._previous = {s: signal.signal(s, self._stop) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _stop(self, signum, _frame) -> None:
        if self._ignoring:  # came while `ignore` swapped the handlers
            return
        self.got.append(signum)
        raise Stopped(signum)

    def ignore(self) -> None:
        """Ignore the signals until exit (a clean-up that a second signal must not cut short)."""
        self._ignoring = True
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)

    @property
    def signum(self) -> int:
        """The first signal that came, or 0."""
        return self.got[0] if self.got else 0
