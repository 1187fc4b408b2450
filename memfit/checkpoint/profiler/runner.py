"""Running a profiled step: one forward and backward with a recorder attached, the model
left as it was found (:func:`preserved`), on fake tensors where the model is on the meta
device (:func:`fake_run`)."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.apply import suspended
from memfit.checkpoint.profiler.recorder import OpMode, Recorder
from memfit.checkpoint.recompute import stock_sequential
from memfit.checkpoint.tree import UnitTree, iter_override_class
from memfit.errors import PlanError
from memfit.nested import call_model, first_floating, map_tensors, tensors
from memfit.precision.policy import PrecisionPolicy

__all__ = [
    "backward_writes",
    "collector_paused",
    "default_loss",
    "fake_run",
    "grads_set_aside",
    "is_fake",
    "preserved",
    "run_step",
]


def default_loss(output: Any) -> torch.Tensor:
    """The sum of the first floating-point tensor in the model's output."""
    t = first_floating(output)
    if t is None:
        raise PlanError("the model's output holds no floating-point tensor; pass loss_fn")
    if not t.requires_grad:
        raise PlanError(
            "the first floating-point tensor of the model's output does not require "
            "grad, so the default loss cannot backpropagate; pass loss_fn"
        )
    return t.float().sum()


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``FakeTensor``."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _probe_iter(self: nn.Module) -> Iterator[nn.Module]:
    marks = self.__dict__.get("_memfit_iterated")
    if marks is not None:
        marks.append(True)
    return iter(self._modules.values())


def run_step(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    policy: PrecisionPolicy,
    device_type: str,
    rec: Recorder,
    tree: UnitTree,
    *,
    forward_only: bool = False,
    wrap: Callable[[Callable[[], Any]], Any] | None = None,
) -> tuple[Any, float]:
    """One forward + backward with ``rec`` attached; returns (output, backward seconds).
    ``forward_only``: stop after the model's forward (backward seconds 0); ``wrap``: runs
    the model's forward, given as a function of no arguments (as a checkpointed piece)."""
    handles = []
    swapped: list[tuple[nn.Module, type]] = []
    try:
        for unit in tree:
            m = unit.module
            handles.append(m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True))
            handles.append(
                m.register_forward_hook(rec.post_hook, with_kwargs=True, always_call=True)
            )
            if rec.full and unit.is_chain and not stock_sequential(m):
                rec.iterated[unit.name] = []
                m.__dict__["_memfit_iterated"] = rec.iterated[unit.name]
                swapped.append((m, type(m)))
                m.__class__ = iter_override_class(type(m), _probe_iter)
        modes = contextlib.ExitStack()
        with modes:
            if rec.full:
                modes.enter_context(OpMode(rec))
                modes.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t))
            elif not rec.sync:
                # Where the last saved tensor of each unit comes, timed: its tail is the rest.
                modes.enter_context(
                    torch.autograd.graph.saved_tensors_hooks(rec.pack_time, lambda t: t)
                )
            rec.phase = "fwd"
            with policy.autocast(device_type):
                run = functools.partial(call_model, model, inputs)
                output = run() if wrap is None else wrap(run)
                if forward_only:
                    return output, 0.0
                rec.phase = "loss"
                loss = loss_fn(output)
            rec.note_retained((output, loss))  # autocast's weight copies are freed by now
            if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
                raise PlanError(
                    "the loss does not depend on the model's parameters through autograd "
                    "(no grad_fn); pass a loss_fn that returns a differentiable scalar"
                )
            handles.extend(rec.hook_graph([loss.grad_fn]))
            if rec.full:  # each gradient's moment, for a loop that releases it there
                trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
                rec.param_names = {id(p): n for n, p in trained}
                handles.extend(
                    p.register_post_accumulate_grad_hook(rec.grad_accumulated) for _, p in trained
                )
            rec.phase = "bwd"
            t0 = rec.now()
            loss.backward()
            t1 = rec.now()
            rec.phase = None
        if not rec.full:
            events = rec.bwd_events + [(t1, None)]
            for (t, owner), (t_next, _) in zip(events, events[1:]):
                if owner is not None:
                    rec.stats[owner].backward_own_seconds += t_next - t
        return output, t1 - t0
    finally:
        rec.phase = None
        for h in handles:
            h.remove()
        for m, cls in swapped:
            m.__class__ = cls
            m.__dict__.pop("_memfit_iterated", None)


@contextlib.contextmanager
def collector_paused(paused: bool) -> Iterator[None]:
    """Python's cycle collector off inside the block when ``paused``. A step on fake
    tensors makes hundreds of thousands of small Python objects (every op's fake outputs,
    hooks, handles), and the collections they set off, each walking every live object,
    take about a tenth of its time; what cycles it leaves are collected afterwards.

    Example::

        with collector_paused(fake_mode is not None):
            output, bwd_seconds = run_step(model, inputs, loss_fn, policy, "cpu", rec, tree)
    """
    enabled = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused and enabled:
            gc.enable()


def backward_writes(model: nn.Module, stepped: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Every tensor a backward of ``model`` writes a gradient into, once each: its
    parameters and ``stepped``, what the optimizer steps (in an Engine's ``*-master`` model
    the fp32 masters, which the working weights' hooks accumulate into). What
    :func:`grads_set_aside` must be given.

    Example::

        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        with grads_set_aside(backward_writes(model, stepped)):
            loss_fn(model, batch).backward()
    """
    return list({id(t): t for t in [*model.parameters(), *stepped]}.values())


@contextlib.contextmanager
def grads_set_aside(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Each of ``tensors`` without its ``.grad`` inside the block, and with the same one
    again after it, whatever backward passes ran in between: a user's gradients (a
    micro-batch's, or a step's not yet applied) are neither summed into nor freed by the
    runs memfit makes to measure a model. Every tensor a backward writes into must be
    named: the parameters and, in the ``*-master`` modes, the fp32 masters the working
    weights' hooks accumulate into.

    Example::

        with grads_set_aside([*model.parameters(), *optimizer_tensors(opt)]):
            loss_fn(model, batch).backward()   # model.parameters()' grads unchanged after
    """
    named = list({id(t): t for t in tensors}.values())
    grads = [t.grad for t in named]
    try:
        for t in named:
            t.grad = None
        yield
    finally:
        for t, g in zip(named, grads):
            t.grad = g


@contextlib.contextmanager
def preserved(model: nn.Module, train: bool | None, rng_devices: list[int]) -> Iterator[None]:
    """Leave the model's modes, buffers, grads, plan and the RNG as they were."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [
        (m, name, buf, buf.detach().clone())
        for m in model.modules()
        for name, buf in m._buffers.items()
        if buf is not None
    ]
    with suspended(model), grads_set_aside(model.parameters()):
        try:
            if train:
                model.train()
            with torch.random.fork_rng(devices=rng_devices, device_type="cuda"):
                yield
        finally:
            with torch.no_grad():
                for m, name, buf, value in buffers:
                    m._buffers[name] = buf
                    buf.copy_(value)
            for m, mode in modes:
                m.training = mode


@contextlib.contextmanager
def fake_run(
    model: nn.Module, inputs: Any, fake_device: str | None
) -> Iterator[tuple[Any, Any, torch.device]]:
    """Yield (inputs, fake mode or None, device) to run the step with.

    Meta tensors cannot autocast or hold values; they are swapped for fake tensors on a
    real device type for the duration of the step, and put back afterwards.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    every = [*model.parameters(), *model.buffers(), *tensors(inputs)]
    fake = next((t for t in every if is_fake(t)), None)
    if fake is not None:
        with fake.fake_mode:
            yield inputs, fake.fake_mode, fake.device
        return
    if not any(t.device.type == "meta" for t in every):
        device = every[0].device if every else torch.device("cpu")
        yield inputs, None, device
        return

    dev = torch.device(fake_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            with mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
            memo[id(t)] = f
        return memo[id(t)]

    originals: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for m in model.modules():
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is not None:
                        originals.append((table, name, t))
                        table[name] = to_fake(t)
        fake_inputs = map_tensors(inputs, to_fake)
        with mode:
            yield fake_inputs, mode, dev
    finally:
        for table, name, t in originals:
            table[name] = t
