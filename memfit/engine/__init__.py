"""The training engine (:class:`Engine`) and its parts.

The core composes the parts: each is given what it needs (the model, the optimizer, the
policy, the settings, small records) and returns what changes, which the Engine sets on
itself. No part imports the core.

- :mod:`~memfit.engine.core`: the Engine: the step, accumulation, clipping, skipping;
- :mod:`~memfit.engine.first_batch`: the Engine's own methods for its first batch (a base
  class of the Engine): its choices in one place (``Engine._first_batch_choices``), the plan,
  and the move to a smaller split when the first step measured over the budget;
- :mod:`~memfit.engine.feed`: micro-batches as they come: their weights, measuring a step,
  rescaling and clipping the step's gradients;
- :mod:`~memfit.engine.precision_stage`: stage one of its order: the loss scaler, the fp32
  masters, and the switch to the mode ``precision="auto"`` chose;
- :mod:`~memfit.engine.plan_stage`: stage two of its order, the plan and the closed loop;
- :mod:`~memfit.engine.auto`: ``precision="auto"`` and ``micro_batch="auto"``, chosen on the
  first batch (:mod:`~memfit.precision.mode_timing`: the model timed in each mode);
- :mod:`~memfit.engine.state`: its saved state and loading it back (``resume``, ``load``);
- :mod:`~memfit.engine.preemption`: SIGTERM/SIGINT saving at the next step boundary
  (``stop_on_signal``), exit code 75;
- :mod:`~memfit.engine.run_files`: ``log_dir``'s ``config.json`` and ``summary.json``;
- :mod:`~memfit.engine.step_log`: what a log step reports (the rates, the recompute overhead);
- :mod:`~memfit.engine.evaluation`: evaluating under the training precision;
- :mod:`~memfit.engine.export`: the trained weights (fp32 masters) as a plain state dict;
- :mod:`~memfit.engine.data_parallel`: DDP and FSDP2 around the step;
- :mod:`~memfit.engine.diagnose`: what to say when steps keep being skipped;
- :mod:`~memfit.engine.settings`: its settings and their checks;
- :mod:`~memfit.engine.batches`: batch sizes and micro-batch splitting.
"""

from memfit.engine.batches import batch_size, split_batch
from memfit.engine.core import Engine
from memfit.engine.evaluation import evaluate
from memfit.engine.preemption import PREEMPTED_EXIT_CODE, Preempted, SignalStop
from memfit.engine.settings import EngineSettings

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Engine",
    "EngineSettings",
    "Preempted",
    "SignalStop",
    "batch_size",
    "evaluate",
    "split_batch",
]
