"""The training engine (:class:`Engine`) and its parts.

- :mod:`~memfit.engine.core`: the Engine: the step, accumulation, clipping, skipping, logging;
- :mod:`~memfit.engine.feed`: micro-batches as they come: their weights, measuring a step;
- :mod:`~memfit.engine.planning`: stage two of its order, the plan and the closed loop;
- :mod:`~memfit.engine.state`: its checkpoint and loading it back (``resume``, ``load``);
- :mod:`~memfit.engine.evaluation`: evaluating under the training precision;
- :mod:`~memfit.engine.export`: the trained weights (fp32 masters) as a plain state dict;
- :mod:`~memfit.engine.settings`: its settings and their checks;
- :mod:`~memfit.engine.batches`: batch sizes and micro-batch splitting;
- :mod:`~memfit.engine.diagnose`: what to say when steps keep being skipped;
- :mod:`~memfit.engine.auto`: ``precision="auto"`` and ``micro_batch="auto"``, chosen on the
  first batch (:mod:`~memfit.precision.timing`: the model timed in each mode).
"""

from memfit.engine.batches import batch_size, split_batch
from memfit.engine.core import Engine
from memfit.engine.evaluation import evaluate
from memfit.engine.settings import EngineSettings

__all__ = ["Engine", "EngineSettings", "batch_size", "evaluate", "split_batch"]
