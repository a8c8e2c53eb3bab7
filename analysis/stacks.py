"""Pure-attention stacks (Dong et al., 2021): attention layers only, no MLP, no normalisation, optionally skip
connections, at random initialisation. The same weights (drawn from one seed) run with three score functions:

- ``euclidean``: the dot-product score q_i . k_j (alpha = gamma = 0), the stack Dong et al. analyse;
- ``euclidean-distance``: -1/2 ||q_i - k_j||^2 in one shared metric (alpha = 0, gamma = 1): distance, homogeneous;
- ``riemannian``: the geodesic score of docs/design.md 1.2 in each query token's own metric G_i = I + alpha U_i U_i^T
  (gamma = 1), with U_i generated from the token by the model's own fibre map (a code z_i = tanh(W_z RMSNorm(x_i)),
  factors bounded to spectral norm < 1).

So the comparison isolates the score function: distance versus dot product, and heterogeneous versus homogeneous metric.
Everything runs in float64, so residuals are measurable down to ~1e-15.
"""

import math
from dataclasses import asdict, dataclass, replace

import torch

from modeling_fiber_bundle.fiber_attention import bounded_factors, causal_allowed, geodesic_scores_reference

from .measures import first_depth_below, relative_residual, summarise

KINDS = ("euclidean", "euclidean-distance", "riemannian")


@dataclass
class StackSpec:
    """Shape and geometry of a pure-attention stack."""

    width: int = 64  # D
    heads: int = 4  # H, head dim d = D / H
    depth: int = 24  # layers
    tokens: int = 32  # n
    metric_rank: int = 2  # r
    code_width: int = 16  # m
    alpha: float = 1.0  # metric gate of the riemannian kind (alpha > -1)
    skip: bool = False  # X <- X + Attn(X) instead of X <- Attn(X)
    causal: bool = False  # Dong et al.'s analysis is bidirectional

    def __post_init__(self):
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}.")
        if self.alpha <= -1:
            raise ValueError(f"alpha must be > -1 (G = I + alpha U U^T must stay positive definite), got {self.alpha}.")
        for name in ("width", "heads", "depth", "tokens", "metric_rank", "code_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")


def _layer_weights(spec: StackSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Gaussian weights with variance 1/fan_in (so a layer keeps the scale of its input), float64."""
    d, m, r = spec.width // spec.heads, spec.code_width, spec.metric_rank
    draw = lambda fan_in, *shape: torch.randn(*shape, generator=gen, dtype=torch.float64) / fan_in**0.5  # noqa: E731
    return {
        "q": draw(spec.width, spec.width, spec.width), "k": draw(spec.width, spec.width, spec.width),
        "v": draw(spec.width, spec.width, spec.width), "o": draw(spec.width, spec.width, spec.width),
        "z": draw(spec.width, spec.width, m), "u": draw(m, m, spec.heads * r * d),
    }


def attention_layer(x: torch.Tensor, w: dict, spec: StackSpec, kind: str) -> torch.Tensor:
    """One multi-head attention layer (no skip): x (n, D) -> (n, D)."""
    n, width = x.shape
    h, d, r = spec.heads, width // spec.heads, spec.metric_rank
    split = lambda t: t.view(n, h, d).transpose(0, 1)[None]  # noqa: E731  (n, D) -> (1, H, n, d)
    query, key, value = split(x @ w["q"]), split(x @ w["k"]), split(x @ w["v"])
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12)  # the fibre code reads RMSNorm(x), as the model
    code = torch.tanh(normed @ w["z"])  # z_i: (n, m)
    factors = bounded_factors((code @ w["u"]).view(n, h, r, d).transpose(0, 1)[None])  # U_i^T: (1, H, n, r, d)
    alpha = torch.full((h,), spec.alpha if kind == "riemannian" else 0.0, dtype=x.dtype)
    gamma = torch.full((h,), 0.0 if kind == "euclidean" else 1.0, dtype=x.dtype)
    scores = geodesic_scores_reference(query, factors, key, alpha, gamma, d**-0.5)  # (1, H, n, n)
    if spec.causal:
        scores = scores.masked_fill(~causal_allowed(n, n, x.device), torch.finfo(x.dtype).min)
    out = torch.softmax(scores, dim=-1) @ value  # (1, H, n, d)
    return out[0].transpose(0, 1).reshape(n, width) @ w["o"]


def stack_residuals(spec: StackSpec, kind: str, seed: int) -> list[float]:
    """Relative residual of X after each layer (index 0: the input) of a random stack drawn from ``seed``."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {list(KINDS)}.")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.tokens, spec.width, generator=gen, dtype=torch.float64)
    layers = [_layer_weights(spec, gen) for _ in range(spec.depth)]  # same draws for every kind: a paired comparison
    curve = [relative_residual(x).item()]
    with torch.no_grad():
        for w in layers:
            update = attention_layer(x, w, spec, kind)
            x = x + update if spec.skip else update
            curve.append(relative_residual(x).item())
    return curve


def default_variants(alphas=(1.0, 10.0, 100.0)) -> dict[str, tuple[str, float]]:
    """Label -> (kind, alpha): the two Euclidean scores and the Riemannian one at each metric gate alpha."""
    variants = {"euclidean (dot product)": ("euclidean", 0.0), "euclidean distance": ("euclidean-distance", 0.0)}
    variants.update({f"riemannian, alpha={a:g}": ("riemannian", float(a)) for a in alphas})
    return variants


def collapse_experiment(spec: StackSpec, seeds, variants: dict[str, tuple[str, float]] | None = None,
                        threshold: float = 1e-3, progress=None) -> dict:
    """Residual curves of every variant (label -> (kind, alpha)) over ``seeds``: per depth the summary of the residual
    and of its log10 (mean ± std over seeds), and the first depth at which the residual falls below ``threshold``."""
    variants = default_variants() if variants is None else variants
    result = {"spec": asdict(spec), "threshold": threshold, "seeds": list(seeds), "variants": {}}
    for label, (kind, alpha) in variants.items():
        curves = []
        for seed in seeds:
            curves.append(stack_residuals(replace(spec, alpha=alpha), kind, seed))
            if progress is not None:
                progress.update(1)
        depths = [first_depth_below(curve, threshold) for curve in curves]
        result["variants"][label] = {
            "kind": kind, "alpha": alpha, "curves": curves,
            "per_depth": [summarise(values) for values in zip(*curves)],
            "log10_per_depth": [summarise([math.log10(max(v, 1e-300)) for v in values]) for values in zip(*curves)],
            "depth_below_threshold": depths,
            "depth_below_threshold_summary": summarise(depths),
            "seeds_reaching_threshold": sum(d is not None for d in depths),
        }
    return result
