"""Four observables of the continuous geometric (integro-differential) picture of a Transformer, as estimators with
known answers and adapters that read them off real models.

The picture: the residual stream X (n tokens x D) evolves in depth under two flows per layer, attention A(X) (a
nonlocal, integral operator over tokens) and the MLP F(X) (local, per token), and a layer is one step of operator
splitting: X <- Phi_F(Phi_A(X)) with Phi_V^h(X) = X + h V(X) (Lie-Trotter, h = 1 in the model). The abstract states
phenomena, not formulas; the definitions below are this project's, each a choice stated where it is one.

1. Splitting torsion (``splitting_torsion``): T(h) = Phi_F^h(Phi_A^h(X)) - Phi_A^h(Phi_F^h(X)). Expanding,
   T(h) = h^2 (DF[A] - DA[F])(X) + O(h^3): the Lie bracket of the two fields, so ||T(h)|| ~ h^2 as h -> 0 (exponent 2,
   the splitting-theory prediction), and a commuting pair has T = 0 at every h.
2. Symmetric ablation (``ablation_responses``): remove layer i (its update u_i = x_{i+1} - x_i set to 0) and measure
   the change of the held-out loss; layers i and L - 1 - i are the symmetric pair. The prediction it is set against
   is the dual (adjoint) equation's first-order one, dLoss_i ~ -<g_{i+1}, u_i> with g_{i+1} = dLoss/dx_{i+1} (the
   adjoint state at depth i + 1): the asymmetry of a symmetric pair is predicted by the adjoint state, not by the
   pair's position alone. Choices: the loss (mean next-token cross-entropy) as the response, ablation as zeroing the
   whole layer's update.
3. RoPE-torus recurrence (``rope_recurrence``): a query / key pair whose complex rotary coordinates give
   c_j = q_j conj(k_j) scores Re sum_j c_j e^{i m theta_j} at relative offset m: a point moving on the torus of
   frequencies theta_j. Its recurrence amplitude r(m) = |sum_j c_j e^{i m theta_j}| / sum_j |c_j| is at most 1, reached
   only where every phase arg c_j + m theta_j aligns (at m = 0 when q = k); for frequencies spread evenly over a band
   the sum is an oscillatory integral and r(m) = O(1/m), the prediction. RoPE's frequencies are spaced geometrically
   (theta_j = base^(-2j/d)), and for such a band the integral is logarithmic instead: with every c_j = 1,
   r(m) ~ |ln(1 / (m theta_min)) - gamma + i pi/2| / ln(theta_max / theta_min) for 1/theta_max << m << 1/theta_min
   (the pairs with m theta_j < 1 have not yet turned). Measured: r(m) averaged over real (q, k) pairs and its upper
   envelope (the largest value in [m, 2m)), each with a power-law fit and a fit linear in ln m; one frequency alone
   recurs exactly (exponent 0).
4. Probability current of training (``probability_current``): a parameter trajectory projected to a few directions,
   z_t, after burn-in; the stationary probability current shows as the antisymmetric part of the lag-tau covariance,
   (C(tau) - C(tau)^T) / 2 with C(tau) = E[z_{t+tau} z_t^T], whose entry for the top two principal directions is at
   lag 1 the mean signed area swept per step (the Levy area rate). Detailed balance (a reversible process)
   makes it 0; a rotational drift makes it nonzero. Interval: batch means over consecutive stretches of the run.
"""

import math

import torch
from transformers import TrainerCallback

from .measures import fit_power_law, linear_fit


# ----------------------------------------------------------------------------------------------------------------------
# 1. splitting torsion
# ----------------------------------------------------------------------------------------------------------------------
def splitting_torsion(attention, mlp, x: torch.Tensor, steps, fit_below: float = 0.1) -> dict:
    """||T(h)|| / ||x|| for each step h (``attention``, ``mlp``: the two fields, callables X -> X of x's shape), the
    fitted exponent of ||T(h)|| ~ c h^p over the steps h <= ``fit_below`` (the prediction is the h -> 0 limit), with
    its 95 % interval and R^2, and the bracket estimate ||T(h)|| / h^2 at the smallest h. Evaluate in float64: at
    h = 1e-3 the torsion is ~1e-6 of x."""
    steps = sorted(float(h) for h in steps)
    norm = torch.linalg.vector_norm(x).item()
    a0, f0 = attention(x), mlp(x)
    torsion = []
    for h in steps:
        a_then_f = x + h * a0 + h * mlp(x + h * a0)  # Phi_F(Phi_A(x)): the model's order
        f_then_a = x + h * f0 + h * attention(x + h * f0)  # Phi_A(Phi_F(x))
        torsion.append(torch.linalg.vector_norm(a_then_f - f_then_a).item() / norm)
    positive = [(h, t) for h, t in zip(steps, torsion) if t > 0 and h <= fit_below]
    fit = fit_power_law(*zip(*positive)) if len(positive) >= 3 else None
    return {"steps": steps, "relative_torsion": torsion, "fit": fit,
            "bracket": torsion[0] / steps[0] ** 2,  # ||[A, F](x)|| / ||x||, the h -> 0 limit
            "update_at_1": {"attention": torch.linalg.vector_norm(a0).item() / norm,
                            "mlp": torch.linalg.vector_norm(f0).item() / norm}}


def decoder_layers(model):
    """The decoder layers of a causal LM (Fiber Bundle or a transformers LLaMA-family class)."""
    from .probes import decoder

    return decoder(model).layers


def layer_inputs(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
    """What each decoder layer receives in one forward pass of ``ids``: (hidden states, keyword arguments such as
    ``position_embeddings`` and ``attention_mask``), read with pre-hooks so that it is exactly the model's own call."""
    from .probes import decoder, run_with_hooks

    captured = []
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, kwargs: captured.append((args[0] if args else kwargs["hidden_states"], dict(kwargs))),
        with_kwargs=True) for layer in decoder(model).layers]
    run_with_hooks(model, ids, hooks)
    return captured


_ATTENTION_KEYS = ("position_embeddings", "attention_mask", "position_ids")


def layer_flows(layer, kwargs: dict):
    """(A, F): the attention and MLP fields of one decoder layer, X -> update, with the layer's own call arguments.

    A(X) = self_attn(input_layernorm(X)) (a Fiber Bundle layer's metric read from that normalised X); F(X) =
    mlp(post_attention_layernorm(X)), preconditioned by the Fiber Bundle MLP metric read from input_layernorm(X): an
    autonomous field. (The model's layer reads the MLP metric at the layer's input, before attention, so its h = 1
    step equals Phi_F(Phi_A(X)) exactly only where that metric is off; ``tests/test_ide.py`` checks both cases.)"""
    call = {key: value for key, value in kwargs.items() if key in _ATTENTION_KEYS}
    fibre = hasattr(layer, "fiber_state")

    def attention(x):
        normed = layer.input_layernorm(x)
        extra = {"metric": layer.fiber_state(normed, kwargs.get("metric"))} if fibre else {}
        return layer.self_attn(normed, **call, **extra)[0]

    def mlp(x):
        update = layer.mlp(layer.post_attention_layernorm(x))
        if fibre and getattr(layer, "fiber", None) is not None and layer.config.ffn_metric_rank > 0:
            update = layer.precondition(layer.input_layernorm(x), update)
        return update

    return attention, mlp


def model_torsion(model, ids: torch.Tensor, steps, layers=None) -> list[dict]:
    """``splitting_torsion`` of every decoder layer (or ``layers``) of ``model`` on the hidden states it receives from
    ``ids``. Pass a float64 model: the small steps need it."""
    from .probes import decoder

    inputs = layer_inputs(model, ids)
    blocks = decoder(model).layers
    chosen = range(len(blocks)) if layers is None else layers
    results = []
    with torch.no_grad():
        for i in chosen:
            if not hasattr(blocks[i], "mlp"):
                raise ValueError(f"layer {i} has no MLP (attention_only): there is no second flow to split.")
            x, kwargs = inputs[i]
            attention, mlp = layer_flows(blocks[i], kwargs)
            results.append({"layer": i, **splitting_torsion(attention, mlp, x, steps)})
    return results


# ----------------------------------------------------------------------------------------------------------------------
# 2. symmetric ablation and the adjoint prediction
# ----------------------------------------------------------------------------------------------------------------------
def _remove(fraction: float):
    """A forward hook that removes ``fraction`` of a decoder layer's update: output x + (1 - fraction) u for input x
    and update u (fraction 1: the layer becomes the identity, its output exactly its input)."""

    def hook(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        kept = hidden if fraction == 1 else hidden + (1 - fraction) * (out - hidden)
        return (kept, *output[1:]) if isinstance(output, tuple) else kept

    return hook


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in the logits' own dtype (transformers' loss casts to float32, which would hide
    the differences a float64 model can resolve)."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def ablation_responses(model, ids: torch.Tensor, fractions=()) -> dict:
    """Per layer i: the held-out loss change when layer i is removed (measured), the adjoint's first-order prediction
    -<dLoss/dx_{i+1}, u_i>, and per symmetric pair (i, L - 1 - i) the measured and predicted asymmetries
    dLoss_i - dLoss_{L-1-i}. Also the fits of measured against predicted (slope, R^2, the slope's interval) over all
    layers and over the pairs' asymmetries, and how many pairs' asymmetries have the predicted sign. For each of
    ``fractions`` (say 0.01, 0.1), the same with only that fraction s of each update removed, where the prediction is
    s times the full one: the slope tends to 1 as s -> 0 (the dual law holds to first order), and how far it moves
    from 1 as s grows to 1 says how nonlinear the whole layer's removal is."""
    from .probes import decoder

    ids = ids.to(model.device)
    blocks = decoder(model).layers
    outputs, inputs = [], []

    def keep(module, args, kwargs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.retain_grad()
        outputs.append(hidden)
        inputs.append(args[0] if args else kwargs["hidden_states"])

    hooks = [layer.register_forward_hook(keep, with_kwargs=True) for layer in blocks]
    try:
        with torch.enable_grad():
            full = _loss(model, ids)
            full.backward()
    finally:
        for hook in hooks:
            hook.remove()
    predicted = [-(out.grad * (out - inp)).sum().item() for out, inp in zip(outputs, inputs)]
    model.zero_grad(set_to_none=True)

    def responses(fraction):
        changes = []
        with torch.no_grad():
            for layer in blocks:
                hook = layer.register_forward_hook(_remove(fraction), with_kwargs=True)
                try:
                    changes.append(_loss(model, ids).item() - full.item())
                finally:
                    hook.remove()
        return changes

    measured = responses(1.0)
    partial = []
    for fraction in fractions:
        changes = responses(float(fraction))
        partial.append({"fraction": float(fraction), "measured": changes,
                        "fit": linear_fit([fraction * p for p in predicted], changes)})
    count = len(blocks)
    pairs = [{"layers": [i, count - 1 - i], "measured": measured[i] - measured[count - 1 - i],
              "predicted": predicted[i] - predicted[count - 1 - i]} for i in range(count // 2)]
    return {"loss": full.item(), "measured": measured, "predicted": predicted, "pairs": pairs,
            "fit": linear_fit(predicted, measured),
            "pair_fit": linear_fit([p["predicted"] for p in pairs], [p["measured"] for p in pairs]),
            "pair_signs_agree": sum((p["measured"] > 0) == (p["predicted"] > 0) for p in pairs), "partial": partial}


# ----------------------------------------------------------------------------------------------------------------------
# 3. recurrence on the rotary torus
# ----------------------------------------------------------------------------------------------------------------------
def rotary_coefficients(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """c_j = q_j conj(k_j) of pre-rotation queries and keys (..., d) in transformers' rotate_half layout, where
    coordinates j and j + d/2 form the complex pair turned by frequency theta_j. Returns (..., d/2) complex128."""
    half = q.shape[-1] // 2
    zq = torch.complex(q[..., :half].double(), q[..., half:].double())
    zk = torch.complex(k[..., :half].double(), k[..., half:].double())
    return zq * zk.conj()


def rope_recurrence(coefficients: torch.Tensor, inv_freq: torch.Tensor, offsets) -> torch.Tensor:
    """r(m) = |sum_j c_j e^{i m theta_j}| / sum_j |c_j| for each offset m: (..., len(offsets)) for coefficients
    (..., d/2)."""
    m = torch.as_tensor(offsets, dtype=torch.float64)
    phases = torch.exp(1j * m[:, None] * inv_freq.double()[None, :])  # (M, d/2)
    return (coefficients @ phases.T).abs() / coefficients.abs().sum(-1, keepdim=True).clamp_min(1e-300)


def recurrence_decay(offsets, values, low: int, high: int | None = None) -> dict:
    """The mean recurrence and its upper envelope (the largest value over [m, 2m)) at offsets m in [low, high / 2], each
    with a power-law fit (exponent -1 is the O(1/m) prediction) and a linear fit in ln m (a geometric band's
    logarithmic decay: slope near -1 / ln(theta_max / theta_min))."""
    offsets = [int(m) for m in offsets]
    values = [float(v) for v in values]
    high = high or offsets[-1]
    at = {m: v for m, v in zip(offsets, values)}
    grid = [m for m in offsets if low <= m <= high // 2]
    envelope = [max(at[o] for o in offsets if m <= o < 2 * m) for m in grid]
    mean = [at[m] for m in grid]
    logs = [math.log(m) for m in grid]
    return {"offsets": grid, "mean": mean, "envelope": envelope, "mean_fit": _fit(grid, mean),
            "envelope_fit": _fit(grid, envelope), "mean_log_fit": linear_fit(logs, mean),
            "envelope_log_fit": linear_fit(logs, envelope)}


def _fit(x, y) -> dict | None:
    points = [(a, b) for a, b in zip(x, y) if b > 0]
    return fit_power_law(*zip(*points)) if len(points) >= 3 else None


# ----------------------------------------------------------------------------------------------------------------------
# 4. probability current of training
# ----------------------------------------------------------------------------------------------------------------------
def principal_plane(z: torch.Tensor) -> torch.Tensor:
    """(T, 2): the top two principal coordinates of a trajectory (T x K), centred and standardised."""
    z = z - z.mean(0)
    _, _, vh = torch.linalg.svd(z, full_matrices=False)
    plane = z @ vh[:2].T
    return plane / plane.std(0).clamp_min(1e-300)


def probability_current(trajectory: torch.Tensor, *, lag: int = 1, burn_in: float = 0.2, batches: int = 20) -> dict:
    """The stationary probability current of a trajectory (T x K, one row per step) in the plane of its top two
    principal directions after ``burn_in`` (a fraction of the steps): a = (E[x_t y_{t+lag}] - E[y_t x_{t+lag}]) / 2 of
    the standardised coordinates, the antisymmetric part of the lag-``lag`` covariance, equal at lag 1 to the mean
    signed area swept per step; its 95 % interval by batch means (the statistic on ``batches`` consecutive stretches,
    a t-interval of their mean: stretches much longer than the correlation time are nearly independent); and the
    statistic of the time-reversed trajectory (exactly -a). The sign follows the principal axes' orientation, which
    is arbitrary: the magnitude and whether the interval excludes 0 are the result."""
    from scipy import stats

    z = trajectory.double()
    z = z[int(burn_in * len(z)):]
    if len(z) < batches * (lag + 4):
        raise ValueError(f"{len(z)} steps after burn-in: too few for a lag-{lag} current in {batches} batches.")
    z = z - z.mean(0)
    plane = principal_plane(z)

    def statistic(p):
        x, y = p[:, 0], p[:, 1]
        return 0.5 * ((x[:-lag] * y[lag:]).mean() - (y[:-lag] * x[lag:]).mean()).item()

    value = statistic(plane)
    size = len(plane) // batches
    means = torch.tensor([statistic(plane[b * size : (b + 1) * size]) for b in range(batches)], dtype=torch.float64)
    half = float(stats.t.ppf(0.975, batches - 1)) * means.std().item() / math.sqrt(batches)
    low, high = value - half, value + half
    return {"current": value, "interval": [low, high], "excludes_zero": not (low <= 0.0 <= high),
            "time_reversed": statistic(plane.flip(0)), "steps": len(plane), "lag": lag, "batches": batches,
            "explained_variance": (torch.linalg.svdvals(z)[:2] ** 2 / (z ** 2).sum()).tolist()}


class TrajectoryRecorder(TrainerCallback):
    """Records K fixed random projections of the trainable parameters after every optimiser step (a Trainer callback):
    z_t = P theta_t with P Gaussian (seeded, 1 / sqrt(N) scaled), held in memory once (K x N floats)."""

    def __init__(self, parameters, dims: int = 8, seed: int = 0):
        self.parameters = [p for p in parameters if p.requires_grad]
        generator = torch.Generator().manual_seed(seed)
        count = sum(p.numel() for p in self.parameters)
        self.projection = torch.randn(dims, count, generator=generator, dtype=torch.float32) / math.sqrt(count)
        self.rows = []

    def record(self) -> None:
        with torch.no_grad():
            flat = torch.cat([p.detach().float().reshape(-1) for p in self.parameters])
            self.rows.append(self.projection @ flat)

    def on_step_end(self, args, state, control, **kwargs):
        self.record()

    def trajectory(self) -> torch.Tensor:
        return torch.stack(self.rows)


# ----------------------------------------------------------------------------------------------------------------------
# on real models
# ----------------------------------------------------------------------------------------------------------------------
def rotary_pairs(model, ids: torch.Tensor, pairs: int = 64, seed: int = 0) -> torch.Tensor:
    """c_j = q_j conj(k_j) for ``pairs`` random (query token, key token) pairs per layer and query head, from the
    pre-rotation queries and keys the model computes on ``ids`` (read at q_proj / k_proj; a query head is paired with
    its KV head). Returns (layers, heads, pairs, d/2) complex128."""
    from .probes import decoder, run_with_hooks

    config = model.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    seen = {}
    hooks = []
    for i, layer in enumerate(decoder(model).layers):
        for name in ("q_proj", "k_proj"):
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                lambda m, a, out, key=(i, name): seen.__setitem__(key, out.detach())))
    run_with_hooks(model, ids, hooks)
    generator = torch.Generator().manual_seed(seed)
    batch, n = ids.shape
    rows = torch.randint(0, batch, (pairs,), generator=generator)
    tokens = torch.randint(0, n, (pairs, 2), generator=generator)
    out = []
    for i in range(len(decoder(model).layers)):
        q = seen[(i, "q_proj")].view(batch, n, heads, d)
        k = seen[(i, "k_proj")].view(batch, n, kv, d)
        qs = q[rows, tokens[:, 0]]  # (pairs, heads, d)
        ks = k[rows, tokens[:, 1]].repeat_interleave(heads // kv, dim=1)  # query head h reads KV head h // (heads / kv)
        out.append(rotary_coefficients(qs, ks).transpose(0, 1))  # (heads, pairs, d/2)
    return torch.stack(out)


def detrend(z: torch.Tensor, degree: int = 1) -> torch.Tensor:
    """Each column minus its least-squares polynomial of ``degree`` in the step index (1: a line)."""
    t = torch.linspace(-1.0, 1.0, len(z), dtype=torch.float64)  # scaled: powers of raw step counts are ill-conditioned
    design = torch.stack([t ** power for power in range(degree + 1)], dim=1)
    return z - design @ torch.linalg.lstsq(design, z).solution


def trajectory_currents(trajectory, degree: int = 1, lags=(1, 2, 5, 10), batches: int = 10) -> dict:
    """``probability_current`` at each lag of a recorded trajectory (steps x K) after removing a polynomial trend of
    ``degree`` from each coordinate: the slow relaxation of a run that has not reached its steady state sweeps area
    too, and a higher degree (2 beside the default 1) checks that the current is not that drift's curvature."""
    z = detrend(torch.as_tensor(trajectory, dtype=torch.float64), degree)
    return {lag: probability_current(z, lag=lag, batches=batches) for lag in lags}
