"""Per-layer costs of a Keras model, for memfit's solver: :func:`profile`, :func:`measure_step`.

The units are the operations of a Sequential or Functional model's graph, in the order it
runs them (layers, and ops such as ``x + y`` written on symbolic tensors). Each is run
eagerly once, on the example batch, to measure:

* output bytes (by shape and compute dtype) and input bytes;
* what it keeps for backward, as far as TensorFlow lets it be seen: the bytes its
  ``tf.GradientTape`` record holds once the layer's output and a private copy of its input
  are released, read from TensorFlow's CPU allocator (:mod:`memfit.keras.memory`, refused
  with a ConfigError where it does not count every tensor); whether it keeps its input and
  its output is seen by releasing each in turn;
* parameter bytes, and the forward time (the median of eager runs).

When the graph is a chain (one tensor from each unit to the next), consecutive units can
form a segment; otherwise each unit is recomputed alone. Units holding random state
(dropout, noise, random augmentation) cannot be recomputed: ``keras.remat`` replays no
random state, so a rebuild would draw new masks; ``allow_random=True`` lets them in.
Every variable (weights, moving statistics, seeds) is as before when profiling ends.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memfit.allocator import collection_paused
from memfit.checkpoint.costs import UnitCost
from memfit.errors import ConfigError
from memfit.keras.backend import keras, tensorflow
from memfit.keras.memory import AllocatorMeter, allocator_meter
from memfit.keras.policy import precision_of

__all__ = [
    "KerasProfile",
    "LayerCost",
    "StepMeasurement",
    "is_random",
    "measure_step",
    "model_graph",
    "profile",
]

RANDOM_LAYERS = tuple(
    getattr(keras.layers, name)
    for name in (
        "Dropout",
        "SpatialDropout1D",
        "SpatialDropout2D",
        "SpatialDropout3D",
        "GaussianDropout",
        "GaussianNoise",
        "AlphaDropout",
    )
    if hasattr(keras.layers, name)
)

LossArg = str | Callable[..., Any] | keras.losses.Loss


@dataclass
class LayerCost:
    """What one unit costs, measured on the example batch."""

    name: str
    """The operation's name (a layer's ``name``)."""
    class_name: str
    """Its class."""
    input_bytes: float
    """Bytes of the tensors it receives."""
    output_bytes: float
    """Bytes of the tensors it returns."""
    saved_bytes: float
    """Bytes its tape record holds beyond its input (its output included, when kept)."""
    input_saved: bool
    """Whether its tape record holds its input."""
    output_saved: bool
    """Whether its tape record holds its output."""
    param_bytes: float
    """Bytes of its trainable variables."""
    fwd_seconds: float
    """Median eager forward time."""
    random: bool
    """Whether it draws random numbers in training (dropout, noise)."""
    shared: bool = False
    """Whether the graph calls it more than once."""
    keywords: bool = False
    """Whether the graph passes it keyword arguments (a piece would not: never recomputed)."""
    backward_hold_bytes: float = 0.0
    """The most its backward allocates above what its forward left, less its parameters'
    gradients: the gradient coming in, the input's gradient, temporaries."""


@dataclass
class KerasProfile:
    """A Keras model's costs: the cost tree for the solver and the step's fixed memory."""

    root: UnitCost
    """The model as a tree of units (its operations, in run order)."""
    layers: list[LayerCost]
    """Each unit's measured costs."""
    chain: bool
    """Whether the units form a chain (segments of consecutive units allowed)."""
    precision: str
    """memfit's precision mode the model computes in (from its layers' policies)."""
    param_bytes: float
    """Every variable of the model (weights and statistics)."""
    grad_bytes: float
    """The trainable variables' gradients."""
    optimizer_bytes: float
    """The optimizer's state (0 without an optimizer)."""
    batch_bytes: float
    """The example batch, inputs and targets."""
    loss_bytes: float
    """What the loss holds at the end of forward: the outputs and what it keeps."""
    structure: list[tuple[str, str]] = field(default_factory=list)
    """(unit name, class name) pairs: the fingerprint a plan checks."""

    @property
    def static_bytes(self) -> float:
        """What the whole step holds that no plan changes: variables, optimizer state and
        the batch (gradients arrive in backward, counted per unit)."""
        return self.param_bytes + self.optimizer_bytes + self.batch_bytes

    @property
    def optimizer_phase_bytes(self) -> float:
        """What the optimizer step holds: variables, all gradients, its state, the batch."""
        return self.static_bytes + self.grad_bytes


@dataclass(frozen=True)
class StepMeasurement:
    """One training step's memory as TensorFlow's CPU allocator counts it."""

    peak_bytes: float
    """The step's peak, counted as the prediction counts it: the most allocated during the
    step above what was allocated before it, plus the variables, optimizer state and batch
    (which were allocated before it)."""
    allocated_peak_bytes: float
    """The allocator's own peak during the step (every tensor of the process)."""
    baseline_bytes: float
    """What the allocator held when the step began."""


# ---------------------------------------------------------------------- the graph


@dataclass
class Graph:
    """The units of a supported model and how to run it with each unit's call wrapped."""

    units: list[Any]
    """The operations, in run order (no input layers)."""
    functional: Any
    """The Functional graph the model runs (a Sequential's own)."""


def model_graph(model: Any, x: Any = None) -> Graph:
    """The units of a Sequential or Functional ``model`` (a Sequential is built on ``x``
    first when it has no input shape yet); a ConfigError for a model whose layers cannot
    be walked.

    Example::

        [u.name for u in model_graph(model).units]   # ["embedding", "block_0", ...]
    """
    from keras.src.models.functional import Functional

    if isinstance(model, keras.Sequential):
        if getattr(model, "_functional", None) is None:
            if x is None:
                raise ConfigError(
                    f"the Sequential model {model.name!r} is not built; give it an Input or "
                    "build it (model.build(shape)) first"
                )
            model(x)
        functional = model._functional
        if functional is None:
            raise ConfigError(
                f"the Sequential model {model.name!r} has no graph after building; start it "
                "with keras.Input(shape) so memfit can walk its layers"
            )
    elif isinstance(model, Functional):
        functional = model
    else:
        raise ConfigError(
            f"cannot walk the layers of {type(model).__name__}: it is a subclassed keras.Model, "
            "whose call() is Python code memfit cannot see into. memfit.keras supports "
            "keras.Sequential and Functional models (keras.Model(inputs, outputs)); a "
            "subclassed layer inside them (a Transformer block) is one unit. Build the model "
            "as a Functional one from its blocks."
        )
    units = [op for op in functional.operations if not isinstance(op, keras.layers.InputLayer)]
    if not units:
        raise ConfigError(f"model {model.name!r} has no layers to plan")
    return Graph(units, functional)


def is_random(layer: Any) -> bool:
    """Whether ``layer`` (or a layer inside it) draws random numbers in training: dropout
    and noise layers with a non-zero rate, and any layer holding a ``SeedGenerator``.

    Example::

        is_random(keras.layers.Dropout(0.1))   # True
        is_random(keras.layers.Dense(4))       # False
    """
    layers = [layer]
    if isinstance(layer, keras.layers.Layer):
        layers += list(layer._flatten_layers(include_self=False, recursive=True))
    for sub in layers:
        if isinstance(sub, RANDOM_LAYERS):
            rate = getattr(sub, "rate", getattr(sub, "stddev", 1.0))
            if rate:
                return True
            continue
        if any(isinstance(v, keras.random.SeedGenerator) for v in vars(sub).values()):
            return True
        if getattr(sub, "dropout", 0) and not isinstance(sub, keras.Model):
            return True  # MultiHeadAttention(dropout=...), recurrent layers
    return False


def _nbytes(value: Any) -> float:
    total = 0.0
    for t in keras.tree.flatten(value):
        if hasattr(t, "shape") and hasattr(t, "dtype"):
            size = int(np.prod(t.shape)) if len(t.shape) else 1
            total += size * np.dtype(keras.backend.standardize_dtype(t.dtype)).itemsize
    return total


def _variable_bytes(variables: Sequence[Any]) -> float:
    return float(sum(_nbytes(v) for v in variables))


def _call(op: Any, training: bool) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if "training" in getattr(op, "_call_context_args", {}):
            kwargs["training"] = training
        return op(*args, **kwargs)

    return run


def _optimizer_bytes(optimizer: Any, variables: Sequence[Any]) -> float:
    """The optimizer's state for ``variables``: its own variables when built, else those of
    a copy built for them (then dropped)."""
    if optimizer is None:
        return 0.0
    if not optimizer.built:
        optimizer = optimizer.__class__.from_config(optimizer.get_config())
        optimizer.build(variables)
    return _variable_bytes(optimizer.variables)


class _Restored:
    """Every variable of the model as it was when the block began (weights, moving
    statistics, seed generators' states)."""

    def __init__(self, variables: Sequence[Any]) -> None:
        self.variables = list(variables)

    def __enter__(self) -> _Restored:
        self.values = [keras.ops.copy(v.value) for v in self.variables]
        return self

    def __exit__(self, *exc: object) -> None:
        for v, value in zip(self.variables, self.values):
            v.assign(value)


def _loss_fn(loss: LossArg) -> Callable[[Any, Any], Any]:
    try:
        return keras.losses.get(loss)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"unknown loss {loss!r}: give a Keras loss name, a keras.losses.Loss or a "
            f"function (y_true, y_pred) -> loss ({exc})"
        ) from None


def profile(
    model: Any,
    x: Any,
    y: Any,
    loss: LossArg,
    optimizer: Any = None,
    *,
    allow_random: bool = False,
    repeats: int = 3,
) -> KerasProfile:
    """Measure each unit of ``model`` on the example batch ``(x, y)`` with ``loss``.

    ``optimizer``: the optimizer training will use (its state counts in the step's fixed
    memory). ``allow_random``: let units that draw random numbers be recomputed.
    ``repeats``: eager runs timed per unit (the median is kept).

    Example::

        prof = profile(model, x, y, "sparse_categorical_crossentropy")
        [(c.name, c.saved_bytes) for c in prof.layers]
    """
    tf = tensorflow("memfit.keras.profile")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an int >= 1, got {repeats!r}")
    meter = allocator_meter("memfit.keras.profile")
    loss_fn = _loss_fn(loss)
    graph = model_graph(model, x)
    x = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
    y = keras.tree.map_structure(keras.ops.convert_to_tensor, y)
    calls: dict[int, list[tuple[list[int], list[int]]]] = {}
    costs: dict[int, LayerCost] = {}
    with_kwargs: set[int] = set()  # units called with keyword arguments: a piece passes none

    def measured(op: Any) -> Callable[..., Any]:
        run = _call(op, training=True)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = run(*args, **kwargs)
            ins = [t for t in keras.tree.flatten((args, kwargs)) if tf.is_tensor(t)]
            outs = [t for t in keras.tree.flatten(out) if tf.is_tensor(t)]
            calls.setdefault(id(op), []).append(([id(t) for t in ins], [id(t) for t in outs]))
            if set(kwargs) - {"training"}:
                with_kwargs.add(id(op))
            if id(op) not in costs:
                costs[id(op)] = _measure_unit(tf, op, run, args, kwargs, out, meter, repeats)
            return out

        return call

    variables = list(model.variables)
    with _Restored(variables), collection_paused():
        graph.functional._run_through_graph(
            keras.tree.flatten(x) if isinstance(x, (list, tuple)) else [x],
            operation_fn=measured,
        )
        pred = model(x, training=True)
        alive: list[Any] = []  # each record alive while the next is taken, for the holes
        loss_saved = min(_loss_saved(tf, loss_fn, y, pred, meter, alive) for _ in range(3))
        loss_bytes = _nbytes(pred) + loss_saved
        del pred, alive
    chain = _is_chain(graph, calls, x)
    layers = []
    for op in graph.units:
        cost = costs.get(id(op))
        if cost is None:
            raise ConfigError(f"unit {op.name!r} did not run on the example batch")
        cost.shared = len(calls[id(op)]) > 1
        cost.keywords = id(op) in with_kwargs
        cost.random = is_random(op)
        layers.append(cost)
    root = _cost_tree(graph, layers, chain, allow_random)
    trainable = list(model.trainable_variables)
    grad_bytes = _variable_bytes(trainable)
    return KerasProfile(
        root=root,
        layers=layers,
        chain=chain,
        precision=precision_of(graph.units),
        param_bytes=_variable_bytes(variables),
        grad_bytes=grad_bytes,
        optimizer_bytes=_optimizer_bytes(optimizer, trainable),
        batch_bytes=_nbytes(x) + _nbytes(y),
        loss_bytes=max(0.0, loss_bytes),
        structure=[(op.name, type(op).__name__) for op in graph.units],
    )


def _measure_unit(
    tf: Any,
    op: Any,
    run: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    out: Any,
    meter: AllocatorMeter,
    repeats: int,
) -> LayerCost:
    input_bytes = _nbytes((args, kwargs))
    output_bytes = _nbytes(out)
    # TensorFlow's BFC allocator hands out a free block of up to twice the size asked for
    # whole, and counts all of it: a record taken among the holes the process left reads
    # up to half a tensor high per tensor. The holes that fit the unit's tensors are
    # filled first (kept until the unit is measured), and each record stays alive while
    # the next is taken, so that later records are cut from fresh memory.
    filled = _fill_holes(tf, meter, [*_sizes((args, kwargs)), *_sizes(out)])
    # Three times, keeping the smallest: a kernel's first run on a shape can allocate a
    # cache it keeps (oneDNN's scratchpad), which is not the record's.
    alive: list[Any] = []
    records = [_tape_record(tf, run, args, kwargs, meter, alive) for _ in range(3)]
    del alive
    held, out_freed, in_freed = min(records)
    input_saved = in_freed < input_bytes / 2
    output_saved = out_freed < output_bytes / 2
    # what the record holds, its copy of the input when kept, less that copy
    saved = max(0.0, held - (input_bytes if input_saved else 0.0))
    # Twice as well, for the same caches, and because the allocator counts the whole
    # process: a buffer another thread allocates meanwhile (a data pipeline's prefetch)
    # reads as the unit's, and never twice the same.
    # Each run's gradients stay alive while the next is taken, for the holes (above).
    alive: list[Any] = []
    hold = min(_backward_hold(tf, op, run, args, kwargs, meter, alive) for _ in range(3))
    del alive, filled
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run(*args, **kwargs)
        _ = keras.ops.convert_to_numpy(keras.tree.flatten(result)[0])  # wait for it
        seconds.append(time.perf_counter() - t0)
    return LayerCost(
        name=op.name,
        class_name=type(op).__name__,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        saved_bytes=saved,
        input_saved=input_saved,
        output_saved=output_saved,
        param_bytes=_variable_bytes(getattr(op, "trainable_variables", [])),
        fwd_seconds=statistics.median(seconds),
        random=False,
        backward_hold_bytes=hold,
    )


#: Tensors below this size are not worth filling holes for: a hole costs at most their size.
HOLE_MIN_BYTES = 64 * 1024
#: The BFC allocator's rounding, and the most fills tried per size.
_BFC_ROUND = 256
_MOST_FILLS = 4096


def _sizes(value: Any) -> list[int]:
    """Byte sizes of the tensors in ``value``."""
    return [int(_nbytes(t)) for t in keras.tree.flatten(value) if hasattr(t, "shape")]


def _fill_holes(tf: Any, meter: AllocatorMeter, sizes: Sequence[int]) -> list[Any]:
    """Tensors that fill the allocator's free blocks of one to two times each of ``sizes``
    (those of at least :data:`HOLE_MIN_BYTES`): one of each size is allocated until one
    is counted at its own size, which the allocator does only when no such block is left
    (it takes the smallest free block that fits). The caller keeps them while it measures."""
    filled: list[Any] = []
    for size in sorted({s for s in sizes if s >= HOLE_MIN_BYTES}):
        exact = -(-size // _BFC_ROUND) * _BFC_ROUND
        for _ in range(_MOST_FILLS):
            before = meter.current()
            block = tf.zeros([size], tf.uint8)
            filled.append(block)
            if meter.current() - before < exact + 2 * _BFC_ROUND:
                break
    return filled


def _tape_record(
    tf: Any,
    run: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    meter: AllocatorMeter,
    alive: list[Any],
) -> tuple[float, float, float]:
    """(bytes a tape record of the call holds, bytes freed with its output, bytes freed
    with its input): the call runs on a private copy of the inputs under a tape, then the
    output and the copy are released one at a time while the tape lives. The tape is
    appended to ``alive``, which keeps the record until the caller drops it."""
    start = meter.current()
    copies_args, copies_kwargs = keras.tree.map_structure(
        lambda t: tf.identity(t) + tf.zeros((), t.dtype) if tf.is_tensor(t) else t,
        (args, kwargs),
    )
    with tf.GradientTape() as tape:
        for t in keras.tree.flatten((copies_args, copies_kwargs)):
            if tf.is_tensor(t) and t.dtype.is_floating:
                tape.watch(t)
        result = run(*copies_args, **copies_kwargs)
    # The record outlives the block while the tape object lives.
    with_output = meter.current()
    del result
    without_output = meter.current()
    del copies_args, copies_kwargs
    without_input = meter.current()
    alive.append(tape)
    return without_input - start, with_output - without_output, without_output - without_input


def _backward_hold(
    tf: Any,
    op: Any,
    run: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    meter: AllocatorMeter,
    alive: list[Any],
) -> float:
    """The most the unit's backward allocates above what forward left (its saved tensors,
    output and input): the incoming gradient, the input's gradient and temporaries; the
    parameter gradients are left out (the solver counts them). The gradients are appended
    to ``alive``, which keeps them until the caller drops it."""
    copies = keras.tree.map_structure(
        lambda t: tf.identity(t) + tf.zeros((), t.dtype) if tf.is_tensor(t) else t, (args, kwargs)
    )
    sources = [t for t in keras.tree.flatten(copies) if tf.is_tensor(t) and t.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(sources)
        out = run(*copies[0], **copies[1])
    outs = [t for t in keras.tree.flatten(out) if tf.is_tensor(t) and t.dtype.is_floating]
    variables = list(getattr(op, "trainable_variables", []))
    if not outs or not (sources or variables):
        return 0.0
    seeds = [tf.ones_like(t) for t in outs]
    meter.reset_peak()
    before = meter.current()
    grads = tape.gradient(outs, sources + variables, output_gradients=seeds)
    peak = meter.peak()
    alive.append(grads)
    del tape, out, outs, seeds
    return max(0.0, peak - before - _variable_bytes(variables))


def _loss_saved(
    tf: Any, loss_fn: Callable, y: Any, pred: Any, meter: AllocatorMeter, alive: list[Any]
) -> float:
    """What the loss's tape record holds beyond the prediction and the loss value; the
    record is appended to ``alive``, which keeps it until the caller drops it."""
    copy = keras.tree.map_structure(lambda t: tf.identity(t) + tf.zeros((), t.dtype), pred)
    start = meter.current()
    with tf.GradientTape() as tape:
        keras.tree.map_structure(tape.watch, copy)
        value = loss_fn(y, copy)
    del value
    held = meter.current() - start
    alive.append(tape)
    return max(0.0, held)


def _is_chain(graph: Graph, calls: dict[int, list], x: Any) -> bool:
    """One input, each unit called once on the previous unit's only output, the model's
    output the last unit's, and no unit's output used by another but the next."""
    inputs = [id(t) for t in (keras.tree.flatten(x) if isinstance(x, (list, tuple)) else [x])]
    if len(inputs) != 1:
        return False
    previous = inputs
    for op in graph.units:
        seen = calls.get(id(op), [])
        if len(seen) != 1:
            return False
        ins, outs = seen[0]
        if ins != previous or len(outs) != 1:
            return False
        previous = outs
    return len(graph.functional.outputs) == 1


def _cost_tree(graph: Graph, layers: list[LayerCost], chain: bool, allow_random: bool) -> UnitCost:
    units: list[UnitCost] = []
    later_grads = [0.0] * (len(layers) + 1)
    for i in range(len(layers) - 1, -1, -1):
        later_grads[i] = later_grads[i + 1] + layers[i].param_bytes
    for i, cost in enumerate(layers):
        # What the unit before keeps of this unit's input (the first unit's input is the
        # batch, held all step): a checkpoint here keeps nothing new for it.
        before_keeps = i == 0 or (chain and layers[i - 1].output_saved)
        own = cost.saved_bytes
        if cost.input_saved and not before_keeps:
            own += cost.input_bytes  # this unit alone holds it for backward
        units.append(
            UnitCost(
                name=cost.name,
                fwd_seconds=cost.fwd_seconds,
                bwd_seconds=2 * cost.fwd_seconds,
                own_saved_bytes=own,
                input_bytes=cost.input_bytes,
                output_bytes=cost.output_bytes,
                can_recompute=not (cost.shared or cost.keywords)
                and (allow_random or not cost.random),
                can_select=False,
                input_saved_by_previous_bytes=cost.input_bytes if before_keeps else 0.0,
                input_saved_bytes=cost.input_bytes if cost.input_saved else 0.0,
                input_saved_by_both_bytes=cost.input_bytes
                if cost.input_saved and before_keeps
                else 0.0,
                grads_from_bytes=later_grads[i],
                # tf.recompute_grad runs the whole piece again, its output included, and
                # holds it until the piece's backward is done (torch stops early instead).
                recompute_extra_bytes=0.0 if cost.output_saved else cost.output_bytes,
                backward_peak_bytes=cost.backward_hold_bytes,
                backward_hold_bytes=cost.backward_hold_bytes,
            )
        )
    return UnitCost(
        name="",
        children=units,
        sequential=chain,
        fwd_seconds=sum(u.fwd_seconds for u in units),
        bwd_seconds=sum(u.bwd_seconds for u in units),
        input_bytes=layers[0].input_bytes,
        output_bytes=layers[-1].output_bytes,
    )


def measure_step(
    model: Any, x: Any, y: Any, loss: LossArg, optimizer: Any = None, *, compiled: bool = False
) -> StepMeasurement:
    """Run one training step of ``model`` on ``(x, y)`` (forward, backward, and the
    optimizer's update when ``optimizer`` is given) and read its peak from TensorFlow's CPU
    allocator; every variable is put back afterwards. A ConfigError with the remedy where
    that allocator does not count every tensor (:mod:`memfit.keras.memory`).

    Eagerly by default, as the profile measures (the plan's prediction is of this step).
    ``compiled=True`` runs it as a ``tf.function``, as ``model.fit`` does: TensorFlow's
    graph frees activations sooner, so its peak is lower than the eager one. Either way the
    step runs once before the measured run (traced there when compiled).

    Example::

        m = measure_step(model, x, y, "mse", optimizer)
        m.peak_bytes   # comparable with plan.predicted_peak_bytes
    """
    tf = tensorflow("memfit.keras.measure_step")
    meter = allocator_meter("memfit.keras.measure_step")
    loss_fn = _loss_fn(loss)
    x = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
    y = keras.tree.map_structure(keras.ops.convert_to_tensor, y)
    trainable = list(model.trainable_variables)
    if optimizer is not None and not optimizer.built:
        optimizer.build(trainable)

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
            if optimizer is not None and hasattr(optimizer, "scale_loss"):
                value = optimizer.scale_loss(value)
        grads = tape.gradient(value, trainable)
        del tape
        if optimizer is not None:
            optimizer.apply(grads, trainable)
        # Returned, so that a tf.function keeps the whole step (it prunes what no output
        # or state needs).
        return value, grads

    run = tf.function(step) if compiled else step
    everything = list(model.variables) + (list(optimizer.variables) if optimizer else [])
    with _Restored(everything):
        # A first run, not measured: traced there when compiled, and, eager or not, what
        # runs allocate once (TensorFlow's and its kernels' caches) is made there, so the
        # measured run is the same whatever ran in the process before.
        run(x, y)
        with collection_paused():
            meter.reset_peak()
            baseline = meter.current()
            run(x, y)
            peak = meter.peak()
    static = (
        _variable_bytes(model.variables)
        + (_variable_bytes(optimizer.variables) if optimizer else 0.0)
        + _nbytes(x)
        + _nbytes(y)
    )
    return StepMeasurement(peak - baseline + static, peak, baseline)
