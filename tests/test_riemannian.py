"""Riemannian optimisers for factored parameters: each gradient against its explicit formula and defining identity,
retractions that keep their manifold, convergence of a low-rank regression for every geometry, momentum state that
saves and restores, and clear errors."""

import copy

import pytest
import torch

from fiber_bundle.training import manifolds as mf
from fiber_bundle.training.riemannian import GEOMETRIES, FactoredRiemannianOptimizer, orthonormalize_

F64 = torch.float64


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def stiefel(m, r, seed=0):
    return mf.qr_retract(rand(m, r, seed=seed))


def inner(a, b):
    return (a * b).sum()


# ----------------------------------------------------------------------------------------------------------------------
# Riemannian gradients: explicit formulas and defining identities, float64
# ----------------------------------------------------------------------------------------------------------------------
def test_quotient_gradient_is_the_gram_preconditioned_gradient():
    left, right, g = rand(9, 3, seed=1), rand(7, 3, seed=2), rand(9, 7, seed=3)
    xi_left, xi_right = mf.quotient_gradient(left, right, g @ right, g.T @ left, damping=0.0)
    assert torch.allclose(xi_left, g @ right @ torch.linalg.inv(right.T @ right), atol=1e-12)
    assert torch.allclose(xi_right, g.T @ left @ torch.linalg.inv(left.T @ left), atol=1e-12)
    # defining identity: g_(L,R)(grad, eta) = Df(L, R)[eta] for every eta, with the metric tr(R^T R dL^T dL) + ...
    eta_left, eta_right = rand(9, 3, seed=4), rand(7, 3, seed=5)
    metric = inner(xi_left @ (right.T @ right), eta_left) + inner(xi_right @ (left.T @ left), eta_right)
    assert metric.item() == pytest.approx((inner(g @ right, eta_left) + inner(g.T @ left, eta_right)).item(), rel=1e-12)


def test_embedded_gradient_is_the_tangent_projection_of_the_euclidean_gradient():
    left, right, g = rand(9, 3, seed=1), rand(7, 3, seed=2), rand(9, 7, seed=3)
    frame = mf.embedded_frame(left, right)
    u, v = frame[0], frame[1]
    explicit = u @ u.T @ g + g @ v @ v.T - u @ u.T @ g @ v @ v.T
    tangent = mf.embedded_gradient(frame, g @ right, g.T @ left)
    assert torch.allclose(mf.tangent_to_dense(frame, tangent), explicit, atol=1e-12)
    a, b = mf.tangent_factors(frame, tangent)
    assert torch.allclose(a @ b.T, explicit, atol=1e-12)
    # projecting a tangent vector again changes nothing; projecting G gives the same as from the factor gradients
    assert torch.allclose(mf.tangent_to_dense(frame, mf.embedded_project(frame, a, b)), explicit, atol=1e-12)
    eye_n = torch.eye(7, dtype=F64)
    assert torch.allclose(mf.tangent_to_dense(frame, mf.embedded_project(frame, g, eye_n)), explicit, atol=1e-12)


def test_isometry_gradients_against_their_formulas():
    x, g = stiefel(8, 3), rand(8, 3, seed=7)
    euclidean = mf.stiefel_euclidean_gradient(x, g)
    assert torch.allclose(euclidean, g - x @ (x.T @ g + g.T @ x) / 2, atol=1e-12)
    assert torch.allclose(x.T @ euclidean, -(x.T @ euclidean).T, atol=1e-12)  # tangent: x^T xi is skew
    canonical = mf.stiefel_canonical_gradient(x, g)
    assert torch.allclose(x.T @ canonical, -(x.T @ canonical).T, atol=1e-12)
    # canonical metric <a, b>_c = tr(a^T (I - x x^T / 2) b): <grad, eta>_c = <g, eta> for every tangent eta
    eta = mf.stiefel_project(x, rand(8, 3, seed=8))
    weight = torch.eye(8, dtype=F64) - x @ x.T / 2
    assert inner(canonical, weight @ eta).item() == pytest.approx(inner(g, eta).item(), rel=1e-12)
    # the joint quotient (L Q, R Q): horizontal vectors have L^T xi_L + R^T xi_R symmetric, and the gradient of a
    # function of L R^T alone is already horizontal
    left, right, target = stiefel(8, 3, 1), stiefel(6, 3, 2), rand(8, 6, seed=3)
    grad = target - left @ right.T  # minus the gradient of 1/2 ||L R^T - T||^2 in X
    gl, gr = -grad @ right, -grad.T @ left
    xl, xr = mf.stiefel_project(left, gl), mf.stiefel_project(right, gr)
    hl, hr = mf.isometry_horizontal(left, right, xl, xr)
    assert torch.allclose(hl, xl, atol=1e-12) and torch.allclose(hr, xr, atol=1e-12)
    al, ar = mf.isometry_horizontal(left, right, rand(8, 3, seed=4), rand(6, 3, seed=5))
    sym_part = left.T @ al + right.T @ ar
    assert torch.allclose(sym_part, sym_part.T, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# retractions keep their manifold
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("retraction", ["qr", "polar"])
def test_isometry_retractions_stay_orthonormal_over_many_steps(retraction):
    x = stiefel(20, 4)
    retract = mf.RETRACTIONS[retraction]
    for step in range(500):
        x = retract(x - 0.3 * mf.stiefel_project(x, rand(20, 4, seed=step)))
    assert mf.orthonormality_error(x) < 1e-12
    # first order: R(x + t xi) = x + t xi + O(t^2)
    xi = mf.stiefel_project(x, rand(20, 4, seed=999))
    for t in (1e-3, 1e-4):
        assert (retract(x + t * xi) - (x + t * xi)).abs().max() < 10 * t**2


def test_embedded_retraction_is_the_best_rank_r_approximation_and_keeps_rank():
    left, right = rand(12, 3, seed=1), rand(10, 3, seed=2)
    for step in range(200):
        frame = mf.embedded_frame(left, right)
        tangent = mf.embedded_project(frame, rand(12, 5, seed=step), rand(10, 5, seed=step + 1000))
        target = left @ right.T - 0.05 * mf.tangent_to_dense(frame, tangent)
        left, right = mf.embedded_retract(frame, tangent, -0.05)
        u, s, vh = torch.linalg.svd(target)
        assert torch.allclose(left @ right.T, (u[:, :3] * s[:3]) @ vh[:3], atol=1e-10)
        assert torch.linalg.matrix_rank(left @ right.T).item() == 3
    assert torch.allclose(left.T @ left, right.T @ right, atol=1e-10)  # balanced factors


# ----------------------------------------------------------------------------------------------------------------------
# the optimiser
# ----------------------------------------------------------------------------------------------------------------------
def regression_problem(geometry, seed=0, m=12, n=10, r=3):
    """min 1/2 ||L R^T - T||^2 with T of rank r (a partial isometry for the isometry geometries); R stored as R^T."""
    if geometry in ("riemannian-quotient", "riemannian-embedded"):
        target = rand(m, r, seed=seed) @ rand(r, n, seed=seed + 1)
        left, right_t = 0.3 * rand(m, r, seed=seed + 2), 0.3 * rand(r, n, seed=seed + 3)
    else:
        target = stiefel(m, r, seed) @ stiefel(n, r, seed + 1).T
        left, right_t = stiefel(m, r, seed + 2), stiefel(n, r, seed + 3).T.contiguous()
    return target, torch.nn.Parameter(left), torch.nn.Parameter(right_t)


def run(optimizer, target, left, right_t, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        (0.5 * (left @ right_t - target).pow(2).sum()).backward()
        optimizer.step()
    return ((left @ right_t - target).norm() / target.norm()).item()


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_low_rank_regression_converges_for_every_geometry(geometry, momentum):
    target, left, right_t = regression_problem(geometry)
    optimizer = FactoredRiemannianOptimizer([{"params": [left, right_t], "transposed": (False, True)}],
                                            geometry=geometry, lr=0.3, momentum=momentum)
    assert run(optimizer, target, left, right_t, 300) < 1e-8
    if geometry not in ("riemannian-quotient", "riemannian-embedded"):
        assert mf.orthonormality_error(left.detach()) < 1e-6 and mf.orthonormality_error(right_t.detach().T) < 1e-6
    assert torch.linalg.matrix_rank(left.detach() @ right_t.detach()).item() == 3


def test_embedded_geometry_starts_from_a_zero_lora_factor():
    """LoRA starts with B = 0 (rank 0, no embedded tangent space): a quotient step first, then embedded steps."""
    target = rand(12, 3, seed=1) @ rand(3, 10, seed=2)
    b = torch.nn.Parameter(torch.zeros(12, 3, dtype=F64))
    a = torch.nn.Parameter(0.3 * rand(3, 10, seed=3))
    optimizer = FactoredRiemannianOptimizer([{"params": [b, a], "transposed": (False, True)}],
                                            geometry="riemannian-embedded", lr=0.3, momentum=0.5)
    assert run(optimizer, target, b, a, 300) < 1e-8


def test_weight_decay_shrinks_the_product():
    left, right_t = torch.nn.Parameter(rand(6, 2, seed=1)), torch.nn.Parameter(rand(2, 5, seed=2))
    before = (left @ right_t).detach().clone()
    optimizer = FactoredRiemannianOptimizer([{"params": [left, right_t], "transposed": (False, True)}],
                                            lr=0.1, momentum=0.0, weight_decay=0.5)
    left.grad, right_t.grad = torch.zeros_like(left), torch.zeros_like(right_t)
    optimizer.step()
    assert torch.allclose(left @ right_t, (1 - 0.1 * 0.5) * before, atol=1e-12)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_state_dict_round_trip_continues_exactly(geometry):
    def make():
        target, left, right_t = regression_problem(geometry, seed=5)
        opt = FactoredRiemannianOptimizer([{"params": [left, right_t], "transposed": (False, True)}],
                                          geometry=geometry, lr=0.1, momentum=0.9)
        return target, left, right_t, opt

    target, left, right_t, opt = make()
    run(opt, target, left, right_t, 10)
    saved_params = (left.detach().clone(), right_t.detach().clone())
    saved_state = copy.deepcopy(opt.state_dict())  # state_dict shares the live per-parameter dicts
    run(opt, target, left, right_t, 5)
    expected = (left.detach().clone(), right_t.detach().clone())

    target, left2, right2, opt2 = make()
    with torch.no_grad():
        left2.copy_(saved_params[0])
        right2.copy_(saved_params[1])
    opt2.load_state_dict(saved_state)
    assert opt2.state[left2], "momentum state restored"
    run(opt2, target, left2, right2, 5)
    assert torch.equal(left2.detach(), expected[0]) and torch.equal(right2.detach(), expected[1])


def test_bad_input_is_refused_with_the_fix():
    left, right_t = torch.nn.Parameter(rand(6, 2)), torch.nn.Parameter(rand(2, 5))
    pair = [{"params": [left, right_t], "transposed": (False, True)}]
    with pytest.raises(ValueError, match="orthonormalize_"):
        FactoredRiemannianOptimizer(pair, geometry="stiefel-euclidean")
    with pytest.raises(ValueError, match="geometry 'hyperbolic'"):
        FactoredRiemannianOptimizer(pair, geometry="hyperbolic")
    with pytest.raises(ValueError, match="rank dimension"):
        FactoredRiemannianOptimizer([{"params": [left, right_t], "transposed": (False, False)}])
    with pytest.raises(ValueError, match="retraction"):
        FactoredRiemannianOptimizer(pair, retraction="cayley")
    orthonormalize_(left)
    orthonormalize_(right_t, transposed=True)
    with pytest.raises(ValueError, match="weight decay"):
        FactoredRiemannianOptimizer(pair, geometry="grassmann", weight_decay=0.1)
    FactoredRiemannianOptimizer(pair, geometry="grassmann")  # orthonormal now: accepted


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21 reads it
def test_lora_pairs_are_found_and_trained_beside_adamw():
    """Every LoRA layer of a PEFT model becomes one pair (B, A^T); a quotient step on the pairs and AdamW on the rest
    (the metric) lower the loss of a tiny Fiber Bundle model."""
    from conftest import random_ids, tiny_model
    from fiber_bundle.training import LORA_TARGET_MODULES, prepare_for_training
    from fiber_bundle.training.riemannian import lora_pairs

    model = prepare_for_training(tiny_model(dtype=torch.float32), "lora", lora_r=4)
    pairs = lora_pairs(model)
    assert len(pairs) == 2 * len(LORA_TARGET_MODULES)  # two layers
    for pair in pairs:
        b, a = pair["params"]
        assert b.shape[1] == a.shape[0] == 4 and "lora_B" not in pair["name"]
    in_pairs = {id(p) for pair in pairs for p in pair["params"]}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in in_pairs]
    assert rest and all(id(p) not in in_pairs for p in rest)  # the fiber modules (modules_to_save) stay with AdamW
    riemannian = FactoredRiemannianOptimizer(pairs, geometry="riemannian-quotient", lr=1e-2, momentum=0.0)
    adamw = torch.optim.AdamW(rest, lr=1e-2)
    ids = random_ids(4, 16)
    losses = []
    for _ in range(15):
        riemannian.zero_grad()
        adamw.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        riemannian.step()
        adamw.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("geometry", ["riemannian-quotient", "riemannian-embedded"])
def test_trainer_runs_a_riemannian_optimizer(tmp_path, geometry):
    """train_model(optimizer=...) trains the LoRA pairs on the manifold and the rest with AdamW, through the Trainer."""
    from datasets import Dataset

    from conftest import random_ids, tiny_model
    from fiber_bundle.training.trainer import train_model

    ids = random_ids(16, 16).tolist()
    trainer = train_model(tiny_model(dtype=torch.float32), Dataset.from_dict({"input_ids": ids, "labels": ids}),
                          tmp_path, mode="lora", max_steps=6, learning_rate=1e-2, batch_size=4, optimizer=geometry,
                          quiet=True, lora_r=4)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < losses[0]
    assert type(trainer.optimizer.optimizer).__name__ == "FactoredRiemannianOptimizer"
    kinds = [group["geometry"] for group in trainer.optimizer.param_groups]
    assert kinds.count(geometry) == 14 and kinds[-1] == "adamw"
