"""The intrinsic rank of a model's attention logits, and the metric rank a conversion picks from it
(``fiber-bundle convert --metric-rank auto``).

The logits are read from the model's own attention, not from a copy of it: for the duration of one forward, the
attention functions the layers call are wrapped so that they record their inputs (query and key after q/k norm and
RoPE, the scale, and for a Fiber Bundle metric layer the turned factors, alpha and gamma); the logits are then the
model's score function (``geodesic_scores_reference``, the dot product where alpha = gamma = 0) of those inputs. This
works on transformers' own LLaMA / Mistral / Qwen2 / Qwen3 classes and on Fiber Bundle models alike.

Imports torch, transformers and the model package only (``analysis`` builds its measurements on this module).
"""

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from modeling_fiber_bundle.fiber_attention import geodesic_scores_reference
from modeling_fiber_bundle.modeling_fiber_bundle import expand_factors, repeat_kv

# The attention functions a layer looks up by name in its modeling file when the model runs eager attention:
# transformers' ``eager_attention_forward`` (the default every ``ALL_ATTENTION_FUNCTIONS.get_interface`` call falls back
# to, in every modeling file) and, in a Fiber Bundle modeling file, the metric layers' ``geodesic_attention_forward``
# (the fast paths) and ``reference_attention_forward`` (the readable one, ``fiber_attention_path="reference"``).
ATTENTION_FUNCTIONS = ("eager_attention_forward", "geodesic_attention_forward", "reference_attention_forward")


class AttentionCall(NamedTuple):
    """What one layer passed to its attention function (detached tensors).

    query (B, H, n, d) and key (B, Hk, kv, d) as the score reads them (after q/k norm and RoPE); ``scaling`` the softmax
    scale; for a metric layer ``factors`` (B, Hf, n, r, d) turned with the query's rotation and ``alpha``, ``gamma``
    (H,); all three None for a dot-product layer.
    """

    query: torch.Tensor
    key: torch.Tensor
    scaling: float
    factors: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    gamma: torch.Tensor | None = None

    def logits(self) -> torch.Tensor:
        """Pre-softmax logits of every (query, key) pair, causal mask not applied: (B, H, n, kv), in at least float32,
        scale included, keys repeated over the GQA group."""
        b, heads, n, d = self.query.shape
        key = repeat_kv(self.key, heads // self.key.shape[1])  # (B, H, kv, d)
        if self.factors is None:  # the dot-product score: no metric (alpha = gamma = 0)
            factors = self.query.new_zeros(b, heads, n, 1, d)
            alpha = gamma = self.query.new_zeros(heads)
        else:
            factors, alpha, gamma = expand_factors(self.factors, heads), self.alpha, self.gamma  # (B, H, n, r, d)
        return geodesic_scores_reference(self.query, factors, key, alpha, gamma, self.scaling)


@contextmanager
def recorded_attention(model) -> Iterator[dict[int, AttentionCall]]:
    """Inside the block, each forward of ``model`` records what every layer passes to its attention function, as a
    dict {layer index: ``AttentionCall``} (the last call of a layer wins).

    Meanwhile the model runs eager attention, so every layer calls a function of its modeling file by name
    (``ATTENTION_FUNCTIONS``); those names are wrapped. The implementation and the functions are restored on exit.
    """
    calls: dict[int, AttentionCall] = {}

    def recording(function):
        def record(module, query, key, value, attention_mask, *args, **kwargs):
            geometry = (kwargs.get(name) for name in ("factors", "alpha", "gamma"))
            calls[module.layer_idx] = AttentionCall(
                query.detach(), key.detach(), kwargs["scaling"], *(t if t is None else t.detach() for t in geometry)
            )
            return function(module, query, key, value, attention_mask, *args, **kwargs)

        return record

    files = {sys.modules[type(m).__module__] for m in model.modules()}  # transformers' or ours, also remote code
    originals = [(file, name, getattr(file, name)) for file in files for name in ATTENTION_FUNCTIONS
                 if callable(getattr(file, name, None))]
    implementation = model.config._attn_implementation
    try:
        if implementation != "eager":
            model.set_attn_implementation("eager")
        for file, name, function in originals:
            setattr(file, name, recording(function))
        yield calls
    finally:
        for file, name, function in originals:
            setattr(file, name, function)
        if model.config._attn_implementation != implementation:
            model.set_attn_implementation(implementation)


def attention_calls(model, ids: torch.Tensor) -> list[AttentionCall]:
    """Every layer's attention inputs on ``ids`` (B, n), from one forward without a cache: one ``AttentionCall`` per
    layer, in layer order."""
    with recorded_attention(model) as calls, torch.no_grad():
        model(input_ids=ids.to(model.device), use_cache=False)
    layers = model.config.num_hidden_layers
    if sorted(calls) != list(range(layers)):
        raise ValueError(
            f"{type(model).__name__}: {len(calls)} of {layers} layers called an attention function the probe can read "
            f"({' / '.join(ATTENTION_FUNCTIONS)} in eager mode); pass a LLaMA-family decoder (LLaMA, Mistral, Qwen2, "
            "Qwen3 or a Fiber Bundle model)."
        )
    return [calls[i] for i in range(layers)]


def each_layer_logits(model, ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(layer index, pre-softmax logits (B, H, n, n), causal mask not applied) for every layer on ``ids``, each
    computed when asked for (one layer's n x n logits at a time)."""
    for i, call in enumerate(attention_calls(model, ids)):
        yield i, call.logits()


# ----------------------------------------------------------------------------------------------------------------------
# spectra
# ----------------------------------------------------------------------------------------------------------------------
def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """Singular values (descending) of (..., m, n), in float64."""
    return torch.linalg.svdvals(matrix.to(torch.float64))


def energy_effective_rank(matrix: torch.Tensor | None = None, *, threshold: float = 0.9,
                          singular: torch.Tensor | None = None) -> torch.Tensor:
    """The smallest k such that the top k singular values hold ``threshold`` of sum(sigma^2); per matrix of (..., m, n)
    (or from precomputed ``singular`` values (..., k)). A zero matrix has rank 0. Returns an integer tensor (...)."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}.")
    sigma = singular_values(matrix) if singular is None else singular.to(torch.float64)
    energy = sigma.pow(2).cumsum(-1)  # (..., k)
    total = energy[..., -1:]
    # why the slack: a matrix of k equal singular values must read k at threshold 1, despite rounding in the cumsum
    reached = energy >= threshold * total * (1 - 1e-12)
    rank = torch.argmax(reached.to(torch.int8), dim=-1) + 1  # first index where the threshold is reached
    return torch.where(total[..., 0] > 0, rank, torch.zeros_like(rank))


def centre_rows(logits: torch.Tensor) -> torch.Tensor:
    """Subtract each row's mean: softmax ignores a per-row constant, so this is the part of the logits that matters."""
    return logits - logits.mean(dim=-1, keepdim=True)


def summarise(values) -> dict:
    """Mean, sample std (ddof 1), min and max of a list of numbers (None entries skipped)."""
    data = [float(v) for v in values if v is not None]
    if not data:
        return {"mean": None, "std": None, "min": None, "max": None, "count": 0}
    mean = sum(data) / len(data)
    std = math.sqrt(sum((v - mean) ** 2 for v in data) / (len(data) - 1)) if len(data) > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(data), "max": max(data), "count": len(data)}


# ----------------------------------------------------------------------------------------------------------------------
# the metric rank of a conversion
# ----------------------------------------------------------------------------------------------------------------------
def suggest_metric_rank(model, ids: torch.Tensor, *, threshold: float = 0.9) -> tuple[int, dict]:
    """The metric rank r for converting ``model``, from the intrinsic rank of its attention logits on ``ids``.

    Rule: r = the median over layers and heads of the logits' energy effective rank (90 %), clamped to [1, d / 4].
    Why: real text concentrates each head's logit field into a few directions (the intrinsic rank); per-token metrics
    of that rank can re-weight every direction the text uses, and a larger rank spends parameters on directions the
    text does not excite. Returns r and the figures behind it (for the conversion report)."""
    ranks, d = [], None
    for call in attention_calls(model, ids):
        d = call.query.shape[-1]
        ranks += energy_effective_rank(centre_rows(call.logits()), threshold=threshold).flatten().tolist()
    median = float(torch.tensor(ranks, dtype=torch.float64).median())
    rank = int(min(max(1, round(median)), max(1, d // 4)))
    reason = {
        "rule": f"median energy effective rank ({threshold:.0%}) of the attention logits on calibration text, "
                f"clamped to [1, head_dim/4 = {max(1, d // 4)}]",
        "median_text_energy_rank": median, "text_energy_rank": summarise(ranks), "head_dim": d,
        "calibration_tokens": int(ids.numel()), "metric_rank": rank,
    }
    return rank, reason
