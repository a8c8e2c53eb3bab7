"""A thin layer over transformers' Trainer: accelerate handles devices, precision, accumulation, checkpoints, logging."""

from pathlib import Path

import torch
from transformers import TrainingArguments, default_data_collator

from .geometry_logging import GeometryLoggingTrainer
from .modes import prepare_for_training


def train_model(
    model,
    train_dataset,
    output_dir: str | Path,
    *,
    mode: str = "metric-only",
    eval_dataset=None,
    max_steps: int = 100,
    learning_rate: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
    lora_r: int = 8,
    probe_ids=None,
    **training_args,
):
    """Train ``model`` in ``mode`` on a dataset of fixed-length ``input_ids`` / ``labels`` blocks.

    Arguments:
        model: a FiberBundleForCausalLM (for example a converted checkpoint).
        train_dataset, eval_dataset: ``datasets.Dataset`` with ``input_ids`` and ``labels`` columns.
        output_dir: where the Trainer writes checkpoints and logs.
        mode: "full", "metric-only" or "lora" (see ``training.modes``).
        max_steps, learning_rate, batch_size, seed: the usual TrainingArguments.
        lora_r: LoRA rank in "lora" mode.
        probe_ids: a small fixed batch on which the geometry proxies are logged with the loss (default: the first
            training block).
        training_args: any further ``TrainingArguments`` field (report_to, save_steps, bf16, ...).
    Returns the Trainer after training (its ``model`` is what was trained, a PeftModel in "lora" mode).
    """
    model = prepare_for_training(model, mode, lora_r=lora_r)
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        learning_rate=learning_rate,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        seed=seed,
        report_to=training_args.pop("report_to", []),
        save_strategy=training_args.pop("save_strategy", "no"),
        logging_steps=training_args.pop("logging_steps", 1),
        **training_args,
    )
    if probe_ids is None and len(train_dataset):
        probe_ids = torch.tensor(train_dataset[:1]["input_ids"])
    trainer = GeometryLoggingTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                                     data_collator=default_data_collator, probe_ids=probe_ids)
    trainer.train()
    return trainer
