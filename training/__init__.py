"""Fine-tuning and publishing Fiber Bundle models with transformers' Trainer, PEFT, datasets and huggingface_hub
(installed as ``fiber_bundle.training``): ``arguments`` (``FiberBundleTrainingArguments``, every training option),
``modes`` (full / metric-only / LoRA), ``data`` (sources and packing), ``trainer`` (``train_model``,
``run_training``), ``merge`` (``merge_adapter``: a LoRA or QLoRA adapter merged into its full-precision base),
``checkpoints`` (checkpoints complete or absent, SIGTERM, a final model written whole), ``errors``
(``TrainingError``, ``TrainingStopped``), ``geometry_logging``, ``publish``, ``trl_recipes`` (the LoRA + metric recipe
for TRL's trainers) and ``cli`` (``fiber-bundle train``, ``merge`` and ``publish``).
"""

# first: the filters of two optional packages' notices (bitsandbytes', DeepSpeed's) must be in place before peft or
# the Trainer imports them, in a script that imports this package before the model too
import modeling_fiber_bundle  # noqa: F401

from .modes import LORA_TARGET_MODULES, TRAINING_MODES, prepare_for_training, trainable_parameter_names

__all__ = ["LORA_TARGET_MODULES", "TRAINING_MODES", "prepare_for_training", "trainable_parameter_names"]
