"""memfit in other training loops: callbacks for Hugging Face ``Trainer`` and Lightning.

Each callback plans activation checkpointing under a memory budget with memfit's planner,
applies the plan to the model before the first step, and adds memfit's metrics and health
checks to the loop's own logs. Import the one you need; neither is imported by ``memfit``
itself, and each names the extra to install when its framework is missing::

    from memfit.integrations.hf import MemfitCallback         # transformers + accelerate
    from memfit.integrations.lightning import MemfitCallback  # lightning

    pip install 'memfit[integrations]'

See ``docs/integrations.md``.
"""
