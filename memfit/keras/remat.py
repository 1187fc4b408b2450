"""Checkpoint plans for Keras models: :func:`plan` and :func:`apply_plan`.

:func:`plan` profiles the model (:func:`memfit.keras.profile`), hands the cost tree to
memfit's own solver and returns a :class:`memfit.Plan`, the same object the PyTorch path
returns (summary, JSON, frontier). :func:`apply_plan` returns a new model, with the same
layers and weights, in which each recomputed piece (one unit, or a segment of consecutive
units of a chain) runs as one :class:`RematSegment` under ``keras.remat``
(``tf.recompute_grad`` on TensorFlow): its activations are dropped after forward and
rebuilt in backward. Keras fixes a layer's recompute when the model is built, so a plan is
applied by building a model, not by patching one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memfit.checkpoint.costs import KEEP, RECOMPUTE
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.solvers import FrontierPoint, plan_cost, solve
from memfit.checkpoint.solvers.frontier import pareto
from memfit.errors import BudgetError, ConfigError, PlanError
from memfit.keras.backend import keras
from memfit.keras.memory import allocator_meter
from memfit.keras.profiling import (
    KerasProfile,
    LossArg,
    _call,
    is_random,
    model_graph,
    profile,
)
from memfit.units import format_bytes, parse_bytes

__all__ = ["RESERVE", "RematSegment", "apply_plan", "plan", "pieces_of"]

#: The share of the budget kept free, as memfit's PyTorch planner keeps it.
RESERVE = 0.02

Budget = str | int | None


class RematSegment(keras.layers.Layer):
    """Consecutive units of a model run as one piece under ``keras.remat``: backward
    rebuilds what they saved from the piece's input instead of keeping it.

    The units are the model's own layer objects, so the weights are shared with it.

    Example::

        piece = RematSegment([dense_1, dense_2], name="remat_dense_1__dense_2")
        y = piece(x)   # as dense_2(dense_1(x)), its activations recomputed in backward
    """

    def __init__(self, units: Sequence[Any], unpack: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not units:
            raise ConfigError("a RematSegment needs at least one unit")
        self.units = list(units)
        # ``unpack``: the input is a list of the first unit's positional arguments (an add
        # of two branches in a graph that is not a chain).
        self.unpack = bool(unpack)
        # The piece passes its input through as it comes; each unit casts for itself.
        self._convert_input_args = False
        self.autocast = False

    def _run(self, inputs: Any, call: Any) -> Any:
        first, *rest = self.units
        x = call(first)(*inputs) if self.unpack else call(first)(inputs)
        for unit in rest:
            x = call(unit)(x)
        return x

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        def call(unit: Any) -> Any:
            return unit if training is None else _call(unit, training)

        return keras.remat(lambda x: self._run(x, call))(inputs)

    def compute_output_spec(self, inputs: Any, training: bool | None = None) -> Any:
        return self._run(inputs, lambda unit: unit.compute_output_spec)


def plan(
    model: Any,
    x: Any,
    y: Any,
    loss: LossArg,
    budget: Budget = None,
    strategy: str = "optimal",
    *,
    optimizer: Any = None,
    allow_random: bool = False,
    frontier: bool = True,
    profiled: KerasProfile | None = None,
) -> Plan:
    """Plan activation checkpointing of a Keras model for one training step on ``(x, y)``.

    ``budget``: the peak of the whole step ("64MiB", bytes, or None for no limit).
    ``strategy``: memfit's ("optimal", "full", "sqrt", "uniform", "uniform:k", "none").
    ``optimizer``: the optimizer training will use; its state counts in the fixed memory.
    ``allow_random``: let segments hold dropout and other random layers (their rebuild
    draws new masks, so gradients differ from the forward's). ``profiled``: the model's
    :func:`memfit.keras.profile` already made (e.g. with its times replaced by counted ones,
    :func:`memfit.checkpoint.costs.counted_times`, for a plan that does not depend on the
    machine's speed).

    Raises :class:`memfit.errors.BudgetError` when no plan fits the budget, and
    :class:`memfit.errors.ConfigError` for a model memfit cannot walk, a bad setting, or
    when TensorFlow's CPU allocator does not count every tensor (the message says what to
    set: ``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts).

    Example::

        plan = memfit.keras.plan(model, x, y, "sparse_categorical_crossentropy",
                                 budget="48MiB")
        print(plan.summary())
        model = memfit.keras.apply_plan(model, plan)
    """
    if budget is None:
        budget_bytes = None
    else:
        if isinstance(budget, float) and 0 < budget <= 1:
            raise ConfigError(
                f"budget {budget!r} is a fraction of device memory, which memfit.keras does "
                "not read; give bytes or a size such as '64MiB'"
            )
        budget_bytes = float(parse_bytes(budget))
    if profiled is None:
        # Checked here first so that the refusal names plan, the function the user called.
        allocator_meter("memfit.keras.plan")
    prof = profiled or profile(model, x, y, loss, optimizer, allow_random=allow_random)
    optimizer_phase = prof.optimizer_phase_bytes
    if budget_bytes is not None and optimizer_phase > budget_bytes:
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} is below what the optimizer step alone "
            f"holds, {format_bytes(optimizer_phase)} (variables, gradients, optimizer state "
            "and the batch): no checkpoint plan can fit it. Raise the budget, or use a "
            "smaller batch or optimizer state."
        )
    root, static, loss_bytes = prof.root, prof.static_bytes, prof.loss_bytes
    solution = solve(
        root, strategy, budget_bytes, static, loss_bytes, reserve=RESERVE, frontier=frontier
    )
    solution.budget_bytes = budget_bytes
    result = plan_cost(
        root, solution.decisions, solution.segments, static, loss_bytes, shared_inputs=True
    )
    solution.static_bytes = static
    solution.kept_bytes = result.kept_bytes
    solution.transient_bytes = result.transient_bytes
    solution.predicted_peak_bytes = max(result.peak_bytes, optimizer_phase)
    raised = [
        (max(p.peak_bytes, optimizer_phase), p.recompute_seconds, p.recompute_flops)
        for p in solution.frontier
    ]
    solution.frontier = [FrontierPoint(*p) for p in pareto(raised)]
    made = Plan.from_solution(
        solution, precision=prof.precision, structure=prof.structure, units_info=root
    )
    random = [c.name for c in prof.layers if c.random]
    if random and not allow_random:
        made.notes.append(
            f"never recomputed: {', '.join(random)}; they draw random numbers and a rebuild "
            "would draw new ones (plan(..., allow_random=True) lets them in)"
        )
    return made


def pieces_of(plan: Plan, names: Sequence[str]) -> list[tuple[int, int]]:
    """The plan's recomputed pieces as inclusive ranges of unit positions, in order.

    Example::

        pieces_of(plan, ["embedding", "block_0", "block_1", "head"])   # [(1, 2)]
    """
    index = {name: i for i, name in enumerate(names)}
    out: list[tuple[int, int]] = []
    for name, decision in plan.decisions.items():
        if decision == KEEP or name == "":
            continue
        if decision != RECOMPUTE:
            raise PlanError(
                f"unit {name!r}: decision {decision!r} has no Keras form; Keras recomputes "
                "whole layers ('recompute' or segments)"
            )
        if name not in index:
            raise PlanError(f"the plan recomputes {name!r}, which is not a unit of this model")
        out.append((index[name], index[name]))
    for owner, ranges in plan.segments.items():
        if owner != "":
            raise PlanError(f"the plan has segments inside {owner!r}; Keras units are not nested")
        out.extend((int(a), int(b)) for a, b in ranges)
    out.sort()
    for (_, b0), (a1, _) in zip(out, out[1:]):
        if a1 <= b0:
            raise PlanError(f"the plan's pieces overlap at unit #{a1} ({names[a1]!r})")
    if out and (out[0][0] < 0 or out[-1][1] >= len(names)):
        raise PlanError("the plan has a segment outside this model's units")
    return out


def apply_plan(model: Any, plan: Plan, *, allow_random: bool = False) -> Any:
    """A model with ``plan`` applied: the same layers and weights, each recomputed piece
    wrapped in a :class:`RematSegment`. ``model`` itself is not changed; a plan that
    recomputes nothing returns ``model``.

    Raises :class:`memfit.errors.PlanError` for a plan made for another model, and
    :class:`memfit.errors.ConfigError` for a piece holding a random layer (dropout,
    noise) unless ``allow_random``: ``keras.remat`` replays no random state, so the
    rebuild would draw new masks and the gradients would not be those of the forward.

    Example::

        planned = memfit.keras.apply_plan(model, plan)
        planned.compile(optimizer, loss)   # train the planned model; model shares its weights
    """
    if not isinstance(plan, Plan):
        raise ConfigError(f"apply_plan needs a memfit.Plan, got {type(plan).__name__}")
    graph = model_graph(model)
    names = [u.name for u in graph.units]
    plan.check_structure([(u.name, type(u).__name__) for u in graph.units])
    pieces = pieces_of(plan, names)
    if not pieces:
        return model
    if not allow_random:
        for a, b in pieces:
            drawn = [u.name for u in graph.units[a : b + 1] if is_random(u)]
            if drawn:
                raise ConfigError(
                    f"the plan recomputes {', '.join(drawn)}, which draw random numbers "
                    "(dropout, noise): keras.remat replays no random state, so the rebuild "
                    "would draw new masks and the gradients would not match the forward. "
                    "Plan again (memfit.keras.plan leaves them out), or pass "
                    "allow_random=True to accept it."
                )
    segments = {a: b for a, b in pieces}
    chained = any(b > a for a, b in pieces)
    wrapped = {}
    for a, b in pieces:
        members = graph.units[a : b + 1]
        label = members[0].name if a == b else f"{members[0].name}__{members[-1].name}"
        wrapped[a] = RematSegment(members, unpack=not chained, name=f"remat_{label}")
    functional = graph.functional
    inputs = [
        keras.Input(batch_shape=t.shape, dtype=t.dtype, name=f"{t.name}_planned")
        for t in functional.inputs
    ]
    if chained:
        if len(inputs) != 1 or len(functional.outputs) != 1:
            raise PlanError("segments of several units need a chain model (one input, one output)")
        x = inputs[0]
        i = 0
        while i < len(graph.units):
            if i in segments:
                x = wrapped[i](x)
                i = segments[i] + 1
            else:
                x = graph.units[i](x)
                i += 1
        outputs: Any = x
    else:
        by_op = {id(graph.units[a]): wrapped[a] for a in wrapped}

        def operation(op: Any) -> Any:
            piece = by_op.get(id(op))
            if piece is None:
                return op
            return lambda *args, **kwargs: piece(list(args))  # profile: no tensor kwargs

        outputs = functional._run_through_graph(inputs, operation_fn=operation)
    single = len(inputs) == 1
    return keras.Model(inputs[0] if single else inputs, outputs, name=f"{model.name}_planned")
