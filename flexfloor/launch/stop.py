"""A stop signal that ends a tool's work as an exception, and is never lost.

Python runs a signal's handler between two bytecodes of the main thread, wherever that thread
is: also inside a weakref callback, a `__del__` or an import lock's clean-up. An exception
raised there is printed as "Exception ignored in ..." and dropped, and the work would go on as
if no signal had come. So the handler keeps each signal in `got`, and a stop that Python
dropped is raised again a moment later, where the main thread has gone on, so the work still
stops:

    with StopSignals((signal.SIGTERM,)) as stop:
        result = stop.run(work)
        if stop.got:
            ...  # clean up, return 128 + stop.signum

A signal is raised only inside `run`: one that comes before the work (while the handlers are
installed) stops it as it starts; a second one while the first unwinds the work is kept but
cuts nothing short; one after the work is ignored (the outcome is decided, and the clean-up
must not be cut short).
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time

_BEFORE, _ARMED, _AFTER = range(3)
AGAIN_AFTER_S = 0.005  # a dropped stop is raised again this long after (the hook has returned)


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
        self._in_flight = False  # a Stopped raised and not dropped: the work is unwinding
        self._again = 0  # stops raised again (each is in `got` already)
        self._in_hook = False  # in the unraisable hook: a Stopped raised there is lost
        self._lock = threading.Lock()  # a stop raised again vs the handlers' restore

    def __enter__(self) -> "StopSignals":
        self._previous = {s: signal.signal(s, self._stop) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        # signal.signal runs a pending handler first: one raised again just now meets `_stop`
        # (and is ignored there), never the handler restored
        with self._lock:
            for s, handler in self._previous.items():
                signal.signal(s, handler)

    def _stop(self, signum, _frame) -> None:
        if self._state == _AFTER:
            return
        if self._again:
            self._again -= 1
        else:
            self.got.append(signum)
        if self._state != _ARMED or self._in_flight:
            return
        if self._in_hook:
            self._raise_again(signum)
            return
        self._in_flight = True
        raise Stopped(signum)

    def _raise_again(self, signum: int) -> None:
        """Run `_stop` for `signum` once more, a moment from now, in the main thread: from a
        thread it does not wait for (Thread.start waits: the handler would run in there), as a
        real signal to the main thread, so that a blocking call there (a sleep, a wait on a
        process) ends as it would for the first; `_thread.interrupt_main` only simulates one,
        which such a call does not see until it returns (a minute's sleep ran to its end). Sent
        under the lock while armed: the handlers are restored only under it (`__exit__`), after
        `run` has set SIG_IGN, which drops one still pending; so it meets `_stop` (which ignores it
        once the work is over) or SIG_IGN, never a restored SIG_DFL."""
        self._again += 1
        main = threading.main_thread().ident

        def soon():
            time.sleep(AGAIN_AFTER_S)
            with self._lock:
                if self._state == _ARMED:
                    signal.pthread_kill(main, signum)

        _thread.start_new_thread(soon, ())

    def _hook(self, previous):
        def unraisable(info) -> None:
            self._in_hook = True
            try:
                previous(info)  # Python's "Exception ignored in ..." lines, as without this
                if isinstance(info.exc_value, Stopped) and self._state == _ARMED:
                    self._in_flight = False
                    self._raise_again(info.exc_value.args[0])
            finally:
                self._in_hook = False
        return unraisable

    def run(self, work, *args):
        """`work(*args)`, stopped by the first signal: its result, or None where a signal's
        exception ended it (`got` says whether a signal came, also one that came as the work
        ended). An exception of the work's own propagates. Afterwards the signals are ignored
        until exit."""
        previous = sys.unraisablehook
        sys.unraisablehook = self._hook(previous)
        try:
            try:
                self._state = _ARMED  # inside the try: a signal from here on is caught below
                if self.got:  # came before the work began
                    raise Stopped(self.got[0])
                return work(*args)
            finally:
                self._state = _AFTER
        except BaseException:
            if not self.got:  # a failure, not a stop
                raise
            return None
        finally:
            for s in self.signals:
                signal.signal(s, signal.SIG_IGN)
            sys.unraisablehook = previous

    @property
    def signum(self) -> int:
        """The first signal that came, or 0."""
        return self.got[0] if self.got else 0
