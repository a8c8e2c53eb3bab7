"""The pure geometry functions: DESIGN.md 1.1-1.4 properties, blocked == reference, cost and memory contracts."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from modeling_fiber_bundle.fiber_attention import (
    anisotropy,
    blocked_attention_probs,
    blocked_geodesic_attention,
    bounded_factors,
    curvature_proxy,
    dense_metric,
    geodesic_scores_reference,
    metric_query,
    reference_geodesic_attention,
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
@pytest.mark.parametrize("raw_scale", [1e-3, 1.0, 1e3, 1e6])
def test_metric_is_spd_for_every_input(raw_scale):
    gen = torch.Generator().manual_seed(3)
    raw = raw_scale * torch.randn(4, 6, 9, 3, 8, generator=gen, dtype=F64)
    factors = bounded_factors(raw)
    assert torch.linalg.matrix_norm(factors, ord=2).max() < 1.0  # ||U||_2 < 1
    # gates from exp(theta) - 1 over a wide theta range, down to alpha -> -1
    theta = torch.tensor([-30.0, -5.0, -0.5, 0.0, 0.5, 3.0], dtype=F64)
    g = dense_metric(factors, torch.expm1(theta))
    assert torch.allclose(g, g.transpose(-1, -2))
    assert torch.linalg.eigvalsh(g).min() > 0


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


MASK_CASES = {
    "causal-none": lambda b, q, kv: None,
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


def test_blocked_decode_step_with_longer_cache():
    """q_len = 1 against kv_len = 9 (generation with a cache): the query sees every cached key."""
    query, factors, key, value, alpha, gamma = make_inputs(q=1, kv=9, hk=2)
    out_b = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.3, None, block_size=4)
    out_r, _ = reference_geodesic_attention(query, factors, repeat(key, 2), repeat(value, 2), alpha, gamma, 0.3, None)
    torch.testing.assert_close(out_b, out_r, rtol=1e-12, atol=1e-12)


def test_blocked_probs_equal_reference_probs():
    query, factors, key, value, alpha, gamma = make_inputs(hk=4, q=10, kv=10)
    mask = padding_bool_mask(2, 10, 10, pad=[0, 3])
    _, p_ref = reference_geodesic_attention(query, factors, key, value, alpha, gamma, 0.3, mask)
    p_blk = blocked_attention_probs(query, factors, key, alpha, gamma, 0.3, mask, block_size=3)
    torch.testing.assert_close(p_blk, p_ref, rtol=1e-12, atol=1e-12)
    row_sums = p_blk.sum(-1)  # 1 on rows with a key to attend to, 0 on fully masked padding rows
    torch.testing.assert_close(row_sums, mask.any(-1).expand_as(row_sums).to(F64))


@pytest.mark.parametrize("hf", [1, 2])
def test_blocked_gradcheck(hf):
    inputs = make_inputs(b=1, h=2, hk=1, q=5, kv=5, d=4, r=2, requires_grad=True, hf=hf)
    fn = lambda q, f, k, v, a, g: blocked_geodesic_attention(q, f, k, v, a, g, 0.5, None, block_size=2)  # noqa: E731
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
def test_blocked_path_never_materialises_n_by_n_by_r():
    """Extra memory O(n * block): no tensor of n x n per head (let alone n x n x r), forward and backward."""
    b, h, hk, n, d, r, block = 1, 4, 2, 256, 16, 4, 32
    query, factors, key, value, alpha, gamma = make_inputs(b=b, h=h, hk=hk, q=n, kv=n, d=d, r=r, requires_grad=True)
    with LargestTensor() as blocked:
        out = blocked_geodesic_attention(query, factors, key, value, alpha, gamma, 0.25, None, block_size=block)
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
