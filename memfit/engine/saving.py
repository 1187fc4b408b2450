"""The Engine's saved state: save, load, resume, export, and saving on a preemption signal.

:class:`SavingStage` is the part of :class:`~memfit.engine.core.Engine` that writes and
reads its state (a base class of the Engine, kept in its own module; it imports nothing of
the core). What a state holds and how it is written and checked lives in
:mod:`memfit.engine.state`, the model's plain weights in :mod:`memfit.engine.export`, the
signal handling in :mod:`memfit.engine.preemption`; the methods here hand them the
Engine's objects and set the counters they return.

Example::

    engine.save("run/last.pt", extra={"epoch": 3})
    engine = memfit.Engine.resume("run/last.pt", build_model(), build_optimizer())
    engine.export("run/model.pt")   # the fp32 weights, for torch.load(weights_only=True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from memfit.engine.export import export_model, model_state_dict
from memfit.engine.settings import EngineSettings
from memfit.engine.state import (
    LoadedState,
    StepCounters,
    TrainingObjects,
    engine_state,
    load_engine_state,
    load_state,
    read_resume_point,
    save_state,
)
from memfit.errors import ConfigError

if TYPE_CHECKING:
    from memfit.engine.data_parallel import EngineParallel
    from memfit.precision.master import MasterWeights
    from memfit.precision.scaler import LossScaler

#: The class ``resume`` is called on (the Engine): it returns one of those.
_Stage = TypeVar("_Stage", bound="SavingStage")


class SavingStage:
    """The Engine's methods that save and load its state (see the module docstring); the
    Engine sets every attribute below in its ``__init__`` and provides ``applied_steps``
    and ``_discard_window``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    master: MasterWeights | None
    lr_scheduler: Any
    settings: EngineSettings
    parallel: EngineParallel | None
    plan: Any
    steps: int
    micro_steps: int
    extra: dict[str, Any]
    _applied_steps: torch.Tensor
    _last_loss: torch.Tensor | None
    _grad_norm: torch.Tensor | None
    _window: Any  # the feed.Window of micro-batches fed since the last step, or None
    _checkpoint_request: Any
    applied_steps: int
    _discard_window: Callable[[], None]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: weights, masters, optimizer, scaler, RNG, counters."""
        counters = StepCounters(self.steps, self.micro_steps, self.applied_steps)
        return engine_state(
            self._training_objects(), self.settings, counters, self.plan, self._checkpoint_request
        )

    def _training_objects(self) -> TrainingObjects:
        """The objects whose state the Engine's state holds (:mod:`memfit.engine.state`)."""
        kind = self.parallel.kind if self.parallel is not None else None
        objects = (self.model, self.optimizer, self.scaler, self.master, self.lr_scheduler)
        return TrainingObjects(*objects, parallel_kind=kind)

    def _take_loaded(self, loaded: LoadedState) -> None:
        """The counters and ``extra`` of a state just loaded into the training objects."""
        self.steps = loaded.counters.steps
        self.micro_steps = loaded.counters.micro_steps
        self._applied_steps.fill_(loaded.counters.applied_steps)
        self._last_loss = None
        self._grad_norm = None
        self.extra = loaded.extra

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write the training state atomically (temp file, fsync, rename). ``extra`` is saved as is.

        Between optimizer steps only: the gradients of micro-batches fed since the last
        :meth:`step` are not part of a saved state, so saving then is a ConfigError."""
        if self._window is not None:
            raise ConfigError(
                f"save() called while {self._window.count} micro-batch(es) fed with backward() "
                "wait for step(): their gradients would not be in the saved state; call "
                "engine.step() first"
            )
        state = self.state_dict()
        state["extra"] = extra or {}
        return save_state(self._training_objects(), state, path)

    def load(self, path: str | Path) -> None:
        """Load a state written by :meth:`save` into this Engine: weights, masters,
        optimizer, scaler, LR scheduler, random generators, counters and ``extra``. Training
        on continues exactly as the saved run did (bitwise, as with :meth:`resume`).

        The saved state's ``precision`` and ``accumulation_steps`` must be this Engine's
        (ConfigError names the one that differs); the other settings and this Engine's
        checkpoint plan are kept (a plan changes what is recomputed, never a value).

        Example::

            engine.save("run/good.pt")
            ...                          # the loss diverges
            engine.load("run/good.pt")   # back to the saved step, same objects
        """
        self._take_loaded(load_state(self._training_objects(), self.settings, path))
        # Micro-batches fed before belong to a step the saved state replaces.
        self._discard_window()

    def model_state_dict(
        self, dtype: torch.dtype | None = torch.float32
    ) -> dict[str, torch.Tensor]:
        """The model's state dict with the fp32 master values in the ``*-master`` modes,
        under ``model.state_dict()``'s keys, as new tensors that share no storage with
        training; it loads with ``strict=True`` into a freshly built model. ``dtype`` casts
        the floating-point tensors (``None``: each keeps its dtype, a master's being fp32).

        Example::

            fresh = build_model()
            fresh.load_state_dict(engine.model_state_dict())   # fp32, plain calls work
        """
        return model_state_dict(self.model, self.master, dtype)

    def export(self, path: str | Path, dtype: torch.dtype | None = torch.float32) -> Path:
        """Write :meth:`model_state_dict` atomically to ``path`` as a plain state dict for
        ``torch.load(path, weights_only=True)``; return the path.

        Example::

            engine.export("run/model.pt")
            fresh.load_state_dict(torch.load("run/model.pt", weights_only=True))
        """
        return export_model(self.model, self.master, path, dtype)

    @classmethod
    def resume(
        cls: type[_Stage],
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any = None,
        **overrides: Any,
    ) -> _Stage:
        """Rebuild an Engine from a checkpoint with its saved settings and every state.

        ``model`` and ``optimizer`` are freshly built the same way as for the saved run (to
        continue an Engine that exists, use :meth:`load`). ``overrides`` replace saved
        settings (e.g. ``log_every``, ``accumulation_steps``); ``checkpoint=`` replaces the
        saved plan. The saved ``extra`` dict is available as ``engine.extra``.

        Example::

            engine = memfit.Engine.resume("run/last.pt", build_model(), build_optimizer())
        """
        point = read_resume_point(path, optimizer, overrides)
        engine = cls(model, optimizer, lr_scheduler=lr_scheduler, **point.arguments)
        objects = engine._training_objects()
        engine._take_loaded(load_engine_state(objects, engine.settings, point.state, path))
        return engine

    _signal_stop: Any = None  # the SignalStop of stop_on_signal(), asked at each step's end

    def stop_on_signal(
        self,
        path: str | Path,
        extra: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
        signals: Sequence[int] | None = None,
    ) -> Any:
        """Save to ``path`` and stop at the end of the step during which SIGTERM or SIGINT
        came (:mod:`memfit.engine.preemption`): :meth:`step` then saves (``extra``, or what
        ``extra()`` returns then, e.g. a data loader's position) and raises
        :class:`~memfit.engine.preemption.Preempted`, a ``SystemExit`` with exit code 75.
        A second signal ends the process at once. Under torch.distributed every rank
        stops at the same step. Returns the installed
        :class:`~memfit.engine.preemption.SignalStop`; leaving it as a ``with`` block (or
        ``.uninstall()``) restores the previous handlers. Call it from the main thread.

        Example::

            with engine.stop_on_signal("run/last.pt", extra=lambda: {"data": loader.state_dict()}):
                for batch in loader:
                    engine.train_step(batch, loss_fn)
        """
        from memfit.engine.preemption import saving_stop

        if self._signal_stop is not None:
            self._signal_stop.uninstall()
        self._signal_stop = saving_stop(self.save, path, extra, signals)
        return self._signal_stop.install()
