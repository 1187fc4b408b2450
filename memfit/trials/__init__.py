"""What the tuner and the Engine's ``micro_batch="auto"`` share to choose among settings
timed on real steps: which settings to time (:mod:`memfit.trials.slots`: the best
predicted splits and the peers, the usual fixes a user reaches without memfit) and how
the timed rounds decide between them (:mod:`memfit.trials.decide`).

Nothing here runs a model: the tuner times its trials on fresh models
(:mod:`memfit.tuning.trials`), the Engine on its own model
(:mod:`memfit.engine.split_trials`).
"""
