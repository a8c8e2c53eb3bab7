"""The observables of the continuous geometric (IDE) picture (``analysis/ide.py``), each estimator checked on a case
with a known answer: a commuting pair of flows has zero torsion and a non-commuting linear pair torsion exactly h^2;
the model's layer is the Lie-Trotter step of its two fields; the adjoint prediction of an ablation becomes exact as
the layers' updates shrink; one rotary frequency recurs exactly and a band of them is suppressed as 1/m; a reversible
process has no probability current and a rotating one the current its dynamics fix."""

import math

import pytest
import torch

from fiber_bundle.analysis import ide


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------------------------
# 1. splitting torsion
# ----------------------------------------------------------------------------------------------------------------------
def test_commuting_flows_have_no_torsion_and_linear_ones_exactly_h_squared():
    x = rand(2, 5, 6)
    b = rand(6, 6, seed=1)
    c = 0.3 * b @ b + 2 * b  # a polynomial in B commutes with it
    steps = [1e-3, 1e-2, 1e-1, 1.0]
    commuting = ide.splitting_torsion(lambda v: v @ b, lambda v: v @ c, x, steps)
    assert max(commuting["relative_torsion"]) < 1e-13
    d = rand(6, 6, seed=2)
    other = ide.splitting_torsion(lambda v: v @ b, lambda v: v @ d, x, steps)
    # T(h) = h^2 x (BD - DB) exactly for linear fields
    exact = torch.linalg.vector_norm(x @ (b @ d - d @ b)).item() / torch.linalg.vector_norm(x).item()
    assert other["relative_torsion"] == pytest.approx([h * h * exact for h in steps], rel=1e-9)
    assert other["fit"]["exponent"] == pytest.approx(2.0, abs=1e-9) and other["fit"]["r2"] > 1 - 1e-12
    assert other["bracket"] == pytest.approx(exact, rel=1e-9)


def test_a_layer_is_the_lie_trotter_step_of_its_two_fields():
    """At h = 1, Phi_F(Phi_A(x)) is the model's own layer output (LLaMA, and a Fiber Bundle layer whose MLP metric is
    off); a Fiber Bundle MLP metric reads the layer's input, so there the autonomous split differs. Torsion of a real
    (tiny, float64) layer scales as h^2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import TINY, random_ids, set_gates, tiny_model
    from fiber_bundle.analysis.probes import residual_stream

    ids = random_ids(2, 10)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=TINY["vocab_size"], hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).double()
    fibre_off = set_gates(tiny_model(), beta=0.0, noise=0.0)  # attention metric on, MLP metric at beta = 0
    fibre_on = set_gates(tiny_model())
    for model, exact in ((llama, True), (fibre_off, True), (fibre_on, False)):
        model.eval()
        inputs = ide.layer_inputs(model, ids)
        states = residual_stream(model, ids)
        for i, (x, kwargs) in enumerate(inputs):
            attention, mlp = ide.layer_flows(ide.decoder_layers(model)[i], kwargs)
            with torch.no_grad():
                after = x + attention(x)
                step = after + mlp(after)
            difference = (step - states[i + 1]).abs().max().item()
            assert (difference < 1e-12) if exact else (difference > 1e-6), (type(model).__name__, i, difference)
    torsion = ide.model_torsion(fibre_on, ids, [1e-4, 1e-3, 1e-2])
    assert len(torsion) == TINY["num_hidden_layers"]
    assert all(abs(layer["fit"]["exponent"] - 2.0) < 0.05 for layer in torsion)


# ----------------------------------------------------------------------------------------------------------------------
# 2. ablation and its adjoint prediction
# ----------------------------------------------------------------------------------------------------------------------
def test_adjoint_prediction_of_an_ablation_becomes_exact_as_updates_shrink(monkeypatch):
    """Scaling every layer's output projections by eps makes each update O(eps): the first-order (adjoint)
    prediction then misses the measured loss change by O(eps^2), a relative error O(eps). (RMSNorm computes in float32
    as LLaMA's does, which would bury O(eps^2) under rounding: here it computes in the model's float64.)"""
    from helpers import random_ids, tiny_model
    from modeling_fiber_bundle.modeling_fiber_bundle import FiberBundleRMSNorm

    def exact_norm(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(FiberBundleRMSNorm, "forward", exact_norm)
    ids = random_ids(2, 12)
    errors = []
    for eps in (1e-2, 1e-3, 1e-4):
        model = tiny_model(metric_rank=0, ffn_metric_rank=0)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(eps)
                layer.mlp.down_proj.weight.mul_(eps)
        result = ide.ablation_responses(model, ids)
        assert len(result["measured"]) == len(result["predicted"]) == 2 and len(result["pairs"]) == 1
        errors.append(max(abs(m - p) / abs(m) for m, p in zip(result["measured"], result["predicted"])))
    assert errors[2] < 3e-3 and errors[2] < errors[1] / 5 < errors[0] / 10  # shrinking like eps
    pair = result["pairs"][0]
    assert pair["measured"] == pytest.approx(result["measured"][0] - result["measured"][1])
    deeper = tiny_model(metric_rank=0, ffn_metric_rank=0, num_hidden_layers=6)  # three symmetric pairs
    with torch.no_grad():
        for layer in deeper.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-4)
            layer.mlp.down_proj.weight.mul_(1e-4)
    result = ide.ablation_responses(deeper, ids)
    assert len(result["pairs"]) == 3 and result["pairs"][2]["layers"] == [2, 3]
    assert result["pair_fit"]["slope"] == pytest.approx(1.0, abs=1e-2) and result["pair_fit"]["r2"] > 0.999
    assert result["fit"]["slope"] == pytest.approx(1.0, abs=1e-2) and result["pair_signs_agree"] == 3
    # unscaled, removing a small fraction s of each update: the prediction s times the full one holds to first order
    model = tiny_model(metric_rank=0, ffn_metric_rank=0, num_hidden_layers=6)
    result = ide.ablation_responses(model, ids, fractions=(1e-3, 0.5))
    small, large = result["partial"]
    assert small["fraction"] == 1e-3 and len(small["measured"]) == 6
    assert small["fit"]["slope"] == pytest.approx(1.0, abs=5e-3) and small["fit"]["r2"] > 0.9999
    assert all(m == pytest.approx(1e-3 * p, rel=2e-2) for m, p in zip(small["measured"], result["predicted"]))
    assert large["fit"]["r2"] < small["fit"]["r2"]


def test_linear_fit_recovers_a_known_line():
    from fiber_bundle.analysis.measures import linear_fit

    fit = linear_fit([0, 1, 2, 3, 4], [1, 3.1, 4.9, 7.05, 9.0])
    assert fit["slope"] == pytest.approx(1.99, abs=0.02) and fit["r2"] > 0.99
    assert linear_fit([0, 1], [1, 2])["slope_interval"] is None
    assert fit["slope_interval"][0] < fit["slope"] < fit["slope_interval"][1]


# ----------------------------------------------------------------------------------------------------------------------
# 3. the rotary torus
# ----------------------------------------------------------------------------------------------------------------------
def test_rotary_coefficients_give_the_rotated_score():
    """Re sum_j c_j e^{i m theta_j} is the dot product of the query rotated at position p + m with the key rotated at p
    (the model's own rotary code), for every m."""
    from modeling_fiber_bundle.fiber_attention import apply_rotary

    d, base = 16, 10000.0
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    q, k = rand(d), rand(d, seed=1)
    c = ide.rotary_coefficients(q, k)
    for p, m in ((0, 0), (3, 5), (100, 77), (7, 1000)):
        rotated = []
        for position, vector in ((p + m, q), (p, k)):
            angles = torch.cat([position * inv_freq, position * inv_freq])  # the model's (cos, sin) layout
            rotated.append(apply_rotary(vector, angles.cos(), angles.sin()))
        score = rotated[0] @ rotated[1]
        assert score.item() == pytest.approx((c * torch.exp(1j * m * inv_freq)).sum().real.item(), rel=1e-10)


def test_one_frequency_recurs_and_a_band_is_suppressed_as_one_over_m():
    offsets = list(range(1, 2049))
    one = ide.rope_recurrence(torch.ones(8, dtype=torch.complex128), torch.full((8,), 0.37), offsets)
    assert torch.allclose(one, torch.ones_like(one))  # every phase moves together: it never leaves
    flat = ide.recurrence_decay(offsets, one.tolist(), low=8)
    assert abs(flat["envelope_fit"]["exponent"]) < 1e-9
    count, a, b = 8192, 0.05, 0.25  # a dense band: the sum is the oscillatory integral over [a, b]
    band = a + (b - a) * (torch.arange(count, dtype=torch.float64) + 0.5) / count
    r = ide.rope_recurrence(torch.ones(count, dtype=torch.complex128), band, offsets)
    assert all(r[m - 1] <= 1.01 * 2 / (m * (b - a)) for m in offsets)  # |int e^{i m t} dt| / (b - a) bound
    decay = ide.recurrence_decay(offsets, r.tolist(), low=16)
    assert decay["envelope_fit"]["exponent"] == pytest.approx(-1.0, abs=0.1)


def test_a_geometric_band_like_ropes_decays_logarithmically_not_as_one_over_m():
    """RoPE's frequencies are spaced geometrically: the sum is the integral of e^{i m theta} d theta / theta, whose
    closed form Ci and Si give r(m) exactly for a dense band, and which falls linearly in ln m with slope near
    -1 / ln(theta_max / theta_min), far from the power law m^-1."""
    from scipy.special import sici

    count, low, high = 20000, 1e-6, 1.0
    band = torch.exp(torch.linspace(math.log(low), math.log(high), count, dtype=torch.float64))
    offsets = [int(m) for m in torch.logspace(2, 4.5, 40).round().tolist()]
    r = ide.rope_recurrence(torch.ones(count, dtype=torch.complex128), band, offsets)
    span = math.log(high / low)
    for m, value in zip(offsets, r.tolist()):
        (si_high, ci_high), (si_low, ci_low) = sici(m * high), sici(m * low)
        assert value == pytest.approx(abs(complex(ci_high - ci_low, si_high - si_low)) / span, abs=3e-3)
    decay = ide.recurrence_decay(offsets, r.tolist(), low=100, high=offsets[-1])
    fit = decay["mean_log_fit"]
    assert fit["slope"] == pytest.approx(-1 / span, rel=0.1) and fit["r2"] > 0.999
    assert decay["mean_fit"]["exponent"] > -0.5  # nowhere near the O(1/m) law


# ----------------------------------------------------------------------------------------------------------------------
# 4. probability current
# ----------------------------------------------------------------------------------------------------------------------
def ar1(rotation: float, steps: int = 20000, radius: float = 0.9, dims: int = 2, seed: int = 0) -> torch.Tensor:
    """z_{t+1} = radius R(rotation) z_t + noise (the first two coordinates; any others independent AR(1) with smaller
    variance): stationary, reversible exactly when rotation = 0."""
    generator = torch.Generator().manual_seed(seed)
    m = torch.eye(dims, dtype=torch.float64) * 0.5
    m[:2, :2] = radius * torch.tensor([[math.cos(rotation), -math.sin(rotation)],
                                       [math.sin(rotation), math.cos(rotation)]], dtype=torch.float64)
    z = torch.zeros(steps, dims, dtype=torch.float64)
    noise = torch.randn(steps, dims, generator=generator, dtype=torch.float64)
    for t in range(1, steps):
        z[t] = m @ z[t - 1] + noise[t]
    return z


def test_a_reversible_process_has_no_current_and_a_rotating_one_its_own():
    """Over 40 reversible runs the 95 % interval covers the true current 0 about 95 % of the time (at least 34: a
    binomial tail of about 1 % below that) and the estimates centre on 0; a rotating AR(1) gives its own current."""
    covered, estimates = 0, []
    for seed in range(40):
        reversible = ide.probability_current(ar1(0.0, steps=8000, seed=seed), burn_in=0.05)
        covered += not reversible["excludes_zero"]
        estimates.append(reversible["current"])
        assert reversible["time_reversed"] == pytest.approx(-reversible["current"])
    assert covered >= 34 and abs(sum(estimates) / 40) < 0.003
    rotating = ide.probability_current(ar1(0.3, dims=4), burn_in=0.05)
    # isotropic stationary covariance: the standardised lag-1 covariance is radius R(rotation), whose antisymmetric
    # part is radius sin(rotation) in either orientation of the principal axes
    assert abs(rotating["current"]) == pytest.approx(0.9 * math.sin(0.3), abs=0.02)
    assert rotating["excludes_zero"] and rotating["steps"] == 19000
    with pytest.raises(ValueError, match="too few"):
        ide.probability_current(ar1(0.3, steps=20))


def test_a_curved_drift_sweeps_area_that_quadratic_detrending_removes():
    """A run still relaxing is not a steady state: a reversible process plus a drift whose coordinates are a parabola
    and a cubic (a loop once lines are removed) shows a 'current' after linear detrending in most of 20 runs; removing
    quadratics leaves the reversible process, whose intervals cover 0 (trajectory_currents, degree 2)."""
    u = torch.linspace(-1, 1, 400, dtype=torch.float64)
    drift = 20 * torch.stack([(3 * u ** 2 - 1) / 2, (5 * u ** 3 - 3 * u) / 2], dim=1)  # Legendre P2, P3
    linear = quadratic = 0
    for seed in range(20):
        z = ar1(0.0, steps=400, seed=seed) + drift
        linear += ide.trajectory_currents(z, lags=(1,))[1]["excludes_zero"]
        quadratic += ide.trajectory_currents(z, degree=2, lags=(1,))[1]["excludes_zero"]
    assert linear >= 16 and quadratic <= 3


def test_trajectory_recorder_projects_the_trainable_parameters():
    weight = torch.nn.Parameter(rand(3, 4))
    frozen = torch.nn.Parameter(rand(5), requires_grad=False)
    recorder = ide.TrajectoryRecorder([weight, frozen], dims=3, seed=1)
    recorder.record()
    with torch.no_grad():
        weight.add_(1.0)
    recorder.on_step_end(None, None, None)
    z = recorder.trajectory()
    assert z.shape == (2, 3)
    assert torch.allclose(z[1] - z[0], recorder.projection @ torch.ones(12), atol=1e-5)
