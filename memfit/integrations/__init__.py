"""memfit in other training loops: callbacks for Hugging Face ``Trainer`` and Lightning,
and a plan for an ``accelerate`` user's own loop.

Each callback plans activation checkpointing under a memory budget with memfit's planner,
for the loop's own order of a step and its precision, applies the plan to the model
before the first step, and adds memfit's metrics and health checks to the loop's own
logs; ``plan_accelerated`` does the planning part for a plain loop. Import the one you
need; none is imported by ``memfit`` itself, and each names the extra to install when its
framework is missing::

    from memfit.integrations.hf import MemfitCallback         # transformers + accelerate
    from memfit.integrations.lightning import MemfitCallback  # lightning
    from memfit.integrations.accelerate import plan_accelerated
    from memfit.integrations.tuned import tuned_loop          # memfit.tune's choice, as
                                                              # each framework takes it

    pip install 'memfit[integrations]'

See ``docs/integrations.md``.
"""
