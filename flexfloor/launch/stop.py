"""A stop signal that ends a tool's work as an exception, and is never lost.

Python runs a signal's handler between two bytecodes of the main thread, wherever that thread
is: also inside a weakref callback, a `__del__` or an import lock's clean-up. An exception
raised there is printed as "Exception ignored in ..." and dropped, and the work goes on as if
no signal had come. So the handler also keeps each signal in `got`, which the caller reads when
the work ends, however it ends:

    with StopSignals((signal.SIGTERM,)) as stop:
        result = stop.run(work)
        if stop.got:
            ...  # clean up, return 128 + stop.signum

A signal is raised only inside `run`, and only the first: one that comes before the work
(while the handlers are installed) stops it as it starts, a second one while the first unwinds
the work is kept but cuts nothing short, and one after the work is ignored (the outcome is
decided; the clean-up must not be cut short).
"""

from __future__ import annotations

import signal

_BEFORE, _ARMED, _AFTER = range(3)


class Stopped(KeyboardInterrupt):
    """A stop signal (args[0]: its number). An interrupt, so that a checkpoint save it cuts
    short raises it, not a disk's failure."""


class StopSignals:
    """While entered, each of `signals` is kept in `got` and stops `run`'s work; the handlers
    there before are back on exit."""

    def __init__(self, signals):
        self.signals = tuple(signals)
        self.got: list[int] = []
        self._previous: dict = {}
        self._state = _BEFORE

    def __enter__(self) -> "StopSignals":
        self._previous = {s: signal.signal(s, self._stop) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _stop(self, signum, _frame) -> None:
        if self._state == _AFTER:
            return
        self.got.append(signum)
        if self._state == _ARMED and len(self.got) == 1:
            raise Stopped(signum)

    def run(self, work, *args):
        """`work(*args)`, stopped by the first signal: its result, or None where a signal's
        exception ended it (`got` says whether a signal came, also one whose exception Python
        dropped). An exception of the work's own propagates. Afterwards the signals are
        ignored until exit."""
        try:
            self._state = _ARMED  # inside the try: a signal from here on is caught below
            if self.got:  # came before the work began
                raise Stopped(self.got[0])
            result = work(*args)
            self._state = _AFTER
            return result
        except BaseException:
            self._state = _AFTER
            if not self.got:  # a failure, not a stop
                raise
            return None
        finally:
            self._state = _AFTER
            for s in self.signals:
                signal.signal(s, signal.SIG_IGN)

    @property
    def signum(self) -> int:
        """The first signal that came, or 0."""
        return self.got[0] if self.got else 0
