"""Riemannian optimisers for factored parameters (a ``torch.optim.Optimizer``; the math is in ``manifolds``).

Each parameter group is one layer's (or one LoRA layer's) factored pairs. A pair is X = L R^T with L (m x r) and R
(n x r) in tall form; each factor is made of slices of the group's stored tensors (a LoRA pair stores B = L as
(out x r) and A = R^T as (r x in); a head's query factor W_Q,h^T is a transposed row block of ``q_proj.weight``). One
side of a pair may hold several factors that share the other side: the block variants (block-rows X = [L_1; ...] R^T,
block-columns X = L [R_1; ...]^T) in which heads share a factor. Geometries:

- ``riemannian-quotient``: fixed rank, quotient geometry; momentum in the total space (identity transport), decoupled
  weight decay shrinks X by (1 - lr wd).
- ``riemannian-embedded``: fixed rank, embedded geometry; momentum is a tangent vector transported by projection onto
  the new tangent space; weight decay as above. A rank-deficient pair (LoRA's B = 0 at the start) has no embedded
  tangent space: it takes a quotient step until it is of full rank. The retracted X is stored as balanced factors
  (``gauge`` "balanced") or as the factors nearest the previous ones ("continuous": for pairs the model does not
  see through X alone, such as W_Q / W_K with RoPE between them).
- ``stiefel-euclidean``, ``stiefel-canonical``, ``grassmann``: each factor orthonormal (X a partial isometry; for
  ``grassmann`` the factors modulo one joint rotation); momentum transported by projection; QR or polar retraction.
  The factors must start orthonormal (``start_on_isometries_`` does it without changing the model's function), and
  weight decay is refused (it would leave the manifold).

Which pairs a model has (``factored_groups``): LoRA (B, A) pairs, each layer's metric generators (W_U and W_V share the
fibre code W_z: X = [W_U; W_V] W_z), and, when the attention projections train (``full``), per-head W_Q,h^T W_K,g with
the query heads of a KV group g sharing its key factor. Two are not exact matrix products: the code passes through
``metric_act`` (tanh by default) and the query / key through RoPE, so the quotient's GL(r) invariance holds only
approximately there; the optimiser still follows the geometry of the factors themselves.
"""

from typing import NamedTuple

import torch

from . import manifolds as mf

GEOMETRIES = ("riemannian-quotient", "riemannian-embedded", "stiefel-euclidean", "stiefel-canonical", "grassmann")
FIXED_RANK = GEOMETRIES[:2]
OPTIMIZERS = ("adamw",) + GEOMETRIES  # the choices of ``fiber-bundle train --optimizer``
PAIRS = {"all": ("lora", "metric", "attention"), "attention": ("attention",)}  # --riemannian-pairs: kinds it trains
GAUGES = ("balanced", "continuous")  # --riemannian-gauge: the factors riemannian-embedded stores its X as


# ----------------------------------------------------------------------------------------------------------------------
# factors as slices of stored tensors
# ----------------------------------------------------------------------------------------------------------------------
class FactorSlice(NamedTuple):
    """A piece of a factor: the tall-form view ``params[index].narrow(dim, start, length)`` of one of the group's
    tensors, transposed when the tensor stores the factor's transpose (LoRA's A, a row block of ``q_proj.weight``)."""

    index: int  # of the tensor in the group's "params"
    dim: int
    start: int
    length: int
    transposed: bool


Factor = tuple[FactorSlice, ...]  # a factor: its slices stacked row-wise


class FactoredPair(NamedTuple):
    """X = L R^T: the left factors L_1, ... and the right factors R_1, ... (several on one side: the block variants,
    in which they share the other side's factor)."""

    lefts: tuple[Factor, ...]
    rights: tuple[Factor, ...]


def tensor_slice(index: int, tensor: torch.Tensor, *, dim: int = 0, start: int = 0, length: int | None = None,
                 transposed: bool = False) -> FactorSlice:
    """The slice of ``tensor`` (the group's tensor ``index``) from ``start`` along ``dim`` (to the end by default)."""
    return FactorSlice(index, dim, start, tensor.shape[dim] - start if length is None else length, transposed)


def whole_pair(left: torch.Tensor, right: torch.Tensor, transposed=(False, False)) -> FactoredPair:
    """The pair (left, right) of a group whose params are [left, right], each one whole factor."""
    return FactoredPair(((tensor_slice(0, left, transposed=transposed[0]),),),
                        ((tensor_slice(1, right, transposed=transposed[1]),),))


def as_pair(pair) -> FactoredPair:
    """A pair given as nested tuples ``(left factors, right factors)``, each factor a tuple of slices, as records."""
    try:
        lefts, rights = pair
        return FactoredPair(*(tuple(tuple(FactorSlice(*piece) for piece in factor) for factor in side)
                              for side in (lefts, rights)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"a pair is (left factors, right factors), each factor a tuple of slices (index, dim, start, "
                         f"length, transposed) made by tensor_slice; got {pair!r} ({error}).") from None


def _plain(pairs) -> list:
    """The pairs as nested plain tuples (what ``state_dict`` saves: see ``FactoredRiemannianOptimizer.state_dict``)."""
    return [tuple(tuple(tuple(tuple(piece) for piece in factor) for factor in side) for side in pair)
            for pair in pairs]


def _view(tensor: torch.Tensor, piece: FactorSlice) -> torch.Tensor:
    view = tensor.narrow(piece.dim, piece.start, piece.length)
    return view.transpose(0, 1) if piece.transposed else view


def _read(params, factor: Factor, grad: bool = False) -> torch.Tensor:
    """A factor (or its gradient) in tall form, float64: its slices stacked row-wise."""
    parts = []
    for piece in factor:
        tensor = params[piece.index]
        if grad:
            parts.append(torch.zeros_like(_view(tensor, piece), dtype=torch.float64) if tensor.grad is None
                         else _view(tensor.grad, piece).to(torch.float64))
        else:
            parts.append(_view(tensor, piece).to(torch.float64))
    return torch.cat(parts, dim=0)


def _write(params, factor: Factor, value: torch.Tensor) -> None:
    row = 0
    for piece in factor:
        view = _view(params[piece.index], piece)
        view.copy_(value[row : row + view.shape[0]].to(view.dtype))
        row += view.shape[0]


def _factor_scales(group: dict, lefts, rights) -> list[float]:
    """The scale each factor of a pair is stored at (its point on the manifold times it): ``left_scale`` for the left
    factors (the stacked query factor of ``attention_groups(..., equal_scale=True)``), 1 for everything else."""
    return [float(group.get("left_scale", 1.0))] * len(lefts) + [1.0] * len(rights)


@torch.no_grad()
def _orthonormalize(params, factor: Factor, scale: float = 1.0) -> None:
    """Replace a factor in place by the Q of its QR decomposition (columns of the tall form orthonormal), stored at
    ``scale``."""
    _write(params, factor, mf.qr_retract(_read(params, factor)) * scale)


def orthonormalize_(tensor: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """One whole tensor as a factor (its transpose if ``transposed``), made orthonormal in place."""
    _orthonormalize([tensor], (tensor_slice(0, tensor, transposed=transposed),))
    return tensor


def orthonormalize_group_(group: dict) -> None:
    """Every factor of every pair of a group made orthonormal in place."""
    for lefts, rights in group["pairs"]:
        for factor, scale in zip(lefts + rights, _factor_scales(group, lefts, rights)):
            _orthonormalize(group["params"], factor, scale)


class FactoredRiemannianOptimizer(torch.optim.Optimizer):
    """Riemannian gradient descent with momentum on factored pairs.

    Arguments:
        groups: parameter-group dicts: ``{"params": [tensors], "pairs": [FactoredPair, ...]}`` (see ``tensor_slice``;
            a pair may also be given as the tuple (left factors, right factors); ``factored_groups`` builds them for a
            model), or the short form of one whole pair ``{"params": [left, right], "transposed": (bool, bool)}``, or
            ``{"params": [...], "geometry": "adamw"}`` for parameters that are not factored (stepped by a
            ``torch.optim.AdamW``, with ``betas`` / ``eps`` if given). Any default below may be overridden per group;
            extra keys (a ``name``) are kept.
        geometry: one of ``GEOMETRIES``.
        lr: step size; momentum: heavy-ball coefficient (0 disables it); weight_decay: decoupled, fixed-rank only.
        retraction: "qr" or "polar" (partial isometries).
        gauge: "balanced" or "continuous": the factors riemannian-embedded stores its retracted X as (``GAUGES``).
        damping: relative regularisation of the quotient geometry's Gram inverses.
    The computation runs in float64 (factors are small); state (momentum) is kept in the parameters' dtype, as
    ``load_state_dict`` restores it, so a resumed run continues exactly. A group's state lives under its first tensor;
    an "adamw" group's AdamW state (step, exp_avg, exp_avg_sq) under each of its tensors, in this optimiser's own
    ``state``, so ``state_dict`` / ``load_state_dict`` save and restore it with the rest (and the group's ``lr``, which
    a learning-rate scheduler sets, is the one AdamW steps with).
    """

    def __init__(self, groups, geometry: str = "riemannian-quotient", lr: float = 1e-3, momentum: float = 0.9,
                 weight_decay: float = 0.0, retraction: str = "qr", damping: float = 1e-8, gauge: str = "balanced"):
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry {geometry!r} is not one of {GEOMETRIES}.")
        if retraction not in mf.RETRACTIONS:
            raise ValueError(f"retraction {retraction!r} is not one of {sorted(mf.RETRACTIONS)}.")
        if gauge not in GAUGES:
            raise ValueError(f"gauge {gauge!r} is not one of {', '.join(GAUGES)}.")
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"need lr > 0, 0 <= momentum < 1, weight_decay >= 0 "
                             f"(got {lr}, {momentum}, {weight_decay}).")
        defaults = dict(geometry=geometry, lr=lr, momentum=momentum, weight_decay=weight_decay, retraction=retraction,
                        damping=damping, gauge=gauge)
        self._adamw = {}  # position in param_groups -> torch's AdamW over that "adamw" group's tensors
        super().__init__([dict(group) for group in groups], defaults)  # why copies: torch fills defaults into them

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(_with_pairs(param_group))
        group = self.param_groups[-1]
        self._check_group(group)
        if group["geometry"] == "adamw" and group["params"]:
            self._adamw[len(self.param_groups) - 1] = _new_adamw(group)

    def __setstate__(self, state):  # load_state_dict, copy.deepcopy and unpickling pass here
        super().__setstate__(state)
        self._adamw = {i: _new_adamw(group) for i, group in enumerate(self.param_groups)
                       if group["geometry"] == "adamw" and group["params"]}

    def state_dict(self):
        """torch's state dict, its pairs as plain tuples. Why: the Trainer reloads ``optimizer.pt`` with
        ``torch.load(weights_only=True)``, which accepts builtin types only (no ``FactoredPair``)."""
        state = super().state_dict()
        state["param_groups"] = [{**group, "pairs": _plain(group["pairs"])} if "pairs" in group else group
                                 for group in state["param_groups"]]
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch takes the saved groups' keys: the pairs come back as plain tuples
            if "pairs" in group:
                group["pairs"] = [as_pair(pair) for pair in group["pairs"]]

    def _check_group(self, group):
        if group["geometry"] == "adamw":  # the parameters that are not factored pairs: torch's AdamW, unchanged
            return
        if group["geometry"] not in GEOMETRIES:
            raise ValueError(f"geometry {group['geometry']!r} is not one of {GEOMETRIES} (or 'adamw').")
        params, label = group["params"], group.get("name", "a factored group")
        for lefts, rights in group["pairs"]:
            if not lefts or not rights:
                raise ValueError(f"{label}: a pair needs at least one left and one right factor.")
            ranks = set()
            for factor in lefts + rights:
                for piece in factor:
                    if not 0 <= piece.index < len(params) or params[piece.index].dim() != 2:
                        raise ValueError(f"{label}: slice {piece} does not name a matrix of the group's params.")
                    ranks.add(_view(params[piece.index], piece).shape[1])
            if len(ranks) != 1:
                raise ValueError(f"{label}: factors must share their rank dimension (tall-form column counts "
                                 f"{sorted(ranks)}; check `transposed`).")
            if group["geometry"] in FIXED_RANK:
                if group.get("left_scale", 1.0) != 1.0:
                    raise ValueError(f"{label}: a stored scale of the left factors (left_scale) applies to the "
                                     "partial-isometry geometries; a fixed-rank one learns every scale itself.")
                continue
            if group["weight_decay"] > 0:
                raise ValueError(f"weight decay would leave the manifold of {group['geometry']}: use weight_decay=0.")
            for factor, scale in zip(lefts + rights, _factor_scales(group, lefts, rights)):
                tall = _read(params, factor) / scale
                _check_tall(tall, group["geometry"], label)
                error = mf.orthonormality_error(tall)
                if error > 1e-4:
                    raise ValueError(f"{label}: {group['geometry']} needs orthonormal factors (max |X^T X - I| = "
                                     f"{error:.2e}, shape {tuple(tall.shape)}): initialise them with "
                                     "fiber_bundle.training.riemannian.start_on_isometries_ (or orthonormalize_), or "
                                     "choose a fixed-rank geometry.")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for position, group in enumerate(self.param_groups):
            if group["geometry"] == "adamw":
                if position in self._adamw:
                    self._adamw_step(self._adamw[position], group)
                continue
            params = group["params"]
            if all(p.grad is None for p in params):
                continue
            state = self.state[params[0]]
            for index, (lefts, rights) in enumerate(group["pairs"]):
                scales = _factor_scales(group, lefts, rights)  # stored = scale x the point on the manifold
                factors = [_read(params, f) / c for f, c in zip(lefts + rights, scales)]
                grads = [_read(params, f, grad=True) * c for f, c in zip(lefts + rights, scales)]  # chain rule
                if group["geometry"] in FIXED_RANK:  # the stacked factors (a block pair's gauge acts on all blocks)
                    k = len(lefts)
                    left, right = torch.cat(factors[:k]), torch.cat(factors[k:])
                    g_left, g_right = torch.cat(grads[:k]), torch.cat(grads[k:])
                    step = self._embedded_step if group["geometry"] == "riemannian-embedded" else self._quotient_step
                    left, right = step(group, state, f"{index}.", left, right, g_left, g_right)
                    if group["weight_decay"] > 0:  # decoupled: X <- (1 - lr wd) X, shared evenly by the factors
                        shrink = (1.0 - group["lr"] * group["weight_decay"]) ** 0.5
                        left, right = left * shrink, right * shrink
                    new = list(torch.split(left, [f.shape[0] for f in factors[:k]])) + \
                        list(torch.split(right, [f.shape[0] for f in factors[k:]]))
                else:
                    new = self._isometry_step(group, state, f"{index}.", factors, grads)
                for factor, value, scale in zip(lefts + rights, new, scales):
                    _write(params, factor, value * scale)
        return loss

    def _adamw_step(self, adamw: torch.optim.AdamW, group: dict) -> None:
        """torch's AdamW step on an "adamw" group, with the group's current hyperparameters and this optimiser's
        state. Why reassign both at every step: a scheduler sets the group's ``lr``, and ``load_state_dict`` replaces
        ``self.state`` and the group dicts."""
        adamw.state = self.state
        adamw.param_groups[0].update(_adamw_options(group))
        adamw.step()

    @staticmethod
    def _heavy_ball(group, state, key, direction):
        if group["momentum"] == 0:
            return direction
        buffer = state.get(key)
        buffer = direction.clone() if buffer is None else group["momentum"] * buffer.to(direction) + direction
        state[key] = buffer.to(group["params"][0].dtype)  # stored as the parameter (as torch restores it)
        return buffer

    def _quotient_step(self, group, state, prefix, left, right, g_left, g_right):
        xi_left, xi_right = mf.quotient_gradient(left, right, g_left, g_right, group["damping"])
        xi_left = self._heavy_ball(group, state, prefix + "left", xi_left)
        xi_right = self._heavy_ball(group, state, prefix + "right", xi_right)
        return left - group["lr"] * xi_left, right - group["lr"] * xi_right

    def _embedded_step(self, group, state, prefix, left, right, g_left, g_right):
        frame = mf.embedded_frame(left, right)
        if not (mf.is_full_rank(frame[3]) and mf.is_full_rank(frame[4])):
            state.pop(prefix + "tangent_a", None)
            state.pop(prefix + "tangent_b", None)
            return self._quotient_step({**group, "momentum": 0.0}, state, prefix, left, right, g_left, g_right)
        tangent = mf.embedded_gradient(frame, g_left, g_right)
        if group["momentum"] > 0:
            if prefix + "tangent_a" in state:  # transport the previous direction to this tangent space, then add
                old = mf.embedded_project(frame, state[prefix + "tangent_a"].to(left),
                                          state[prefix + "tangent_b"].to(left))
                tangent = tuple(group["momentum"] * o + t for o, t in zip(old, tangent))
            a, b = mf.tangent_factors(frame, tangent)
            dtype = group["params"][0].dtype  # stored as the parameter (as torch restores it)
            state[prefix + "tangent_a"], state[prefix + "tangent_b"] = a.to(dtype), b.to(dtype)
        new_left, new_right = mf.embedded_retract(frame, tangent, -group["lr"])
        if group.get("gauge", "balanced") == "continuous":  # .get: a state saved before gauges existed is balanced
            return mf.continuous_factors(new_left, new_right, left)
        return new_left, new_right

    def _isometry_step(self, group, state, prefix, factors, grads):
        gradient, project, horizontal = mf.ISOMETRY_GEOMETRIES[group["geometry"]]

        def tangent(directions):  # onto the tangent (and horizontal) space at the current point
            directions = [project(f, d) for f, d in zip(factors, directions)]
            return horizontal(factors, directions) if horizontal else directions

        xi = [gradient(f, g) for f, g in zip(factors, grads)]
        if horizontal:
            xi = horizontal(factors, xi)
        if group["momentum"] > 0:
            keys = [f"{prefix}momentum{i}" for i in range(len(factors))]
            if keys[0] in state:  # vector transport by projection, then the heavy-ball sum
                old = tangent([state[key].to(f) for key, f in zip(keys, factors)])
                xi = [group["momentum"] * o + x for o, x in zip(old, xi)]
            for key, x in zip(keys, xi):
                state[key] = x.to(group["params"][0].dtype)  # stored as the parameter (as torch restores it)
        retract = mf.RETRACTIONS[group["retraction"]]
        return [retract(f - group["lr"] * x) for f, x in zip(factors, xi)]


def _check_tall(factor: torch.Tensor, geometry: str, label: str) -> None:
    if factor.shape[0] < factor.shape[1]:
        raise ValueError(f"{label}: a factor of shape {tuple(factor.shape)} has fewer rows than its rank, so it cannot "
                         f"have orthonormal columns as {geometry} needs: drop --block (stack the heads' slices) or "
                         "choose a fixed-rank geometry.")


def _with_pairs(group: dict) -> dict:
    """A group in the general form: its pairs as ``FactoredPair`` records, the short form {"params": [left, right],
    "transposed": ...} of one whole pair expanded."""
    if group.get("geometry") == "adamw":
        return group
    group["params"] = list(group["params"])
    if "pairs" not in group:
        if len(group["params"]) != 2:
            raise ValueError(f"a group without 'pairs' is one factored pair of exactly two tensors (left, right), got "
                             f"{len(group['params'])}.")
        group["pairs"] = [whole_pair(*group["params"], group.pop("transposed", (False, False)))]
    group["pairs"] = [as_pair(pair) for pair in group["pairs"]]
    return group


def _new_adamw(group: dict) -> torch.optim.AdamW:
    return torch.optim.AdamW(group["params"], **_adamw_options(group))


def _adamw_options(group: dict) -> dict:
    """The hyperparameters of torch's AdamW for an "adamw" group (torch's defaults where the group has none)."""
    return dict(lr=group["lr"], betas=tuple(group.get("betas", (0.9, 0.999))), eps=group.get("eps", 1e-8),
                weight_decay=group["weight_decay"])


# ----------------------------------------------------------------------------------------------------------------------
# the factored pairs of a model
# ----------------------------------------------------------------------------------------------------------------------
# LoRA targets whose factor is split by attention heads in the block variant: the heads are row blocks of B (q, k, v:
# block-rows, the heads share A) or column blocks of A (o: block-columns, the heads share B).
HEAD_BLOCKS = {"q_proj": ("rows", "num_attention_heads"), "k_proj": ("rows", "num_key_value_heads"),
               "v_proj": ("rows", "num_key_value_heads"), "o_proj": ("columns", "num_attention_heads")}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _blocks(index, tensor, dim, count, size, transposed) -> tuple[Factor, ...]:
    if tensor.shape[dim] != count * size:
        raise ValueError(f"cannot split a dimension of {tensor.shape[dim]} into {count} heads of {size}.")
    return tuple((tensor_slice(index, tensor, dim=dim, start=h * size, length=size, transposed=transposed),)
                 for h in range(count))


def lora_groups(model, *, block: bool = False, adapter: str = "default") -> list[dict]:
    """The LoRA pairs of a PEFT model: for every LoRA layer, X = B A, i.e. L = B (out x r), R^T = A (r x in). With
    ``block``, the attention heads of q/k/v (row blocks of B) and of o (column blocks of A) are separate factors."""
    config = model.config
    groups = []
    for name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if lora_a is None or lora_b is None or adapter not in lora_a:
            continue
        b, a = lora_b[adapter].weight, lora_a[adapter].weight
        if not (b.requires_grad and a.requires_grad):
            continue
        lefts, rights = ((tensor_slice(0, b),),), ((tensor_slice(1, a, transposed=True),),)
        kind = HEAD_BLOCKS.get(name.rsplit(".", 1)[-1])
        if block and kind:
            heads = getattr(config, kind[1])
            if kind[0] == "rows":
                lefts = _blocks(0, b, 0, heads, _head_dim(config), False)
            else:
                rights = _blocks(1, a, 1, heads, _head_dim(config), True)
        groups.append({"params": [b, a], "pairs": [FactoredPair(lefts, rights)], "name": name, "kind": "lora"})
    return groups


def metric_groups(model, *, block: bool = False) -> list[dict]:
    """Each layer's metric generators: X = [W_U; W_V] W_z (W_U, W_V stored as (out x m), W_z as (m x D), so
    R = W_z^T). Non-block: [W_U; W_V] is one left factor; block: one factor per factor-head row block of W_U, and
    W_V."""
    groups = []
    for name, module in model.named_modules():
        code = getattr(module, "code_proj", None)
        # (weight, heads it splits into in the block variant): W_U per factor head, W_V whole
        generators = [(getattr(module, "attn_factor_proj", None), getattr(module, "factor_heads", 1)),
                      (getattr(module, "ffn_factor_proj", None), 1)]
        generators = [(g.weight, heads) for g, heads in generators if g is not None and g.weight.requires_grad]
        if code is None or not code.weight.requires_grad or not generators:
            continue
        params = [code.weight] + [weight for weight, _ in generators]
        rights = ((tensor_slice(0, code.weight, transposed=True),),)
        if block:
            lefts = sum((_blocks(i, w, 0, heads, w.shape[0] // heads, False)
                         for i, (w, heads) in enumerate(generators, start=1)), ())
        else:
            lefts = (tuple(tensor_slice(i, w) for i, (w, _) in enumerate(generators, start=1)),)
        groups.append({"params": params, "pairs": [FactoredPair(lefts, rights)], "name": name, "kind": "metric"})
    return groups


def attention_groups(model, *, block: bool = False, equal_scale: bool = False) -> list[dict]:
    """Per-head W_Q,h^T W_K,g (D x D, rank head_dim) of every attention layer whose q_proj / k_proj weights train, one
    pair per KV group g (its query heads share the key factor). Non-block: the group's query heads stacked as one left
    factor; block: one factor per query head. One parameter group per layer (a tensor sits in one group only).

    ``equal_scale`` (non-block only): the stacked query factor is stored at scale sqrt(query heads per KV head)
    (``left_scale``). Why: orthonormal columns of the stack give its k head slices Sum_h Q_h^T Q_h = I, a k-th of the
    identity each on average, where the block variant makes each slice orthonormal; at this scale the plain variant's
    queries start as large as the block variant's, so the two differ in geometry only."""
    config = model.config
    d, heads, kv = _head_dim(config), config.num_attention_heads, config.num_key_value_heads
    groups = []
    for name, module in model.named_modules():
        q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if not (isinstance(q, torch.nn.Linear) and isinstance(k, torch.nn.Linear)):
            continue
        if not (q.weight.requires_grad and k.weight.requires_grad):
            continue
        queries = _blocks(0, q.weight, 0, heads, d, True)  # W_Q,h^T: (D, d) each
        keys = _blocks(1, k.weight, 0, kv, d, True)
        per_group = heads // kv
        pairs = []
        for g in range(kv):
            mine = queries[g * per_group : (g + 1) * per_group]  # repeat_kv order: head h reads KV head h // per_group
            lefts = mine if block else (tuple(piece for factor in mine for piece in factor),)
            pairs.append(FactoredPair(lefts, (keys[g],)))
        groups.append({"params": [q.weight, k.weight], "pairs": pairs, "name": name, "kind": "attention",
                       **({"left_scale": per_group ** 0.5} if equal_scale else {})})
    return groups


def factored_groups(model, *, block: bool = False, pairs: str = "all", equal_scale: bool = False) -> list[dict]:
    """Every trainable factored pair of a model: LoRA pairs, metric generators, per-head W_Q / W_K (``pairs``: a key
    of ``PAIRS``, "attention" for the W_Q / W_K pairs only; ``equal_scale``: see ``attention_groups``)."""
    if pairs not in PAIRS:
        raise ValueError(f"pairs {pairs!r} is not one of {', '.join(PAIRS)}.")
    if equal_scale and block:
        raise ValueError("equal_scale stores the stacked query factor at the block variant's scale: it applies "
                         "without block, where the heads are stacked.")
    found = {"lora": lora_groups, "metric": metric_groups,
             "attention": lambda model, block: attention_groups(model, block=block, equal_scale=equal_scale)}
    groups, seen = [], set()
    for group in [group for kind in PAIRS[pairs] for group in found[kind](model, block=block)]:
        key = tuple(id(p) for p in group["params"])
        if key not in seen:  # why: PEFT's modules_to_save wrapper forwards attributes to the copy it trains
            seen.add(key)
            groups.append(group)
    return groups


def _is_orthonormal(group: dict) -> bool:
    return all(mf.orthonormality_error(_read(group["params"], factor) / scale) < 1e-4
               for lefts, rights in group["pairs"]
               for factor, scale in zip(lefts + rights, _factor_scales(group, lefts, rights)))


@torch.no_grad()
def start_on_isometries_(model, groups: list[dict], *, fresh: bool = False) -> None:
    """Make every factor orthonormal so that a partial-isometry geometry can start, where that leaves the model's
    function unchanged: a layer's metric generators while its gates are at the graft value (the metric is not used yet).
    ``fresh``: the model is freshly initialised (trained from scratch), so its W_Q / W_K may be made orthonormal too:
    that changes its function, but only its random start (the factors' scale is then fixed at 1; the RMSNorm weights
    before attention, trained by AdamW, carry the scores' scale).

    Refused with the reason: LoRA pairs (a partial isometry has every singular value 1, so the update cannot start at
    B A = 0 as LoRA must) and, unless ``fresh``, W_Q / W_K (orthonormal factors cannot represent a trained
    W_Q^T W_K). Every group is checked before any is written, so a refusal leaves the model untouched."""
    to_orthonormalize = []
    for group in groups:
        label, kind = group.get("name", "a factored group"), group.get("kind")
        for lefts, rights in group["pairs"]:
            for factor in lefts + rights:
                _check_tall(_read(group["params"], factor), "a partial-isometry geometry", label)  # scale-free
        if _is_orthonormal(group):
            continue
        if kind == "metric":
            module = model.get_submodule(label)
            if any(torch.count_nonzero(getattr(module, n)) for n in ("attn_gate", "ffn_gate") if hasattr(module, n)):
                raise ValueError(f"{label}: its metric is in use (gates off the graft value), so orthonormalising its "
                                 "generators would change the model: train it with riemannian-quotient or "
                                 "riemannian-embedded, or start from the converted (graft) model.")
            to_orthonormalize.append(group)
        elif kind == "lora":
            raise ValueError(f"{label}: a partial-isometry geometry cannot train LoRA pairs (every singular value of "
                             "B A would be 1 from the first step, so the adapter could not start at 0): use "
                             "riemannian-quotient or riemannian-embedded for LoRA, or an isometry geometry with "
                             "--mode metric-only.")
        elif kind == "attention" and fresh:
            to_orthonormalize.append(group)
        elif kind == "attention":
            raise ValueError(f"{label}: orthonormal W_Q / W_K factors cannot represent the trained W_Q^T W_K: use "
                             "riemannian-quotient or riemannian-embedded in --mode full (a model trained from scratch, "
                             "--from-config, starts them orthonormal instead).")
        else:
            raise ValueError(f"{label}: its factors are not orthonormal; orthonormalise them yourself "
                             "(orthonormalize_group_) if that leaves your model unchanged.")
    for group in to_orthonormalize:
        orthonormalize_group_(group)


def build_optimizer(model, geometry: str, *, lr: float, riemannian_lr: float | None = None, momentum: float = 0.9,
                    weight_decay: float = 0.0, retraction: str = "qr", block: bool = False, pairs: str = "all",
                    fresh: bool = False, betas=(0.9, 0.999), eps: float = 1e-8, gauge: str = "balanced",
                    equal_scale: bool = False) -> FactoredRiemannianOptimizer:
    """One optimiser for a whole model: every trainable factored pair (``factored_groups``; ``pairs`` "attention":
    only the per-head W_Q / W_K) on ``geometry`` at ``riemannian_lr`` (default ``lr``), every other trainable parameter
    (gates, biases, norms, ...) with AdamW at ``lr``.
    For a partial-isometry geometry the factors are first made orthonormal (``start_on_isometries_``; ``fresh``: the
    model is untrained, so W_Q / W_K may be). ``gauge``: how riemannian-embedded stores X (``GAUGES``). ``equal_scale``:
    the stacked query factor at the block variant's scale (``attention_groups``; partial-isometry geometries)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"optimizer {geometry!r} is not one of {OPTIMIZERS}.")
    if equal_scale and geometry in FIXED_RANK:
        raise ValueError(f"equal_scale fixes the scale of orthonormal query factors; {geometry} learns every scale "
                         "itself: choose stiefel-euclidean, stiefel-canonical or grassmann.")
    groups = factored_groups(model, block=block, pairs=pairs, equal_scale=equal_scale)
    if not groups:
        raise ValueError(f"--optimizer {geometry} found no trainable factored pairs ("
                         + ("W_Q / W_K in --mode full" if pairs == "attention" else
                            "LoRA pairs, metric generators, or W_Q / W_K in --mode full") + ").")
    if geometry not in FIXED_RANK:
        start_on_isometries_(model, groups, fresh=fresh)
    paired = {id(p) for group in groups for p in group["params"]}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in paired]
    for group in groups:
        group["lr"] = riemannian_lr or lr
    groups += [{"params": rest, "geometry": "adamw", "lr": lr, "weight_decay": weight_decay, "betas": tuple(betas),
                "eps": eps}] if rest else []
    return FactoredRiemannianOptimizer(groups, geometry=geometry, lr=lr, momentum=momentum,
                                       weight_decay=weight_decay if geometry in FIXED_RANK else 0.0,
                                       retraction=retraction, gauge=gauge)
