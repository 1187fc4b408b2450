"""Stopping cleanly when the job is preempted: SIGTERM or SIGINT asks training to save at
the next step boundary and exit with :data:`PREEMPTED_EXIT_CODE`; a second signal ends the
process at once.

Job schedulers (SLURM, Kubernetes, spot-instance reclaim) send SIGTERM and wait a grace
period before SIGKILL; Ctrl-C sends SIGINT. :class:`SignalStop` turns the first of them
into a request that the training loop honours between two optimizer steps, where the
state is whole: :meth:`Engine.stop_on_signal <memfit.engine.core.Engine.stop_on_signal>`
installs one with a path, and the Engine then saves there at the end of the step during
which the signal came and raises :class:`Preempted` (a ``SystemExit``: uncaught, the
process exits with code 75 and ``finally`` blocks run). The first signal also gives both
signals back to the operating system's default action, so a second one ends the process
at once, even inside a long kernel or a hung collective (nothing is saved then; the last
saved state stays whole, as every save is atomic).

**Exit code 75** is ``EX_TEMPFAIL`` of ``sysexits.h``, "a temporary failure; the user is
invited to retry": the state is saved, and running the same command again continues. It
differs from memfit's error codes (1, 2) and from ``128 + N``, which a shell reports for a
process that a signal ``N`` killed with nothing saved (130 for SIGINT, 143 for SIGTERM),
so a wrapper script or a scheduler's requeue rule can tell "stopped cleanly, run me again"
from "died".

**Under torch.distributed** every rank must stop at the same step (the save is
collective): at each step boundary the ranks all-reduce their stop flags with MAX
(:func:`memfit.distributed.collectives.any_rank`, on the CPU), so a signal that reaches
one rank stops them all at the same step. Under ``torchrun`` the launcher forwards its
SIGTERM or SIGINT to every rank once (the ranks run in their own sessions, so a
terminal's Ctrl-C reaches them only through it) and waits 30 s before SIGKILL.

Host syncs: none on one process; under torch.distributed one all-reduce of a CPU integer
per step once a stop is installed.

Example::

    with engine.stop_on_signal("run/last.pt"):     # one call installs it
        for batch in loader:
            engine.train_step(batch, loss_fn)       # SIGTERM: saved after this step, exit 75
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType
from typing import Any

from memfit.distributed.collectives import any_rank
from memfit.distributed.world import current_world
from memfit.errors import ConfigError

#: The exit code of a run that stopped on a signal after saving its state (EX_TEMPFAIL:
#: run the same command again to continue). See the module docstring for why 75.
PREEMPTED_EXIT_CODE = 75

#: The signals a stop listens to by default: what schedulers (SIGTERM) and Ctrl-C (SIGINT)
#: send.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int | None) -> str:
    """``"SIGTERM"`` for 15; ``"a signal to another rank"`` for None."""
    if signum is None:
        return "a signal to another rank"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Preempted(SystemExit):
    """Raised at the step boundary after a stop signal, once the state is saved; a
    ``SystemExit`` with code :data:`PREEMPTED_EXIT_CODE` (75), so an uncaught one exits the
    process cleanly with it and ``except Exception`` does not swallow it.

    Example::

        try:
            train()
        except Preempted as stop:
            print(stop.step, stop.path)   # where to continue from
            raise
    """

    def __init__(self, signum: int | None, step: int, path: Path | None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal = signum
        """The signal this rank received (None where only another rank received one)."""
        self.step = step
        """The step the run stopped after: the saved state's step."""
        self.path = path
        """Where the state was saved."""

    def __str__(self) -> str:
        saved = f"the state is saved in {self.path}" if self.path else "the state is saved"
        return (
            f"stopped after step {self.step} on {signal_name(self.signal)}: {saved}; run the "
            f"same command again to continue (exit code {PREEMPTED_EXIT_CODE})"
        )


class SignalStop:
    """A stop request from SIGTERM or SIGINT, honoured at a step boundary.

    :meth:`install` replaces the signals' handlers (from the main thread); the first signal
    sets :attr:`received`, prints one line to stderr and gives the signals their default
    action back, so that a second one ends the process at once. :meth:`requested` is the
    stop decision every rank shares; :meth:`at_step_boundary` saves with ``save`` and
    raises :class:`Preempted` when it is taken. :meth:`uninstall` (or leaving the ``with``
    block) restores the handlers that were there before.

    ``save``: called with no argument at the stop, on every rank; returns the saved path.
    Without it, the caller saves (``memfit train`` does, to rotate its state files).

    Example::

        stop = SignalStop(save=lambda: engine.save("run/last.pt")).install()
        for batch in loader:
            engine.train_step(batch, loss_fn)
            stop.at_step_boundary(engine.steps)   # the Engine calls this itself with
                                                  # engine.stop_on_signal(path)
        stop.uninstall()
    """

    def __init__(
        self,
        save: Callable[[], Path | str] | None = None,
        signals: Iterable[int] = STOP_SIGNALS,
    ) -> None:
        self.save = save
        self.signals = tuple(signals)
        if not self.signals:
            raise ConfigError("SignalStop needs at least one signal, e.g. signal.SIGTERM")
        self.received: int | None = None
        """The first stop signal this process received (None until one came)."""
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        """Whether the handlers are in place."""
        return bool(self._previous)

    def install(self) -> SignalStop:
        """Handle the signals from now on; returns self. ConfigError off the main thread
        (Python runs signal handlers there only)."""
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "stop_on_signal()/SignalStop.install() must be called from the main thread: "
                "Python delivers signals there only"
            )
        if self.installed:
            return self
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install` (idempotent)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def __enter__(self) -> SignalStop:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # a second signal before the default action was back
            return
        self.received = signum
        # The next signal takes the default action: the process ends at once.
        for other in self.signals:
            signal.signal(other, signal.SIG_DFL)
        world = current_world()
        rank = f"rank {world.rank}: " if world.distributed else ""
        name = signal_name(signum)
        # os.write, not print: a handler may interrupt a print in progress.
        os.write(
            2,
            f"memfit: {rank}{name} received; the state is saved at the end of this step, then "
            f"the run stops (exit code {PREEMPTED_EXIT_CODE}); another {name} stops it at "
            "once, without saving\n".encode(),
        )

    def requested(self, *more: bool) -> tuple[bool, ...]:
        """``(stop, *more)`` as every rank sees them: this rank's stop request and ``more``
        flags, each OR-ed over the ranks in one all-reduce (see the module docstring).
        Every rank calls it at the same step boundary.

        Example::

            stop, save_now = stop.requested(minutes_since_save >= 10)
        """
        return any_rank(self.received is not None, *more)

    def at_step_boundary(self, step: int) -> None:
        """Save and raise :class:`Preempted` when a stop was requested on any rank; else
        nothing. ``step``: the step just finished (the saved state's)."""
        (stop,) = self.requested()
        if not stop:
            return
        if self.save is None:
            raise ConfigError(
                "this SignalStop has no save function; give SignalStop(save=...) or save "
                "yourself when stop.requested()[0] is True"
            )
        path = Path(self.save())
        preempted = Preempted(self.received, step, path)
        world = current_world()
        rank = f"rank {world.rank}: " if world.distributed else ""
        os.write(2, f"memfit: {rank}{preempted}\n".encode())
        raise preempted


def saving_stop(
    save: Callable[..., Path],
    path: str | Path,
    extra: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    signals: Iterable[int] | None = None,
) -> SignalStop:
    """A :class:`SignalStop`, not yet installed, whose stop calls ``save(path, extra=...)``
    with ``extra``, or with what ``extra()`` returns then (e.g. a data loader's position,
    read at the stop, not now). ``signals``: None for :data:`STOP_SIGNALS`.

    Example::

        stop = saving_stop(engine.save, "run/last.pt", extra=lambda: {"epoch": epoch})
        with stop:                                   # installs it; leaving restores
            ...
    """

    def save_now() -> Path:
        return save(path, extra=extra() if callable(extra) else extra)

    return SignalStop(save_now, STOP_SIGNALS if signals is None else signals)
