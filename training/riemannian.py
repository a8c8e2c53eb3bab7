"""Riemannian optimisers for factored parameters (a ``torch.optim.Optimizer``; the math is in ``manifolds``).

Each parameter group is one factored pair: ``params=[left, right]`` with the matrix that matters X = L R^T, where
L (m x r) and R (n x r) are the stored tensors or their transposes (``transposed=(bool, bool)``: a LoRA pair stores
B = L as (out x r) and A = R^T as (r x in), so ``transposed=(False, True)``). Geometries:

- ``riemannian-quotient``: fixed rank, quotient geometry; momentum in the total space (identity transport), decoupled
  weight decay shrinks X by (1 - lr wd).
- ``riemannian-embedded``: fixed rank, embedded geometry; momentum is a tangent vector transported by projection onto
  the new tangent space; weight decay as above. A rank-deficient pair (LoRA's B = 0 at the start) has no embedded
  tangent space: it takes a quotient step until it is of full rank.
- ``stiefel-euclidean``, ``stiefel-canonical``, ``grassmann``: each factor orthonormal (X a partial isometry; for
  ``grassmann`` the pair modulo a joint rotation); momentum transported by projection; QR or polar retraction. The factors must start orthonormal (``orthonormalize_``), and
  weight decay is refused (it would leave the manifold).
"""

import torch
from torch.optim.adamw import adamw  # the functional form of torch.optim.AdamW (its update, not a copy)

from . import manifolds as mf

GEOMETRIES = ("riemannian-quotient", "riemannian-embedded", "stiefel-euclidean", "stiefel-canonical", "grassmann")
FIXED_RANK = GEOMETRIES[:2]


def _as_tall(tensor: torch.Tensor, transposed: bool) -> torch.Tensor:
    return tensor.transpose(0, 1) if transposed else tensor


@torch.no_grad()
def orthonormalize_(tensor: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """Replace a factor in place by the Q of its QR decomposition (columns of the tall form orthonormal)."""
    tall = _as_tall(tensor, transposed)
    tall.copy_(mf.qr_retract(tall.to(torch.float64)).to(tensor.dtype))
    return tensor


class FactoredRiemannianOptimizer(torch.optim.Optimizer):
    """Riemannian gradient descent with momentum on factored pairs; one parameter group per pair.

    Arguments:
        pairs: a list of dicts, each ``{"params": [left, right], "transposed": (bool, bool)}`` plus any per-pair
            override of the defaults below.
        geometry: one of ``GEOMETRIES``.
        lr: step size; momentum: heavy-ball coefficient (0 disables it); weight_decay: decoupled, fixed-rank only.
        retraction: "qr" or "polar" (partial isometries).
        damping: relative regularisation of the quotient geometry's Gram inverses.
    The computation runs in float64 (factors are small); state (momentum) is kept in the parameters' dtype, as
    ``load_state_dict`` restores it, so a resumed run continues exactly.
    """

    def __init__(self, pairs, geometry: str = "riemannian-quotient", lr: float = 1e-3, momentum: float = 0.9,
                 weight_decay: float = 0.0, retraction: str = "qr", damping: float = 1e-8):
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry {geometry!r} is not one of {GEOMETRIES}.")
        if retraction not in mf.RETRACTIONS:
            raise ValueError(f"retraction {retraction!r} is not one of {sorted(mf.RETRACTIONS)}.")
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"need lr > 0, 0 <= momentum < 1, weight_decay >= 0 (got {lr}, {momentum}, {weight_decay}).")
        defaults = dict(geometry=geometry, lr=lr, momentum=momentum, weight_decay=weight_decay, retraction=retraction,
                        damping=damping, transposed=(False, False))
        pairs = [dict(pair) for pair in pairs]  # why: torch fills defaults into the group dicts; keep the caller's
        super().__init__(pairs, defaults)
        for group in self.param_groups:
            self._check_group(group)

    def _check_group(self, group):
        if group["geometry"] == "adamw":  # the parameters that are not factored pairs: torch's AdamW, unchanged
            return
        if len(group["params"]) != 2:
            raise ValueError(f"a factored pair has exactly two tensors (left, right), got {len(group['params'])}.")
        left, right = (_as_tall(p, t) for p, t in zip(group["params"], group["transposed"]))
        if left.dim() != 2 or right.dim() != 2 or left.shape[1] != right.shape[1]:
            raise ValueError(f"factors must be matrices sharing their rank dimension: L {tuple(left.shape)}, "
                             f"R {tuple(right.shape)} (check `transposed`).")
        if group["geometry"] not in GEOMETRIES:
            raise ValueError(f"geometry {group['geometry']!r} is not one of {GEOMETRIES} (or 'adamw').")
        if group["geometry"] not in FIXED_RANK:
            if group["weight_decay"] > 0:
                raise ValueError(f"weight decay would leave the manifold of {group['geometry']}: use weight_decay=0.")
            for factor in (left, right):
                error = mf.orthonormality_error(factor.detach().to(torch.float64))
                if error > 1e-4:
                    raise ValueError(f"{group['geometry']} needs orthonormal factors (max |X^T X - I| = {error:.2e}): "
                                     "initialise them with fiber_bundle.training.riemannian.orthonormalize_, or "
                                     "choose a fixed-rank geometry.")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["geometry"] == "adamw":
                self._adamw_step(group)
                continue
            left_p, right_p = group["params"]
            if left_p.grad is None and right_p.grad is None:
                continue
            t_left, t_right = group["transposed"]
            left = _as_tall(left_p, t_left).to(torch.float64)
            right = _as_tall(right_p, t_right).to(torch.float64)
            g_left = _grad(left_p, t_left, left)
            g_right = _grad(right_p, t_right, right)
            geometry = group["geometry"]
            if geometry == "riemannian-embedded":
                new_left, new_right = self._embedded_step(group, left, right, g_left, g_right)
            elif geometry == "riemannian-quotient":
                new_left, new_right = self._quotient_step(group, left, right, g_left, g_right)
            else:
                new_left, new_right = self._isometry_step(group, left, right, g_left, g_right)
            if group["weight_decay"] > 0:  # decoupled: X <- (1 - lr wd) X, shared evenly by the factors
                shrink = (1.0 - group["lr"] * group["weight_decay"]) ** 0.5
                new_left, new_right = new_left * shrink, new_right * shrink
            _as_tall(left_p, t_left).copy_(new_left.to(left_p.dtype))
            _as_tall(right_p, t_right).copy_(new_right.to(right_p.dtype))
        return loss

    def _adamw_step(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                             exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        adamw(
            params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
            [self.state[p]["exp_avg_sq"] for p in params], [], [self.state[p]["step"] for p in params],
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group.get("eps", 1e-8), maximize=False,
        )

    def _quotient_step(self, group, left, right, g_left, g_right):
        xi_left, xi_right = mf.quotient_gradient(left, right, g_left, g_right, group["damping"])
        xi_left = self._heavy_ball(group["params"][0], xi_left, group["momentum"])
        xi_right = self._heavy_ball(group["params"][1], xi_right, group["momentum"])
        return left - group["lr"] * xi_left, right - group["lr"] * xi_right

    def _heavy_ball(self, param, direction, momentum):
        if momentum == 0:
            return direction
        state = self.state[param]
        buffer = state.get("momentum_buffer")
        if buffer is None or buffer.shape != direction.shape:
            buffer = direction.clone()
        else:
            buffer = momentum * buffer.to(direction) + direction
        state["momentum_buffer"] = buffer.to(param.dtype)  # stored as the parameter (as torch restores it)
        return buffer

    def _embedded_step(self, group, left, right, g_left, g_right):
        frame = mf.embedded_frame(left, right)
        left_state, right_state = self.state[group["params"][0]], self.state[group["params"][1]]
        if not (mf.is_full_rank(frame[3]) and mf.is_full_rank(frame[4])):
            left_state.pop("tangent_a", None)
            right_state.pop("tangent_b", None)
            return self._quotient_step({**group, "momentum": 0.0}, left, right, g_left, g_right)
        tangent = mf.embedded_gradient(frame, g_left, g_right)
        if group["momentum"] > 0:
            if "tangent_a" in left_state:  # transport the previous direction to this tangent space, then add
                old = mf.embedded_project(frame, left_state["tangent_a"].to(left), right_state["tangent_b"].to(left))
                tangent = tuple(group["momentum"] * o + t for o, t in zip(old, tangent))
            a, b = mf.tangent_factors(frame, tangent)
            left_state["tangent_a"] = a.to(group["params"][0].dtype)  # stored as the parameter (as torch restores it)
            right_state["tangent_b"] = b.to(group["params"][1].dtype)
        return mf.embedded_retract(frame, tangent, -group["lr"])

    def _isometry_step(self, group, left, right, g_left, g_right):
        gradient, project, horizontal = mf.ISOMETRY_GEOMETRIES[group["geometry"]]

        def tangent(xi_left, xi_right):  # onto the tangent (and horizontal) space at the current point
            xi_left, xi_right = project(left, xi_left), project(right, xi_right)
            return horizontal(left, right, xi_left, xi_right) if horizontal else (xi_left, xi_right)

        xi_left, xi_right = gradient(left, g_left), gradient(right, g_right)
        if horizontal:
            xi_left, xi_right = horizontal(left, right, xi_left, xi_right)
        if group["momentum"] > 0:
            left_state, right_state = self.state[group["params"][0]], self.state[group["params"][1]]
            if "momentum_buffer" in left_state:  # vector transport by projection, then the heavy-ball sum
                old_left, old_right = tangent(left_state["momentum_buffer"].to(left),
                                              right_state["momentum_buffer"].to(right))
                xi_left, xi_right = group["momentum"] * old_left + xi_left, group["momentum"] * old_right + xi_right
            left_state["momentum_buffer"] = xi_left.to(group["params"][0].dtype)  # as torch restores it
            right_state["momentum_buffer"] = xi_right.to(group["params"][1].dtype)
        retract = mf.RETRACTIONS[group["retraction"]]
        return retract(left - group["lr"] * xi_left), retract(right - group["lr"] * xi_right)


def _grad(param, transposed, like):
    if param.grad is None:
        return torch.zeros_like(like)
    return _as_tall(param.grad, transposed).to(torch.float64)


def lora_pairs(model, adapter: str = "default") -> list[dict]:
    """The factored pairs of a PEFT LoRA model: for every LoRA layer, (B, A) with X = B A, i.e. L = B (out x r) and
    R^T = A (r x in). Returns parameter-group dicts for ``FactoredRiemannianOptimizer`` (with a ``name`` each)."""
    pairs = []
    for name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if lora_a is None or lora_b is None or adapter not in lora_a:
            continue
        b, a = lora_b[adapter].weight, lora_a[adapter].weight
        if b.requires_grad and a.requires_grad:
            pairs.append({"params": [b, a], "transposed": (False, True), "name": name})
    return pairs


def build_optimizer(model, geometry: str, *, lr: float, riemannian_lr: float | None = None, momentum: float = 0.9,
                    weight_decay: float = 0.0, retraction: str = "qr") -> FactoredRiemannianOptimizer:
    """One optimiser for a whole model: every LoRA pair (``lora_pairs``) on ``geometry`` at ``riemannian_lr`` (default
    ``lr``), every other trainable parameter (the metric under ``modules_to_save``, ...) with AdamW at ``lr``."""
    pairs = lora_pairs(model)
    if not pairs:
        raise ValueError(f"--optimizer {geometry} found no factored pairs to optimise: it needs LoRA (--mode lora).")
    paired = {id(p) for pair in pairs for p in pair["params"]}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in paired]
    for pair in pairs:
        pair["lr"] = riemannian_lr or lr
    groups = pairs + ([{"params": rest, "geometry": "adamw", "lr": lr, "weight_decay": weight_decay}] if rest else [])
    return FactoredRiemannianOptimizer(groups, geometry=geometry, lr=lr, momentum=momentum,
                                       weight_decay=weight_decay if geometry in FIXED_RANK else 0.0,
                                       retraction=retraction)
