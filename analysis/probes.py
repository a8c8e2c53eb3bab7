"""Measurements on real models: what each layer's residual stream and attention logits look like on real text.

Works on a FiberBundleForCausalLM and on transformers' own LLaMA / Mistral / Qwen2 / Qwen3 classes alike: the project
keeps transformers' module names (``model.layers[i].self_attn.q_proj``, ``input_layernorm``), so one function reads
both. The attention logits are the model's own: ``fiber_bundle.conversion.rank`` records what each layer passes to its
attention function (a metric layer scores with its geodesic metric, any other with the dot product).
"""

import torch

from fiber_bundle.conversion.rank import each_layer_logits, suggest_metric_rank  # noqa: F401  (re-exported)
from modeling_fiber_bundle.fiber_attention import causal_allowed

from .measures import (
    attention_entropy,
    centre_rows,
    energy_effective_rank,
    fit_power_law,
    lipschitz_probes,
    numerical_rank,
    relative_residual,
    rmsnorm_lipschitz,
    singular_values,
    summarise,
)


def decoder(model):
    """The decoder stack (``.layers``, ``.rotary_emb``, ``.embed_tokens``, ``.norm``) of a causal LM."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise ValueError(f"{type(model).__name__} is not a LLaMA-family decoder (no .model.layers / rotary_emb).")
    return inner


def residual_stream(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """The hidden states entering each layer and leaving the last (before the final norm): L + 1 tensors (B, n, D).

    Read with forward hooks, so it is the same quantity for every model class (transformers' ``hidden_states`` output
    replaces its last entry by the normed state in some versions)."""
    inner = decoder(model)
    states = []
    take = lambda output: output[0] if isinstance(output, tuple) else output  # noqa: E731
    hooks = [inner.embed_tokens.register_forward_hook(lambda m, a, out: states.append(take(out).detach()))]
    hooks += [layer.register_forward_hook(lambda m, a, out: states.append(take(out).detach())) for layer in inner.layers]
    run_with_hooks(model, ids, hooks)
    return states


def run_with_hooks(model, ids: torch.Tensor, hooks) -> None:
    """One forward pass of ``ids`` without gradient, then every hook in ``hooks`` removed (also on error)."""
    try:
        with torch.no_grad():
            model(input_ids=ids.to(model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()


def _causal_probs(logits: torch.Tensor) -> torch.Tensor:
    n = logits.shape[-1]
    masked = logits.masked_fill(~causal_allowed(n, n, logits.device), torch.finfo(logits.dtype).min)
    return torch.softmax(masked.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


# ----------------------------------------------------------------------------------------------------------------------
# collapse on real models
# ----------------------------------------------------------------------------------------------------------------------
def model_collapse(model, ids: torch.Tensor) -> dict:
    """Relative residual of the residual stream entering each layer (and leaving the last), per sample; also without
    the first token, whose outsized norm (an attention sink) can dominate the whole matrix."""
    states = residual_stream(model, ids)
    all_tokens = torch.stack([relative_residual(h) for h in states], dim=-1)  # (B, L + 1)
    no_first = torch.stack([relative_residual(h[:, 1:]) for h in states], dim=-1)
    return {
        "layers": len(states) - 1,
        "per_sample": all_tokens.tolist(),
        "per_depth": [summarise(col.tolist()) for col in all_tokens.T],
        "per_depth_without_first_token": [summarise(col.tolist()) for col in no_first.T],
    }


# ----------------------------------------------------------------------------------------------------------------------
# intrinsic rank
# ----------------------------------------------------------------------------------------------------------------------
def interaction_spectrum(model, layer_idx: int) -> torch.Tensor:
    """Singular values of each head's learned interaction matrix W_Q^h^T W_K^h (D x D, rank <= d): (H, d).

    Why the QR: W_Q^T W_K = (Q_q R_q)(Q_k R_k)^T has the singular values of the d x d matrix R_q R_k^T."""
    attn = decoder(model).layers[layer_idx].self_attn
    d = attn.head_dim
    wq = attn.q_proj.weight.detach().to(torch.float64).view(-1, d, attn.q_proj.in_features)  # (H, d, D)
    wk = attn.k_proj.weight.detach().to(torch.float64).view(-1, d, attn.k_proj.in_features)  # (Hk, d, D)
    wk = wk.repeat_interleave(wq.shape[0] // wk.shape[0], dim=0)  # (H, d, D)
    r_q = torch.linalg.qr(wq.transpose(-1, -2)).R  # (H, d, d)
    r_k = torch.linalg.qr(wk.transpose(-1, -2)).R
    return singular_values(r_q @ r_k.transpose(-1, -2))


def intrinsic_rank(model, ids: torch.Tensor, *, threshold: float = 0.9, rtol: float = 1e-10, progress=None) -> dict:
    """Per layer and head: energy effective rank (at ``threshold``) of the row-centred logit matrix on ``ids`` (mean
    over samples) and of W_Q^T W_K, and the numerical rank (at ``rtol``) of the score matrix (max over samples).

    The numerical rank is meaningful only for a float64 model: a dot-product head has rank <= d (a Gram matrix), a
    homogeneous metric <= d + 1, and a heterogeneous metric can exceed d + 1 (docs/design.md 1.2's non-Gram property)."""
    layers = []
    for i, logits in each_layer_logits(model, ids):
        logits = logits.to(torch.float64)  # (B, H, n, n)
        text = energy_effective_rank(centre_rows(logits), threshold=threshold).to(torch.float64)  # (B, H)
        numeric = numerical_rank(logits, rtol=rtol)  # (B, H)
        wqk = energy_effective_rank(singular=interaction_spectrum(model, i), threshold=threshold)  # (H,)
        layers.append({
            "text_energy_rank": text.mean(0).tolist(),
            "score_numerical_rank": numeric.max(0).values.tolist(),
            "interaction_energy_rank": wqk.tolist(),
        })
        if progress is not None:
            progress.update(1)
    d = decoder(model).layers[0].self_attn.head_dim
    flat = lambda key: [v for layer in layers for v in layer[key]]  # noqa: E731
    return {
        "head_dim": d, "threshold": threshold, "rtol": rtol, "samples": ids.shape[0], "tokens": ids.shape[1],
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "layers": layers,
        "summary": {
            "text_energy_rank": summarise(flat("text_energy_rank")),
            "interaction_energy_rank": summarise(flat("interaction_energy_rank")),
            "score_numerical_rank": summarise(flat("score_numerical_rank")),
            "heads_above_gram_bound": sum(v > d + 1 for v in flat("score_numerical_rank")),
            "heads": len(flat("score_numerical_rank")),
        },
    }


# ----------------------------------------------------------------------------------------------------------------------
# geometry: connection proxies, RMSNorm Lipschitz constant, attention entropy
# ----------------------------------------------------------------------------------------------------------------------
def geometry_proxies(model, ids: torch.Tensor) -> dict | None:
    """Per-layer curvature, torsion and anisotropy (docs/design.md 1.4) on ``ids``, mean over samples; None for a model
    without a metric."""
    if getattr(model.config, "model_type", None) != "fiber_bundle":
        return None
    per_sample = []
    with torch.no_grad():
        for row in ids:
            geometry = model(input_ids=row[None].to(model.device), output_geometry=True).geometry
            if geometry is None:
                return None
            per_sample.append({k: v.double() for k, v in geometry.items()})
    return {key: torch.stack([s[key] for s in per_sample]).mean(0).tolist() for key in per_sample[0]}


def norm_lipschitz(weight: torch.Tensor, eps_values, data: torch.Tensor | None = None, seed: int = 0) -> dict:
    """RMSNorm's Lipschitz constant against eps: worst case over probe inputs at magnitudes from 0 up (where the
    prediction is max|w| eps^(-1/2)), and the mean local constant at real hidden states ``data`` (k, D), each with
    its fitted power law."""
    probes = lipschitz_probes(weight.shape[-1], seed=seed)
    worst = [rmsnorm_lipschitz(weight, eps, probes).max().item() for eps in eps_values]
    out = {"eps": list(eps_values), "worst_case": worst, "worst_case_fit": fit_power_law(eps_values, worst),
           "max_abs_weight": weight.abs().max().item()}
    if data is not None:
        local = [rmsnorm_lipschitz(weight, eps, data).mean().item() for eps in eps_values]
        out.update(on_data=local, on_data_fit=fit_power_law(eps_values, local))
    return out


def context_bins(n: int) -> list[tuple[int, int]]:
    """Context lengths 1..n in powers-of-two bins [1, 1], [2, 3], [4, 7], ..."""
    bins, low = [], 1
    while low <= n:
        bins.append((low, min(2 * low - 1, n)))
        low *= 2
    return bins


def entropy_by_context(model, ids: torch.Tensor) -> dict:
    """Mean attention entropy (nats, causal softmax, over samples and heads) per layer and context-length bin on
    ``ids``; the uniform distribution's entropy log(c) is the ceiling at context length c."""
    bins = context_bins(ids.shape[1])
    per_layer = []
    for _, logits in each_layer_logits(model, ids):
        entropy = attention_entropy(_causal_probs(logits))  # (B, H, n)
        by_position = entropy.mean(dim=(0, 1))  # (n,): row i has context length i + 1
        per_layer.append([by_position[lo - 1 : hi].mean().item() for lo, hi in bins])
    uniform = [torch.log(torch.arange(lo, hi + 1, dtype=torch.float64)).mean().item() for lo, hi in bins]
    return {"bins": bins, "uniform": uniform, "per_layer": per_layer,
            "mean_over_layers": [sum(col) / len(col) for col in zip(*per_layer)]}


def geometry_report(model, ids: torch.Tensor, *, eps_values=None, norm_layers=None, data_tokens: int = 16,
                    seed: int = 0) -> dict:
    """Connection proxies per layer, RMSNorm Lipschitz constant versus eps (for the input norms of ``norm_layers``,
    default first / middle / last, and the final norm), and attention entropy versus context length."""
    eps_values = [float(e) for e in (eps_values or torch.logspace(-10, -1, 10).tolist())]
    states = residual_stream(model, ids)
    inner = decoder(model)
    count = len(inner.layers)
    norm_layers = sorted({0, count // 2, count - 1} if norm_layers is None else set(norm_layers))
    if any(not 0 <= i < count for i in norm_layers):
        raise ValueError(f"norm layers must lie in [0, {count - 1}], got {norm_layers}.")
    gen = torch.Generator().manual_seed(seed)
    norms = {}
    for i in [*norm_layers, "final"]:
        module = inner.norm if i == "final" else inner.layers[i].input_layernorm
        hidden = states[-1] if i == "final" else states[i]
        flat = hidden.reshape(-1, hidden.shape[-1])
        data = flat[torch.randperm(flat.shape[0], generator=gen)[:data_tokens]]
        key = "final" if i == "final" else f"layer{i}"
        norms[key] = norm_lipschitz(module.weight, eps_values, data, seed)
        norms[key]["model_eps"] = float(getattr(module, "variance_epsilon", getattr(module, "eps", float("nan"))))
    return {"proxies": geometry_proxies(model, ids), "rmsnorm_lipschitz": norms,
            "attention_entropy": entropy_by_context(model, ids)}


def gate_ablation(model, eval_ids: torch.Tensor, batch_size: int = 8) -> dict | None:
    """Which part of a learned geometry carries the gain: held-out loss of the model as it is, with the attention
    metric switched off (alpha = gamma = 0 in every layer: dot-product attention), with the MLP preconditioner
    switched off (beta = 0), and with both off (the backbone). None for a model without a metric."""
    if getattr(model.config, "model_type", None) != "fiber_bundle":
        return None
    fibers = [layer.fiber for layer in decoder(model).layers if hasattr(layer, "fiber")]
    gates = {"attention": ("attn_gate", "flatness_gate"), "mlp": ("ffn_gate",)}
    saved = {id(f): {k: v.detach().clone() for k, v in f.named_parameters()} for f in fibers}

    def loss(off: tuple[str, ...]) -> float:
        with torch.no_grad():
            for fiber in fibers:
                for name, param in fiber.named_parameters():
                    param.copy_(saved[id(fiber)][name])
                    if any(name in gates[part] for part in off):
                        param.zero_()  # theta = 0 -> alpha = 0; gamma = 0; phi = 0 -> beta = 0
            total = 0.0
            for start in range(0, len(eval_ids), batch_size):
                batch = eval_ids[start : start + batch_size].to(model.device)
                total += model(input_ids=batch, labels=batch).loss.item() * len(batch)
        return total / len(eval_ids)

    try:
        result = {"learned": loss(()), "attention_metric_off": loss(("attention",)), "mlp_metric_off": loss(("mlp",)),
                  "backbone": loss(("attention", "mlp"))}
    finally:
        loss(())  # restore the learned gates
    return {**result, "blocks": len(eval_ids), "tokens_per_block": eval_ids.shape[1]}
