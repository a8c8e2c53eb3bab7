"""A thin layer over transformers' Trainer: accelerate handles devices, precision, accumulation, checkpoints, logging."""

import json
import shutil
from pathlib import Path

import torch
from transformers import TrainingArguments, default_data_collator, set_seed
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from .checkpoints import CHECKPOINTS
from .errors import TrainingError, describe
from .geometry_logging import GeometryLoggingTrainer
from .modes import is_geometry_parameter, prepare_for_training


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
    metric_learning_rate: float | None = None,
    optimizer: str = "adamw",
    riemannian_learning_rate: float | None = None,
    block: bool = False,
    retraction: str = "qr",
    probe_ids=None,
    resume_from_checkpoint: str | bool | None = None,
    quiet: bool = False,
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
        metric_learning_rate: learning rate of the ``fiber`` (metric) parameters when it should differ from
            ``learning_rate`` (e.g. LoRA at 1e-3 with the metric at 2e-2); same schedule, AdamW for both groups.
        optimizer: "adamw", or a geometry of ``training.riemannian.GEOMETRIES`` for the trainable factored pairs
            (``riemannian.factored_groups``: LoRA pairs, metric generators, per-head W_Q / W_K in "full" mode); the
            rest of the trainable parameters stay with AdamW in the same optimiser, whose state saves with the
            checkpoints.
        riemannian_learning_rate: learning rate of the factored pairs under a Riemannian ``optimizer`` (default:
            ``learning_rate``).
        block: the block variant of the geometry (heads' slices of a factor are separate factors sharing the other).
        retraction: "qr" or "polar", the retraction of the partial-isometry geometries.
        probe_ids: a small fixed batch on which the geometry proxies are logged with the loss (default: the first
            training block).
        resume_from_checkpoint: True (the newest complete checkpoint in ``output_dir``; from the beginning, with a
            warning, when there is none yet) or a checkpoint folder to resume from. Checkpoints are written into
            ``output_dir/.staging`` and renamed into place when complete (``checkpoints.StagedCheckpointTrainer``).
        quiet: do not print log lines or a progress bar (``report_to`` integrations still receive every log).
        training_args: any further ``TrainingArguments`` field (report_to, save_steps, bf16, ...).
    Returns the Trainer after training (its ``model`` is what was trained, a PeftModel in "lora" mode). On SIGTERM it
    saves a checkpoint at the next step boundary and raises ``errors.TrainingStopped``.
    """
    set_seed(seed)  # why: LoRA's A matrices are drawn in prepare_for_training, before the Trainer seeds anything
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
        dataloader_pin_memory=training_args.pop("dataloader_pin_memory", torch.cuda.is_available()),
        **training_args,
    )
    if probe_ids is None and len(train_dataset):
        probe_ids = torch.tensor(train_dataset[:1]["input_ids"])
    optimizers = (None, None)
    check_optimizer_options(optimizer, metric_learning_rate=metric_learning_rate, block=block,
                            riemannian_learning_rate=riemannian_learning_rate, retraction=retraction)
    if optimizer != "adamw":
        from .riemannian import build_optimizer

        optimizers = (build_optimizer(model, optimizer, lr=learning_rate, riemannian_lr=riemannian_learning_rate,
                                      weight_decay=args.weight_decay, block=block, retraction=retraction,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon), None)
    elif metric_learning_rate is not None:
        optimizers = (_two_rate_adamw(model, args, metric_learning_rate), None)  # the Trainer adds its scheduler
    trainer = GeometryLoggingTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                                     data_collator=default_data_collator, probe_ids=probe_ids, optimizers=optimizers)
    if quiet:
        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def check_optimizer_options(optimizer: str, *, metric_learning_rate=None, block=False, riemannian_learning_rate=None,
                            retraction="qr") -> None:
    """Refuse option combinations that cannot work (checked before any model is loaded)."""
    if optimizer == "adamw" and (block or riemannian_learning_rate is not None or retraction != "qr"):
        raise TrainingError("block, riemannian_learning_rate and retraction apply to a Riemannian optimizer, not to "
                            "adamw.")
    if optimizer != "adamw" and metric_learning_rate is not None:
        raise TrainingError("metric_learning_rate applies to the AdamW optimiser; with a Riemannian optimizer the "
                            "parameters outside the factored pairs use learning_rate.")


def _two_rate_adamw(model, args: TrainingArguments, metric_learning_rate: float) -> torch.optim.AdamW:
    """AdamW with the Trainer's hyper-parameters, the metric parameters in their own group at their own rate."""
    metric, rest = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (metric if is_geometry_parameter(name) else rest).append(param)
    groups = [{"params": rest, "lr": args.learning_rate}, {"params": metric, "lr": metric_learning_rate}]
    return torch.optim.AdamW([g for g in groups if g["params"]], betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=args.weight_decay)


def evaluation_loss(model, dataset, batch_size: int = 8) -> float:
    """Mean token loss of ``model`` over ``dataset`` (blocks of equal length), without gradient."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            ids = torch.tensor(dataset[start : start + batch_size]["input_ids"], device=model.device)
            total += model(input_ids=ids, labels=ids).loss.item() * len(ids)
            count += len(ids)
    model.train(was_training)
    return total / max(1, count)


def run_training(
    model_path: str | Path,
    output: str | Path,
    *,
    data=None,
    eval_data=None,
    mode: str = "metric-only",
    block_size: int = 256,
    max_steps: int = 100,
    learning_rate: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
    lora_r: int = 8,
    metric_learning_rate: float | None = None,
    optimizer: str = "adamw",
    riemannian_learning_rate: float | None = None,
    block: bool = False,
    retraction: str = "qr",
    curvature_weight: float | None = None,
    torsion_weight: float | None = None,
    base_model_id: str | None = None,
    resume_from_checkpoint: bool | str | None = None,
    overwrite: bool = False,
    **training_args,
) -> dict:
    """Load a Fiber Bundle folder and its tokenizer, build packed datasets, train, and save the result to ``output``.

    Arguments:
        model_path: a Fiber Bundle folder (for example the output of ``fiber-bundle convert``).
        output: where the trained model (or, in "lora" mode, the adapter) and the tokenizer are saved; the Trainer's
            checkpoints go to ``output/checkpoints``. The model is written into a staging folder beside ``output``
            and renamed into place when complete (``checkpoints.write_output``).
        data, eval_data: local files or a Hub dataset name (``training.data.load_source``); without ``data`` the
            standard library's pydoc topics are used, split by topic into train and eval.
        mode, block_size, max_steps, learning_rate, batch_size, seed, lora_r, metric_learning_rate, optimizer,
            riemannian_learning_rate, block, retraction: as in ``train_model``.
        curvature_weight, torsion_weight: geometry regulariser weights (default: the model config's).
        base_model_id: in "lora" mode, the Hub id of the base (the Fiber Bundle model the adapter applies to) recorded
            in adapter_config.json; default: ``model_path``.
        resume_from_checkpoint: True: continue from the newest complete checkpoint in ``output/checkpoints`` (from
            the beginning when there is none yet); or a checkpoint folder.
        overwrite: replace an ``output`` that already holds a model or other files (only once the new model is
            complete), and without ``resume_from_checkpoint`` start again over an earlier run's checkpoints.
    Returns eval loss before and after, the number of steps and the output folder.
    Raises ``TrainingError`` (bad data, an existing ``output``, a mode this model cannot train, a full disk, ...)
    before the model is loaded wherever the check does not need it, and ``TrainingStopped`` on SIGTERM.
    """
    from transformers import AutoTokenizer

    from modeling_fiber_bundle import FiberBundleConfig, FiberBundleForCausalLM

    from .checkpoints import prepare_output, start_again, write_output
    from .data import load_source, pydoc_topics, training_blocks
    from .modes import mode_problem

    output = Path(output)
    earlier_checkpoints = prepare_output(output, overwrite=overwrite, resume=bool(resume_from_checkpoint))
    try:
        config = FiberBundleConfig.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=True)
    except Exception as error:
        raise TrainingError(f"could not read MODEL {model_path} ({describe(error)}); pass a Fiber Bundle folder, e.g. "
                            "the output of fiber-bundle convert.") from error
    problem = mode_problem(mode, config)
    if problem:
        raise TrainingError(f"{problem}.")
    check_optimizer_options(optimizer, metric_learning_rate=metric_learning_rate, block=block,
                            riemannian_learning_rate=riemannian_learning_rate, retraction=retraction)
    if data is None:
        train_text, eval_text = pydoc_topics(seed=seed)
        train_name, eval_name = "the training data (Python's pydoc topics)", "the eval data (held-out pydoc topics)"
    else:
        train_text = load_source(data)
        eval_text = load_source(eval_data) if eval_data is not None else None
        train_name, eval_name = f"training data {_named(data)}", f"eval data {_named(eval_data)}"
    train_set = training_blocks(train_text, tokenizer, block_size, name=train_name)
    eval_set = training_blocks(eval_text, tokenizer, block_size, name=eval_name) if eval_text is not None else None

    model = FiberBundleForCausalLM.from_pretrained(model_path)
    if earlier_checkpoints:  # every check has passed: only now are they removed
        start_again(output)
    for name, value in (("curvature_weight", curvature_weight), ("torsion_weight", torsion_weight)):
        if value is not None:
            setattr(model.config, name, value)
    before = evaluation_loss(model, eval_set, batch_size) if eval_set is not None else None
    trainer = train_model(model, train_set, output / CHECKPOINTS, mode=mode, eval_dataset=eval_set,
                          max_steps=max_steps, learning_rate=learning_rate, batch_size=batch_size, seed=seed,
                          lora_r=lora_r, metric_learning_rate=metric_learning_rate, optimizer=optimizer,
                          riemannian_learning_rate=riemannian_learning_rate, block=block, retraction=retraction,
                          resume_from_checkpoint=resume_from_checkpoint, **training_args)
    after = evaluation_loss(trainer.model, eval_set, batch_size) if eval_set is not None else None
    if mode == "lora" and base_model_id:  # an adapter published on the Hub must name its base by Hub id
        for peft_config in trainer.model.peft_config.values():
            peft_config.base_model_name_or_path = base_model_id
    result = {"mode": mode, "steps": trainer.state.global_step, "eval_loss_before": before, "eval_loss_after": after,
              "block_size": block_size, "learning_rate": learning_rate, "batch_size": batch_size, "seed": seed,
              "optimizer": optimizer, **({"riemannian_learning_rate": riemannian_learning_rate or learning_rate,
                                          "block": block, "retraction": retraction} if optimizer != "adamw" else {})}

    def write(folder: Path):
        trainer.model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        for name in ("README.md", "conversion_report.json"):  # the card and parity report travel with the model
            if (Path(model_path) / name).is_file() and not (folder / name).exists():
                shutil.copyfile(Path(model_path) / name, folder / name)
        (folder / "training_metrics.json").write_text(json.dumps(result, indent=2) + "\n")

    write_output(output, write)
    return {**result, "output": str(output)}


def _named(source) -> str:
    return ", ".join(map(str, source)) if isinstance(source, (list, tuple)) else str(source)
