"""Fine-tuning Fiber Bundle models with transformers' Trainer and PEFT (installed as ``fiber_bundle.training``).

Work in progress (issue 4): the training modes and the Trainer loop are here; data loading from ``datasets``, the
``fiber-bundle train`` command, distribution and publishing come next.
"""

from .modes import LORA_TARGET_MODULES, TRAINING_MODES, prepare_for_training, trainable_parameter_names

__all__ = ["LORA_TARGET_MODULES", "TRAINING_MODES", "prepare_for_training", "trainable_parameter_names"]
