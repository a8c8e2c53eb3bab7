"""The three ways to train a (converted) Fiber Bundle model.

- ``full``: every parameter trains.
- ``metric-only``: the backbone is frozen; only each layer's ``fiber`` module (metric generators and gates) trains.
  The cheap way to learn geometry on a converted model, which starts as its source.
- ``lora``: PEFT LoRA on the attention and MLP projections, with the ``fiber`` modules trained alongside
  (``modules_to_save``). The model_type "fiber_bundle" has no PEFT defaults, so the targets are always explicit.
"""

import torch

TRAINING_MODES = ("full", "metric-only", "lora")
# LoRA targets for model_type "fiber_bundle": the backbone's projections (transformers' names are kept).
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


NO_METRIC = "metric-only training needs a model with a metric (metric_rank or ffn_metric_rank > 0)"


def mode_problem(mode: str, config) -> str | None:
    """Why ``mode`` cannot train a model of ``config`` (read before any weight is loaded), or None: an unknown mode,
    metric-only without a metric, or quantised weights where the mode trains them (full: every weight; metric-only and
    LoRA: the ``fiber`` modules, unless the quantisation skipped them)."""
    if mode not in TRAINING_MODES:
        return f"training mode {mode!r} is not one of {TRAINING_MODES}"
    if mode == "metric-only" and not (getattr(config, "metric_rank", 0) or getattr(config, "ffn_metric_rank", 0)):
        return f"{NO_METRIC}; this model has none: use --mode full or lora, or convert its source with --metric-rank"
    quantisation = getattr(config, "quantization_config", None)
    if not quantisation:
        return None
    quantisation = quantisation if isinstance(quantisation, dict) else quantisation.to_dict()
    method = quantisation.get("quant_method", "quantised")
    skipped = quantisation.get("llm_int8_skip_modules") or quantisation.get("modules_to_not_convert") or []
    if mode == "full":
        return (f"the model's weights are quantised ({method}) and --mode full trains every weight, which needs "
                "full-precision weights: train a full-precision copy (convert the unquantised source), or use --mode "
                "lora on a quantisation that skips the fiber modules")
    if not any("fiber" in name for name in skipped):
        return (f"the model's weights are quantised ({method}) including its fiber (metric) modules, which --mode "
                f"{mode} trains in full precision: quantise with the fiber modules skipped (llm_int8_skip_modules="
                "['fiber']) or train a full-precision copy")
    return None


def prepare_for_training(model, mode: str, *, lora_r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0):
    """Set what trains for ``mode``; returns the model to train (a PeftModel for ``lora``)."""
    if mode not in TRAINING_MODES:
        raise ValueError(f"training mode {mode!r} is not one of {TRAINING_MODES}.")
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
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=LORA_TARGET_MODULES,
        modules_to_save=["fiber"] if geometry else None, task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_geometry_parameter(name: str) -> bool:
    """Whether a parameter name (of a model or its PEFT wrapper) belongs to a layer's ``fiber`` module."""
    return ".fiber." in f".{name}"


def trainable_parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]
