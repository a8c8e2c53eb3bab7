"""The measures, as small pure functions on tensors with known answers (each is tested on constructed inputs).

- ``relative_residual``: Dong et al. (2021)'s rank-collapse residual, ||X - 1 x^T|| / ||X|| with x the best constant row.
- ``energy_effective_rank``: the number of singular directions holding a fraction of a matrix's energy (sum of sigma^2),
  the intrinsic-rank measure of attention logit fields (arXiv:2604.04384 uses 90 %). It lives, with ``singular_values``,
  ``centre_rows`` and ``summarise``, in ``fiber_bundle.conversion.rank`` (the conversion's ``--metric-rank auto`` uses
  it) and is re-exported here.
- ``numerical_rank``: singular values above a relative tolerance (the non-Gram check of docs/design.md 1.2).
- ``linear_fit``: the least-squares line with its R^2 and the slope's interval; ``fit_power_law``: the same line in
  log-log space, y = c x^p (the RMSNorm Lipschitz exponent, the IDE picture's decay exponents).
- ``curve_settling``: how far a loss curve has flattened: its drop over the last third of its steps over its drop over
  the first third (the scaling study's "enough tokens" criterion: under a tenth).
- ``size_trend``: the slope of a paired difference against log10(parameters) across model sizes, with a bootstrap
  interval that resamples the seeds within each size.
- ``rmsnorm_lipschitz``: the largest spectral norm of RMSNorm's Jacobian over a set of inputs, by autograd.
- ``attention_entropy``: entropy of each row of attention probabilities.
"""

import math

import torch

from fiber_bundle.conversion.rank import centre_rows, energy_effective_rank, singular_values, summarise  # noqa: F401


def relative_residual(x: torch.Tensor) -> torch.Tensor:
    """||X - 1 x^T||_F / ||X||_F for X (..., n, D); x is the mean row, the constant row closest to X in Frobenius norm.

    0 exactly when every token holds the same vector (rank collapse); sqrt((n-1)/n) for an n x n orthogonal X.
    Returns (...). Computed in float64 so that values far below float32's 1e-7 stay measurable.
    """
    x = x.to(torch.float64)
    centred = x - x.mean(dim=-2, keepdim=True)  # X - 1 x^T: (..., n, D)
    return torch.linalg.matrix_norm(centred) / torch.linalg.matrix_norm(x).clamp_min(torch.finfo(x.dtype).tiny)


def first_depth_below(curve, threshold: float) -> int | None:
    """The first index (layer) at which ``curve`` falls below ``threshold``; None if it never does."""
    for depth, value in enumerate(curve):
        if value < threshold:
            return depth
    return None


def numerical_rank(matrix: torch.Tensor | None = None, *, rtol: float = 1e-10,
                   singular: torch.Tensor | None = None) -> torch.Tensor:
    """Number of singular values above ``rtol`` x the largest, per matrix of (..., m, n). Compute the matrix in float64
    when the rank is to be read at rtol 1e-10 (float32 rounding alone fills the spectrum at ~1e-7)."""
    sigma = singular_values(matrix) if singular is None else singular.to(torch.float64)
    return (sigma > rtol * sigma[..., :1]).sum(-1)


def attention_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row of probabilities (..., n_keys) -> (...); zero probabilities contribute 0."""
    p = probs.to(torch.float64)
    return -(p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))).sum(-1)


def _least_squares_line(x, y, confidence: float) -> tuple[float, float, float, list[float] | None]:
    """(slope, intercept, R^2, the slope's t-interval at ``confidence``) of the least-squares line y = a x + b through
    two or more points; the interval (n - 2 degrees of freedom) is None for two, R^2 NaN for a constant y."""
    x = torch.as_tensor(x, dtype=torch.float64)
    y = torch.as_tensor(y, dtype=torch.float64)
    design = torch.stack([x, torch.ones_like(x)], dim=-1)  # (k, 2)
    solution = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
    ss_res = (y - design @ solution).pow(2).sum()
    ss_tot = (y - y.mean()).pow(2).sum()
    r2 = 1.0 - (ss_res / ss_tot).item() if ss_tot > 0 else float("nan")
    interval = None
    if x.numel() > 2:
        from scipy import stats

        spread = (x - x.mean()).pow(2).sum()
        stderr = math.sqrt(ss_res.item() / (x.numel() - 2) / spread.item()) if spread > 0 else float("nan")
        half = float(stats.t.ppf(0.5 + confidence / 2, x.numel() - 2)) * stderr
        interval = [solution[0].item() - half, solution[0].item() + half]
    return solution[0].item(), solution[1].item(), r2, interval


def linear_fit(x, y, confidence: float = 0.95) -> dict:
    """Least squares y = a x + b: slope, intercept, R^2 and the slope's t-interval (n - 2 degrees of freedom); all None
    for fewer than three points."""
    if len(x) < 3:  # two points fit any line exactly: no interval, no R^2 worth the name
        return {"slope": None, "intercept": None, "r2": None, "slope_interval": None}
    slope, intercept, r2, interval = _least_squares_line(x, y, confidence)
    r2 = 0.0 if math.isnan(r2) else r2  # a constant y: nothing explained (scipy.stats.linregress's convention)
    return {"slope": slope, "intercept": intercept, "r2": r2, "slope_interval": interval}


def fit_power_law(x, y, confidence: float = 0.95) -> dict:
    """Least-squares fit of log y = p log x + log c. Returns exponent p, prefactor c, R^2 of the log-log fit and the
    exponent's t-interval at ``confidence`` (n - 2 degrees of freedom; None for two points)."""
    if len(x) < 2:
        raise ValueError("a power-law fit needs at least two points.")
    log = lambda v: torch.log(torch.as_tensor(v, dtype=torch.float64))  # noqa: E731
    exponent, log_prefactor, r2, interval = _least_squares_line(log(x), log(y), confidence)
    return {"exponent": exponent, "prefactor": math.exp(log_prefactor), "r2": r2, "exponent_interval": interval}


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as LLaMA-family models compute it: weight * x / sqrt(mean(x^2) + eps)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rmsnorm_lipschitz(weight: torch.Tensor, eps: float, inputs: torch.Tensor) -> torch.Tensor:
    """Spectral norm of the Jacobian of ``rmsnorm(., weight, eps)`` at each input (k, D), by autograd (float64).

    The supremum over all inputs, reached at x = 0, is max|w| / sqrt(eps): the eps^(-1/2) scaling. Returns (k,)."""
    weight = weight.detach().to(torch.float64)
    jacobians = torch.func.vmap(torch.func.jacrev(lambda v: rmsnorm(v, weight, eps)))(inputs.to(torch.float64))
    return torch.linalg.matrix_norm(jacobians, ord=2)  # (k,)


def lipschitz_probes(dim: int, *, scales=None, per_scale: int = 1, seed: int = 0) -> torch.Tensor:
    """Inputs at magnitudes from 0 to 100 x unit RMS (random directions), where RMSNorm's Jacobian is largest near 0."""
    scales = [0.0, *torch.logspace(-8, 2, 11).tolist()] if scales is None else scales
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(len(scales) * per_scale, dim, generator=gen, dtype=torch.float64)
    factors = torch.tensor(scales, dtype=torch.float64).repeat_interleave(per_scale)[:, None]
    return directions * factors


def paired_interval(differences, *, confidence: float = 0.95, power: float = 0.8, resamples: int = 10_000,
                    seed: int = 0) -> dict:
    """What paired differences (arm minus reference, one per seed) say about the true mean difference.

    Returns the mean, sample std and count; the t-interval (Student's t with n - 1 degrees of freedom, two-sided at
    ``confidence``); a percentile bootstrap interval of the mean (``resamples`` seeded resamples), as a check that does
    not assume normality; and the smallest true difference the design would have detected (two-sided test at
    1 - ``confidence`` with probability ``power``: (t_{1-a/2} + t_power) s / sqrt(n), the usual approximation with the
    observed s). ``spans_zero`` says whether the t-interval contains 0. None entries are skipped; fewer than two
    differences give no interval."""
    from scipy import stats

    data = torch.tensor([float(v) for v in differences if v is not None], dtype=torch.float64)
    n = data.numel()
    if n < 2:
        return {"mean": data.mean().item() if n else None, "std": None, "count": n, "t_interval": None,
                "bootstrap_interval": None, "detectable_difference": None, "spans_zero": None}
    mean, std = data.mean().item(), data.std().item()  # sample std (n - 1)
    alpha = 1 - confidence
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * std / math.sqrt(n)  # plain floats: the result is JSON
    generator = torch.Generator().manual_seed(seed)
    means = data[torch.randint(0, n, (resamples, n), generator=generator)].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)).tolist()
    detectable = float(stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * std / math.sqrt(n)
    return {"mean": mean, "std": std, "count": n, "t_interval": [mean - half, mean + half],
            "bootstrap_interval": [low, high], "detectable_difference": detectable,
            "spans_zero": mean - half <= 0.0 <= mean + half}


def curve_settling(curve, threshold: float = 0.1) -> dict:
    """How far the loss curve ``curve`` ((step, loss) pairs, steps increasing) has flattened: with the steps from its
    first point to its last cut in thirds (losses between points linearly interpolated), the drop over the last third
    divided by the drop over the first third. ``settled`` says whether that ratio is under ``threshold`` (a tenth: the
    scaling study's criterion for enough tokens); a curve that does not fall over its first third gives no ratio."""
    steps = torch.tensor([float(step) for step, _ in curve], dtype=torch.float64)
    losses = torch.tensor([float(loss) for _, loss in curve], dtype=torch.float64)
    if steps.numel() < 2 or not bool((steps[1:] > steps[:-1]).all()):
        raise ValueError("a loss curve needs two or more points at increasing steps.")

    def at(step: float) -> float:  # the loss at ``step``, linear between the recorded points
        right = int(torch.searchsorted(steps, torch.tensor([step], dtype=torch.float64)).clamp(1, steps.numel() - 1))
        x0, x1, y0, y1 = steps[right - 1], steps[right], losses[right - 1], losses[right]
        return (y0 + (y1 - y0) * (step - x0) / (x1 - x0)).item()

    first, last = steps[0].item(), steps[-1].item()
    third = (last - first) / 3
    first_drop, last_drop = at(first) - at(first + third), at(last - third) - at(last)
    ratio = last_drop / first_drop if first_drop > 0 else None
    return {"from_step": first, "to_step": last, "first_third_drop": first_drop, "last_third_drop": last_drop,
            "ratio": ratio, "settled": ratio is not None and ratio < threshold}


def size_trend(sizes, *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0) -> dict:
    """The trend of a paired difference (arm minus reference, one per seed) with model size.

    ``sizes``: (parameters, differences) per model size, three or more sizes of two or more differences each. The slope
    is the least-squares line through each size's mean difference against log10(parameters) (each size weighs the
    same): the change of the mean difference per tenfold parameters. Its interval is a percentile bootstrap that
    resamples the seeds within each size (``resamples`` seeded draws); ``below_zero`` is the fraction of draws whose
    slope is negative. ``reading``: for a difference where negative favours the arm, "grows" when the whole interval
    is below zero (the arm's edge grows with size), "shrinks" when it is above, else "cannot be told apart from zero".
    """
    points = [(float(parameters), torch.tensor([float(d) for d in differences], dtype=torch.float64))
              for parameters, differences in sizes]
    if len(points) < 3 or any(data.numel() < 2 for _, data in points):
        raise ValueError("a trend across sizes needs three or more sizes, each with two or more paired differences.")
    if len({parameters for parameters, _ in points}) < len(points):
        raise ValueError("two sizes have the same parameter count: give each size once.")
    x = torch.log10(torch.tensor([parameters for parameters, _ in points], dtype=torch.float64))  # (k,)
    centred = x - x.mean()

    def slopes(means: torch.Tensor) -> torch.Tensor:  # (..., k) size means -> (...) least-squares slopes in x
        return ((means - means.mean(-1, keepdim=True)) * centred).sum(-1) / centred.pow(2).sum()

    means = torch.stack([data.mean() for _, data in points])  # (k,)
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.stack([data[torch.randint(0, data.numel(), (resamples, data.numel()), generator=generator)].mean(1)
                         for _, data in points], dim=-1)  # (resamples, k): each size's seeds resampled on their own
    draws = slopes(drawn)
    alpha = 1 - confidence
    low, high = torch.quantile(draws, torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)).tolist()
    slope = slopes(means).item()
    reading = "grows" if high < 0 else "shrinks" if low > 0 else "cannot be told apart from zero"
    return {"slope_per_tenfold_parameters": slope, "intercept": (means.mean() - slope * x.mean()).item(),
            "bootstrap_interval": [low, high], "below_zero": (draws < 0).double().mean().item(), "reading": reading,
            "log10_parameters": x.tolist(), "mean_differences": means.tolist(), "resamples": resamples}
