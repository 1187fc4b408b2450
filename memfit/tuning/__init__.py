"""The joint tuner: ``memfit.tune`` chooses precision, checkpoint plan, micro-batch and
accumulation together (:mod:`memfit.tuning.tune`).

- :mod:`~memfit.tuning.tune`: search (on :mod:`memfit.candidates`), measure, choose;
- :mod:`~memfit.tuning.trials`: a candidate measured on a few real Engine steps;
- :mod:`~memfit.tuning.result`: ``TuneResult`` and its rows;
- :mod:`~memfit.tuning.hints`: loss scale, checkpoint interval, split; ``run_advice``
  from what the monitor recorded.
"""

from memfit.tuning.hints import run_advice
from memfit.tuning.result import TuneResult, TuneRow
from memfit.tuning.tune import tune

__all__ = ["TuneResult", "TuneRow", "run_advice", "tune"]
