"""Geometry logged alongside the loss: per-layer gates, and the connection proxies on a fixed probe batch."""

import torch

from .checkpoints import StagedCheckpointTrainer

GATES = {"attn_gate": "alpha", "flatness_gate": "gamma", "ffn_gate": "beta"}


def gate_values(model) -> dict[str, float]:
    """Mean gate value per layer and kind (alpha = exp(theta) - 1, gamma, beta = exp(phi) - 1). Under PEFT the
    trainable copy (``modules_to_save``) is the one reported."""
    found = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[-1] not in GATES or "fiber" not in parts or "original_module" in parts:
            continue
        layer = parts[parts.index("layers") + 1]
        value = param.detach().float()
        value = value if parts[-1] == "flatness_gate" else torch.expm1(value)
        found[f"geometry/layer{layer}/{GATES[parts[-1]]}"] = value.mean().item()
    return found


def _proxies(model, probe_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The curvature, torsion and anisotropy proxies of ``model`` on ``probe_ids``, one value per layer with an
    attention metric, without gradient (empty for a plain backbone or a model without attention metric)."""
    if getattr(model.config, "model_type", None) != "fiber_bundle":  # a plain backbone (e.g. LoRA on the source)
        return {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        geometry = model(input_ids=probe_ids.to(model.device), output_geometry=True).geometry
    model.train(was_training)
    return {key: values.float() for key, values in (geometry or {}).items()}


def probe_geometry(model, probe_ids: torch.Tensor) -> dict[str, float]:
    """Mean (over layers) curvature, torsion and anisotropy proxies of ``model`` on ``probe_ids``, without gradient."""
    return {f"geometry/{key}": values.mean().item() for key, values in _proxies(model, probe_ids).items()}


def geometry_by_layer(model, probe_ids: torch.Tensor) -> list[dict]:
    """Per layer: its gates (``gate_values``: alpha, gamma, beta) and its connection proxies on ``probe_ids``
    (curvature, torsion, anisotropy; layers without an attention metric have none): what the model card shows."""
    layers: dict[int, dict] = {}
    for key, value in gate_values(model).items():  # "geometry/layer{i}/{name}"
        _, layer, name = key.split("/")
        layers.setdefault(int(layer.removeprefix("layer")), {})[name] = value
    with_metric = sorted(index for index, values in layers.items() if "alpha" in values)  # the proxies' layer order
    for key, values in _proxies(model, probe_ids).items():
        for index, value in zip(with_metric, values.tolist(), strict=True):
            layers[index][key] = value
    return [{"layer": index, **layers[index]} for index in sorted(layers)]


class GeometryLoggingTrainer(StagedCheckpointTrainer):
    """transformers' Trainer whose training logs also carry the geometry (``gate_values`` and ``probe_geometry`` on
    ``probe_ids``), so every ``report_to`` integration and ``state.log_history`` see it next to the loss; its
    checkpoints are complete or absent and it stops cleanly on SIGTERM (``checkpoints.StagedCheckpointTrainer``)."""

    def __init__(self, *args, probe_ids: torch.Tensor | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe_ids = probe_ids

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # training steps, not the final summary or evaluation
            logs = {**logs, **gate_values(self.model)}
            if self.probe_ids is not None:
                logs.update(probe_geometry(self.model, self.probe_ids))
        super().log(logs, start_time)
