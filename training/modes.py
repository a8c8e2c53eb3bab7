"""The three ways to train a (converted) Fiber Bundle model.

- ``full``: every parameter trains.
- ``metric-only``: the backbone is frozen; only each layer's ``fiber`` module (metric generators and gates) trains.
  The cheap way to learn geometry on a converted model, which starts as its source.
- ``lora``: PEFT LoRA on the attention and MLP projections, with the ``fiber`` modules trained alongside
  (``modules_to_save``). The model_type "fiber_bundle" has no PEFT defaults, so the targets are always explicit.
  On a backbone loaded quantised (bitsandbytes 4-bit NF4 or 8-bit: ``--load-in-4bit`` / ``--load-in-8bit``) this is
  QLoRA: the model keeps its ``fiber`` modules in full precision (``_keep_in_fp32_modules``), and peft's
  ``prepare_model_for_kbit_training`` runs before the adapters are attached. Full and metric-only training refuse a
  quantised model (``mode_problem``).
"""

import torch

TRAINING_MODES = ("full", "metric-only", "lora")
# LoRA targets for model_type "fiber_bundle": the backbone's projections (transformers' names are kept).
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


NO_METRIC = "metric-only training needs a model with a metric (metric_rank or ffn_metric_rank > 0)"


# Quantisation methods that leave the fiber modules in full precision on their own: transformers' bitsandbytes 4-bit
# and 8-bit quantizers skip the model's ``_keep_in_fp32_modules``, where FiberBundlePreTrainedModel names them.
KEEPS_METRIC = ("bitsandbytes",)
# What a quantisation config must skip for the fiber modules to stay unquantised (the quantizers match a module name's
# suffix), for the methods that do not honour ``_keep_in_fp32_modules``.
FIBER_LINEARS = ["fiber.code_proj", "fiber.attn_factor_proj", "fiber.ffn_factor_proj"]


def mode_problem(mode: str, config, quantization=None) -> str | None:
    """Why ``mode`` cannot train a model of ``config`` (read before any weight is loaded), or None: an unknown mode,
    metric-only without a metric, or quantised weights in a mode that cannot train them: full (every weight needs
    gradients), metric-only (transformers' Trainer trains a quantised model only through adapters), or any mode that
    trains the fiber modules where the quantisation took them too. ``quantization`` is the config the model is loaded
    with (this project's model class then keeps the fiber modules in full precision under bitsandbytes); without it,
    the folder's own ``config.quantization_config`` (saved quantised weights: the fiber modules count as unquantised
    only when its skip list names them, as a saved config does not record what the model class kept)."""
    if mode not in TRAINING_MODES:
        return f"training mode {mode!r} is not one of {TRAINING_MODES}"
    if mode == "metric-only" and not (getattr(config, "metric_rank", 0) or getattr(config, "ffn_metric_rank", 0)):
        return f"{NO_METRIC}; this model has none: use --mode full or lora, or convert its source with --metric-rank"
    quantisation = quantization if quantization is not None else getattr(config, "quantization_config", None)
    if not quantisation:
        return None
    quantisation = quantisation if isinstance(quantisation, dict) else quantisation.to_dict()
    method = str(getattr(quantisation.get("quant_method"), "value", quantisation.get("quant_method", "quantised")))
    skipped = quantisation.get("llm_int8_skip_modules") or quantisation.get("modules_to_not_convert") or []
    metric_kept = any("fiber" in name for name in skipped) or (quantization is not None and method in KEEPS_METRIC)
    if mode == "full":
        return (f"the model's weights are quantised ({method}) and --mode full trains every weight, which needs "
                "full-precision weights: use --mode lora (QLoRA: LoRA adapters and the metric train, the quantised "
                "backbone stays frozen), or train a full-precision folder without --load-in-4bit / --load-in-8bit")
    if not metric_kept:
        return (f"the model's weights are quantised ({method}) including its fiber (metric) modules, which --mode "
                f"{mode} trains in full precision: load the full-precision folder with --load-in-4bit or "
                f"--load-in-8bit (the fiber modules stay unquantised), or quantise with them skipped "
                f"(modules_to_not_convert={FIBER_LINEARS})")
    if mode == "metric-only":
        return (f"the model's weights are quantised ({method}) and transformers' Trainer trains a quantised model only "
                "through adapters: use --mode lora (the metric trains beside the LoRA adapters), or train --mode "
                "metric-only on a full-precision folder without --load-in-4bit / --load-in-8bit")
    return None


def prepare_for_training(model, mode: str, *, lora_r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0,
                         gradient_checkpointing: bool = False):
    """Set what trains for ``mode``; returns the model to train (a PeftModel for ``lora``). A quantised model (loaded
    with a bitsandbytes ``quantization_config``) trains only in ``lora`` mode (QLoRA), after peft's
    ``prepare_model_for_kbit_training`` (with ``gradient_checkpointing`` as asked); other modes raise ValueError."""
    if mode not in TRAINING_MODES:
        raise ValueError(f"training mode {mode!r} is not one of {TRAINING_MODES}.")
    if getattr(model, "hf_quantizer", None) is not None:
        problem = mode_problem(mode, model.config, model.config.quantization_config)  # quantised at its loading
        unquantised = all(p.is_floating_point() for p in getattr(model, "geometry_parameters", list)())
        if problem is None and not unquantised:  # a model class that does not keep its metric in full precision
            problem = (f"the fiber (metric) modules were quantised too, and --mode {mode} trains them in full "
                       f"precision: load the model with this project's code, which keeps them unquantised, or skip "
                       f"them in the quantisation config (modules_to_not_convert={FIBER_LINEARS})")
        if problem:
            raise ValueError(f"{problem}.")
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    if mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    geometry = model.geometry_parameters() if hasattr(model, "geometry_parameters") else []  # a plain backbone: none
    if mode == "metric-only":
        if not geometry:
            raise ValueError(f"{NO_METRIC}.")
        for p in model.parameters():
            p.requires_grad_(False)
        for p in geometry:
            p.requires_grad_(True)
        return model
    from peft import get_peft_model

    return get_peft_model(model, lora_config(lora_r, lora_alpha, lora_dropout, geometry=bool(geometry)))


def lora_config(r: int = 8, alpha: int = 16, dropout: float = 0.0, *, geometry: bool = True):
    """The PEFT ``LoraConfig`` of ``--mode lora`` (and of TRL's ``peft_config``: training/trl_recipes.py): adapters of
    rank ``r`` on the backbone's projections (``LORA_TARGET_MODULES``) and, with ``geometry`` (a model with a metric),
    each layer's ``fiber`` module trained alongside in full (``modules_to_save``: saved with the adapter)."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=LORA_TARGET_MODULES,
                      modules_to_save=["fiber"] if geometry else None, task_type="CAUSAL_LM")


def is_geometry_parameter(name: str) -> bool:
    """Whether a parameter name (of a model or its PEFT wrapper) belongs to a layer's ``fiber`` module."""
    return ".fiber." in f".{name}"


def trainable_parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]
