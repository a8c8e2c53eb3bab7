"""A thin layer over transformers' Trainer: accelerate handles devices, precision, accumulation, checkpoints, logging."""

import copy
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainingArguments,
                          default_data_collator, set_seed)
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from fiber_bundle.model_cards import framework_versions, hardware, public_name, render_card

from .arguments import FiberBundleTrainingArguments
from .checkpoints import CHECKPOINTS, prepare_output, start_again, write_output
from .errors import TrainingError, describe
from .geometry_logging import GeometryLoggingTrainer, geometry_by_layer
from .modes import is_geometry_parameter, prepare_for_training


def training_arguments(args=None, **fields) -> FiberBundleTrainingArguments:
    """The options of a run: ``args`` itself (a ``FiberBundleTrainingArguments``), or one built from ``fields``
    (``args`` then being the ``output_dir``, or None)."""
    if isinstance(args, FiberBundleTrainingArguments):
        if fields:
            raise TypeError(f"pass the options either as FiberBundleTrainingArguments or as keywords, not both (got "
                            f"args and {sorted(fields)}).")
        return args
    if isinstance(args, TrainingArguments):
        raise TypeError("pass FiberBundleTrainingArguments (a TrainingArguments subclass with this project's fields), "
                        "not TrainingArguments.")
    return FiberBundleTrainingArguments(**({"output_dir": str(args)} if args is not None else {}), **fields)


def train_model(model, train_dataset, args=None, *, eval_dataset=None, probe_ids=None, callbacks=(), **fields):
    """Train ``model`` in ``args.mode`` on a dataset of fixed-length ``input_ids`` / ``labels`` blocks.

    Arguments:
        model: a FiberBundleForCausalLM (for example a converted checkpoint).
        train_dataset, eval_dataset: ``datasets.Dataset`` with ``input_ids`` and ``labels`` columns.
        args: the options (``arguments.FiberBundleTrainingArguments``, whose ``output_dir`` is where the Trainer
            writes checkpoints); or the ``output_dir``, with the options as keyword ``fields`` of that dataclass
            (``mode``, ``max_steps``, ``learning_rate``, ``batch_size``, ``optimizer``, ``save_steps``, ``bf16``, ...).
        probe_ids: a small fixed batch on which the geometry proxies are logged with the loss (default: the first
            training block).
        callbacks: further ``transformers.TrainerCallback`` instances for the Trainer.
    Returns the Trainer after training (its ``model`` is what was trained, a PeftModel in "lora" mode). On SIGTERM it
    saves a checkpoint at the next step boundary and raises ``errors.TrainingStopped``. Checkpoints are written into
    ``output_dir/.staging`` and renamed into place when complete (``checkpoints.StagedCheckpointTrainer``);
    ``resume_from_checkpoint=True`` (or ``resume``) continues from the newest complete one.
    """
    trainer = build_trainer(model, train_dataset, training_arguments(args, **fields), eval_dataset=eval_dataset,
                            probe_ids=probe_ids)
    for callback in callbacks:
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=trainer.args.checkpoint_to_resume)
    return trainer


def build_trainer(model, train_dataset, args: FiberBundleTrainingArguments, *, eval_dataset=None, probe_ids=None):
    """The Trainer of ``train_model``, before it trains: ``model`` prepared for ``args.mode`` (seeded first, as LoRA's
    A matrices are drawn there) with the regularisers' weights ``args`` sets, the optimiser ``args.optimizer`` names,
    and the console output ``args`` asks for."""
    if args.output_dir is None:
        raise TrainingError("output_dir is not set: pass the folder for the Trainer's checkpoints.")
    for name in ("curvature_weight", "torsion_weight"):  # the regularisers' weights live in the model's config
        if getattr(args, name) is not None:
            setattr(model.config, name, getattr(args, name))
    set_seed(args.seed)  # why: LoRA's A matrices are drawn in prepare_for_training, before the Trainer seeds anything
    model = prepare_for_training(model, args.mode, lora_r=args.lora_r,
                                 gradient_checkpointing=args.gradient_checkpointing)  # read by QLoRA's preparation
    if probe_ids is None and len(train_dataset):
        probe_ids = torch.tensor(train_dataset[:1]["input_ids"])
    optimizers = (None, None)
    if args.optimizer != "adamw":
        from .riemannian import build_optimizer

        optimizers = (build_optimizer(model, args.optimizer, lr=args.learning_rate,
                                      riemannian_lr=args.riemannian_learning_rate, weight_decay=args.weight_decay,
                                      block=args.block, retraction=args.retraction, pairs=args.riemannian_pairs,
                                      fresh=args.orthonormal_start, gauge=args.riemannian_gauge,
                                      equal_scale=args.equal_scale,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon), None)
    elif args.metric_learning_rate is not None:
        optimizers = (two_rate_adamw(model, args, args.metric_learning_rate), None)  # the Trainer adds its scheduler
    trainer = GeometryLoggingTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                                     data_collator=default_data_collator, probe_ids=probe_ids, optimizers=optimizers)
    _check_fsdp_applies(trainer)
    _compile_by_layer(trainer)
    _console(trainer)
    return trainer


def _compile_by_layer(trainer) -> None:
    """Under ``torch_compile`` (``--torch-compile``): regional compilation, fullgraph. accelerate compiles each decoder
    layer alone (its ``compile_regions``, which the Trainer's ``prepare`` runs) and the embedding, final norm and head
    apart. Why: the layers are one class with one forward, and inductor takes their parameters as inputs, so the first
    layer's compiled code serves every layer: compile time stays that of one layer whatever the depth, where compiling
    the whole model compiles every layer's copy (docs/design.md 1.5, "Compiled"; the step is as fast)."""
    if trainer.args.torch_compile:
        plugin = trainer.accelerator.state.dynamo_plugin
        plugin.use_regional_compilation = True
        plugin.fullgraph = True  # a graph break inside a layer is an error, not a silent slow path


def _check_fsdp_applies(trainer) -> None:
    """FSDP asked for (``fsdp`` / ``fsdp_config``, or ``accelerate launch --use_fsdp``) on CPU processes: accelerate
    1.15 applies FSDP only on GPUs and other accelerators, and under ``use_cpu=True`` with several processes the Trainer
    would silently train plain DDP, every parameter replicated (docs/distributed.md)."""
    from accelerate.utils import DistributedType, parse_flag_from_env

    asked = trainer.args.fsdp_plugin_args is not None or parse_flag_from_env("ACCELERATE_USE_FSDP")
    if asked and not trainer.is_fsdp_enabled and trainer.accelerator.distributed_type == DistributedType.MULTI_CPU:
        raise TrainingError(
            "fsdp was asked for, but accelerate runs this job as MULTI_CPU without FSDP (it applies FSDP only on GPUs "
            "or other accelerators; on CPU it would train plain DDP, every parameter replicated). Drop fsdp / "
            "fsdp_config to train with DDP on CPU (torchrun --nproc_per_node N with use_cpu=True), or run on GPUs; "
            "see docs/distributed.md."
        )


class _ProgressBarOnly(ProgressCallback):
    """transformers' progress bars without the log entries it prints under them."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def _console(trainer) -> None:
    """What a Trainer prints: by default transformers' progress bar with each log entry under it; ``print_logs``
    False: the bar only; ``quiet`` (or ``disable_tqdm`` without ``print_logs``): nothing."""
    if trainer.args.print_logs:
        return
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(_ProgressBarOnly)


def two_rate_adamw(model, args: TrainingArguments, metric_learning_rate: float) -> torch.optim.AdamW:
    """AdamW with the hyper-parameters of ``args`` (any ``TrainingArguments``), the metric parameters in their own group
    at ``metric_learning_rate``, every other trainable parameter at ``args.learning_rate``."""
    metric, rest = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (metric if is_geometry_parameter(name) else rest).append(param)
    groups = [{"params": rest, "lr": args.learning_rate}, {"params": metric, "lr": metric_learning_rate}]
    return torch.optim.AdamW([g for g in groups if g["params"]], betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=args.weight_decay)


def evaluation_loss(model, dataset, batch_size: int = 8) -> float:
    """Mean token loss of ``model`` over ``dataset`` (blocks of equal length), without gradient, on the device the model
    is on: ``Trainer.evaluate``'s ``eval_loss``, for a model outside a run (a run evaluates with its own Trainer)."""
    was_training = model.training
    with tempfile.TemporaryDirectory() as scratch:
        args = FiberBundleTrainingArguments(output_dir=scratch, batch_size=batch_size, quiet=True,
                                            use_cpu=model.device.type == "cpu")
        trainer = Trainer(model=model, args=args, eval_dataset=dataset, data_collator=default_data_collator)
        _console(trainer)
        loss = trainer.evaluate()["eval_loss"]
    model.train(was_training)
    return loss


def run_training(model_path: str | Path | None, output: str | Path, args: FiberBundleTrainingArguments | None = None,
                 **fields) -> dict:
    """Load a Fiber Bundle folder and its tokenizer, build packed datasets, train, and save the result to ``output``.

    Arguments:
        model_path: a Fiber Bundle folder (for example the output of ``fiber-bundle convert``); None with
            ``args.from_config``, which builds a freshly initialised model (``scratch.fresh_model``) with the tokenizer
            ``args.tokenizer`` (default: byte-level) and trains it in "full" mode.
        output: where the trained model (or, in "lora" mode, the adapter) and the tokenizer are saved; the Trainer's
            checkpoints go to ``output/checkpoints`` (``args.output_dir``, which must be unset or that folder). The
            model is written into a staging folder beside ``output`` and renamed into place when complete
            (``checkpoints.write_output``).
        args: the options, ``arguments.FiberBundleTrainingArguments`` (``fiber-bundle train`` parses its command line
            into one), or None to build it from the keyword ``fields`` (``mode``, ``data``, ``max_steps``, ...).
            Without ``data`` the standard library's pydoc topics are used, split by topic into train and eval (a
            named corpus, ``data.CORPORA``, brings its own split);
            ``resume`` (or ``resume_from_checkpoint``) continues from the newest complete checkpoint in
            ``output/checkpoints`` (from the beginning when there is none yet); ``overwrite`` replaces an ``output``
            that already holds a model or other files (only once the new model is complete), and without resuming
            starts again over an earlier run's checkpoints.
    Returns the held-out eval loss before and after training (``Trainer.evaluate``; None without eval data), the
    number of steps and the output folder.
    Raises ``TrainingError`` (bad options or data, an existing ``output``, a mode this model cannot train, a full
    disk, ...) before the model is loaded wherever the check does not need it, and ``TrainingStopped`` on SIGTERM.
    """
    output = Path(output)
    args = run_arguments(model_path, output, training_arguments(args, **fields))
    earlier_checkpoints = prepare_output(output, overwrite=args.overwrite, resume=bool(args.checkpoint_to_resume))
    config, tokenizer = config_and_tokenizer(model_path, args)
    quantization = checked_quantization(args, config)
    data = training_data(args, tokenizer)
    model = model_to_train(model_path, args, config, quantization)
    with args.main_process_first(local=False, desc="removing the earlier run's checkpoints"):
        if earlier_checkpoints and args.process_index == 0:  # every check has passed: only now are they removed
            start_again(output)
    trainer = build_trainer(model, data.train, args, eval_dataset=data.eval)
    outcome, train_seconds = train_and_evaluate(trainer, evaluate=data.eval is not None)
    final = trained_model(trainer)  # every process calls it (ZeRO-3 gathers); None but on the main process
    if final is None:  # another process of a distributed run: the main process writes OUTPUT
        trainer.accelerator.wait_for_everyone()
        return {**outcome, "output": str(output)}
    metrics = training_metrics(args, trainer, model, final, config, model_path=model_path, data=data, outcome=outcome,
                               train_seconds=train_seconds)
    save_run(output, trainer, final, tokenizer, model_path=model_path, metrics=metrics)
    trainer.accelerator.wait_for_everyone()
    return {**metrics, "output": str(output)}


def run_arguments(model_path: str | Path | None, output: Path,
                  args: FiberBundleTrainingArguments) -> FiberBundleTrainingArguments:
    """A copy of ``args`` (the caller's keeps its ``output_dir``) whose ``output_dir`` is OUTPUT/checkpoints, where a
    run's checkpoints always go, refusing another ``output_dir`` and a MODEL given with ``--from-config`` or neither."""
    args = copy.copy(args)
    checkpoints = str(output / CHECKPOINTS)
    if args.output_dir not in (None, checkpoints):
        raise TrainingError(f"output_dir is set to {args.output_dir}, but the checkpoints of a run always go to "
                            f"OUTPUT/checkpoints ({checkpoints}): drop --output_dir (output_dir).")
    args.output_dir = checkpoints
    if (model_path is None) == (args.from_config is None):
        raise TrainingError("give either MODEL (a Fiber Bundle folder to train) or --from-config CONFIG (a fresh "
                            "model), not " + ("both." if model_path is not None else "neither."))
    return args


def config_and_tokenizer(model_path: str | Path | None,
                         args: FiberBundleTrainingArguments) -> tuple[PreTrainedConfig, PreTrainedTokenizerBase]:
    """The config and tokenizer of the model to train, without its weights (so that every check runs before they
    load): MODEL's, or with ``--from-config`` the fresh model's config and ``args.tokenizer``."""
    if args.from_config is not None:
        from .scratch import load_tokenizer, scratch_config

        tokenizer = load_tokenizer(args.tokenizer)
        return scratch_config(args.from_config, tokenizer), tokenizer
    from transformers import AutoTokenizer

    from modeling_fiber_bundle import FiberBundleConfig

    try:
        config = FiberBundleConfig.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=True)
    except Exception as error:
        raise TrainingError(f"could not read MODEL {model_path} ({describe(error)}); pass a Fiber Bundle folder, "
                            "e.g. the output of fiber-bundle convert.") from error
    return config, tokenizer


def checked_quantization(args: FiberBundleTrainingArguments, config: PreTrainedConfig):
    """The quantisation ``args`` asks for (None, or bitsandbytes 4-bit / 8-bit: QLoRA), refused (``TrainingError``)
    when ``args.mode`` cannot train a model of ``config`` loaded that way."""
    from .modes import mode_problem

    quantization = args.quantization_config()
    problem = mode_problem(args.mode, config, quantization)
    if problem:
        raise TrainingError(f"{problem}.")
    return quantization


@dataclass
class TrainingData:
    """The packed blocks a run trains and evaluates on, and the named corpus they came from (None for files)."""

    train: Dataset
    eval: Dataset | None
    corpus: str | None


def training_data(args: FiberBundleTrainingArguments, tokenizer: PreTrainedTokenizerBase) -> TrainingData:
    """``args.data`` and ``args.eval_data`` as blocks of ``args.block_size`` tokens: a named corpus (the pydoc topics
    without ``data``) with its own held-out split, or files (``eval_data`` optional)."""
    from .data import is_named_corpus, load_source, named_corpus, training_blocks

    corpus = "pydoc" if args.data is None else is_named_corpus(args.data)
    if corpus is not None:
        if args.eval_data is not None:
            raise TrainingError(f"--data {corpus} is a named corpus with its own held-out split: drop --eval-data, "
                                "or give the training data as files.")
        train_text, eval_text = named_corpus(corpus, seed=args.seed)
        train_name, eval_name = f"the training split of {corpus}", f"the held-out split of {corpus}"
    else:
        train_text = load_source(args.data)
        eval_text = load_source(args.eval_data) if args.eval_data is not None else None
        train_name, eval_name = f"training data {_named(args.data)}", f"eval data {_named(args.eval_data)}"
    train_set = training_blocks(train_text, tokenizer, args.block_size, name=train_name)
    eval_set = training_blocks(eval_text, tokenizer, args.block_size, name=eval_name) if eval_text is not None else None
    return TrainingData(train_set, eval_set, corpus)


def model_to_train(model_path: str | Path | None, args: FiberBundleTrainingArguments, config: PreTrainedConfig,
                   quantization) -> PreTrainedModel:
    """The model's weights, once every check has passed: MODEL's, loaded with ``quantization``, or a fresh model of
    ``config`` seeded with ``args.seed``."""
    if args.deepspeed:
        _deepspeed_process_group(args)
    if args.from_config is not None:
        from .scratch import fresh_model

        return fresh_model(config, args.seed)
    from modeling_fiber_bundle import FiberBundleForCausalLM

    return FiberBundleForCausalLM.from_pretrained(model_path, quantization_config=quantization)


def train_and_evaluate(trainer: Trainer, *, evaluate: bool) -> tuple[dict, float]:
    """Train (resuming as the trainer's arguments ask), with the held-out loss before and after when ``evaluate``:
    (the outcome every process returns: mode, steps and the two losses; the seconds spent training)."""
    before = trainer.evaluate()["eval_loss"] if evaluate else None
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=trainer.args.checkpoint_to_resume)
    train_seconds = time.perf_counter() - started
    after = trainer.evaluate()["eval_loss"] if evaluate else None
    return {"mode": trainer.args.mode, "steps": trainer.state.global_step, "eval_loss_before": before,
            "eval_loss_after": after}, train_seconds


def training_metrics(args: FiberBundleTrainingArguments, trainer: Trainer, model: PreTrainedModel, final,
                     config: PreTrainedConfig, *, model_path: str | Path | None, data: TrainingData, outcome: dict,
                     train_seconds: float) -> dict:
    """training_metrics.json: the ``outcome``, the options that shaped the run, ``run_record``'s sources, size, hardware
    and software, and the trained model's geometry by layer on two held-out blocks (training blocks without eval
    data). ``model`` is the model as loaded (its quantisation), ``final`` the trained one."""
    riemannian = {"riemannian_learning_rate": args.riemannian_learning_rate or args.learning_rate, "block": args.block,
                  "retraction": args.retraction, "riemannian_pairs": args.riemannian_pairs,
                  "riemannian_gauge": args.riemannian_gauge, **({"equal_scale": True} if args.equal_scale else {})}
    probe = torch.tensor((data.eval if data.eval is not None else data.train)[:2]["input_ids"])
    return {**outcome, "block_size": args.block_size, "learning_rate": args.learning_rate,
            "batch_size": args.per_device_train_batch_size, "seed": args.seed, "optimizer": args.optimizer,
            **({"quantization": quantised} if (quantised := _quantisation_of(model)) else {}),
            **(riemannian if args.optimizer != "adamw" else {}),
            **({"from_config": public_name(args.from_config), "tokenizer": public_name(args.tokenizer or "byte")}
               if args.from_config is not None else {}),
            # what the model card shows (model_cards.card): sources by Hub id or name, never by local path
            **run_record(args, trainer, final, config, base=None if model_path is None else args.base_model_id or
                         public_name(model_path), data=data.corpus or public_name(args.data),
                         eval_data=None if data.corpus else public_name(args.eval_data), train_blocks=len(data.train),
                         eval_blocks=len(data.eval) if data.eval is not None else None, train_seconds=train_seconds),
            "geometry": {"probe_tokens": int(probe.numel()), "held_out": data.eval is not None,
                         "layers": geometry_by_layer(final, probe)}}


def save_run(output: Path, trainer: Trainer, final, tokenizer: PreTrainedTokenizerBase, *,
             model_path: str | Path | None, metrics: dict) -> None:
    """Write the trained model (or, in "lora" mode, the adapter), its tokenizer, MODEL's conversion report,
    training_metrics.json and the card to OUTPUT, whole or not at all (``checkpoints.write_output``)."""
    args = trainer.args
    if args.mode == "lora" and args.base_model_id:  # an adapter published on the Hub must name its base by Hub id
        for peft_config in trainer.model.peft_config.values():
            peft_config.base_model_name_or_path = args.base_model_id

    def write(folder: Path):
        final.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        conversion = None if model_path is None else Path(model_path) / "conversion_report.json"
        if conversion is not None and conversion.is_file():  # the source and its parity travel with the model
            shutil.copyfile(conversion, folder / "conversion_report.json")
        (folder / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        render_card(folder, name=output.name)  # replaces the card PEFT writes beside an adapter

    write_output(output, write)


def _deepspeed_process_group(args) -> None:
    """Hand DeepSpeed the process group the arguments set up under torchrun. It keeps its own record of it, which a
    ZeRO-3 load reads (``from_pretrained`` builds the weights partitioned, under ``deepspeed.zero.Init``): without it
    that load counts one process and rejects the batch size (train_batch_size 4 != 2 * 1 * 1)."""
    import torch.distributed as dist

    if args.world_size > 1 and dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend())


def trained_model(trainer):
    """The trained model whole, on the main process (None on the others); every process must call it.

    Under DeepSpeed ZeRO-3 each process holds a slice of every weight: the slices are gathered to the main process
    (``stage3_gather_16bit_weights_on_model_save``, which the arguments require with ZeRO-3) and loaded into a fresh
    copy of the model; otherwise it is the Trainer's own model (DDP keeps a whole copy on every process)."""
    zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.deepspeed_config["zero_optimization"].get("stage") == 3
    if not zero3:
        return trainer.model if trainer.is_world_process_zero() else None
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # collective: every process takes part
    if not trainer.is_world_process_zero():
        return None
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # why: the copy is a plain model, not built partitioned under deepspeed.zero.Init
    model = type(trainer.model)(trainer.model.config)
    model.load_state_dict(state)  # strict: every weight of the model came back
    frozen = {name for name, param in trainer.model.named_parameters() if not param.requires_grad}
    for name, param in model.named_parameters():  # what trained (the run record counts it)
        param.requires_grad_(name not in frozen)
    return model.eval()


def run_record(args: FiberBundleTrainingArguments, trainer, model, config, *, base: str | None, data: str | None,
               eval_data: str | None, train_blocks: int, eval_blocks: int | None, train_seconds: float) -> dict:
    """What training_metrics.json records for the model card besides the losses: the sources (public names), the
    tokens seen, the rest of the hyper-parameters, the size of the trained ``model``, the hardware, the time and the
    software."""
    trainable = total = 0
    if hasattr(model, "get_nb_trainable_parameters"):  # PEFT: counts 4-bit weights by their real size
        trainable, total = model.get_nb_trainable_parameters()
    else:
        for param in model.parameters():
            total += param.numel()
            trainable += param.numel() if param.requires_grad else 0
    accumulation, processes = args.gradient_accumulation_steps, args.world_size
    scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    return {
        "base": base, "data": data, "eval_data": eval_data,
        "train_tokens": trainer.state.global_step * args.per_device_train_batch_size * accumulation * processes
        * args.block_size,
        "train_blocks": train_blocks, "eval_tokens": None if eval_blocks is None else eval_blocks * args.block_size,
        "gradient_accumulation_steps": accumulation, "processes": processes, "lr_scheduler_type": str(scheduler),
        "warmup_steps": args.get_warmup_steps(max(trainer.state.max_steps, 1)), "weight_decay": args.weight_decay,
        "metric_learning_rate": args.metric_learning_rate, **({"lora_r": args.lora_r} if args.mode == "lora" else {}),
        "precision": "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        "model": {"architectures": list(config.architectures or ["FiberBundleForCausalLM"]), "parameters": total,
                  "trainable": trainable, **{name: getattr(config, name) for name in
                                             ("metric_rank", "ffn_metric_rank", "metric_hidden", "num_hidden_layers",
                                              "hidden_size")}},
        "hardware": hardware(), "train_seconds": train_seconds, "versions": framework_versions(),
    }


def _quantisation_of(model) -> str | None:
    """How the loaded ``model``'s weights are quantised ("4-bit NF4", "8-bit"), read from the model itself (what it was
    loaded as, not what was asked for), or None for full precision."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return None
    config = quantizer.quantization_config
    if getattr(config, "load_in_4bit", False):
        return f"4-bit {config.bnb_4bit_quant_type.upper()}"
    return "8-bit" if getattr(config, "load_in_8bit", False) else str(getattr(config, "quant_method", "quantised"))


def _named(source) -> str:
    return ", ".join(map(str, source)) if isinstance(source, (list, tuple)) else str(source)
