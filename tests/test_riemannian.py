"""Riemannian optimisers for factored parameters: each gradient against its explicit formula and defining identity,
retractions that keep their manifold, convergence of a low-rank regression for every geometry (also with heads sharing
a factor: the block variants), momentum state that saves and restores, the factored pairs found in a model, and clear
errors. Resuming through Trainer checkpoints is tested in test_training.py."""

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
    hl, hr = mf.isometry_horizontal([left, right], [xl, xr])
    assert torch.allclose(hl, xl, atol=1e-12) and torch.allclose(hr, xr, atol=1e-12)
    al, ar = mf.isometry_horizontal([left, right], [rand(8, 3, seed=4), rand(6, 3, seed=5)])
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


def test_continuous_factors_are_the_same_product_in_the_previous_gauge():
    """Factors regauged by any invertible B come back to the previous ones exactly (A = B^-1), with the same product;
    where no invertible A exists (the previous factor outside the new column space) the factors stay as given."""
    left, right = rand(12, 3, seed=1), rand(10, 3, seed=2)
    gauge = rand(3, 3, seed=3) + 3 * torch.eye(3, dtype=F64)
    turned_left, turned_right = left @ gauge, right @ torch.linalg.inv(gauge).T
    new_left, new_right = mf.continuous_factors(turned_left, turned_right, left)
    assert torch.allclose(new_left, left, atol=1e-10) and torch.allclose(new_right, right, atol=1e-10)
    assert torch.allclose(new_left @ new_right.T, turned_left @ turned_right.T, atol=1e-10)
    outside = torch.zeros(12, 3, dtype=F64)
    outside[:, 0] = torch.linalg.svd(left, full_matrices=True)[0][:, -1]  # orthogonal to left's columns
    kept = mf.continuous_factors(turned_left, turned_right, outside)
    assert torch.equal(kept[0], turned_left) and torch.equal(kept[1], turned_right)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_embedded_gauges_follow_the_same_products_and_continuous_factors_move_by_the_step(momentum):
    """Where the loss is a function of X alone the two gauges are the same optimiser (the momentum lives in X's
    tangent space): equal products after every step. Their factors differ: the balanced ones jump to U S^1/2 at the
    first step, the continuous ones move by about the step."""
    target, left, right_t = regression_problem("riemannian-embedded", seed=5)
    left2, right2 = torch.nn.Parameter(left.detach().clone()), torch.nn.Parameter(right_t.detach().clone())
    start = left.detach().clone()
    pair = lambda l, r: [{"params": [l, r], "transposed": (False, True)}]  # noqa: E731
    balanced = FactoredRiemannianOptimizer(pair(left, right_t), geometry="riemannian-embedded", lr=1e-3,
                                           momentum=momentum)
    continuous = FactoredRiemannianOptimizer(pair(left2, right2), geometry="riemannian-embedded", lr=1e-3,
                                             momentum=momentum, gauge="continuous")
    run(balanced, target, left, right_t, 1)
    run(continuous, target, left2, right2, 1)
    assert (left2.detach() - start).norm() < 0.05 * start.norm() < (left.detach() - start).norm()
    for _ in range(30):
        run(balanced, target, left, right_t, 1)
        run(continuous, target, left2, right2, 1)
        assert torch.allclose(left @ right_t, left2 @ right2, atol=1e-9)
    assert (left2.detach() - start).norm() < (left.detach() - start).norm()


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
    with pytest.raises(ValueError, match="gauge 'polar' is not one of balanced, continuous"):
        FactoredRiemannianOptimizer(pair, geometry="riemannian-embedded", gauge="polar")
    orthonormalize_(left)
    orthonormalize_(right_t, transposed=True)
    with pytest.raises(ValueError, match="weight decay"):
        FactoredRiemannianOptimizer(pair, geometry="grassmann", weight_decay=0.1)
    FactoredRiemannianOptimizer(pair, geometry="grassmann")  # orthonormal now: accepted


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21 reads it
def test_lora_pairs_are_found_and_trained_beside_adamw():
    """Every LoRA layer of a PEFT model becomes one pair (B, A^T); a quotient step on the pairs and AdamW on the rest
    (the metric) lower the loss of a tiny Fiber Bundle model."""
    from helpers import random_ids, tiny_model
    from fiber_bundle.training import LORA_TARGET_MODULES, prepare_for_training
    from fiber_bundle.training.riemannian import lora_groups

    model = prepare_for_training(tiny_model(dtype=torch.float32), "lora", lora_r=4)
    pairs = lora_groups(model)
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

    from helpers import random_ids, tiny_model
    from fiber_bundle.training.trainer import train_model

    ids = random_ids(16, 16).tolist()
    trainer = train_model(tiny_model(dtype=torch.float32), Dataset.from_dict({"input_ids": ids, "labels": ids}),
                          tmp_path, mode="lora", max_steps=6, learning_rate=1e-2, batch_size=4, optimizer=geometry,
                          quiet=True, lora_r=4)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < losses[0]
    assert type(trainer.optimizer.optimizer).__name__ == "FactoredRiemannianOptimizer"
    kinds = [group["geometry"] for group in trainer.optimizer.param_groups]
    assert kinds.count(geometry) == 16 and kinds[-1] == "adamw"  # 14 LoRA pairs, 2 layers of metric generators
    assert [g["kind"] for g in trainer.optimizer.param_groups[:-1]] == ["lora"] * 14 + ["metric"] * 2


# ----------------------------------------------------------------------------------------------------------------------
# block variants: heads sharing a factor
# ----------------------------------------------------------------------------------------------------------------------
def block_problem(geometry, heads=3, m=8, n=10, r=2, seed=0):
    """X_h = L_h R^T for h < heads, R shared (block-rows), stored in one (heads * m) x r tensor and R^T (r x n)."""
    if geometry in ("riemannian-quotient", "riemannian-embedded"):
        target = torch.cat([rand(m, r, seed=seed + h) for h in range(heads)]) @ rand(r, n, seed=seed + 99)
        left, right_t = 0.3 * rand(heads * m, r, seed=seed + 50), 0.3 * rand(r, n, seed=seed + 51)
    else:
        target = torch.cat([stiefel(m, r, seed + h) for h in range(heads)]) @ stiefel(n, r, seed + 99).T
        left = torch.cat([stiefel(m, r, seed + 50 + h) for h in range(heads)])
        right_t = stiefel(n, r, seed + 60).T.contiguous()
    return target, torch.nn.Parameter(left), torch.nn.Parameter(right_t)


def block_group(left, right_t, heads, block=True):
    from fiber_bundle.training.riemannian import tensor_slice

    m = left.shape[0] // heads
    slices = [tensor_slice(0, left, start=h * m, length=m) for h in range(heads)]
    lefts = tuple((s,) for s in slices) if block else (tuple(slices),)
    return {"params": [left, right_t], "pairs": [(lefts, ((tensor_slice(1, right_t, transposed=True),),))]}


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_block_rows_regression_converges_and_keeps_each_block_on_its_manifold(geometry):
    heads = 3
    target, left, right_t = block_problem(geometry, heads)
    optimizer = FactoredRiemannianOptimizer([block_group(left, right_t, heads)], geometry=geometry, lr=0.2,
                                            momentum=0.5)
    assert run(optimizer, target, left, right_t, 400) < 1e-8
    if geometry not in ("riemannian-quotient", "riemannian-embedded"):
        for h in range(heads):  # each head's block is its own Stiefel point (the stacked left factor is not)
            assert mf.orthonormality_error(left.detach()[h * 8 : (h + 1) * 8]) < 1e-6
        assert mf.orthonormality_error(right_t.detach().T) < 1e-6
        assert mf.orthonormality_error(left.detach()) > 0.5


@pytest.mark.parametrize("geometry", ["riemannian-quotient", "riemannian-embedded"])
def test_fixed_rank_block_step_is_the_stacked_step(geometry):
    """The GL(r) gauge acts on all blocks at once, so a block pair steps exactly as its stacked factors do."""
    target, left, right_t = block_problem(geometry, 3, seed=4)
    left2, right2 = torch.nn.Parameter(left.detach().clone()), torch.nn.Parameter(right_t.detach().clone())
    block = FactoredRiemannianOptimizer([block_group(left, right_t, 3)], geometry=geometry, lr=0.1, momentum=0.9)
    stacked = FactoredRiemannianOptimizer([{"params": [left2, right2], "transposed": (False, True)}],
                                          geometry=geometry, lr=0.1, momentum=0.9)
    run(block, target, left, right_t, 20)
    run(stacked, target, left2, right2, 20)
    assert torch.allclose(left, left2, atol=1e-12) and torch.allclose(right_t, right2, atol=1e-12)


def test_block_grassmann_horizontal_space():
    """With blocks F_1..F_k sharing one O(r): after the projection sum_i F_i^T xi_i is symmetric, the removed part is
    vertical (F_i W with W skew), and the gradient of a function of the blocks' products is already horizontal."""
    factors = [stiefel(8, 3, 1), stiefel(8, 3, 2), stiefel(6, 3, 3)]  # L_1, L_2 sharing R
    raw = [mf.stiefel_project(f, rand(*f.shape, seed=10 + i)) for i, f in enumerate(factors)]
    horizontal = mf.isometry_horizontal(factors, raw)
    total = sum(f.T @ h for f, h in zip(factors, horizontal))
    assert torch.allclose(total, total.T, atol=1e-12)
    w = factors[0].T @ (raw[0] - horizontal[0])
    assert torch.allclose(w, -w.T, atol=1e-12)
    for f, r, h in zip(factors, raw, horizontal):
        assert torch.allclose(r - h, f @ w, atol=1e-12)  # one W for every block
    targets = [rand(8, 6, seed=20), rand(8, 6, seed=21)]
    grads = [-(t - f @ factors[2].T) @ factors[2] for t, f in zip(targets, factors[:2])]
    grads.append(sum(-(t - f @ factors[2].T).T @ f for t, f in zip(targets, factors[:2])))
    tangent = [mf.stiefel_project(f, g) for f, g in zip(factors, grads)]
    for a, b in zip(tangent, mf.isometry_horizontal(factors, tangent)):
        assert torch.allclose(a, b, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# the factored pairs of a model
# ----------------------------------------------------------------------------------------------------------------------
def products(group):
    """Each pair's blocks L_i R_j^T, read through the group's slices (what the optimiser sees)."""
    from fiber_bundle.training.riemannian import _read

    out = []
    for lefts, rights in group["pairs"]:
        out.append([[_read(group["params"], a) @ _read(group["params"], b).T for b in rights] for a in lefts])
    return out


@pytest.mark.parametrize("block", [False, True])
def test_metric_generators_and_attention_heads_are_found_with_their_products(block):
    from helpers import TINY, tiny_model
    from fiber_bundle.training import prepare_for_training
    from fiber_bundle.training.riemannian import attention_groups, factored_groups, metric_groups

    model = prepare_for_training(tiny_model(), "full")
    groups = factored_groups(model, block=block)
    metric, attention = metric_groups(model, block=block), attention_groups(model, block=block)
    assert len(groups) == len(metric) + len(attention) == 4 and {g["kind"] for g in groups} == {"metric", "attention"}
    d, heads, kv = TINY["head_dim"], TINY["num_attention_heads"], TINY["num_key_value_heads"]
    for layer, group in enumerate(attention):
        attn = model.model.layers[layer].self_attn
        assert len(group["pairs"]) == kv
        for g, blocks in enumerate(products(group)):
            expected = [attn.q_proj.weight[h * d : (h + 1) * d].T @ attn.k_proj.weight[g * d : (g + 1) * d]
                        for h in range(g * heads // kv, (g + 1) * heads // kv)]  # W_Q,h^T W_K,g
            got = [row[0] for row in blocks] if block else list(blocks[0][0].split(TINY["hidden_size"]))
            assert len(got) == len(expected)
            assert all(torch.allclose(a, b, rtol=0, atol=1e-14) for a, b in zip(got, expected))
    for layer, group in enumerate(metric):
        fiber = model.model.layers[layer].fiber
        stacked = torch.cat([fiber.attn_factor_proj.weight, fiber.ffn_factor_proj.weight]) @ fiber.code_proj.weight
        (blocks,) = products(group)
        assert len(blocks) == (fiber.factor_heads + 1 if block else 1)
        assert torch.allclose(torch.cat([row[0] for row in blocks]), stacked, rtol=0, atol=1e-14)  # [W_U; W_V] W_z
    # metric-only finds only the generators
    frozen = prepare_for_training(tiny_model(), "metric-only")
    assert [g["kind"] for g in factored_groups(frozen, block=block)] == ["metric", "metric"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_blocks_are_heads_rows_of_b_and_columns_of_a():
    from helpers import TINY, tiny_model
    from fiber_bundle.training import prepare_for_training
    from fiber_bundle.training.riemannian import _read, lora_groups

    model = prepare_for_training(tiny_model(dtype=torch.float32), "lora", lora_r=4)
    d = TINY["head_dim"]
    by_name = {g["name"].rsplit(".", 1)[-1]: g for g in lora_groups(model, block=True) if ".layers.0." in g["name"]}
    plain = {g["name"].rsplit(".", 1)[-1]: g for g in lora_groups(model) if ".layers.0." in g["name"]}
    counts = {name: (len(g["pairs"][0][0]), len(g["pairs"][0][1])) for name, g in by_name.items()}
    assert counts == {"q_proj": (TINY["num_attention_heads"], 1), "k_proj": (TINY["num_key_value_heads"], 1),
                      "v_proj": (TINY["num_key_value_heads"], 1), "o_proj": (1, TINY["num_attention_heads"]),
                      "gate_proj": (1, 1), "up_proj": (1, 1), "down_proj": (1, 1)}
    b, a = by_name["q_proj"]["params"]
    assert torch.equal(_read([b, a], by_name["q_proj"]["pairs"][0][0][1]), b[d : 2 * d].double())  # head 1 of B
    b, a = by_name["o_proj"]["params"]
    assert torch.equal(_read([b, a], by_name["o_proj"]["pairs"][0][1][2]), a[:, 2 * d : 3 * d].T.double())  # of A
    assert all(len(g["pairs"][0][0]) == len(g["pairs"][0][1]) == 1 for g in plain.values())


def test_isometry_start_keeps_the_model_and_refuses_what_it_would_change():
    """At the graft the start orthonormalises the metric generators (they change, the logits do not: the gates leave
    the metric unused); off the graft, where the same orthonormalisation changes the logits, it is refused."""
    from helpers import random_ids, set_gates, tiny_model
    from fiber_bundle.training import prepare_for_training
    from fiber_bundle.training.riemannian import (_is_orthonormal, build_optimizer, metric_groups,
                                                  orthonormalize_group_)

    def generators(model):  # W_z, W_U, W_V of every layer
        return [p.detach().clone() for group in metric_groups(model) for p in group["params"]]

    model = prepare_for_training(tiny_model(), "metric-only")
    ids = random_ids(2, 12)
    before, drawn = model(input_ids=ids).logits, generators(model)
    assert not any(_is_orthonormal(g) for g in metric_groups(model))  # drawn at random: the start has work to do
    with pytest.raises(ValueError, match="fewer rows than its rank"):  # a head's W_U block: 2 x 16 rows, rank 32
        build_optimizer(model, "grassmann", lr=1e-2, block=True)
    optimizer = build_optimizer(model, "grassmann", lr=1e-2)
    assert all(_is_orthonormal(g) for g in metric_groups(model))
    assert all((new - old).abs().max() > 1e-3 for new, old in zip(generators(model), drawn))  # every generator moved
    assert torch.equal(model(input_ids=ids).logits, before)  # and the function did not: gates at the graft value
    assert [g["geometry"] for g in optimizer.param_groups] == ["grassmann", "grassmann", "adamw"]
    trained = prepare_for_training(set_gates(tiny_model()), "metric-only")
    before, drawn = trained(input_ids=ids).logits, generators(trained)
    with pytest.raises(ValueError, match="gates off the graft value"):
        build_optimizer(trained, "stiefel-euclidean", lr=1e-2)
    assert all(torch.equal(new, old) for new, old in zip(generators(trained), drawn))  # refused before any write
    build_optimizer(trained, "riemannian-quotient", lr=1e-2)  # fixed rank needs nothing
    assert torch.equal(trained(input_ids=ids).logits, before)
    for group in metric_groups(trained):  # what the refusal prevents: here orthonormalising changes the model
        orthonormalize_group_(group)
    assert (trained(input_ids=ids).logits - before).abs().max() > 1e-3
    one_gate = prepare_for_training(tiny_model(), "metric-only")  # one gate off the graft: the last MLP metric's
    with torch.no_grad():
        one_gate.model.layers[-1].fiber.ffn_gate.fill_(0.5)
    before, drawn = one_gate(input_ids=ids).logits, generators(one_gate)
    with pytest.raises(ValueError, match="layers.1.*gates off the graft value"):
        build_optimizer(one_gate, "grassmann", lr=1e-2)
    assert torch.equal(one_gate(input_ids=ids).logits, before)
    assert all(torch.equal(new, old) for new, old in zip(generators(one_gate), drawn))  # layer 0 untouched too
    with pytest.raises(ValueError, match="cannot represent the trained W_Q"):
        build_optimizer(prepare_for_training(tiny_model(), "full"), "stiefel-canonical", lr=1e-2)
    plain = tiny_model(metric_rank=0, ffn_metric_rank=0)
    for name, p in plain.named_parameters():
        p.requires_grad_(name.startswith("model.norm"))
    with pytest.raises(ValueError, match="no trainable factored pairs"):
        build_optimizer(plain, "grassmann", lr=1e-2)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_isometry_geometry_refuses_lora_pairs_with_the_reason():
    from helpers import tiny_model
    from fiber_bundle.training import prepare_for_training
    from fiber_bundle.training.riemannian import build_optimizer

    model = prepare_for_training(tiny_model(dtype=torch.float32), "lora", lora_r=4)
    with pytest.raises(ValueError, match="could not start at 0"):
        build_optimizer(model, "grassmann", lr=1e-2)


# ----------------------------------------------------------------------------------------------------------------------
# the optimiser abstract's setting: the ten design points on W_Q / W_K of a model trained from scratch
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_attention_design_points_from_scratch_keep_shared_keys_and_stay_on_their_manifold(geometry, block):
    """``pairs="attention"``: only the per-head W_Q / W_K pairs take the geometry (the metric generators go to AdamW).
    ``fresh``: a model trained from scratch starts them orthonormal for a partial isometry. The block variant keeps
    each KV group's key factor one factor shared by its query heads (the plain one stacks those heads into one left
    factor), and after real training steps every factor a partial isometry holds is still on its manifold; the
    fixed-rank geometries keep each pair's rank."""
    from helpers import TINY, random_ids, tiny_model
    from fiber_bundle.training import prepare_for_training
    from fiber_bundle.training.riemannian import FIXED_RANK, _read, attention_groups, build_optimizer

    model = prepare_for_training(tiny_model(), "full")
    optimizer = build_optimizer(model, geometry, lr=1e-3, riemannian_lr=5e-2, block=block, pairs="attention",
                                fresh=True, momentum=0.5)
    kinds = [g.get("kind", g["geometry"]) for g in optimizer.param_groups]
    assert kinds == ["attention"] * TINY["num_hidden_layers"] + ["adamw"]
    rest = {id(p) for p in optimizer.param_groups[-1]["params"]}
    assert all(id(p) in rest for name, p in model.named_parameters() if ".fiber." in name)  # generators: AdamW
    heads, kv = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    for group in attention_groups(model, block=block):
        for lefts, rights in group["pairs"]:
            assert len(rights) == 1  # the group's one key factor W_K,g^T
            assert len(lefts) == (heads // kv if block else 1)  # one factor per query head, or the heads stacked
    ids = random_ids(2, 12)
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert torch.isfinite(loss)
    for group in optimizer.param_groups[:-1]:
        for lefts, rights in group["pairs"]:
            factors = [_read(group["params"], f) for f in lefts + rights]
            if geometry in FIXED_RANK:
                product = torch.cat([f @ _read(group["params"], rights[0]).T for f in factors[:-1]])
                assert torch.linalg.matrix_rank(product).item() == TINY["head_dim"]
            else:
                assert all(mf.orthonormality_error(f) < 1e-10 for f in factors)


@pytest.mark.parametrize("geometry", GEOMETRIES[2:])
def test_the_scale_control_stacks_heads_at_the_block_variants_query_scale(geometry):
    """``equal_scale``: each KV group's stacked query factor S is stored at sqrt(k) times a point of the manifold (k
    query heads per KV head), so its head slices carry together k times the plain stack's squared norm, as the block
    variant's k orthonormal slices do; the step is the plain geometry's step on S / sqrt(k) with the chain rule's
    gradient sqrt(k) dL/dS, and S stays at that scale through training."""
    from helpers import TINY, random_ids, tiny_model
    from fiber_bundle.training import prepare_for_training
    from fiber_bundle.training.riemannian import _read, attention_groups, build_optimizer

    k = TINY["num_attention_heads"] // TINY["num_key_value_heads"]
    norms = {}
    for variant in ("plain", "block", "scaled"):
        model = prepare_for_training(tiny_model(), "full")
        optimizer = build_optimizer(model, geometry, lr=1e-3, riemannian_lr=5e-2, block=variant == "block",
                                    pairs="attention", fresh=True, momentum=0.5, equal_scale=variant == "scaled")
        group = attention_groups(model)[0]  # read as stacked heads whatever the variant
        norms[variant] = sum(_read(group["params"], lefts[0]).pow(2).sum().item() for lefts, _ in group["pairs"])
        if variant == "scaled":
            assert optimizer.param_groups[0]["left_scale"] == pytest.approx(k ** 0.5)
            ids = random_ids(2, 12)
            for _ in range(3):
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for lefts, rights in group["pairs"]:
                stack = _read(group["params"], lefts[0])
                assert mf.orthonormality_error(stack / k ** 0.5) < 1e-10
                assert mf.orthonormality_error(_read(group["params"], rights[0])) < 1e-10
    assert norms["block"] == pytest.approx(k * norms["plain"]) and norms["scaled"] == pytest.approx(norms["block"])


@pytest.mark.parametrize("geometry", GEOMETRIES[2:])
def test_a_scaled_factor_steps_as_the_unscaled_factor_of_the_scaled_loss(geometry):
    """The chain rule of ``left_scale``: a factor stored as c F under loss f(stored) follows, exactly, the trajectory
    of an unscaled factor F under loss f(c F)."""
    from fiber_bundle.training.riemannian import whole_pair

    gen = torch.Generator().manual_seed(0)
    target = torch.randn(12, 10, generator=gen, dtype=torch.float64)
    left0 = mf.qr_retract(torch.randn(12, 3, generator=gen, dtype=torch.float64))
    right0 = mf.qr_retract(torch.randn(10, 3, generator=gen, dtype=torch.float64))
    c = 3.0 ** 0.5
    scaled = [torch.nn.Parameter(left0 * c), torch.nn.Parameter(right0.clone())]
    plain = [torch.nn.Parameter(left0.clone()), torch.nn.Parameter(right0.clone())]
    options = dict(geometry=geometry, lr=0.05, momentum=0.5)
    steppers = [FactoredRiemannianOptimizer([{"params": scaled, "pairs": [whole_pair(*scaled)], "left_scale": c}],
                                            **options),
                FactoredRiemannianOptimizer([{"params": plain, "pairs": [whole_pair(*plain)]}], **options)]
    for _ in range(5):
        for (left, right), scale, stepper in ((scaled, 1.0, steppers[0]), (plain, c, steppers[1])):
            ((scale * left) @ right.T - target).pow(2).sum().backward()
            stepper.step()
            stepper.zero_grad(set_to_none=True)
    assert not torch.allclose(plain[0], left0)  # it moved
    torch.testing.assert_close(scaled[0].detach(), c * plain[0].detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(scaled[1].detach(), plain[1].detach(), rtol=0, atol=1e-12)


def test_the_scale_control_is_refused_where_it_means_nothing():
    from helpers import tiny_model
    from fiber_bundle.training import prepare_for_training
    from fiber_bundle.training.arguments import FiberBundleTrainingArguments
    from fiber_bundle.training.errors import TrainingError
    from fiber_bundle.training.riemannian import build_optimizer, whole_pair

    model = prepare_for_training(tiny_model(), "full")
    with pytest.raises(ValueError, match="applies without block"):
        build_optimizer(model, "grassmann", lr=1e-2, pairs="attention", fresh=True, block=True, equal_scale=True)
    with pytest.raises(ValueError, match="riemannian-quotient learns every scale itself"):
        build_optimizer(model, "riemannian-quotient", lr=1e-2, pairs="attention", equal_scale=True)
    pair = [torch.nn.Parameter(torch.randn(6, 2)), torch.nn.Parameter(torch.randn(5, 2))]
    with pytest.raises(ValueError, match="left_scale.*fixed-rank one learns every scale"):
        FactoredRiemannianOptimizer([{"params": pair, "pairs": [whole_pair(*pair)], "left_scale": 2.0}])
    for options in (dict(optimizer="grassmann", block=True), dict(optimizer="riemannian-embedded"), {}):
        with pytest.raises(TrainingError, match="equal_scale gives the stacked query factor"):
            FiberBundleTrainingArguments(output_dir="unused", equal_scale=True, **options)


def test_attention_pairs_of_a_trained_model_are_refused_and_bad_options_named():
    """Without ``fresh`` (a model that was not trained from scratch) a partial isometry on W_Q / W_K is refused before
    any write, naming the from-scratch route; the pair choice and the Riemannian-only options are checked."""
    from helpers import tiny_model
    from fiber_bundle.training import prepare_for_training
    from fiber_bundle.training.arguments import FiberBundleTrainingArguments
    from fiber_bundle.training.errors import TrainingError
    from fiber_bundle.training.riemannian import build_optimizer, factored_groups

    model = prepare_for_training(tiny_model(), "full")
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="cannot represent the trained W_Q.*--from-config"):
        build_optimizer(model, "grassmann", lr=1e-2, pairs="attention")
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    with pytest.raises(ValueError, match="pairs 'keys' is not one of all, attention"):
        factored_groups(model, pairs="keys")
    frozen = prepare_for_training(tiny_model(), "metric-only")
    with pytest.raises(ValueError, match=r"no trainable factored pairs \(W_Q / W_K in --mode full\)"):
        build_optimizer(frozen, "riemannian-quotient", lr=1e-2, pairs="attention")
    with pytest.raises(TrainingError, match="riemannian_pairs and retraction apply to a Riemannian optimizer"):
        FiberBundleTrainingArguments(output_dir="unused", riemannian_pairs="attention")
    with pytest.raises(TrainingError, match="riemannian_gauge applies to the riemannian-embedded optimizer, not to "
                                            "riemannian-quotient"):
        FiberBundleTrainingArguments(output_dir="unused", optimizer="riemannian-quotient", riemannian_gauge="continuous")
    with pytest.raises(TrainingError, match="riemannian_gauge 'svd' is not one of balanced, continuous"):
        FiberBundleTrainingArguments(output_dir="unused", optimizer="riemannian-embedded", riemannian_gauge="svd")
    assert FiberBundleTrainingArguments(output_dir="unused", from_config="small").orthonormal_start is True
    assert FiberBundleTrainingArguments(output_dir="unused").orthonormal_start is False
