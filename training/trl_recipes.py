"""TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``) on a Fiber Bundle model: the project's LoRA + metric
mode as TRL takes it, and the settings TRL's defaults need on this model (docs/fine_tuning.md, "With TRL").

TRL computes some things itself (SFT's and GRPO's fused LM-head loss, the padding-free packed batch, DPO's reference
log-probabilities with the adapter off); tests/test_trl.py checks each against the model's own computation.
"""

from .modes import lora_config

__all__ = ["lora_config", "with_metric_learning_rate", "continuous_batching_config"]


def with_metric_learning_rate(trainer, metric_learning_rate: float):
    """Give ``trainer`` (a transformers ``Trainer``, TRL's included, once built: TRL wraps the model in PEFT inside its
    constructor) the optimiser of ``fiber-bundle train --metric_learning_rate``: AdamW with the trainer's
    hyper-parameters, the metric (``fiber``) parameters at ``metric_learning_rate`` and every other trainable
    parameter at ``args.learning_rate``. The Trainer adds its scheduler to both groups. Returns ``trainer``."""
    from .trainer import two_rate_adamw

    if trainer.optimizer is not None:
        raise ValueError("the trainer already has an optimiser (optimizers=...): pass one or the other, not both.")
    trainer.optimizer = two_rate_adamw(trainer.model, trainer.args, metric_learning_rate)
    return trainer


def continuous_batching_config(**options) -> dict:
    """Keyword arguments of transformers' ``ContinuousBatchingConfig`` for TRL's GRPO generation through continuous
    batching (``GRPOConfig(use_transformers_continuous_batching=True, transformers_continuous_batching_config=...)``):
    on a CPU, the paged cache of ``fiber-bundle serve`` (transformers would reserve 90 % of the RAM for it), with
    ``options`` on top."""
    from fiber_bundle.serving.server import CPU_CACHE_TOKENS, CPU_MAX_BATCH_TOKENS, DEFAULT_PAGE_SIZE

    return {"num_blocks": CPU_CACHE_TOKENS // DEFAULT_PAGE_SIZE, "max_batch_tokens": CPU_MAX_BATCH_TOKENS, **options}
