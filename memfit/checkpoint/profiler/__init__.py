"""Cost profiling: one measured training step → a tree of :class:`UnitCost` for the planner.

:func:`profile` runs the model's forward and backward under the training precision
(``precision.autocast(device.type)``) and records, per candidate unit
(:mod:`memfit.checkpoint.tree`), what the cost model (:mod:`memfit.checkpoint.costs`) needs.

How each number is measured:

* **Bytes saved for backward**: ``torch.autograd.graph.saved_tensors_hooks`` sees every
  tensor autograd keeps. Each storage is counted once, for the innermost unit running when
  it was first saved. Storages of parameters, buffers and the example inputs are
  *resident* (they exist whatever the plan) and are not counted. Tensors saved by the loss
  (outside the model) go to :attr:`Profile.loss_saved_bytes`.
* **Input / output bytes**: the storages of the tensors a unit receives (positional and
  keyword) and returns, resident ones excluded, counted once per call.
* **Matmul saved bytes**: the outputs of matmul-like ops (:data:`~memfit.checkpoint.
  recompute.MATMUL_OPS`, seen by a ``TorchDispatchMode``). Selective recompute keeps *every* such
  output of the unit, whether or not autograd saves it, so that is what is counted.
* **FLOPs**: ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention),
  plus :data:`FLOP_FORMULAS` for CPU attention kernels torch does not count. Elementwise
  ops count 0 FLOPs, as in ``FlopCounterMode``; :func:`flop_counter` counts the same way.
* **Tail** (what a rebuild that stops early skips): the FLOPs and op time of the unit's ops
  after the last one whose tensors autograd saves (saved-tensor hooks mark the point; every
  saved tensor counts, parameters too, as torch's ``early_stop`` counts them). Its time is
  measured in the timed step, from the last saved tensor to the unit's end (on CUDA, where
  that would need a device sync per saved tensor, and on fake tensors: the tail ops' share
  of the unit's op time, applied to its forward time).
* **Times**: forward time from forward pre/post hooks, in uninstrumented steps after the
  first (which warms up), read on the step's thread's CPU clock (``time.thread_time``: not
  the time it waited while other processes ran) or, on CUDA, with ``time.perf_counter``
  after a device synchronize:
  each unit's time is its median over ``timed_steps`` steps (3 by default).
  Backward time per unit: a pre-hook on every autograd node stamps the time; each node's
  time (until the next node starts) goes to the unit that created it, found from the
  node's sequence number. This works whatever the unit returns, takes or modifies in place.
* **Checkpoint machinery per piece** (:attr:`Profile.piece_seconds`): a chain of tiny ops
  timed as pieces of memfit's executor and as plain ops, on the device and under the
  training precision; the median difference per piece (0 on fake tensors). Each unit is
  charged it once per call in the step (``UnitCost.piece_seconds``).
* **Non-matmul forward time** (what selective recompute re-runs): the unit's forward time
  times the share of its ops' time spent outside matmul-like ops, the ops timed one by one
  in the instrumented step. Measured op by op, the share is exact for the kernels, and the
  Python overhead of the unit is split in the same proportion (an estimate). Plus, twice
  (the forward and the rebuild), what selective checkpoint's dispatch mode adds to the
  unit's forward: whole-model forwards under that mode against plain ones, alternating,
  ``timed_steps`` of each, the median difference per unit (0 on fake tensors).
* **can_recompute** is False, with the reasons in :attr:`Profile.reasons`, when a unit
  modifies an input in place, updates a buffer in forward other than a normalization
  layer's running statistics (the executor handles those), or draws random numbers from an
  explicit ``torch.Generator`` (checkpoint only replays the default generators). Also for
  a container with no forward of its own (an ``nn.ModuleList``) and for units the step
  never called.
* **can_select** is False, with the reason in :attr:`Profile.no_selective`, when a matmul
  output made in the unit is changed in place later in the step (``ReLU(inplace=True)``
  right after a ``Linear`` or a convolution): selective recompute caches that output and
  torch refuses the changed copy in backward. Plain recompute is still offered.
* **sequential** is True for a chain (``nn.Sequential`` with the stock forward, or a
  container its parent iterates with ``for block in container``) whose children were
  called in index order, each with one tensor (no keyword arguments) that was the previous
  child's output, each returning one tensor.

On the **meta device** the model is run on fake tensors (``FakeTensorMode``; parameters,
buffers and inputs are swapped for fakes during the call): bytes and FLOPs are exact,
times are estimated per op as ``max(flops / flop_rate, bytes / bandwidth)``. A model whose
tensors are already fake is run under its own fake mode the same way.

Profiling leaves the model as it found it: parameters, buffers (BatchNorm statistics),
``.grad`` (None included), train/eval modes, an applied plan, and the RNG state.

The pieces: :mod:`~memfit.checkpoint.profiler.measure` (:func:`profile`),
:mod:`~memfit.checkpoint.profiler.recorder` (the hooks and dispatch mode of a step),
:mod:`~memfit.checkpoint.profiler.stats` (what a step measured of each unit),
:mod:`~memfit.checkpoint.profiler.runner` (running a step on real or fake tensors),
:mod:`~memfit.checkpoint.profiler.timing` (the timed steps and the machinery's costs),
:mod:`~memfit.checkpoint.profiler.build` (records to the :class:`UnitCost` tree),
:mod:`~memfit.checkpoint.profiler.flops` (FLOP formulas) and
:mod:`~memfit.checkpoint.profiler.result` (:class:`Profile`).

Example::

    prof = profile(model, torch.randint(0, 256, (8, 128)), precision="bf16-mixed")
    print(prof.summary())
    prof.root            # UnitCost tree for memfit.checkpoint.solvers
"""

from typing import Any

from memfit.checkpoint.profiler.flops import DEFAULT_BANDWIDTH, DEFAULT_FLOP_RATE, flop_counter
from memfit.checkpoint.profiler.measure import profile
from memfit.checkpoint.profiler.result import Profile

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_FLOP_RATE",
    "Profile",
    "flop_counter",
    "profile",
]


def __getattr__(name: str) -> Any:
    # FLOP_FORMULAS: made on first use (memfit.checkpoint.profiler.flops says why).
    if name == "FLOP_FORMULAS":
        from memfit.checkpoint.profiler.flops import flop_formulas

        return flop_formulas()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
