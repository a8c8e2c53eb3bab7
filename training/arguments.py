"""Every training option in one place: ``FiberBundleTrainingArguments``, transformers' ``TrainingArguments`` plus this
project's fields. ``fiber-bundle train`` parses it with ``HfArgumentParser`` (so every ``TrainingArguments`` field is a
flag, as ``--field_name`` or ``--field-name``) and ``run_training`` / ``train_model`` take it, or build it from
keyword arguments.

Where the project's meaning differs from a ``TrainingArguments`` field of a similar name:
* ``output_dir`` is derived: ``run_training`` (and so ``fiber-bundle train``) puts the Trainer's checkpoints in
  ``OUTPUT/checkpoints`` and refuses any other value; only ``train_model`` takes it from the caller.
* ``overwrite`` (``--overwrite``) replaces an OUTPUT that already holds a model; transformers 5 has no
  ``overwrite_output_dir``.
* ``resume`` (``--resume``) continues from the newest complete checkpoint in the checkpoint folder; transformers'
  ``resume_from_checkpoint`` (a checkpoint folder, or True in Python) is honoured too and wins when both are given.
* ``batch_size`` (``--batch-size``) sets both ``per_device_train_batch_size`` and ``per_device_eval_batch_size``.
"""

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import SaveStrategy
from transformers.training_args import OptimizerNames

from .errors import TrainingError
from .manifolds import RETRACTIONS
from .modes import TRAINING_MODES
from .riemannian import FIXED_RANK, GAUGES, OPTIMIZERS, PAIRS


@dataclass
class FiberBundleTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with this project's defaults (a short metric-only run: 100 steps at 1e-3, batches of 8,
    a log line per step, no checkpoints unless ``save_steps``, no integrations) and its fields (the training mode, the
    data, the optimiser of the factored pairs, ...). Bad values and combinations are refused when it is built
    (``TrainingError``, a ``ValueError``), before any model is loaded."""

    # TrainingArguments fields whose defaults differ here
    output_dir: str | None = field(default=None, metadata={
        "help": "the Trainer's checkpoint folder; fiber-bundle train and run_training set it to OUTPUT/checkpoints "
                "(give it only to train_model)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    max_steps: int = field(default=100, metadata={"help": "optimiser steps"})
    seed: int = field(default=0, metadata={"help": "random seed (LoRA's initialisation, data order, the default "
                                                   "pydoc train / eval split)"})
    logging_steps: float = field(default=1, metadata={"help": "log the loss and the geometry every N steps"})
    save_strategy: SaveStrategy | str | None = field(default=None, metadata={
        "help": "when to write a checkpoint (default: 'steps' when --save_steps is set, else 'no'; SIGTERM always "
                "saves one)", "choices": [strategy.value for strategy in SaveStrategy]})
    save_steps: float = field(default=0, metadata={
        "help": "write a checkpoint to the checkpoint folder every N steps (0: none)"})
    report_to: list[str] = field(default_factory=list, metadata={
        "help": "integrations that receive every log, e.g. tensorboard wandb ('all': every installed one; default: "
                "none)"})
    dataloader_pin_memory: bool | None = field(default=None, metadata={
        "help": "pin the batches' memory (default: only when CUDA is available)"})

    # this project's fields
    mode: str | None = field(default=None, metadata={
        "help": "what trains: everything, only the metric (backbone frozen), or LoRA plus the metric (default: "
                "metric-only; full with --from-config)", "choices": TRAINING_MODES})
    from_config: str | None = field(default=None, metadata={
        "help": "train a freshly initialised model instead of MODEL: a JSON file of FiberBundleConfig fields or a size "
                "preset (tiny, small, base); gates start at its metric_gate_init / flatness_gate_init / "
                "ffn_gate_init, metric_rank 0 and ffn_metric_rank 0 give the Euclidean twin; --mode full"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "--from-config: the tokenizer, 'byte' (default: 256 byte tokens + <|endoftext|> + <|pad|>) or a "
                "tokenizer folder / Hub id"})
    data: list[str] | None = field(default=None, metadata={
        "help": "training text: .txt / .json(l) / .parquet files, a Hub dataset name, or a named corpus with its own "
                "held-out split: 'pydoc' (the default: Python's pydoc topics, split by topic) or 'python-stdlib' (the "
                "standard library's source, about 13 MB, split by module)"})
    eval_data: list[str] | None = field(default=None, metadata={
        "help": "held-out data in the same forms as --data"})
    block_size: int = field(default=256, metadata={"help": "tokens per packed training block"})
    batch_size: int | None = field(default=None, metadata={
        "help": "blocks per device and step: sets per_device_train_batch_size and per_device_eval_batch_size"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (--mode lora)"})
    metric_learning_rate: float | None = field(default=None, metadata={
        "help": "learning rate of the metric (fiber) parameters when it should differ from --learning_rate (e.g. "
                "--mode lora --learning_rate 1e-3 --metric_learning_rate 2e-2); AdamW only"})
    optimizer: str = field(default="adamw", metadata={
        "help": "adamw, or a Riemannian geometry for the factored pairs (LoRA pairs, metric generators, per-head "
                "W_Q / W_K in --mode full); the other parameters stay with AdamW", "choices": OPTIMIZERS})
    riemannian_learning_rate: float | None = field(default=None, metadata={
        "help": "learning rate of the factored pairs under a Riemannian --optimizer (default: --learning_rate); "
                "the steps are plain Riemannian gradient steps, so rates differ from AdamW's"})
    block: bool = field(default=False, metadata={
        "help": "the block variant of the geometry: each attention head's slice of a factor is its own factor (heads "
                "share the other one)"})
    equal_scale: bool = field(default=False, metadata={
        "help": "without --block, under a partial-isometry --optimizer (stiefel-*, grassmann) on W_Q / W_K: store each "
                "KV group's stacked query factor at scale sqrt(query heads per KV head), so that each head's query "
                "slice starts as large as --block makes it (a control for the query's scale)"})
    riemannian_pairs: str = field(default="all", metadata={
        "help": "the factored pairs a Riemannian --optimizer trains: all of them, or attention (only the per-head "
                "W_Q / W_K of --mode full; metric generators then stay with AdamW)", "choices": tuple(PAIRS)})
    orthonormal_start: bool | None = field(default=None, metadata={
        "help": "a partial-isometry --optimizer (stiefel-*, grassmann) on W_Q / W_K: make them orthonormal before the "
                "first step, which changes the model, so only for one trained from scratch (default: on with "
                "--from-config, off otherwise, where such a start is refused)"})
    retraction: str = field(default="qr", metadata={
        "help": "retraction of the partial-isometry optimizers (stiefel-*, grassmann): QR or polar factor",
        "choices": tuple(RETRACTIONS)})
    riemannian_gauge: str = field(default="balanced", metadata={
        "help": "the factors riemannian-embedded stores each retracted X as: balanced (U S^1/2, V S^1/2) or continuous "
                "(the factors of that X nearest the previous ones; for W_Q / W_K, whose RoPE breaks the gauge symmetry)",
        "choices": GAUGES})
    curvature_weight: float | None = field(default=None, metadata={
        "help": "weight of the curvature regulariser (default: the model config's)"})
    torsion_weight: float | None = field(default=None, metadata={
        "help": "weight of the torsion regulariser (default: the model config's)"})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA: load MODEL's backbone quantised to 4-bit NF4 with bitsandbytes (the metric stays in full "
                "precision) and train LoRA adapters plus the metric on it (--mode lora); needs the quantization extra "
                "(pip install 'fiber-bundle-transformers[quantization]')"})
    load_in_8bit: bool = field(default=False, metadata={
        "help": "as --load-in-4bit, with the backbone quantised to 8-bit (bitsandbytes LLM.int8)"})
    base_model_id: str | None = field(default=None, metadata={
        "help": "--mode lora: Hub id of the base model, recorded in adapter_config.json (default: MODEL)"})
    resume: bool = field(default=False, metadata={
        "help": "continue from the newest complete checkpoint in OUTPUT/checkpoints (a killed or preempted run "
                "continues exactly; with none yet, training starts from the beginning)"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace an OUTPUT that already holds a model or other files (once the new model is complete); "
                "without --resume, also start again over an earlier run's checkpoints"})
    quiet: bool = field(default=False, metadata={
        "help": "print neither log lines nor a progress bar (the report_to integrations still receive every log)"})
    print_logs: bool = field(default=True, metadata={
        "help": "print each log entry (loss, learning rate, geometry) under the progress bar; false: the bar only"})

    def __post_init__(self):
        if self.mode is None:  # a fresh model has no pretrained backbone to keep: everything trains
            self.mode = "full" if self.from_config is not None else "metric-only"
        if self.orthonormal_start is None:  # only a fresh model's W_Q / W_K may be moved onto the manifold
            self.orthonormal_start = self.from_config is not None
        derived = self.output_dir is None
        if self.batch_size is not None:
            self.per_device_train_batch_size = self.per_device_eval_batch_size = self.batch_size
        if self.save_strategy is None:
            self.save_strategy = "steps" if self.save_steps else "no"
        if self.dataloader_pin_memory is None:
            self.dataloader_pin_memory = torch.cuda.is_available()
        if self.quiet:
            self.disable_tqdm, self.print_logs = True, False
        self._check_deepspeed()  # before transformers reads the config: its errors would not name the fix
        super().__post_init__()
        self._check_options()
        if derived:  # None, not transformers' "trainer_output": run_training sets OUTPUT/checkpoints
            self.output_dir = None

    def _check_options(self) -> None:
        for name, choices in (("mode", TRAINING_MODES), ("optimizer", OPTIMIZERS), ("retraction", tuple(RETRACTIONS)),
                              ("riemannian_pairs", tuple(PAIRS)), ("riemannian_gauge", GAUGES)):
            if getattr(self, name) not in choices:
                raise TrainingError(f"{name} {getattr(self, name)!r} is not one of {', '.join(choices)}.")
        if self.optimizer == "adamw" and (self.block or self.riemannian_learning_rate is not None
                                          or self.retraction != "qr" or self.riemannian_pairs != "all"):
            raise TrainingError("block, riemannian_learning_rate, riemannian_pairs and retraction apply to a Riemannian "
                                "optimizer, not to adamw.")
        if self.equal_scale and (self.block or self.optimizer in ("adamw", *FIXED_RANK)):
            raise TrainingError("equal_scale gives the stacked query factor of a partial-isometry optimizer the block "
                                "variant's scale: use it with --optimizer stiefel-euclidean, stiefel-canonical or "
                                "grassmann and without --block.")
        if self.riemannian_gauge != "balanced" and self.optimizer != "riemannian-embedded":
            raise TrainingError(f"riemannian_gauge applies to the riemannian-embedded optimizer, not to "
                                f"{self.optimizer}: drop --riemannian_gauge or choose --optimizer riemannian-embedded.")
        if self.optimizer != "adamw" and self.metric_learning_rate is not None:
            raise TrainingError("metric_learning_rate applies to the AdamW optimiser; with a Riemannian optimizer the "
                                "parameters outside the factored pairs use learning_rate.")
        if (self.optimizer != "adamw" or self.metric_learning_rate is not None) and self.optim != OptimizerNames(
                TrainingArguments.__dataclass_fields__["optim"].default):
            raise TrainingError("optim (transformers' optimiser) applies with optimizer adamw and no "
                                "metric_learning_rate, where the Trainer builds the optimiser; drop --optim.")
        if self.from_config is not None and self.mode != "full":
            raise TrainingError(f"--from-config trains a freshly initialised model, which has no pretrained backbone "
                                f"to freeze or adapt: drop --mode {self.mode} (from-config training is --mode full).")
        if self.from_config is not None and (self.load_in_4bit or self.load_in_8bit):
            raise TrainingError("--from-config trains every weight of a fresh model in full precision: drop "
                                "--load-in-4bit / --load-in-8bit (they quantise a pretrained backbone for QLoRA).")
        if self.tokenizer is not None and self.from_config is None:
            raise TrainingError("--tokenizer applies with --from-config; a model folder brings its own tokenizer.")
        if self.load_in_4bit and self.load_in_8bit:
            raise TrainingError("load_in_4bit and load_in_8bit are two ways to quantise the backbone: pass one of "
                                "--load-in-4bit and --load-in-8bit, not both.")
        if self.save_strategy == SaveStrategy.STEPS and not self.save_steps:
            raise TrainingError("save_strategy 'steps' needs save_steps > 0: pass --save_steps N.")

    def _check_deepspeed(self) -> None:
        """--deepspeed CONFIG: DeepSpeed installed, the config readable, and a ZeRO-3 run able to save its model."""
        if not self.deepspeed:
            return
        if importlib.util.find_spec("deepspeed") is None:
            raise TrainingError("--deepspeed needs DeepSpeed, which is not installed: pip install "
                                "'fiber-bundle-transformers[deepspeed]' (on a machine without a GPU also set "
                                "DS_ACCELERATOR=cpu).")
        config = self.deepspeed
        if isinstance(config, str):
            if not Path(config).is_file():
                raise TrainingError(f"--deepspeed {config}: no such file; pass the path of a DeepSpeed JSON config "
                                    "(docs/distributed.md has one).")
            try:
                config = json.loads(Path(config).read_text())
            except json.JSONDecodeError as error:
                raise TrainingError(f"--deepspeed {self.deepspeed} is not valid JSON ({error}).") from None
        zero = config.get("zero_optimization") or {}
        if zero.get("stage") == 3:
            if not zero.get("stage3_gather_16bit_weights_on_model_save", False):
                raise TrainingError('ZeRO stage 3 splits every weight across the processes, and without '
                                    '"stage3_gather_16bit_weights_on_model_save": true in the config\'s '
                                    '"zero_optimization" the trained model cannot be gathered and saved: add it to '
                                    f"{self.deepspeed if isinstance(self.deepspeed, str) else 'the config'}.")
            if self.mode == "lora":
                raise TrainingError("--mode lora trains a small adapter, which ZeRO-3 would only split: use ZeRO "
                                    "stage 2 (or plain DDP, no --deepspeed) for LoRA.")
        if self.load_in_4bit or self.load_in_8bit:
            raise TrainingError("--load-in-4bit / --load-in-8bit (bitsandbytes) do not train under DeepSpeed: drop "
                                "--deepspeed for QLoRA.")

    def quantization_config(self):
        """The ``BitsAndBytesConfig`` that ``load_in_4bit`` (NF4) or ``load_in_8bit`` asks for, None for a
        full-precision load; ``TrainingError`` naming the extra to install when bitsandbytes is missing."""
        if not (self.load_in_4bit or self.load_in_8bit):
            return None
        if importlib.util.find_spec("bitsandbytes") is None:
            flag = "--load-in-4bit" if self.load_in_4bit else "--load-in-8bit"
            raise TrainingError(f"{flag} needs bitsandbytes, which is not installed: pip install "
                                "'fiber-bundle-transformers[quantization]' (or pip install bitsandbytes).")
        from transformers import BitsAndBytesConfig

        if self.load_in_4bit:
            return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
        return BitsAndBytesConfig(load_in_8bit=True)

    @property
    def checkpoint_to_resume(self) -> bool | str | None:
        """What ``Trainer.train(resume_from_checkpoint=...)`` gets: ``resume_from_checkpoint`` when given, else True
        (the newest complete checkpoint) with ``resume``, else None."""
        return self.resume_from_checkpoint or (True if self.resume else None)
