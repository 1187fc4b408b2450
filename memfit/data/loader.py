"""A DataLoader whose place in its epochs is saved with the training state and restored
exactly: after a kill and a resume, the next batch is the one the uninterrupted run trained
on next.

:class:`ResumableLoader` wraps a ``torch.utils.data.DataLoader``. Its
:meth:`~ResumableLoader.state_dict` is the epoch, the batches of it given out, and what
makes the epoch's order: captured when the epoch began, so a resumed run makes the same
order again and skips what was trained. What the sampler must provide (checked when the
loader is wrapped):

* a ``state_dict()`` and ``load_state_dict()`` (e.g. torchdata's stateful samplers): the
  state at the epoch's start is saved and loaded back; or
* a ``set_epoch(epoch)`` whose order is a function of a seed and the epoch (e.g.
  ``DistributedSampler(dataset, seed=0)``): it is called at each epoch's start; or
* a ``torch.Generator`` (``DataLoader(..., shuffle=True, generator=g)``, or a
  ``RandomSampler``/``SubsetRandomSampler``/``WeightedRandomSampler`` given one): its state
  at the epoch's start is saved. A random sampler without one (``shuffle=True`` alone draws
  each epoch's order from torch's global generator, which a resume cannot rewind) is given
  ``torch.Generator().manual_seed(seed)``; or
* no randomness (``SequentialSampler``, ``shuffle=False``).

An ``IterableDataset`` must repeat its epoch's order given ``set_epoch(epoch)`` (called when
present) or always; it is resumed by replaying the epoch's first batches.

The skipped batches of a map-style dataset are skipped by their indices (nothing is
loaded). With ``num_workers > 0`` a resumed epoch then hands its batches to other workers
than the uninterrupted one did: a dataset whose transforms draw from the worker's random
generator gets other random draws. For bitwise-equal batches there, draw augmentations
from a generator seeded by the sample index and epoch, or pass ``replay=True`` (the
skipped batches are loaded again, through the same workers in the same order).

Making an epoch's iterator never draws from torch's global random generator (the
DataLoader's worker seed comes from its own ``generator``, or from ``(seed, epoch)``), so
the model's random stream (dropout) is the same whether or not the run was resumed.

Example::

    loader = ResumableLoader(DataLoader(dataset, batch_size=32, shuffle=True,
                                        generator=torch.Generator().manual_seed(0)))
    if resuming:
        loader.load_state_dict(engine.extra["data"])
    with engine.stop_on_signal(path, extra=lambda: {"data": loader.state_dict()}):
        while loader.epoch < epochs:
            for batch in loader:                 # the rest of the current epoch
                engine.train_step(batch, loss_fn)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from memfit.errors import ConfigError

#: DataLoader arguments a resumed epoch's loader copies (those that exist in this torch).
_LOADER_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "pin_memory_device",
    "in_order",
)


class _Skipping:
    """A batch sampler that gives its sampler's batches after the first ``skip``."""

    def __init__(self, batches: Any, skip: int) -> None:
        self.batches = batches
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.batches):
            if i >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.skip)


class ResumableLoader:
    """Iterate a DataLoader epoch by epoch, with the position saved and restored exactly
    (see the module docstring for what its sampler must provide).

    Iterating it gives the rest of the current epoch (all of it from the start); at the
    epoch's end :attr:`epoch` counts up. Save :meth:`state_dict` with the training state
    at a step boundary (``engine.save(path, extra={"data": loader.state_dict()})``);
    :meth:`load_state_dict` on a freshly built loader makes the next batch the one that
    followed.

    ``seed``: the seed of a generator given to a random sampler that has none, and of the
    worker seeds where the DataLoader has no ``generator``. ``replay``: resume an epoch by
    loading its first batches again instead of skipping their indices.

    Example::

        loader = ResumableLoader(DataLoader(ds, batch_size=8, shuffle=True,
                                            generator=torch.Generator().manual_seed(0)))
        for batch in loader: ...
        state = loader.state_dict()          # {"epoch": 1, "position": 0, ...}
    """

    def __init__(self, loader: DataLoader, seed: int = 0, replay: bool = False) -> None:
        if not isinstance(loader, DataLoader):
            raise ConfigError(
                f"ResumableLoader wraps a torch.utils.data.DataLoader, got "
                f"{type(loader).__name__}; build a DataLoader over your dataset"
            )
        self.loader = loader
        self.seed = int(seed)
        self.replay = bool(replay) or isinstance(loader.dataset, IterableDataset)
        self.epoch = 0
        """The current epoch (0-based); counts up when an epoch's iteration ends."""
        self.position = 0
        """Batches of the current epoch given out (and so trained, at a step boundary)."""
        self._order = self._order_source()
        self._start: dict[str, Any] | None = None  # the order's state at the epoch's start

    # ------------------------------------------------------------------ the order

    def _sampler(self) -> Any:
        """What decides the order: a custom batch sampler, else the sampler."""
        batches = self.loader.batch_sampler
        if batches is not None and not isinstance(batches, BatchSampler):
            return batches
        return self.loader.sampler

    def _order_source(self) -> str:
        """How an epoch's order is made again: ``state_dict``, ``set_epoch``,
        ``generator``, ``none`` or ``dataset`` (an IterableDataset); ConfigError when the
        sampler gives no way."""
        if isinstance(self.loader.dataset, IterableDataset):
            return "dataset"
        sampler = self._sampler()
        if callable(getattr(sampler, "state_dict", None)) and callable(
            getattr(sampler, "load_state_dict", None)
        ):
            return "state_dict"
        if callable(getattr(sampler, "set_epoch", None)):
            return "set_epoch"
        if hasattr(sampler, "generator"):
            if sampler.generator is None:
                # shuffle=True alone: each epoch's order would come from torch's global
                # generator, which a resumed run cannot rewind.
                sampler.generator = torch.Generator().manual_seed(self.seed)
            if not isinstance(sampler.generator, torch.Generator):
                raise ConfigError(
                    f"the DataLoader's {type(sampler).__name__} has generator="
                    f"{sampler.generator!r}; give it a torch.Generator so its order can be "
                    "made again on resume"
                )
            return "generator"
        if isinstance(sampler, SequentialSampler):
            return "none"
        raise ConfigError(
            f"the DataLoader's sampler {type(sampler).__name__} gives no way to make an "
            "epoch's order again on resume: give it state_dict()/load_state_dict(), or "
            "set_epoch(epoch) with a seed (as DistributedSampler has), or a torch.Generator "
            "(DataLoader(..., generator=torch.Generator().manual_seed(0)))"
        )

    def _generators(self) -> dict[str, torch.Generator]:
        """The generators an epoch's iterator draws from: the DataLoader's (worker seeds,
        and the order under shuffle=True) and the sampler's, once each."""
        found: dict[str, torch.Generator] = {}
        if isinstance(self.loader.generator, torch.Generator):
            found["loader"] = self.loader.generator
        sampler_gen = getattr(self._sampler(), "generator", None)
        if isinstance(sampler_gen, torch.Generator) and sampler_gen is not self.loader.generator:
            found["sampler"] = sampler_gen
        return found

    def _capture(self) -> dict[str, Any]:
        """The state that makes this epoch's order, before its iterator draws anything."""
        start: dict[str, Any] = {name: g.get_state() for name, g in self._generators().items()}
        if self._order == "state_dict":
            start["sampler"] = self._sampler().state_dict()
        return start

    def _restore(self, start: dict[str, Any]) -> None:
        for name, g in self._generators().items():
            if name in start:
                g.set_state(start[name])
        if self._order == "state_dict" and "sampler" in start:
            self._sampler().load_state_dict(start["sampler"])

    def _set_epoch(self) -> None:
        for owner in (self._sampler(), self.loader.dataset):
            set_epoch = getattr(owner, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)

    def _iterator(self, skip: int) -> Iterator[Any]:
        """The epoch's batches after the first ``skip``, its iterator made without
        drawing from torch's global generator."""
        loader = self.loader
        if skip and not self.replay and loader.batch_sampler is not None:
            kwargs = {k: getattr(loader, k) for k in _LOADER_ARGS if hasattr(loader, k)}
            if not kwargs.get("num_workers"):
                kwargs.pop("prefetch_factor", None)
            loader = DataLoader(
                loader.dataset, batch_sampler=_Skipping(loader.batch_sampler, skip), **kwargs
            )
            skip = 0
        with torch.random.fork_rng(devices=[]):
            # The worker seed of a DataLoader without a generator: from (seed, epoch).
            torch.default_generator.manual_seed(self.seed * 1_000_003 + self.epoch)
            iterator = iter(loader)
        for _ in range(skip):  # replay: the same batches through the same workers
            next(iterator)
        return iterator

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        self._set_epoch()
        if self._start is None:  # a new epoch: its order's state, before anything draws
            self._start = self._capture()
        else:  # a loaded position: the epoch's order made again
            self._restore(self._start)
        for batch in self._iterator(self.position):
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0
        self._start = None

    def __len__(self) -> int:
        """Batches in an epoch (the DataLoader's length)."""
        return len(self.loader)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The position to save with the training state: epoch, batches given out of it,
        and the state its order was made from (plain values and tensors, which
        ``Engine.save`` stores and ``torch.load(weights_only=True)`` reads).

        Example::

            engine.save(path, extra={"data": loader.state_dict()})
        """
        # Between epochs the next one's order starts from the state as it is now.
        start = self._start if self._start is not None else self._capture()
        return {
            "epoch": self.epoch,
            "position": self.position,
            "order": self._order,
            "start": start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next batch is the one after the last
        one given out when it was taken. ConfigError when it was saved with another kind
        of sampler."""
        if state.get("order") != self._order:
            raise ConfigError(
                f"the saved data position was made with a sampler ordered by "
                f"{state.get('order')!r}, this loader's is ordered by {self._order!r}; build "
                "the DataLoader as the saved run did"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._start = state["start"]
