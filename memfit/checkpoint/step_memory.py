"""The memory of a training step that a checkpoint plan cannot change.

The budget is the peak of a whole training step (what ``memfit.measure`` reports). The part
checkpointing cannot change, the *static* bytes, is counted from the model and optimizer:

* parameters and buffers, as they are held (low-precision in the ``*-master`` modes);
* gradients of everything the optimizer updates (fp32 masters' gradients in the master
  modes, since the low-precision ones are freed as they arrive);
* optimizer state: measured if the optimizer already has state, else its known size
  (Adam/AdamW two fp32 buffers per parameter element and a step count per parameter,
  SGD with momentum and Adagrad one buffer; an optimizer made to keep its state in 8 bits
  or bf16 by :func:`memfit.precision.optimizer_state.low_bit_state`, that state's size);
* fp32 master weights in the master modes;
* during the optimizer step only: what the step allocates for itself (a ``foreach``
  optimizer's temporaries, about one parameter-sized tensor per group for AdamW), measured
  on a shadow optimizer over fake tensors;
* the step's inputs, and the activation gradient passed between units in backward;
* at the end of forward only: the model's output, what the loss saves, and the larger of
  autocast's 16-bit copies of fp32 weights (mixed modes) and the gradients the head of
  backward makes (the loss's, an LM head's, a loss computed inside the model).

**Per rank** (``layout=RankLayout("fsdp" | "ddp", world_size)``): under FSDP2 each rank
holds ``1/world_size`` of the parameters, gradients and optimizer state (the fp32 shards
are the masters of the ``*-master`` modes), and, gathered while they compute, the root's own
parameters (kept through the step) and two blocks' (one computing, one prefetched) in the
gathered dtype, plus one block's full fp32 gradients before they are reduce-scattered.
Under DDP the gradients live in its buckets from the first step on, so they are held
through the activation phase as with accumulation.

With gradient accumulation (``accumulation_steps > 1``) the gradients of the micro-batches
already run are held while the later ones run forward and backward: the last micro-batch
holds all of them from its first op on, so they count as held for the whole activation
phase instead of appearing one unit at a time as its backward makes them.

**Where the loop frees the gradients** (``zero_grad``): a loop that clears them after the
optimizer step or before the forward (``"before_forward"``: the Engine, the Hugging Face
Trainer, most plain loops) starts each forward without them. Lightning's automatic
optimization runs ``training_step`` first and ``zero_grad`` between it and the backward
(``"before_backward"``): the previous step's gradients are alive through the whole
forward, so the end of forward holds them too (``StepMemory.forward_grad_bytes``), and
backward does not. A loop that applies each update in backward and frees the gradient
at once (``"in_backward"``: ``Engine(release_gradients=True)``, :mod:`memfit.engine.release`)
never holds them all: a moment of backward holds the gradient of the tensor it updates
and its update's temporaries (``StepMemory.released_by_param``, at the moments the
profiled step accumulated each gradient: :attr:`UnitCost.release_levels`), and no
rebuild holds the gradients made before it.

:func:`static_bytes` counts the weights, buffers, gradients, masters and optimizer state
(:func:`optimizer_state_bytes`) for every caller: the step memory, the estimator's rows and
the capacity view. :meth:`RankLayout.of` makes the layout from the ``world_size`` and
``data_parallel`` arguments for planning, estimating and tuning alike.

Example::

    mem = step_memory(model, prof, PrecisionPolicy.of("bf16-mixed"), optimizer)
    mem.optimizer_phase_bytes   # what the optimizer step alone holds
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.optimizer_bytes import optimizer_state_bytes, optimizer_temp_bytes
from memfit.checkpoint.profiler import Profile
from memfit.checkpoint.released import released_tensors
from memfit.checkpoint.tree import outermost_blocks
from memfit.errors import ConfigError
from memfit.precision.policy import PrecisionPolicy

ZeroGrad = Literal["before_forward", "before_backward", "in_backward"]
"""Where a training loop frees the gradients (module docstring): of the last step, before
the forward or between forward and backward; or each one in backward, as soon as its
update is applied (``Engine(release_gradients=True)``)."""
ZERO_GRAD_ORDERS: tuple[str, ...] = get_args(ZeroGrad)


@dataclass(frozen=True)
class RankLayout:
    """How a data-parallel run spreads a step over ranks, for the per-rank memory.

    Example::

        step_memory(model, prof, policy, opt, layout=RankLayout("fsdp", 8))
    """

    kind: str | None = None
    """``"fsdp"``, ``"ddp"`` or None (one process)."""
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in (None, "ddp", "fsdp"):
            raise ConfigError(f"data_parallel must be 'ddp', 'fsdp' or None, got {self.kind!r}")
        if int(self.world_size) != self.world_size or self.world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {self.world_size!r}")

    @classmethod
    def of(cls, world_size: int = 1, data_parallel: str | None = None) -> RankLayout:
        """The layout of the ``world_size`` and ``data_parallel`` arguments that planning,
        estimating and tuning take: one process for ``world_size=1``; over more ranks
        ``data_parallel``, DDP when no kind is named (what ``memfit.parallelize`` and
        ``memfit train --nproc`` run by default). A kind without ranks to spread over,
        an unknown kind or a bad size is a ConfigError.

        Example::

            RankLayout.of(8)           # RankLayout(kind="ddp", world_size=8)
            RankLayout.of(8, "fsdp")   # RankLayout(kind="fsdp", world_size=8)
            RankLayout.of()            # one process
        """
        layout = cls(data_parallel, world_size)  # refuses an unknown kind or a bad size
        if data_parallel is not None and world_size == 1:
            raise ConfigError(
                f"data_parallel={data_parallel!r} needs world_size > 1 (the ranks it spreads the "
                "step over); give world_size, or drop data_parallel for one process"
            )
        if data_parallel is None and world_size > 1:
            return cls("ddp", world_size)
        return layout


@dataclass(frozen=True)
class StaticBytes:
    """What a training step holds whatever the plan, on one rank (see :func:`static_bytes`)."""

    params: float
    """The weights as training holds them: 16-bit outside the fp32 islands in the
    ``*-master`` modes and ``bf16-sr``; under FSDP2 the rank's fp32 shard and its gathered
    blocks."""
    buffers: float
    """The model's buffers."""
    grads: float
    """Gradients of what the optimizer updates (the fp32 masters' in the master modes,
    16-bit in ``bf16-sr``; under FSDP2 the rank's fp32 shard)."""
    masters: float
    """fp32 master weights of the ``*-master`` modes (0 under FSDP2: the shards are)."""
    optimizer_state: float
    """The optimizer's state (:func:`optimizer_state_bytes`; under FSDP2 the rank's share)."""

    @property
    def weights_and_state_bytes(self) -> float:
        """Held through the whole step: weights, buffers, optimizer state and masters."""
        return self.params + self.buffers + self.optimizer_state + self.masters

    @property
    def total_bytes(self) -> float:
        """All of it: the weights and state, and the gradients (all present at the
        optimizer step)."""
        return self.weights_and_state_bytes + self.grads


def static_bytes(
    model: nn.Module,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None,
    layout: RankLayout | None = None,
    root: UnitCost | None = None,
    sparse_grads: Mapping[str, float] | None = None,
) -> StaticBytes:
    """The weights, buffers, gradients, fp32 masters and optimizer state a step holds
    whatever the plan (the module docstring says how each is counted), on one rank of
    ``layout``. Under FSDP2 ``root``, the model's unit tree, names the blocks gathered
    while they compute; without it (before profiling) they are left out, a lower bound.
    ``sparse_grads``: the bytes of each sparse gradient, by parameter name, as a profiled
    step measured them (:func:`sparse_grad_sizes`); without it every gradient is sized
    as its parameter, which bounds a sparse one only while its ids are fewer than the
    table's rows.

    Example::

        s = static_bytes(model, PrecisionPolicy.of("bf16-master"), torch.optim.AdamW(model.parameters()))
        s.params, s.masters   # 2 and 4 bytes per parameter element
    """
    trained = _trained_widths(model, policy)
    param_bytes = sum(p.numel() * trained[id(p)] for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    if optimizer is not None:
        updated = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    else:
        updated = [p for p in model.parameters() if p.requires_grad]
    model_params = {id(p) for p in model.parameters()}
    # fp32 master copies live in the optimizer, not in the model. Before an Engine has
    # made them (planning a fresh model), they are the ones it will make.
    master_bytes = sum(p.numel() * p.element_size() for p in updated if id(p) not in model_params)
    if policy.master_weights and master_bytes == 0:
        master_bytes = sum(p.numel() * 4 for p in model.parameters() if trained[id(p)] < 4)
    sparse = sizes_by_param(model, sparse_grads)
    # Gradients as the weights they train: fp32 for masters, 16-bit for bf16-sr's weights
    # (whether or not the model has been cast yet).
    grad_bytes = sum(
        sparse.get(
            id(p),
            p.numel() * (4 if policy.master_weights else trained.get(id(p), p.element_size())),
        )
        for p in updated
    )
    state_bytes = optimizer_state_bytes(optimizer)
    layout = layout or RankLayout()
    if layout.kind == "fsdp":
        # Sharded fp32 parameters are the masters; gradients are reduced in fp32.
        n = layout.world_size
        gathered = 0.0 if root is None else _gathered_bytes(model, root, policy)[0]
        fp32_params = sum(p.numel() * 4 for p in model.parameters())
        param_bytes, master_bytes = fp32_params / n + gathered, 0
        grad_bytes = sum(p.numel() * 4 for p in updated) / n
        state_bytes = state_bytes / n
    return StaticBytes(param_bytes, buffer_bytes, grad_bytes, master_bytes, state_bytes)


@dataclass(frozen=True)
class StepMemory:
    """The parts of a step's peak that a checkpoint plan cannot change."""

    base_bytes: float
    """Held all step: parameters, buffers, optimizer state, fp32 masters, the inputs."""
    loss_bytes: float
    """Held from the end of forward until the loss's backward: the model's output, what
    the loss saves, and the larger of autocast's 16-bit weight copies (held until the
    autocast region ends) and the gradients the head of backward makes (the loss's, the
    model output's, and those of ops the model runs after its blocks: an LM head, or a
    loss it computes itself); less the gradient in flight that ``held_bytes`` counts and
    these moments do not have, so it may be negative. Freed before the first recomputed
    piece is rebuilt."""
    grad_bytes: float
    """Gradients of what the optimizer updates, all present at the optimizer step."""
    in_flight_bytes: float
    """The activation gradient passed between units in backward (the largest output of a
    unit inside the model; the model's own output's gradient is in ``loss_bytes``)."""
    workspace_bytes: float = 0.0
    """What kernels allocate for themselves beyond every tensor, measured on one step by
    the allocator against the tracker (in ``base_bytes`` already)."""
    correction_bytes: float = 0.0
    """Memory a measured step held beyond the model's prediction (in ``base_bytes``
    already); set when the Engine re-plans after measuring its first planned step."""
    optimizer_temp_bytes: float = 0.0
    """What the optimizer's step allocates for itself (``foreach`` temporaries; see
    :func:`memfit.fake.optimizer_step_temp_bytes`), held only during the step."""
    accumulated_grad_bytes: float = 0.0
    """Gradients held from earlier micro-batches while the last one runs (all of
    ``grad_bytes`` when ``accumulation_steps > 1``, else 0)."""
    edge_bytes: float = 0.0
    """The most the step holds while no unit runs, before the first unit's forward and
    after the last one's backward (a stem's forward and backward, with their kernels'
    buffers): measured on the model by the allocator
    (:func:`memfit.checkpoint.workspace.step_workspace`), and no plan changes it. 0 when
    not measured (off CPU, or per rank of a data-parallel run)."""

    cast_bytes: float = 0.0
    """Autocast's 16-bit copies of fp32 weights held at the end of forward (in
    ``loss_bytes``'s moments before the autocast region ends; 0 outside the mixed modes)."""
    loss_uncast_bytes: float = 0.0
    """Of ``loss_bytes``, its moment after the autocast region has ended (the head of
    backward), which holds no cast copies: the least ``loss_bytes`` can be."""

    forward_grad_bytes: float = 0.0
    """The previous step's gradients, alive through the forward when the loop frees them
    only between forward and backward (``zero_grad="before_backward"``); counted in
    ``loss_bytes`` and ``loss_uncast_bytes`` (the end of forward), and in the step's edge
    before the first unit. 0 when accumulating (``accumulated_grad_bytes`` holds them
    all step)."""

    released_by_param: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """With gradients released in backward: each trained tensor's gradient and update
    temporaries by parameter name (:func:`memfit.checkpoint.released.released_tensors`).
    A unit's backward is charged them at the moments the profiled step accumulated each
    (:func:`~memfit.checkpoint.released.released_backward_peak`), the head of backward (in
    ``loss_bytes``, not at the end of forward) the most of those the model trains outside
    every unit; ``grad_bytes`` and ``optimizer_temp_bytes`` are then the largest tensor's.
    Empty otherwise."""

    retained_bytes: float = 0.0
    """What the units' forward keeps alive outside autograd's saved tensors (a custom
    Function's ``ctx.x``, hidden states appended to a list), measured on the profiled
    step (:attr:`memfit.checkpoint.profiler.Profile.retained_bytes`): no plan frees it,
    and it is counted as held through the activation phase."""

    loss_quiet_bytes: float | None = None
    """``loss_bytes`` without the loss's measured spike (None when none was measured)."""
    spike_bytes: float = 0.0
    """The spike's moment in ``loss_bytes``'s terms: the last unit's end and the loss's
    part of forward after it (:attr:`~memfit.checkpoint.workspace.StepEdges.loss_spike_bytes`)."""
    spike_later_bytes: float = 0.0
    """The same, the last unit's end left out
    (:attr:`~memfit.checkpoint.workspace.StepEdges.loss_spike_later_bytes`)."""
    spike_unsaved_inputs: tuple[tuple[int, float], ...] = ()
    """Units' inputs the spike held at the last unit's end that nothing saved, by id
    (:attr:`memfit.checkpoint.profile_stage.ModelProfile.forward_end_unsaved_inputs`)."""

    def loss_for(self, kept_cast_bytes: float, kept_inputs: Collection[int] = ()) -> float:
        """``loss_bytes`` for a plan whose kept units save ``kept_cast_bytes`` of autocast's
        weight copies (:meth:`loss_beside`) and whose checkpoints keep the memory blocks
        ``kept_inputs`` (ids, as :attr:`UnitCost.input_storages` gives them) as their
        inputs: what the spike held of those at the last unit's end is counted with what
        is kept, not again in the spike (a recommender's concatenated features, 2.25 MiB,
        were counted twice: its least peak predicted 4.3% over).

        Example::

            mem.loss_for(0.0) == mem.loss_bytes
        """
        loss = self.loss_beside(kept_cast_bytes)
        credit = sum(n for i, n in self.spike_unsaved_inputs if i in kept_inputs)
        if not credit or self.loss_quiet_bytes is None:
            return loss
        cast = min(kept_cast_bytes, self.cast_bytes)
        quiet = max(self.loss_uncast_bytes, self.loss_quiet_bytes - cast)
        spike = max(self.spike_bytes - credit, self.spike_later_bytes) - cast
        return max(quiet, spike)

    def loss_beside(self, kept_cast_bytes: float) -> float:
        """``loss_bytes`` for a plan whose kept units save ``kept_cast_bytes`` of autocast's
        weight copies: those are the cast copies themselves (a matmul under autocast saves
        the copy it multiplies by), counted with what is kept, so its moments that hold
        the copies hold those no second time.

        Example::

            mem.loss_beside(0.0) == mem.loss_bytes
        """
        return max(self.loss_uncast_bytes, self.loss_bytes - min(kept_cast_bytes, self.cast_bytes))

    @property
    def held_bytes(self) -> float:
        """What the activation phase holds besides activations: base, the in-flight
        gradient, the accumulated gradients and what the forward retains outside autograd."""
        return (
            self.base_bytes
            + self.in_flight_bytes
            + self.accumulated_grad_bytes
            + self.retained_bytes
        )

    @property
    def forward_offset_bytes(self) -> float:
        """What a unit's forward moment holds beyond the held bytes (less the gradient in
        flight) and the level measured in its forward: the last step's gradients where the
        loop frees them before backward, less the retained bytes, which the held bytes
        count and the measured level includes once they are made (so every forward moment
        counts them once, before they are made too: no later forward holds less)."""
        return self.forward_grad_bytes - self.retained_bytes

    @property
    def optimizer_phase_bytes(self) -> float:
        """What the optimizer step holds: base, every gradient and the step's temporaries."""
        return self.base_bytes + self.grad_bytes + self.optimizer_temp_bytes

    @property
    def floor_bytes(self) -> float:
        """The least peak any plan can have: the larger of the optimizer step and the
        step's measured edges."""
        return max(self.optimizer_phase_bytes, self.edge_bytes)


def step_memory(
    model: nn.Module,
    prof: Profile,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None,
    output_bytes: float | None = None,
    loss_saved_bytes: float | None = None,
    root: UnitCost | None = None,
    accumulation_steps: int = 1,
    output_held: bool = True,
    layout: RankLayout | None = None,
    loss_spike_bytes: float | None = None,
    head_backward_bytes: float | None = None,
    zero_grad: ZeroGrad = "before_forward",
    loss_spike_later_bytes: float = 0.0,
    end_unsaved_inputs: tuple[tuple[int, float], ...] = (),
) -> StepMemory:
    """What a training step holds whatever the plan (see the module docstring).

    ``output_bytes`` and ``loss_saved_bytes``: the model's output and what the loss saves,
    when they are not the profiled step's own (default: ``prof``'s). ``root``: the model's
    own unit tree, when ``prof`` profiled more than the model (default: ``prof.root``).
    ``accumulation_steps``: micro-batches per optimizer step; above 1 the gradients are
    held through the activation phase (``accumulated_grad_bytes``). ``output_held``: the
    caller holds the model's output through backward (``out = model(x)``); False when only
    the loss outlives the forward (``loss = loss_fn(model, batch)``, the Engine's form),
    so the output is freed before backward, but for what the loss saves of it.
    ``layout``: what one rank of a data-parallel run holds (module docstring).
    ``loss_spike_bytes``: the transients of the loss's part of forward, measured
    (:attr:`memfit.checkpoint.workspace.StepEdges.loss_spike_bytes`), held above the end
    of forward at its moment. ``head_backward_bytes``: what the head of backward held above
    the end of forward, measured
    (:attr:`memfit.checkpoint.workspace.StepEdges.head_backward_bytes`), in place of the
    profiler's count of what the head makes (which does not subtract what it frees).
    ``zero_grad``: where the training loop frees the gradients (module docstring).
    ``loss_spike_later_bytes``: the spike's moments after the last unit's end
    (:attr:`memfit.checkpoint.workspace.StepEdges.loss_spike_later_bytes`);
    ``end_unsaved_inputs``: what it held at the last unit's end that nothing saved
    (:attr:`memfit.checkpoint.profile_stage.ModelProfile.forward_end_unsaved_inputs`)."""
    check_zero_grad(zero_grad)
    layout = layout or RankLayout()
    root = prof.root if root is None else root
    sparse = sparse_grad_sizes(prof, accumulation_steps)
    static = static_bytes(model, policy, optimizer, layout, root, sparse)
    # Under autocast with fp32 weights, torch keeps a 16-bit copy of each weight it casts
    # until the autocast region ends, after the loss: held at the end of forward, gone in
    # backward (a recompute casts only its own piece's weights again).
    cast_cache = autocast_copy_bytes(model, policy)
    output = prof.output_bytes if output_bytes is None else output_bytes
    loss_saved = prof.loss_saved_bytes if loss_saved_bytes is None else loss_saved_bytes
    # Under FSDP2 one block's full fp32 gradients, before they are reduce-scattered.
    block_grads = _gathered_bytes(model, root, policy)[1] if layout.kind == "fsdp" else 0.0
    # The head of backward (the loss's ops, and the model's own ops after its blocks: an LM
    # head, or a loss computed inside the model) makes gradients while everything kept is
    # still held. For a loss outside the model: its own gradients, at most the size of what
    # it saves, and the model output's. Whatever the loss, the profiler measured the most
    # of what the head makes alive at once, the gradient it hands to the last block
    # included. The larger of the two is taken. It does not meet the cast copies: it runs
    # after the autocast region has ended.
    in_flight = largest_in_flight_bytes(root)
    made = prof.head_backward_bytes if head_backward_bytes is None else head_backward_bytes
    head = max(loss_saved + output, made)
    accumulated = accumulation_steps > 1 or layout.kind == "ddp"
    released = zero_grad == "in_backward"
    if released and (accumulated or layout.kind == "fsdp"):
        raise ConfigError(
            "zero_grad='in_backward' (each update applied as its gradient is made) cannot "
            "be planned with gradient accumulation or a data-parallel run, which need every "
            "gradient before the update; plan with zero_grad='before_forward'"
        )
    # The last step's gradients, alive through the forward where the loop frees them only
    # before backward: every moment of forward holds them, the head of backward does not.
    forward_grads = (
        float(static.grads) if zero_grad == "before_backward" and not accumulated else 0.0
    )
    # The end of forward (under autocast: its weight copies held), the same once autocast
    # has ended (no copies; the last step's gradients still alive), the head of backward.
    if output_held:  # out = model(x); loss_fn(out).backward(): the output lives on
        forward_end = output + loss_saved + cast_cache
        uncast_end = output + loss_saved
        backward_head = output + loss_saved + head
    else:  # loss = loss_fn(model, batch): the output is gone when backward starts
        forward_end = loss_saved + output + cast_cache
        uncast_end = loss_saved
        backward_head = loss_saved + head
    # The held bytes count the largest gradient in flight between units in backward; the
    # end of forward has none yet, and the head of backward only the one it hands to the
    # last block, which ``made`` counts (an EmbeddingBag recommender's 4 MiB one
    # over-predicted its unplanned step by 4.8%). Both moments are given less it: they may
    # lie below what is held with it (``loss_bytes`` < 0).
    # A gradient released in backward: the head's backward may update a tensor the model
    # trains outside its units (those inside are updated in the units' backward). Where
    # the profile noted the moment a gradient was accumulated, the whole model's backward
    # is charged its update there (the root's release levels), the head's included;
    # charging the head its peak plus that update as well counted it at a moment it is
    # not made: a tied embedding is updated at the end of backward, an LM head's weight
    # once the logits' gradient is freed (Whisper +16%, an LSTM +10% over). A tensor with
    # no noted moment (used by a loss outside the model's forward) is charged at the head.
    charges = released_tensors(model, optimizer, static.masters) if released else {}
    largest = max(charges.values(), key=lambda c: c.total_bytes, default=None)
    one_grad, one_temp = (largest.grad_bytes, largest.temp_bytes) if largest else (0.0, 0.0)
    released_by_param = {name: c.total_bytes for name, c in charges.items()}
    noted = _noted_params(model, root.release_levels)  # by identity: a tied tensor's aliases
    head_params = own_param_ids(model, root) - noted
    head_names = [n for n, p in model.named_parameters() if id(p) in head_params]
    backward_head += max((released_by_param.get(n, 0.0) for n in head_names), default=0.0)
    backward_head -= in_flight
    loss_bytes = max(forward_end + forward_grads - in_flight, backward_head)
    uncast = max(uncast_end + forward_grads - in_flight, backward_head)
    quiet, spike, spike_later = None, 0.0, 0.0
    if loss_spike_bytes:
        # Measured: the loss's transients above the end of forward, with what the loss
        # saves and autocast's copies (a loss inside the model spikes while they are still
        # held). The model's output was freed by then, so the spike holds it if it was
        # alive at its moment; no gradient is in flight yet, which the held bytes count.
        quiet = loss_bytes
        spike = loss_saved + cast_cache + loss_spike_bytes - in_flight + forward_grads
        spike_later = spike - loss_spike_bytes + min(loss_spike_later_bytes, loss_spike_bytes)
        loss_bytes = max(loss_bytes, spike)
    temp = float(optimizer_temp_bytes(optimizer))
    return StepMemory(
        base_bytes=float(static.weights_and_state_bytes + prof.input_bytes),
        loss_bytes=float(loss_bytes),
        cast_bytes=float(cast_cache),
        loss_uncast_bytes=float(uncast),
        grad_bytes=one_grad if released else float(static.grads),
        in_flight_bytes=in_flight + block_grads,
        optimizer_temp_bytes=one_temp
        if released
        else temp / layout.world_size
        if layout.kind == "fsdp"
        else temp,
        accumulated_grad_bytes=float(static.grads) if accumulated else 0.0,
        forward_grad_bytes=forward_grads,
        retained_bytes=float(sum(prof.retained_bytes.values())),
        released_by_param=released_by_param,
        loss_quiet_bytes=None if quiet is None else float(quiet),
        spike_bytes=float(spike),
        spike_later_bytes=float(spike_later),
        spike_unsaved_inputs=end_unsaved_inputs if quiet is not None else (),
    )


def check_zero_grad(zero_grad: str) -> None:
    """Raise a ConfigError for a ``zero_grad`` that is not one of :data:`ZERO_GRAD_ORDERS`.

    >>> check_zero_grad("before_backward")
    """
    if zero_grad not in ZERO_GRAD_ORDERS:
        raise ConfigError(
            f"zero_grad={zero_grad!r} is not a place a training loop frees its gradients: "
            "use 'before_forward' (zero_grad after the optimizer step or before the forward: "
            "the Engine, the Hugging Face Trainer, most loops) or 'before_backward' "
            "(between forward and backward: Lightning's automatic optimization)"
        )


def sparse_grad_sizes(prof: Profile, accumulation_steps: int = 1) -> dict[str, float]:
    """Each sparse gradient's bytes at the optimizer step, by parameter name: what the
    profiled step made, once per micro-batch (autograd sums sparse gradients by
    concatenating their rows, uncoalesced, so ``k`` micro-batches hold ``k`` times one's).

    Example::

        sparse_grad_sizes(prof, accumulation_steps=4)   # {"embed.weight": 4 * 272384.0}
    """
    return {name: float(n * accumulation_steps) for name, n in prof.sparse_grad_bytes.items()}


def sizes_by_param(model: nn.Module, by_name: Mapping[str, float] | None) -> dict[int, float]:
    """``by_name`` keyed by the parameters' ids instead of their names."""
    if not by_name:
        return {}
    return {id(p): by_name[n] for n, p in model.named_parameters() if n in by_name}


def _gathered_bytes(
    model: nn.Module, root: UnitCost, policy: PrecisionPolicy
) -> tuple[float, float]:
    """FSDP2's gathered parameters on one rank (the root's own, kept through the step, and
    the two largest blocks') and one block's full fp32 gradients. The blocks are those
    ``parallelize`` shards one by one: the outermost units with a forward of their own."""
    width = torch.finfo(policy.compute_dtype).bits // 8 if policy.master_weights else 4
    names = outermost_blocks(model, [u.name for u in root.walk()])
    blocks = [model.get_submodule(n) for n in names]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    own = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    sizes = sorted((sum(p.numel() for p in b.parameters()) for b in blocks), reverse=True)
    largest_two = sum(sizes[:2])
    return float((own + largest_two) * width), float(sizes[0] * 4 if sizes else 0)


def _trained_widths(model: nn.Module, policy: PrecisionPolicy) -> dict[int, int]:
    """Bytes per element of each parameter as training holds it: in the ``*-master``
    modes and ``bf16-sr``, floating-point weights outside the fp32 islands in the compute
    dtype (whether or not the model has been cast yet), else as they are."""
    widths = {id(p): p.element_size() for p in model.parameters()}
    if policy.low_precision_weights:
        low = torch.finfo(policy.compute_dtype).bits // 8
        islands = {id(p) for m in model.modules() if policy.is_island(m) for p in m.parameters()}
        for p in model.parameters():
            if p.is_floating_point() and id(p) not in islands:
                widths[id(p)] = low
    return widths


def _noted_params(model: nn.Module, names: Iterable[str]) -> set[int]:
    """The ids of the parameters ``names`` name (any of a tied tensor's names); names the
    model does not have are left out."""
    found = set()
    for name in names:
        try:
            found.add(id(model.get_parameter(name)))
        except AttributeError:
            continue
    return found


def own_param_ids(model: nn.Module, unit: UnitCost) -> set[int]:
    """The ids of the parameters ``unit``'s module holds outside its child units."""
    inner = {id(p) for c in unit.children for p in model.get_submodule(c.name).parameters()}
    return {id(p) for p in model.get_submodule(unit.name).parameters() if id(p) not in inner}


def largest_in_flight_bytes(root: UnitCost) -> float:
    """The largest activation gradient passed from one unit's backward to another's: the
    gradient of a unit's output, over the units inside the model. The model's own output
    is left out: its gradient is the loss's, counted at the end of forward (``loss_bytes``)
    and freed before any unit inside is rebuilt. (An LM's logits are many times a block's
    output: counting them in every rebuild would over-predict such plans by up to ~10%.)"""
    return float(max((u.output_bytes for u in root.walk() if u is not root), default=0.0))


def autocast_copy_bytes(module: nn.Module, policy: PrecisionPolicy) -> int:
    """Bytes of the 16-bit copies autocast makes of ``module``'s fp32 weights (0 outside
    the mixed modes, 0 too where autocast keeps no cache): matrices and filters of modules
    that are not fp32 islands. An embedding's table is not one: autocast casts no lookup
    (``embedding``, ``embedding_bag``), only what it reads out."""
    if not policy.mixed or policy.low_precision_weights or not policy.autocast_cache:
        return 0
    width = torch.finfo(policy.compute_dtype).bits // 8
    return sum(
        p.numel() * width
        for m in module.modules()
        if not policy.is_island(m) and not isinstance(m, _LOOKUPS)
        for p in m.parameters(recurse=False)
        if p.dtype == torch.float32 and p.dim() >= 2
    )


#: Modules whose weights autocast never casts: lookups read rows, they multiply nothing.
_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)
