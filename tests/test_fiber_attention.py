"""The pure geometry functions: docs/design.md 1.1-1.4 properties, blocked == reference, cost and memory contracts."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from helpers import dense_metric
from modeling_fiber_bundle.fiber_attention import (
    GATE_FLOOR,
    Dropout,
    anisotropy,
    blocked_attention_probs,
    blocked_geodesic_attention,
    bounded_factors,
    curvature_proxy,
    rotate_factors,
    geodesic_scores_reference,
    metric_gate,
    metric_gram,
    metric_query,
    reference_geodesic_attention,
    small_spd_solve,
    torsion_proxy,
    woodbury_precondition,
)

F64 = torch.float64


class LargestTensor(TorchDispatchMode):
    """Records every op's output shapes, to check what a computation materialises."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out

    @property
    def max_numel(self):
        return max(math.prod(s) for s in self.shapes)


def make_inputs(b=2, h=4, hk=2, q=13, kv=13, d=8, r=2, seed=0, requires_grad=False, scale_factors=1.0, hf=None):
    """Random attention inputs; factors per query head (hf = h, default) or shared by each KV group (hf = hk)."""
    gen = torch.Generator().manual_seed(seed)
    t = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    query, key, value = t(b, h, q, d), t(b, hk, kv, d), t(b, hk, kv, d)
    factors = bounded_factors(scale_factors * t(b, hf or h, q, r, d))
    alpha = 0.9 * torch.rand(h, generator=gen, dtype=F64) - 0.3
    gamma = torch.rand(h, generator=gen, dtype=F64)
    tensors = [query, factors, key, value, alpha, gamma]
    if requires_grad:
        tensors = [x.clone().requires_grad_(True) for x in tensors]
    return tensors


def repeat(x, g):
    return x.repeat_interleave(g, dim=1)


# ---------------------------------------------------------------------------------------------------------------------
# 1.1 the metric field
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, F64])
@pytest.mark.parametrize("raw_scale", [1e-3, 1.0, 1e2, 1e4])
def test_metric_is_spd_for_every_input_in_every_dtype(dtype, raw_scale):
    """G = I + alpha U U^T and the MLP's I + beta V^T V stay SPD from the values the model computes with, in every
    dtype: factors and gates come out in at least float32, alpha never reaches -1, a rotation keeps ||U||_2 < 1.
    (The model-level test with YaRN's scaled rotary embedding is in test_modeling.py.)"""
    gen = torch.Generator().manual_seed(3)
    raw = (raw_scale * torch.randn(4, 8, 9, 3, 8, generator=gen, dtype=F64)).to(dtype)  # (B, H, n, r, d)
    factors = bounded_factors(raw)
    assert factors.dtype == torch.promote_types(dtype, torch.float32)
    angle = 100.0 * torch.rand(4, 9, 4, generator=gen)  # a rotation of each token's factors, as RoPE's
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(factors.dtype), torch.cat([angle.sin()] * 2, -1).to(factors.dtype)
    factors = rotate_factors(factors, cos, sin)
    sigma_sq = torch.linalg.eigvalsh(metric_gram(factors.double())).amax(-1)  # ||U_i||_2^2 per token, in float64
    assert sigma_sq.max() < 1.0 + 1e-6
    # gates from exp(theta) - 1 over a wide theta range, down to where expm1 rounds to -1 in float32 and bf16
    theta = torch.tensor([-30.0, -20.0, -7.0, -5.0, -0.5, 0.0, 0.5, 3.0], dtype=dtype)
    alpha = metric_gate(theta)
    assert alpha.dtype == factors.dtype and (alpha >= GATE_FLOOR).all() and (alpha > -1).all()
    smallest = 1.0 + alpha.double().view(1, -1, 1) * sigma_sq  # G's smallest eigenvalue where alpha < 0, per head
    assert smallest.min() > 1e-5
    if dtype == F64:
        g = dense_metric(factors, torch.expm1(theta))
        assert torch.allclose(g, g.transpose(-1, -2)) and torch.linalg.eigvalsh(g).min() > 0
    # the MLP step's r x r Woodbury system at beta = expm1(-20): solvable, finite, in every dtype
    update = torch.randn(4, 8, 9, 8, generator=gen, dtype=F64).to(dtype)
    out = woodbury_precondition(update, factors, metric_gate(torch.tensor(-20.0, dtype=dtype)))
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_metric_query_is_dense_metric_times_query():
    query, factors, _, _, alpha, _ = make_inputs(hk=4)
    dense = dense_metric(factors, alpha)
    expected = torch.matmul(dense, query.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(metric_query(query, factors, alpha), expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# 1.2 geodesic scores
# ---------------------------------------------------------------------------------------------------------------------
def test_scores_are_geodesic_distances_up_to_a_query_term():
    """gamma = 1: s_ij = -(scale/2)(q_i - k_j)^T G_i (q_i - k_j) + c_i."""
    query, factors, key, _, alpha, _ = make_inputs(hk=4)
    gamma = torch.ones_like(alpha)
    scale = 0.37
    s = geodesic_scores_reference(query, factors, key, alpha, gamma, scale)
    g = dense_metric(factors, alpha)  # (B, H, q, d, d)
    diff = query[:, :, :, None, :] - key[:, :, None, :, :]  # (B, H, q, kv, d)
    dist = torch.einsum("bhijd,bhide,bhije->bhij", diff, g, diff)
    shifted = s + 0.5 * scale * dist  # must not depend on j
    torch.testing.assert_close(shifted, shifted[..., :1].expand_as(shifted), rtol=1e-10, atol=1e-10)


def test_scores_reduce_to_dot_product_at_the_graft():
    query, factors, key, _, alpha, gamma = make_inputs(hk=4)
    zeros = torch.zeros_like(alpha)
    s = geodesic_scores_reference(query, factors, key, zeros, zeros, 0.5)
    torch.testing.assert_close(s, 0.5 * query @ key.transpose(-1, -2), rtol=0, atol=0)


def test_score_matrix_is_not_gram():
    """Heterogeneous metrics: numerical rank far above d + 1 (44 for d = 8, n = 200); homogeneous: at most d + 1."""
    d, n = 8, 200
    gen = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 1, n, d, generator=gen, dtype=F64), torch.randn(1, 1, n, d, generator=gen, dtype=F64)
    alpha, gamma = torch.tensor([0.8], dtype=F64), torch.tensor([1.0], dtype=F64)
    hetero = bounded_factors(torch.randn(1, 1, n, 2, d, generator=gen, dtype=F64))
    homo = hetero[:, :, :1].expand_as(hetero)
    rank = lambda f: int(torch.linalg.matrix_rank(geodesic_scores_reference(query, f, key, alpha, gamma, 1.0)[0, 0]))  # noqa: E731
    assert rank(hetero) == d * (d + 1) // 2 + d  # 44: the quadratic lift of the keys, plus the keys
    assert rank(homo) <= d + 1


# ---------------------------------------------------------------------------------------------------------------------
# blocked path == reference path
# ---------------------------------------------------------------------------------------------------------------------
def padding_bool_mask(b, q, kv, pad, window=None):
    """A transformers-style boolean (B, 1, q, kv) mask: bottom-right causal, left padding, optional sliding window."""
    rows = torch.arange(q)[:, None] + (kv - q)
    cols = torch.arange(kv)[None, :]
    allowed = cols <= rows
    if window is not None:
        allowed &= cols > rows - window
    keep = torch.ones(b, kv, dtype=torch.bool)
    for i, p in enumerate(pad):
        keep[i, :p] = False
    return allowed[None, None] & keep[:, None, None, :]


def additive_mask(b, q, kv, h=1, seed=0):
    """A float mask as people build them for packed documents or biases: arbitrary values, -1e4 and -1e9 "soft"
    blocks, the dtype's minimum where transformers blocks, and one row of -inf (a query with nothing to attend to)."""
    gen = torch.Generator().manual_seed(seed)
    mask = 2.0 * torch.randn(b, h, q, kv, generator=gen, dtype=F64)
    mask[..., 1::3] = -1e4
    mask[..., 2::5] = -1e9
    mask = mask.masked_fill(~padding_bool_mask(b, q, kv, pad=[2, 0]), torch.finfo(F64).min)
    mask[0, :, -1] = float("-inf")
    return mask


def per_head_bool_mask(b, q, kv, h=4):
    """(B, H, q, kv): each query head its own sliding window (so a KV group's heads see different keys)."""
    return torch.cat([padding_bool_mask(b, q, kv, pad=[0, 3], window=2 + 2 * i) for i in range(h)], dim=1)


MASK_CASES = {
    "causal-none": lambda b, q, kv: None,
    "float-additive": lambda b, q, kv: additive_mask(b, q, kv),
    "float-additive-per-head": lambda b, q, kv: additive_mask(b, q, kv, h=4),
    "bool-per-head": lambda b, q, kv: per_head_bool_mask(b, q, kv),
    "bool-padding": lambda b, q, kv: padding_bool_mask(b, q, kv, pad=[0, 4]),
    "float-padding": lambda b, q, kv: torch.zeros(b, 1, q, kv, dtype=F64).masked_fill(
        ~padding_bool_mask(b, q, kv, pad=[3, 0]), torch.finfo(F64).min
    ),
    "sliding-window": lambda b, q, kv: padding_bool_mask(b, q, kv, pad=[0, 2], window=4),
}


def valid_rows(mask, b, h, q, kv):
    """Rows with at least one allowed key (fully masked padding rows are garbage on every implementation)."""
    if mask is None:
        return torch.ones(b, h, q, 1, dtype=F64)
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return allowed.any(-1, keepdim=True).expand(b, h, q, 1).to(F64)


@pytest.mark.parametrize("mask_name", list(MASK_CASES))
@pytest.mark.parametrize("block", [1, 4, 64])
@pytest.mark.parametrize("hk", [1, 2, 4])
@pytest.mark.parametrize("shared", [False, True])
def test_blocked_equals_reference_forward_and_backward(mask_name, block, hk, shared):
    b, h, n, d = 2, 4, 11, 8
    g = h // hk
    query, factors, key, value, alpha, gamma = make_inputs(
        b=b, h=h, hk=hk, q=n, kv=n, d=d, requires_grad=True, hf=hk if shared else h
    )
    mask = MASK_CASES[mask_name](b, n, n)
    weight = valid_rows(mask, b, h, n, n) * torch.randn(b, h, n, d, dtype=F64)
    out_b = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.35, mask, block_size=block)
    per_head = repeat(factors, g) if shared else factors  # the reference path takes one factor matrix per head
    out_r, _ = reference_geodesic_attention(query, per_head, repeat(key, g), repeat(value, g), alpha, gamma, 0.35, mask)
    torch.testing.assert_close(out_b, out_r, rtol=1e-11, atol=1e-12)  # fully masked rows are 0 on both
    grads_b = torch.autograd.grad((out_b * weight).sum(), [query, factors, key, value, alpha, gamma])
    grads_r = torch.autograd.grad((out_r * weight).sum(), [query, factors, key, value, alpha, gamma])
    for name, gb, gr in zip(["query", "factors", "key", "value", "alpha", "gamma"], grads_b, grads_r):
        torch.testing.assert_close(gb, gr, rtol=1e-10, atol=1e-11, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("path", ["blocked", "reference"])
@pytest.mark.parametrize("heads", [1, 4])
def test_a_float_mask_is_added_to_the_scores(path, heads):
    """Any float mask is added, as the backbone adds it (no reinterpretation of -1e4 or -1e9 as "blocked"); the
    dtype's minimum and -inf block; a row with no key to attend to gives 0, not NaN."""
    b, h, hk, n = 2, 4, 2, 9
    query, factors, key, value, alpha, gamma = make_inputs(b=b, h=h, hk=hk, q=n, kv=n)
    mask = additive_mask(b, n, n, h=heads)
    if path == "blocked":
        out = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.4, mask, block_size=4)
    else:
        out, _ = reference_geodesic_attention(query, factors, repeat(key, 2), repeat(value, 2), alpha, gamma, 0.4, mask)
    scores = geodesic_scores_reference(query, factors, repeat(key, 2), alpha, gamma, 0.4) + mask
    expected = torch.softmax(scores, dim=-1) @ repeat(value, 2)  # what an eager backbone computes
    # rows with no key above the minimum (padding, the -inf row) attend to nothing, where eager is uniform or NaN
    empty = (mask <= torch.finfo(F64).min).all(-1).expand(b, h, n)
    assert torch.isnan(expected[0, :, -1]).all() and (out[empty] == 0).all() and empty.sum() == 3 * h
    torch.testing.assert_close(out[~empty], expected[~empty], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("mask_name", list(MASK_CASES))
@pytest.mark.parametrize("hk", [1, 2, 4])
@pytest.mark.parametrize("shared", [False, True])
def test_decode_step_equals_reference(mask_name, hk, shared):
    """q_len = 1 against a longer cache (generation): the one-token step (``geodesic_decode_step``, taken by
    ``blocked_geodesic_attention`` without autograd) equals the reference path for every mask and KV grouping; a
    fully masked row (a padded sequence's query) gives 0."""
    b, h, kv = 2, 4, 11
    g = h // hk
    query, factors, key, value, alpha, gamma = make_inputs(b=b, h=h, hk=hk, q=1, kv=kv, hf=hk if shared else h)
    mask = MASK_CASES[mask_name](b, kv, kv)
    mask = None if mask is None else mask[..., -1:, :]  # the last query row: the new token against the cache
    if mask is not None and mask_name == "bool-padding":
        mask = mask.clone()
        mask[1] = False  # a row with nothing to attend to
    out_b = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.3, mask, block_size=4)
    per_head = repeat(factors, g) if shared else factors
    out_r, _ = reference_geodesic_attention(query, per_head, repeat(key, g), repeat(value, g), alpha, gamma, 0.3, mask)
    torch.testing.assert_close(out_b, out_r, rtol=1e-12, atol=1e-12)
    if mask_name == "bool-padding":
        assert (out_b[1] == 0).all()
    low = blocked_geodesic_attention(*(x.float() for x in (query, factors, key, value, alpha, gamma)), 0.3,
                                     None if mask is None else mask.float() if mask.dtype != torch.bool else mask)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low.double(), out_r, rtol=1e-5, atol=1e-5)  # float32 in, float32 out


@pytest.mark.parametrize("mask_name", ["bool-padding", "float-additive-per-head"])
def test_blocked_probs_are_the_kernels_probabilities(mask_name):
    """output_attentions of the blocked path: the probabilities whose product with the values *is* the blocked
    kernel's output, equal to the reference path's, with a gradient (as LLaMA's eager attention returns them)."""
    query, factors, key, value, alpha, gamma = make_inputs(hk=2, q=10, kv=10, requires_grad=True, hf=2)
    mask = MASK_CASES[mask_name](2, 10, 10)
    p_blk = blocked_attention_probs(query, factors, key, alpha, gamma, 0.3, mask, block_size=3)
    out = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.3, mask, block_size=3)
    torch.testing.assert_close(p_blk @ repeat(value, 2), out, rtol=1e-12, atol=1e-12)
    _, p_ref = reference_geodesic_attention(query, repeat(factors, 2), repeat(key, 2), repeat(value, 2), alpha, gamma,
                                            0.3, mask)
    torch.testing.assert_close(p_blk, p_ref, rtol=1e-12, atol=1e-12)
    row_sums = p_blk.sum(-1)  # 1 on rows with a key to attend to, 0 on fully masked padding rows
    torch.testing.assert_close(row_sums, valid_rows(mask, 2, 4, 10, 10).squeeze(-1))
    grads = torch.autograd.grad(p_blk[..., 1:4].sum(), [query, factors, key, alpha, gamma])
    grads_ref = torch.autograd.grad(p_ref[..., 1:4].sum(), [query, factors, key, alpha, gamma])
    for g_blk, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g_blk, g_ref, rtol=1e-10, atol=1e-11)


def test_blocked_dropout_draws_the_same_masks_in_forward_backward_and_probabilities():
    """Attention dropout in the blocked kernel: each block's keep-mask is redrawn from its seed in the backward and
    for output_attentions, so out = dropped probabilities @ V and the custom backward equals autograd through them."""
    b, h, hk, n = 2, 4, 2, 23
    inputs = make_inputs(b=b, h=h, hk=hk, q=n, kv=n, requires_grad=True)
    query, factors, key, value, alpha, gamma = inputs
    mask = padding_bool_mask(b, n, n, pad=[0, 5])
    drop = Dropout(0.3, seed=1234)
    out = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.35, mask, block_size=4, dropout=drop)
    probs = blocked_attention_probs(query, factors, key, alpha, gamma, 0.35, mask, block_size=4, dropout=drop)
    expected = probs @ repeat(value, 2)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    _, clean = reference_geodesic_attention(query, factors, repeat(key, 2), repeat(value, 2), alpha, gamma, 0.35, mask)
    allowed = clean > 0
    dropped = (probs[allowed] == 0).double().mean()
    assert 0.25 < dropped < 0.35  # a fraction p of the probabilities dropped...
    kept = probs[allowed] != 0
    torch.testing.assert_close(probs[allowed][kept], clean[allowed][kept] / 0.7)  # ...the others scaled by 1/(1-p)
    weight = torch.randn_like(out)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    grads_ref = torch.autograd.grad((expected * weight).sum(), inputs)
    for name, g_blk, g_ref in zip(["query", "factors", "key", "value", "alpha", "gamma"], grads, grads_ref):
        torch.testing.assert_close(g_blk, g_ref, rtol=1e-10, atol=1e-11, msg=lambda m: f"{name}: {m}")
    other = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.35, mask, block_size=4,
                                       dropout=Dropout(0.3, seed=99))
    assert (other - out).abs().max() > 1e-3  # another seed, other masks


@pytest.mark.parametrize("hf", [1, 2])
@pytest.mark.parametrize("dropout", [None, Dropout(0.4, seed=5)])
def test_blocked_gradcheck(hf, dropout):
    inputs = make_inputs(b=1, h=2, hk=1, q=5, kv=5, d=4, r=2, requires_grad=True, hf=hf)
    mask = additive_mask(2, 5, 5, h=2)[:1] if dropout is not None else None  # per head, additive, one empty row

    def fn(q, f, k, v, a, g):
        return blocked_geodesic_attention(q, f, k, v, a, g, 0.5, mask, block_size=2, dropout=dropout)

    assert torch.autograd.gradcheck(fn, inputs)


def test_blocked_fp32_matches_fp64_and_bf16_is_finite():
    inputs64 = make_inputs(q=300, kv=300, d=16, hk=2)
    out64 = blocked_geodesic_attention(*inputs64, 0.25, None, block_size=64)
    out32 = blocked_geodesic_attention(*[x.float() for x in inputs64], 0.25, None, block_size=64)
    torch.testing.assert_close(out32.double(), out64, rtol=1e-4, atol=1e-5)
    out16 = blocked_geodesic_attention(*[x.bfloat16() for x in inputs64], 0.25, None, block_size=64)
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()


# ---------------------------------------------------------------------------------------------------------------------
# cost and memory contracts
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dropout", [None, Dropout(0.1, seed=3)])
def test_blocked_path_never_materialises_n_by_n_by_r(dropout):
    """Extra memory O(n * block): no tensor of n x n per head (let alone n x n x r), forward and backward, with
    attention dropout too."""
    b, h, hk, n, d, r, block = 1, 4, 2, 256, 16, 4, 32
    query, factors, key, value, alpha, gamma = make_inputs(b=b, h=h, hk=hk, q=n, kv=n, d=d, r=r, requires_grad=True)
    with LargestTensor() as blocked:
        out = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.25, None, block_size=block,
                                         dropout=dropout)
        out.sum().backward()
    assert blocked.max_numel <= b * h * block * (r + 1) * n  # one query block's stacked products
    assert blocked.max_numel < b * h * n * n
    with LargestTensor() as reference:
        reference_geodesic_attention(query, factors, repeat(key, 2), repeat(value, 2), alpha, gamma, 0.25, None)
    assert reference.max_numel >= b * h * n * n * r  # what the default path avoids


def test_cost_is_linear_in_rank_with_d_times_r_per_pair():
    """Flops grow linearly in r, by about one d-length multiply-add per (i, j) pair per unit of rank."""
    b, h, n, d = 1, 2, 128, 16

    def flops(r):
        inputs = make_inputs(b=b, h=h, hk=h, q=n, kv=n, d=d, r=r)
        with FlopCounterMode(display=False) as counter:
            blocked_geodesic_attention(*inputs, 0.25, None, block_size=n)
        return counter.get_total_flops()

    f1, f2, f4, f8 = flops(1), flops(2), flops(4), flops(8)
    per_rank = f2 - f1
    assert f4 - f2 == 2 * per_rank and f8 - f4 == 4 * per_rank  # exactly linear in r
    pairs = b * h * n * n
    assert per_rank <= 2 * d * pairs * 1.05  # one multiply-add of length d per pair (plus O(n d) terms)
    assert f1 <= 2 * d * pairs * (1 + 2) * 1.05  # (r + 1) pseudo-queries and the values


# ---------------------------------------------------------------------------------------------------------------------
# 1.3 Woodbury
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [-0.99, -0.5, 0.0, 0.7, 20.0])
def test_woodbury_equals_dense_inverse(beta):
    gen = torch.Generator().manual_seed(0)
    tokens, dim, r = 7, 24, 3
    y = torch.randn(tokens, dim, generator=gen, dtype=F64)
    v = bounded_factors(3 * torch.randn(tokens, r, dim, generator=gen, dtype=F64))
    b = torch.tensor(beta, dtype=F64)
    dense = torch.eye(dim, dtype=F64) + b * v.transpose(-1, -2) @ v  # M = I + beta V V^T
    expected = torch.linalg.solve(dense, y.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(woodbury_precondition(y, v, b), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_small_spd_solve_equals_lapack(r):
    """The unrolled Cholesky solves like LAPACK, reads only the lower triangle, and its gradients are LAPACK's."""
    gen = torch.Generator().manual_seed(r)
    a = torch.randn(50, r, r, generator=gen, dtype=F64)
    system = a @ a.transpose(-1, -2) + 0.05 * torch.eye(r, dtype=F64)  # SPD, some badly conditioned
    rhs = torch.randn(50, r, generator=gen, dtype=F64)
    expected = torch.linalg.solve(system, rhs.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(small_spd_solve(system, rhs), expected, rtol=1e-10, atol=1e-10)
    upper_garbage = system + torch.triu(torch.full((r, r), 7.0, dtype=F64), diagonal=1)
    torch.testing.assert_close(small_spd_solve(upper_garbage, rhs), expected, rtol=1e-10, atol=1e-10)
    sym = lambda m: 0.5 * (m + m.transpose(-1, -2))  # noqa: E731  the function of a symmetric input, both ways
    torch.autograd.gradcheck(lambda m, b: small_spd_solve(sym(m), b), (system[:3].clone().requires_grad_(),
                                                                        rhs[:3].clone().requires_grad_()))


def test_woodbury_never_builds_a_d_by_d_matrix():
    tokens, dim, r = 4, 512, 3
    y, v = torch.randn(tokens, dim, dtype=F64), bounded_factors(torch.randn(tokens, r, dim, dtype=F64))
    with LargestTensor() as seen:
        woodbury_precondition(y, v, torch.tensor(0.5, dtype=F64))
    assert seen.max_numel <= tokens * r * dim  # O(D r) per token; a D x D matrix would be 262144 per token
    with FlopCounterMode(display=False) as counter:
        woodbury_precondition(y, v, torch.tensor(0.5, dtype=F64))
    assert counter.get_total_flops() <= 2 * tokens * (dim * r * r + 2 * dim * r) * 1.1  # O(D r^2 + r^3)


# ---------------------------------------------------------------------------------------------------------------------
# 1.4 connection observables
# ---------------------------------------------------------------------------------------------------------------------
def dense_curvature(factors, alpha):
    g = dense_metric(factors, alpha)
    num = (g[:, :, 1:] - g[:, :, :-1]).pow(2).sum((-2, -1))
    return (num / g[:, :, :-1].pow(2).sum((-2, -1))).mean()


def dense_torsion(factors, key, alpha, block):
    g = dense_metric(factors, alpha)
    n = key.shape[2]
    asym = total = 0.0
    for s in range(0, n, block):
        kb, gb = key[:, :, s : s + block], g[:, :, s : s + block]
        diff = kb[:, :, :, None] - kb[:, :, None, :]  # (B, H, T, T, d)
        dist = torch.einsum("bhijd,bhide,bhije->bhij", diff, gb, diff)
        asym = asym + (dist - dist.transpose(-1, -2)).pow(2).sum()
        total = total + dist.pow(2).sum()
    return torch.sqrt(asym / total)


def test_observables_match_their_dense_definitions():
    query, factors, key, _, alpha, _ = make_inputs(hk=4, q=23, kv=23)
    torch.testing.assert_close(curvature_proxy(factors, alpha), dense_curvature(factors, alpha), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(torsion_proxy(factors, key, alpha, 5), dense_torsion(factors, key, alpha, 5), rtol=1e-10, atol=1e-14)
    sigma = torch.linalg.matrix_norm(factors, ord=2)
    expected = torch.log1p(alpha.view(1, -1, 1) * sigma.pow(2)).mean()
    torch.testing.assert_close(anisotropy(factors, alpha), expected, rtol=1e-10, atol=1e-14)


def test_torsion_and_curvature_vanish_for_a_homogeneous_metric():
    _, factors, key, _, alpha, _ = make_inputs(hk=4, q=40, kv=40)
    homogeneous = factors[:, :, :1].expand_as(factors).contiguous()
    assert torsion_proxy(homogeneous, key, alpha, 8).abs() < 1e-14
    assert curvature_proxy(homogeneous, alpha).abs() < 1e-14
    assert torsion_proxy(factors, key, alpha, 8) > 1e-3  # and not for a heterogeneous one
    assert curvature_proxy(factors, alpha) > 1e-3


def test_observables_cost_o_n_block_and_no_d_by_d():
    b, h, n, d, r, block = 1, 2, 256, 32, 2, 8
    _, factors, key, _, alpha, _ = make_inputs(b=b, h=h, hk=h, q=n, kv=n, d=d, r=r)
    with LargestTensor() as seen:
        curvature_proxy(factors, alpha)
        torsion_proxy(factors, key, alpha, block)
        anisotropy(factors, alpha)
    assert seen.max_numel <= b * h * n * block * d  # the in-block key differences
    assert not any(s[-2:] == (d, d) for s in seen.shapes)
    with FlopCounterMode(display=False) as counter:
        torsion_proxy(factors, key, alpha, block)
    assert counter.get_total_flops() <= 2 * b * h * n * block * d * r * 1.1


def test_masked_observables_ignore_padding():
    _, factors, key, _, alpha, _ = make_inputs(b=2, hk=4, q=12, kv=12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False
    scrambled_f, scrambled_k = factors.clone(), key.clone()
    scrambled_f[1, :, :5] = bounded_factors(torch.randn_like(scrambled_f[1, :, :5]))
    scrambled_k[1, :, :5] = 100 * torch.randn_like(scrambled_k[1, :, :5])
    for fn, args, args2 in [
        (curvature_proxy, (factors, alpha), (scrambled_f, alpha)),
        (anisotropy, (factors, alpha), (scrambled_f, alpha)),
        (torsion_proxy, (factors, key, alpha, 4), (scrambled_f, scrambled_k, alpha, 4)),
    ]:
        torch.testing.assert_close(fn(*args, token_mask=mask), fn(*args2, token_mask=mask))
