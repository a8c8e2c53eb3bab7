"""The geometry of the Fiber Bundle Transformer as small pure functions (sections 1.1-1.4 of docs/design.md in the
Fiber Bundle Transformers repository).

Every token i carries, per head, a metric G_i = I_d + alpha U_i U_i^T with U_i a d x r factor of spectral norm <= 1 and a
gate alpha = exp(theta) - 1 > -1, so G_i is symmetric positive definite for every input. The attention score of query i
and key j is a geodesic distance measured in the *query's* metric:

    s_ij = scale * [ (G_i q_i) . k_j  -  (gamma/2) ||k_j||^2  -  (alpha/2) ||U_i^T k_j||^2 ]

With gamma = 1 this is -(scale/2) (q_i - k_j)^T G_i (q_i - k_j) up to a term in i alone; with alpha = gamma = 0 it is the
dot-product score. The last term is quadratic in k_j through a *per-query* matrix, so s cannot be written as Q K^T: it is
computed as one matmul of the keys with r + 1 stacked pseudo-queries [G_i q_i, u_i1, ..., u_ir] and an elementwise
combine, O(d r) per (i, j).

Layout convention: factors are stored row-wise, ``factors[..., l, :] = u_il`` (shape ``(..., r, d)``), i.e. U_i^T.

Two attention paths compute the same function:
- ``reference_geodesic_attention``: a few einsums, materialises (n x n x r); short and obviously correct.
- ``blocked_geodesic_attention``: the default. Loops over query blocks with a custom backward that recomputes the
  scores from the saved log-sum-exp (as flash attention does), so extra memory is O(n * block), never n x n x r.

This file imports only torch: it is copied into every published Hub folder.
"""

from typing import NamedTuple

import torch


# --------------------------------------------------------------------------------------------------------------------
# Metric field
# --------------------------------------------------------------------------------------------------------------------
# Why a floor: expm1(theta) rounds to exactly -1 in float32 at theta = -20 (in bf16 at -7), where G_i = I + alpha U U^T
# (and the MLP's M_i) would lose positive definiteness. The floor bounds their condition number by 1e4 and leaves the
# function unchanged for every theta > log(1e-4) = -9.2.
GATE_FLOOR = -1.0 + 1e-4


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the geometry is computed in: at least float32 (bf16 / fp16 models), float64 stays float64."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def metric_gate(theta: torch.Tensor) -> torch.Tensor:
    """A gate alpha = exp(theta) - 1 > -1 (alpha or beta), in at least float32 and never below ``GATE_FLOOR``."""
    return torch.expm1(theta.to(compute_dtype(theta.dtype))).clamp_min(GATE_FLOOR)


def bounded_factors(raw: torch.Tensor) -> torch.Tensor:
    """Map raw factors (..., r, d) to factors of spectral norm < 1: u = raw / sqrt(1 + ||raw||_F^2).

    Why this map: ||u||_2 <= ||u||_F < 1, so I + a u^T u is SPD for every gate a > -1; it is smooth, and close to the
    identity for small raw factors (so gradients flow at initialisation). Computed and returned in at least float32:
    in bf16 the rounded u reaches ||u||^2 = 1.01.
    """
    raw = raw.to(compute_dtype(raw.dtype))
    sq_norm = raw.pow(2).sum(dim=(-2, -1), keepdim=True)  # (..., 1, 1)
    return raw * torch.rsqrt(1.0 + sq_norm)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # Copied from transformers 5.24 models/llama/modeling_llama.py
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last dim of x; cos/sin must already broadcast against x."""
    return (x * cos) + (rotate_half(x) * sin)


def rotate_factors(factors: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each token's factor rows with that token's (query) rotary embedding.

    factors (B, Hf, n, r, d); cos, sin (B, n, d), the *pure* rotation (no ``attention_scaling``: YaRN's or longrope's
    scale would push ||U_i||_2 above 1). Why: the factors live in the token's own frame, like q_i; rotating them
    with R_i makes U_i^T R_i^T R_j k_j depend on j - i only, so scores depend on relative positions only.
    """
    cos = cos[:, None, :, None, :]  # (B, 1, n, 1, d)
    sin = sin[:, None, :, None, :]
    return apply_rotary(factors, cos, sin)


def _lift(query: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """U_i (U_i^T q_i) in O(d r) per token. query (..., n, d); factors (..., n, r, d), broadcastable leading dims."""
    coords = torch.matmul(factors, query.unsqueeze(-1))  # U^T q: (..., n, r, 1)
    return torch.matmul(coords.transpose(-1, -2), factors).squeeze(-2)  # U (U^T q): (..., n, d)


def metric_query(query: torch.Tensor, factors: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """G_i q_i = q_i + alpha U_i (U_i^T q_i). query (B, H, n, d); factors (B, H, n, r, d); alpha (H,)."""
    return query + alpha.view(1, -1, 1, 1).to(query.dtype) * _lift(query, factors)


def metric_gram(factors: torch.Tensor) -> torch.Tensor:
    """U^T U as an r x r Gram matrix per token, from row-wise factors (..., r, d) -> (..., r, r)."""
    return torch.matmul(factors, factors.transpose(-1, -2))


# --------------------------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------------------------
class MaskTerms(NamedTuple):
    """A transformers attention mask, read as the backbone reads it.

    allowed: bool (B|1, H|1, q, kv), True where the key may be attended; None means what it means to SDPA: causal
        with upper-left alignment when q > 1, every key when q == 1.
    additive: the float mask itself, (B|1, H|1, q, kv), added to the scores (any values: -1e4, -1e9, a bias for packed
        documents), or None for a bool mask.
    """

    allowed: torch.Tensor | None
    additive: torch.Tensor | None


def mask_terms(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> MaskTerms:
    """sdpa masks are boolean (True = attend); eager and user masks are additive floats. A float entry at its dtype's
    minimum (or -inf) is what transformers writes for "blocked": it is blocked exactly, so a row of them attends to
    nothing (see ``zero_empty_rows``); every other float value is added to the score, as the backbone adds it."""
    if attention_mask is None:
        return MaskTerms(None, None)
    if hasattr(attention_mask, "mask_mod"):  # flex_attention's BlockMask (attn_implementation="flex_attention")
        attention_mask = dense_block_mask(attention_mask, q_len, kv_len)
    mask = attention_mask[..., :q_len, :kv_len]
    if mask.dtype == torch.bool:
        return MaskTerms(mask, None)
    return MaskTerms(mask > torch.finfo(mask.dtype).min, mask)


def dense_block_mask(block_mask, q_len: int, kv_len: int) -> torch.Tensor:
    """A flex_attention BlockMask as a boolean (B, 1, q, kv) mask, from its token-level ``mask_mod``.

    Why: geodesic scores are not q.k, so flex's kernel cannot compute them; its mask still says who sees whom.
    transformers' mask functions broadcast over index tensors (and carry the cache offsets themselves).
    """
    device = block_mask.kv_num_blocks.device
    batch = torch.arange(block_mask.kv_num_blocks.shape[0], device=device)[:, None, None, None]
    rows = torch.arange(q_len, device=device)[None, None, :, None]
    cols = torch.arange(kv_len, device=device)[None, None, None, :]
    allowed = block_mask.mask_mod(batch, torch.zeros_like(batch), rows, cols)
    return allowed.expand(batch.shape[0], 1, q_len, kv_len)


def causal_allowed(q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """The boolean mask that a None mask stands for (see ``MaskTerms``)."""
    if q_len == 1:
        return None
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows)[None, None]  # (1, 1, q, kv)


def apply_mask(scores: torch.Tensor, mask: MaskTerms, allowed: torch.Tensor | None) -> torch.Tensor:
    """Add a float mask to the scores and set blocked entries to the dtype's minimum (never -inf: no NaN rows).
    ``allowed`` is the boolean mask to apply (``mask.allowed`` or its causal stand-in); returns a new tensor."""
    if mask.additive is not None:
        scores = (scores + mask.additive.to(scores.dtype)).clamp_min(torch.finfo(scores.dtype).min)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return scores


def query_blocks(q_len, block_size: int) -> list:
    """The [i0, i1) row range of each query block of the blocked path.

    Why count the blocks rather than step through range(0, q_len, block_size): under torch.compile a range over the
    length specialises the graph to that very length (one compilation per length); a range over the number of blocks
    guards on ceil(q_len / block_size) only, so every length with as many blocks shares one graph.
    """
    return [(i * block_size, min((i + 1) * block_size, q_len)) for i in range((q_len + block_size - 1) // block_size)]


def _key_range(allowed: torch.Tensor | None, i0: int, i1: int, q_len: int, kv_len: int) -> tuple[int, int]:
    """The smallest key interval [start, end) that holds every allowed key of query rows [i0, i1).

    Why: causal and sliding-window masks allow a band, so blocks skip the keys no row of theirs can see. Under
    torch.compile the whole range (a data-dependent bound would break the graph; the mask still applies).
    """
    if allowed is None:
        return 0, (kv_len if q_len == 1 else min(i1, kv_len))
    if torch.compiler.is_compiling():
        return 0, kv_len
    cols = allowed[..., i0:i1, :].any(dim=-2).flatten(0, -2).any(dim=0).nonzero()  # (n_allowed, 1)
    if cols.numel() == 0:  # every row fully masked (padding): any range gives the same zero rows
        return 0, kv_len
    return int(cols[0]), int(cols[-1]) + 1


def _block_mask(mask: MaskTerms, i0, i1, k0, k1, q_len) -> tuple[MaskTerms, int | None]:
    """The mask of query rows [i0, i1) and keys [k0, k1), shaped to broadcast over (B, Hk, g, Bq, nk), and, for the
    causal mask that a None mask stands for, the tile column of key i0 (see ``_block_logits``), else None."""
    additive = None if mask.additive is None else mask.additive[..., i0:i1, k0:k1]
    if mask.allowed is not None:
        return MaskTerms(mask.allowed[..., i0:i1, k0:k1], additive), None
    if q_len == 1:
        return MaskTerms(None, additive), None
    return MaskTerms(None, additive), i0 - k0  # upper-left causal, as SDPA's is_causal


def _grouped_mask(mask: MaskTerms, hk: int, g: int) -> MaskTerms:
    """(B|1, H|1, q, kv) -> (B|1, Hk|1, g|1, q, kv): a per-head mask applies to each query head of a KV group."""

    def group(t):
        if t is None:
            return None
        if t.shape[1] == 1:
            return t.unsqueeze(2)
        return t.reshape(t.shape[0], hk, g, *t.shape[2:])  # heads h = kv_head * g + j, as repeat_kv orders them

    return MaskTerms(group(mask.allowed), group(mask.additive))


def zero_empty_rows(probs: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Rows with no allowed key (left padding) attend to nothing: output 0, as flash attention does.

    Why: a uniform row over all keys would read future tokens into padded positions, breaking causality there.
    """
    if allowed is None or allowed.dtype != torch.bool:
        return probs
    return probs * allowed.any(dim=-1, keepdim=True).to(probs.dtype)


# --------------------------------------------------------------------------------------------------------------------
# Reference path
# --------------------------------------------------------------------------------------------------------------------
def geodesic_scores_reference(
    query: torch.Tensor,
    factors: torch.Tensor,
    key: torch.Tensor,
    alpha: torch.Tensor,
    gamma: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """s_ij of docs/design.md 1.2, written out term by term. Materialises (B, H, q, r, kv): tests and short inputs only.

    query (B, H, q, d); factors (B, H, q, r, d); key (B, H, kv, d); alpha, gamma (H,). Returns (B, H, q, kv) in at
    least float32.
    """
    compute = compute_dtype(query.dtype, factors.dtype)
    query, factors, key, alpha, gamma = (t.to(compute) for t in (query, factors, key, alpha, gamma))
    gq = metric_query(query, factors, alpha)
    linear = torch.einsum("bhid,bhjd->bhij", gq, key)  # (G_i q_i) . k_j
    coords = torch.einsum("bhird,bhjd->bhirj", factors, key)  # U_i^T k_j: (B, H, q, r, kv)
    quadratic = coords.pow(2).sum(-2)  # ||U_i^T k_j||^2: (B, H, q, kv)
    a = alpha.view(1, -1, 1, 1)
    g = gamma.view(1, -1, 1, 1)
    return scale * (linear - 0.5 * g * key.pow(2).sum(-1)[:, :, None, :] - 0.5 * a * quadratic)


def reference_geodesic_attention(
    query, factors, key, value, alpha, gamma, scale, attention_mask=None, dropout=0.0, training=False
):
    """Softmax over geodesic scores, values aggregated unchanged. Returns output (B, H, q, d) and probabilities."""
    q_len, kv_len = query.shape[2], key.shape[2]
    scores = geodesic_scores_reference(query, factors, key, alpha, gamma, scale)
    mask = mask_terms(attention_mask, q_len, kv_len)
    allowed = mask.allowed if mask.allowed is not None else causal_allowed(q_len, kv_len, query.device)
    scores = apply_mask(scores, mask, allowed)
    probs = zero_empty_rows(torch.softmax(scores, dim=-1), allowed).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=training)
    return torch.matmul(probs, value), probs


# --------------------------------------------------------------------------------------------------------------------
# Blocked path (default)
# --------------------------------------------------------------------------------------------------------------------
class Dropout(NamedTuple):
    """Attention dropout of the blocked path: the probability and the seed its keep-masks are drawn from."""

    p: float
    seed: int


def draw_dropout(p: float) -> Dropout | None:
    """A ``Dropout`` with a seed from torch's default generator (so ``torch.manual_seed`` reproduces it), or None."""
    if p <= 0:
        return None
    return Dropout(float(p), int(torch.randint(0, 2**62, (), dtype=torch.int64)))


def _dropout_keep(dropout: Dropout, i0: int, shape, k0: int, k1: int, device) -> torch.Tensor:
    """Which probabilities of the query block starting at row i0 survive, for keys [k0, k1): (B, Hk, g, Bq, nk) bool.

    Why a generator seeded by (seed, i0), drawn over all keys: the backward and ``blocked_attention_probs`` redraw
    the very same mask for the block, so nothing of size n x n is stored.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(dropout.seed + i0)
    return torch.rand(shape, generator=gen, device=device)[..., k0:k1] >= dropout.p


def _block_products(gq_blk, factors_blk, key_blk):
    """One matmul of a query block's stacked pseudo-queries with a key slice, grouped by KV head.

    gq_blk (B, Hk, g, Bq, d): G_i q_i per query head; factors_blk (B, Hk, gf, Bq, r, d) with gf = 1 when a KV group
    shares its factors (then U_i^T k_j is computed once for the whole group, not g times); key_blk (B, Hk, nk, d).
    Returns the stacked rows (B, Hk, g*Bq + gf*Bq*r, d) and their products with the keys (B, Hk, rows, nk).
    """
    b, hk, g, bq, d = gq_blk.shape
    rows = torch.cat((gq_blk.reshape(b, hk, g * bq, d), factors_blk.reshape(b, hk, -1, d)), dim=2)
    return rows, torch.matmul(rows, key_blk.transpose(-1, -2))


def _block_logits(prods, shape, bias_blk, half_alpha, mask_blk: MaskTerms, diagonal: int | None = None):
    """Combine the products into scores (G_i q_i).k_j + bias_j - (alpha/2) ||U_i^T k_j||^2 and mask them.

    The softmax scale is already folded into the inputs (see ``kernel_operands``).
    prods (B, Hk, g*Bq + gf*Bq*r, nk); shape = (g, gf, Bq, r); bias_blk (B, Hk, g, nk); half_alpha (1, Hk, g, 1, 1);
    mask_blk and diagonal from ``_block_mask`` (its float part already in the compute dtype).
    Returns logits (B, Hk, g, Bq, nk), coords U_i^T k_j (B, Hk, gf, Bq, r, nk) and their squared norms (.., gf, Bq, nk).
    """
    g, gf, bq, r = shape
    b, hk, _, nk = prods.shape
    linear = prods[:, :, : g * bq].view(b, hk, g, bq, nk)  # (G_i q_i) . k_j
    coords = prods[:, :, g * bq :].view(b, hk, gf, bq, r, nk)  # U_i^T k_j
    quadratic = coords.square().sum(-2)  # (B, Hk, gf, Bq, nk), broadcast over the g heads of a shared group
    logits = torch.add(linear, bias_blk[:, :, :, None, :]).addcmul_(half_alpha, quadratic, value=-1.0)
    if mask_blk.additive is not None:  # a float mask is added, whatever its values; clamp: never -inf, no NaN rows
        logits.add_(mask_blk.additive).clamp_min_(torch.finfo(logits.dtype).min)
    if mask_blk.allowed is not None:
        logits.masked_fill_(~mask_blk.allowed, torch.finfo(logits.dtype).min)
    if diagonal is not None and diagonal < nk:
        # causal: only the keys from the block's first row on can be in any row's future, so only the tile's last
        # columns are masked (key i0 + c is blocked for row i0 + t when c > t), not the whole (Bq, nk) tile
        rows = torch.arange(bq, device=logits.device)[:, None]
        cols = torch.arange(nk - diagonal, device=logits.device)[None, :]
        logits[..., diagonal:].masked_fill_(cols > rows, torch.finfo(logits.dtype).min)
    return logits, coords, quadratic


def _blocked_forward(gq, factors, half_alpha, bias, key, value, mask: MaskTerms, block_size, dropout=None):
    """Forward of the blocked kernel (shapes as in ``_BlockedGeodesicAttention``; gq, factors, half_alpha, bias in
    the compute dtype): output (compute dtype) and the per-row log-sum-exp the backward needs to recompute the
    probabilities."""
    b, hk, g, q_len, d = gq.shape
    gf, r = factors.shape[2], factors.shape[4]
    kv_len = key.shape[2]
    key_c, value_c = key.to(gq.dtype), value.to(gq.dtype)  # why: low-precision inputs combine in fp32
    ha = half_alpha.view(1, hk, g, 1, 1)
    out = gq.new_empty((b, hk, g, q_len, d))
    lse = gq.new_empty((b, hk, g, q_len))
    for i0, i1 in query_blocks(q_len, block_size):
        k0, k1 = _key_range(mask.allowed, i0, i1, q_len, kv_len)
        mask_blk, diagonal = _block_mask(mask, i0, i1, k0, k1, q_len)
        _, prods = _block_products(gq[:, :, :, i0:i1], factors[:, :, :, i0:i1], key_c[:, :, k0:k1])
        logits, _, _ = _block_logits(prods, (g, gf, i1 - i0, r), bias[..., k0:k1], ha, mask_blk, diagonal)
        # softmax in place, keeping its log-normaliser for the backward
        row_max = logits.amax(dim=-1, keepdim=True)
        probs = logits.sub_(row_max).exp_()
        row_sum = probs.sum(dim=-1, keepdim=True)
        probs = zero_empty_rows(probs.div_(row_sum), mask_blk.allowed)
        if dropout is not None:
            keep = _dropout_keep(dropout, i0, (b, hk, g, i1 - i0, kv_len), k0, k1, gq.device)
            probs = probs.mul_(keep).div_(1.0 - dropout.p)
        # (B, Hk, g*Bq, nk) @ (B, Hk, nk, d) -> (B, Hk, g*Bq, d)
        blk = torch.matmul(probs.view(b, hk, g * (i1 - i0), -1), value_c[:, :, k0:k1])
        out[:, :, :, i0:i1] = blk.view(b, hk, g, i1 - i0, d)
        lse[:, :, :, i0:i1] = (row_max + row_sum.log()).squeeze(-1)
    return out, lse


def kernel_operands(query, factors, alpha, scale):
    """scale * G_i q_i, sqrt(scale) * U_i and alpha / 2: the blocked loop's operands, with the scale folded in.
    Why fold the scale here: these O(n d) tensors absorb it instead of every O(n * block) score tile."""
    hk, g = alpha.shape
    lifted = _lift(query, factors)  # U_i (U_i^T q_i): (B, Hk, g, q, d), factors broadcast over a shared group
    gq = query + alpha.view(1, hk, g, 1, 1) * lifted  # G_i q_i
    return gq * scale, factors * scale**0.5, 0.5 * alpha, lifted


class _BlockedGeodesicAttention(torch.autograd.Function):
    """Memory-bounded geodesic attention with a recomputing backward (flash-attention style, on plain matmuls).

    Grouped by KV head so keys are never repeated: query (B, Hk, g, q, d); factors (B, Hk, gf, q, r, d), gf in {1, g};
    alpha (Hk, g); bias (B, Hk, g, kv) with the softmax scale folded in (all four in the compute dtype); key, value
    (B, Hk, kv, d); the mask's parts (B|1, Hk|1, g|1, q, kv) (bool, and float in the compute dtype) or None; dropout a
    ``Dropout`` or None. Saves only these inputs, the output and the log-sum-exp: G_i q_i is rebuilt in the backward,
    so training keeps no extra (n x d) tensor per head; the dropout masks are redrawn from their seed.
    """

    @staticmethod
    def forward(ctx, query, factors, alpha, bias, key, value, allowed, additive, scale, block_size, dropout):
        gq, factors_s, half_alpha, _ = kernel_operands(query, factors, alpha, scale)
        mask = MaskTerms(allowed, additive)
        out, lse = _blocked_forward(gq, factors_s, half_alpha, bias, key, value, mask, block_size, dropout)
        ctx.save_for_backward(query, factors, alpha, bias, key, value, allowed, additive, out, lse)
        ctx.scale, ctx.block_size, ctx.dropout = scale, block_size, dropout
        return out.to(value.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, factors_in, alpha, bias, key, value, allowed, additive, out, lse = ctx.saved_tensors
        scale, block_size, dropout = ctx.scale, ctx.block_size, ctx.dropout
        mask = MaskTerms(allowed, additive)
        gq, factors, half_alpha, lifted = kernel_operands(query, factors_in, alpha, scale)
        b, hk, g, q_len, d = gq.shape
        gf, r = factors.shape[2], factors.shape[4]
        kv_len = key.shape[2]
        compute = out.dtype
        key_c, value_c = key.to(compute), value.to(compute)
        ha = half_alpha.view(1, hk, g, 1, 1)
        grad_out = grad_out.to(compute)
        d_gq, d_factors = torch.empty_like(gq), torch.empty_like(factors)
        d_half_alpha, d_bias = out.new_zeros((hk, g)), torch.zeros_like(bias)
        d_key, d_value = torch.zeros_like(key_c), torch.zeros_like(value_c)
        # D_i = sum_j P_ij dP_ij = dO_i . O_i (softmax backward without storing P; holds with dropout too)
        delta = (grad_out * out).sum(-1, keepdim=True)  # (B, Hk, g, q, 1)
        for i0, i1 in query_blocks(q_len, block_size):
            bq = i1 - i0
            k0, k1 = _key_range(allowed, i0, i1, q_len, kv_len)
            mask_blk, diagonal = _block_mask(mask, i0, i1, k0, k1, q_len)
            k_blk, v_blk = key_c[:, :, k0:k1], value_c[:, :, k0:k1]
            rows, prods = _block_products(gq[:, :, :, i0:i1], factors[:, :, :, i0:i1], k_blk)
            logits, coords, quadratic = _block_logits(prods, (g, gf, bq, r), bias[..., k0:k1], ha, mask_blk,
                                                      diagonal)
            probs = zero_empty_rows(logits.sub_(lse[:, :, :, i0:i1, None]).exp_(), mask_blk.allowed)  # (B,Hk,g,Bq,nk)
            dropped, keep = probs, None
            if dropout is not None:
                keep = _dropout_keep(dropout, i0, (b, hk, g, bq, kv_len), k0, k1, gq.device)
                dropped = probs * keep / (1.0 - dropout.p)
            go = grad_out[:, :, :, i0:i1].reshape(b, hk, g * bq, d)
            d_value[:, :, k0:k1] += torch.matmul(dropped.view(b, hk, g * bq, -1).transpose(-1, -2), go)
            d_probs = torch.matmul(go, v_blk.transpose(-1, -2)).view(b, hk, g, bq, -1)
            if keep is not None:
                d_probs = d_probs.mul_(keep).div_(1.0 - dropout.p)
            d_logits = d_probs.sub_(delta[:, :, :, i0:i1]).mul_(probs)  # softmax backward: (B, Hk, g, Bq, nk)
            d_bias[..., k0:k1] += d_logits.sum(-2)
            d_half_alpha -= (d_logits * quadratic).sum(dim=(0, 3, 4))
            # d/d coords of -(alpha/2)||U^T k||^2, summed over the heads that share the factors
            if gf == 1:
                d_quadratic = torch.einsum("bkgqn,kg->bkqn", d_logits, -2.0 * ha.view(hk, g)).unsqueeze(2)
            else:
                d_quadratic = d_logits * (-2.0 * ha)
            d_coords = coords * d_quadratic.unsqueeze(-2)  # (B, Hk, gf, Bq, r, nk)
            d_prods = torch.cat((d_logits.view(b, hk, g * bq, -1), d_coords.view(b, hk, gf * bq * r, -1)), dim=2)
            d_rows = torch.matmul(d_prods, k_blk)  # (B, Hk, g*Bq + gf*Bq*r, d)
            d_gq[:, :, :, i0:i1] = d_rows[:, :, : g * bq].view(b, hk, g, bq, d)
            d_factors[:, :, :, i0:i1] = d_rows[:, :, g * bq :].view(b, hk, gf, bq, r, d)
            d_key[:, :, k0:k1] += torch.matmul(d_prods.transpose(-1, -2), rows)
        d_query, d_factors, d_alpha = operand_grads(query, factors_in, alpha, lifted, scale, d_gq, d_factors,
                                                     d_half_alpha)
        return d_query, d_factors, d_alpha, d_bias, d_key.to(key.dtype), d_value.to(value.dtype), *(None,) * 5


def operand_grads(query, factors_in, alpha, lifted, scale, d_gq, d_factors, d_half_alpha):
    """The chain rule from the gradients of the kernel's operands (``kernel_operands``: d/d(scale G_i q_i),
    d/d(sqrt(scale) U_i), d/d(alpha/2)) back to the grouped query, factors and alpha; shared by the blocked and the
    Triton backward. Shapes as in ``_BlockedGeodesicAttention``; ``lifted`` = U_i (U_i^T q_i)."""
    hk, g = alpha.shape
    gf = factors_in.shape[2]
    # chain rule through the operands: gq = scale (q + alpha U U^T q), factors = sqrt(scale) U, half_alpha = alpha/2
    d_gq = d_gq * scale  # d/d(G_i q_i)
    a = alpha.view(1, hk, g, 1, 1)
    coords = torch.matmul(factors_in, query.unsqueeze(-1))  # U^T q: (B, Hk, g, q, r, 1)
    d_coords = torch.matmul(factors_in, d_gq.unsqueeze(-1))  # U^T dgq: (B, Hk, g, q, r, 1)
    d_query = d_gq + a * torch.matmul(d_coords.transpose(-1, -2), factors_in).squeeze(-2)  # G is symmetric
    # d/dU of alpha U U^T q: alpha (U^T q) dgq^T + alpha (U^T dgq) q^T, summed over the heads sharing U
    d_lift = a.unsqueeze(-1) * (coords * d_gq.unsqueeze(-2) + d_coords * query.unsqueeze(-2))
    if gf == 1:
        d_lift = d_lift.sum(2, keepdim=True)
    d_factors = d_factors * scale**0.5 + d_lift
    d_alpha = 0.5 * d_half_alpha + (d_gq * lifted).sum(dim=(0, 3, 4))
    return d_query, d_factors, d_alpha


def key_norms(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """||k_j||^2 of every key in ``dtype``: key (B, Hk, kv, d) -> (B, Hk, kv). The one definition of the key term's norms,
    whether computed at each call or once per key as it enters a cache (``update_cache`` in the modeling file)."""
    return key.to(dtype).pow(2).sum(-1)


def prepare_geodesic_inputs(query, factors, key, alpha, gamma, scale, key_sq=None):
    """The O(n d r) inputs of the blocked kernel, grouped by KV head, in the compute dtype (at least float32).

    query (B, H, q, d) after RoPE; factors (B, Hf, q, r, d) after RoPE, Hf = H (per head) or Hk (shared by each KV
    group); key (B, Hk, kv, d); alpha, gamma (H,); key_sq the keys' ``key_norms`` where a cache keeps them, else None
    (ignored where a gradient flows through the key: the key term's gradient needs ||k_j||^2 computed from it). Returns
    query (B, Hk, g, q, d), factors (B, Hk, gf, q, r, d), alpha (Hk, g) and the key term -scale (gamma/2) ||k_j||^2
    (B, Hk, g, kv).
    """
    b, h, q_len, d = query.shape
    hk = key.shape[1]
    g, gf = h // hk, factors.shape[1] // hk
    compute = compute_dtype(query.dtype, factors.dtype)
    grouped_q = query.to(compute).view(b, hk, g, q_len, d)  # heads h = kv_head * g + j, as repeat_kv orders them
    grouped_f = factors.to(compute).view(b, hk, gf, q_len, factors.shape[-2], d)
    # -(gamma/2)||k_j||^2 per query head: (B, Hk, 1, kv) * (Hk, g) -> (B, Hk, g, kv)
    if key_sq is None or gradients_flow(key):
        key_sq = key_norms(key, compute)
    key_sq = key_sq.to(compute)  # (B, Hk, kv)
    bias = (-0.5 * scale) * key_sq[:, :, None, :] * gamma.to(compute).view(1, hk, g, 1)
    return grouped_q, grouped_f, alpha.to(compute).view(hk, g), bias


def grouped_kernel_mask(attention_mask, q_len, kv_len, hk, g, compute) -> MaskTerms:
    """The mask grouped by KV head, its float part in the compute dtype."""
    mask = _grouped_mask(mask_terms(attention_mask, q_len, kv_len), hk, g)
    return mask if mask.additive is None else mask._replace(additive=mask.additive.to(compute))


def geodesic_decode_step(query, factors, key, value, alpha, gamma, scale, attention_mask=None,
                         key_sq=None) -> torch.Tensor:
    """One new token against the cache, without autograd: the blocked forward's scores for a single query row in the
    fewest ops (decoding is bound by the number of ops, not by flops), and none of the blocked loop's bookkeeping.

    query (B, H, 1, d) after RoPE; factors (B, Hf, 1, r, d) after RoPE; key, value (B, Hk, kv, d); alpha, gamma (H,);
    key_sq the cached keys' ``key_norms`` (B, Hk, kv) where the cache keeps them, else None (computed here).
    Returns (B, H, 1, d) in value's dtype.
    """
    b, h, _, d = query.shape
    hk, kv_len = key.shape[1], key.shape[2]
    g, gf, r = h // hk, factors.shape[1] // hk, factors.shape[-2]
    compute = compute_dtype(query.dtype, factors.dtype)
    q = query.to(compute).view(b, hk, g, d)  # heads h = kv_head * g + j, as repeat_kv orders them
    u = factors.to(compute).view(b, hk, gf * r, d)  # the factor rows of each KV group (gf = 1) or of each head
    a = alpha.to(compute).view(hk, g, 1)
    # G_i q_i = q_i + alpha U_i (U_i^T q_i), with the softmax scale folded in
    if gf == 1:
        lifted = torch.matmul(torch.matmul(q, u.transpose(-1, -2)), u)  # U (U^T q), the group's U for each head
    else:
        uh = u.view(b, hk, g, r, d)
        lifted = (torch.matmul(uh, q.unsqueeze(-1)) * uh).sum(-2)  # each head's own U_h (U_h^T q_h)
    gq = torch.addcmul(q, a, lifted).mul_(scale)  # (B, Hk, g, d)
    # one product of the stacked pseudo-queries [G q, u_1 .. u_r] with the cached keys: (B, Hk, g + gf*r, kv)
    keys = key.to(compute)
    rows = torch.cat((gq, u), dim=2).view(b * hk, g + gf * r, d)
    prods = torch.bmm(rows, keys.reshape(b * hk, kv_len, d).transpose(1, 2)).view(b, hk, g + gf * r, kv_len)
    coords = prods[:, :, g:].view(b, hk, gf, r, kv_len)  # U_i^T k_j
    # scale [(G q).k - (gamma/2)||k||^2 - (alpha/2)||U^T k||^2]: the two quadratic terms as two fused multiply-adds
    key_sq = (key_norms(keys, compute) if key_sq is None else key_sq.to(compute)).unsqueeze(2)  # (B, Hk, 1, kv)
    logits = torch.addcmul(prods[:, :, :g], gamma.to(compute).view(hk, g, 1), key_sq, value=-0.5 * scale)
    logits.addcmul_(a, coords.square().sum(3), value=-0.5 * scale)  # a shared group's quadratic broadcasts over g
    logits = logits.view(b, hk, g, 1, kv_len)
    mask = None
    if attention_mask is not None:
        mask = grouped_kernel_mask(attention_mask, 1, kv_len, hk, g, compute)
        logits = apply_mask(logits, mask, mask.allowed)
    probs = torch.softmax(logits, dim=-1)
    if mask is not None:
        probs = zero_empty_rows(probs, mask.allowed)  # (B, Hk, g, 1, kv)
    out = torch.bmm(probs.view(b * hk, g, kv_len), value.to(compute).reshape(b * hk, kv_len, d))
    return out.to(value.dtype).view(b, h, 1, d)


def gradients_flow(*tensors: torch.Tensor) -> bool:
    """Whether a backward will run through these tensors: gradients are enabled and one of them requires them."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def blocked_geodesic_attention(
    query, factors, key, value, alpha, gamma, scale, attention_mask=None, block_size=64, dropout: Dropout | None = None,
    *, key_sq=None,
) -> torch.Tensor:
    """The default path: same function as ``reference_geodesic_attention``, extra memory O(n * block).

    query (B, H, q, d) after RoPE; factors (B, Hf, q, r, d) after RoPE, Hf = H (per head) or Hk (shared by each KV
    group); key, value (B, Hk, kv, d) (not repeated); alpha, gamma (H,); dropout from ``draw_dropout``; key_sq the keys'
    ``key_norms`` where a cache keeps them (inference only), else None. Returns the attention output (B, H, q, d) in
    value's dtype.
    """
    training = gradients_flow(query, factors, key, value, alpha, gamma)
    if query.shape[2] == 1 and dropout is None and not training:
        return geodesic_decode_step(query, factors, key, value, alpha, gamma, scale, attention_mask, key_sq)
    grouped_q, grouped_f, grouped_alpha, bias = prepare_geodesic_inputs(query, factors, key, alpha, gamma, scale,
                                                                        key_sq)
    b, hk, g, q_len, d = grouped_q.shape
    mask = grouped_kernel_mask(attention_mask, q_len, key.shape[2], hk, g, grouped_q.dtype)
    if training:
        inputs = (grouped_q, grouped_f, grouped_alpha, bias, key, value)
        out = _BlockedGeodesicAttention.apply(*inputs, *mask, scale, block_size, dropout)
    else:  # inference (a prompt): no autograd bookkeeping, no saved tensors
        gq, factors_s, half_alpha, _ = kernel_operands(grouped_q, grouped_f, grouped_alpha, scale)
        out = _blocked_forward(gq, factors_s, half_alpha, bias, key, value, mask, block_size, dropout)[0]
    return out.to(value.dtype).view(b, hk * g, q_len, d)  # (B, Hk, g, q, d) -> (B, H, q, d)


def blocked_attention_probs(
    query, factors, key, alpha, gamma, scale, attention_mask=None, block_size=64, dropout=None
) -> torch.Tensor:
    """The attention probabilities (B, H, q, kv) of ``blocked_geodesic_attention`` (for ``output_attentions``), built
    from the kernel's own block functions over every key, after dropout (the same keep-masks), differentiable.
    Arguments as ``blocked_geodesic_attention``'s. Materialises q x kv per head, as LLaMA's eager attention does."""
    grouped_q, grouped_f, grouped_alpha, bias = prepare_geodesic_inputs(query, factors, key, alpha, gamma, scale)
    gq, factors_s, half_alpha, _ = kernel_operands(grouped_q, grouped_f, grouped_alpha, scale)
    b, hk, g, q_len, _ = gq.shape
    kv_len = key.shape[2]
    mask = grouped_kernel_mask(attention_mask, q_len, kv_len, hk, g, gq.dtype)
    key_c = key.to(gq.dtype)
    blocks = []
    for i0, i1 in query_blocks(q_len, block_size):
        mask_blk, diagonal = _block_mask(mask, i0, i1, 0, kv_len, q_len)
        _, prods = _block_products(gq[:, :, :, i0:i1], factors_s[:, :, :, i0:i1], key_c)
        shape = (g, factors_s.shape[2], i1 - i0, factors_s.shape[4])
        logits, _, _ = _block_logits(prods, shape, bias, half_alpha.view(1, hk, g, 1, 1), mask_blk, diagonal)
        probs = zero_empty_rows(torch.softmax(logits, dim=-1), mask_blk.allowed)  # (B, Hk, g, Bq, kv)
        if dropout is not None:
            keep = _dropout_keep(dropout, i0, probs.shape, 0, kv_len, gq.device)
            probs = probs * keep / (1.0 - dropout.p)
        blocks.append(probs)
    return torch.cat(blocks, dim=3).view(b, hk * g, q_len, kv_len).to(query.dtype)


# --------------------------------------------------------------------------------------------------------------------
# Metric-preconditioned MLP step (docs/design.md 1.3)
# --------------------------------------------------------------------------------------------------------------------
# Ranks up to this get the Woodbury system solved by an unrolled Cholesky in elementwise ops (``small_spd_solve``);
# larger ranks by LAPACK. Why: per token the system is r x r, and batched LAPACK on thousands of 2 x 2 matrices is an
# opaque call per matrix that no compiler fuses, while r(r + 1)/2 elementwise steps fuse into the surrounding kernel.
UNROLLED_SOLVE_MAX_RANK = 4


def gram_entries(v: torch.Tensor) -> torch.Tensor:
    """V^T V of row-wise factors v (..., r, D) as (..., r, r): each entry of the lower triangle an elementwise product
    summed over D, mirrored to the upper one.

    Why not a matmul: per token this is an (r x D) @ (D x r) product, which batched matmul runs far below its speed;
    one entry at a time keeps the temporaries at O(D) per token (a broadcast product would hold r^2 D)."""
    r = v.shape[-2]
    return symmetric_from_lower({(i, j): (v[..., i, :] * v[..., j, :]).sum(-1) for i in range(r) for j in range(i + 1)},
                                r)


def symmetric_from_lower(lower: dict, r: int) -> torch.Tensor:
    """The symmetric (..., r, r) matrix whose entry (i, j), i >= j, is ``lower[i, j]`` (each of shape (...))."""
    entry = lambda i, j: lower[max(i, j), min(i, j)]  # noqa: E731
    return torch.stack([torch.stack([entry(i, j) for j in range(r)], dim=-1) for i in range(r)], dim=-2)


def spd_solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """x = system^{-1} rhs for a batch of r x r SPD systems (..., r, r), rhs (..., r): unrolled for r up to
    ``UNROLLED_SOLVE_MAX_RANK``, else Cholesky by LAPACK (half the ops of a general LU solve)."""
    if system.shape[-1] <= UNROLLED_SOLVE_MAX_RANK:
        return small_spd_solve(system, rhs)
    return torch.cholesky_solve(rhs.unsqueeze(-1), torch.linalg.cholesky_ex(system)[0]).squeeze(-1)


def small_spd_solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """x = system^{-1} rhs for a batch of small SPD matrices, by Cholesky unrolled into elementwise ops.

    system (..., r, r) symmetric positive definite (only its lower triangle is read); rhs (..., r). Returns (..., r).
    Why unrolled: see ``UNROLLED_SOLVE_MAX_RANK``. The pivots are clamped at the dtype's smallest normal number, which
    changes nothing for an SPD system and keeps a rounding error from turning into a NaN.
    """
    r = system.shape[-1]
    tiny = torch.finfo(system.dtype).tiny
    low = [[None] * r for _ in range(r)]  # L[i][j], i >= j: entries of the Cholesky factor, each of shape (...)
    for j in range(r):
        pivot = system[..., j, j]
        for k in range(j):
            pivot = pivot - low[j][k].square()
        low[j][j] = pivot.clamp_min(tiny).sqrt()
        for i in range(j + 1, r):
            entry = system[..., i, j]
            for k in range(j):
                entry = entry - low[i][k] * low[j][k]
            low[i][j] = entry / low[j][j]
    z = [None] * r  # L z = rhs
    for i in range(r):
        value = rhs[..., i]
        for k in range(i):
            value = value - low[i][k] * z[k]
        z[i] = value / low[i][i]
    x = [None] * r  # L^T x = z
    for i in reversed(range(r)):
        value = z[i]
        for k in range(i + 1, r):
            value = value - low[k][i] * x[k]
        x[i] = value / low[i][i]
    return torch.stack(x, dim=-1)


def woodbury_precondition(update: torch.Tensor, factors: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """M^{-1} y with M = I_D + beta V V^T, by Woodbury: y - beta V (I_r + beta V^T V)^{-1} V^T y.

    update y (..., D); factors (..., r, D) row-wise (V^T); beta scalar tensor. O(D r^2 + r^3) per token, never D x D.
    """
    # why at least float32: the r x r system stays SPD in float32 only because beta >= GATE_FLOOR (beta = -1 exactly
    # would make it singular), and LAPACK's Cholesky has no half-precision kernels
    compute = compute_dtype(update.dtype, factors.dtype)
    y, v = update.to(compute), factors.to(compute)
    beta = beta.to(compute)
    r = v.shape[-2]
    # why elementwise products for V^T y and V s: per token they are (r x D) matrix-vector products, which batched
    # matmul runs far below its speed; a multiply and a sum over D stream through memory once.
    coords = (v * y.unsqueeze(-2)).sum(-1)  # V^T y: (..., r)
    eye = torch.eye(r, dtype=compute, device=v.device)
    system = torch.addcmul(eye, beta, gram_entries(v))  # I + beta V^T V: SPD since beta > -1 and ||V||_2 < 1
    solved = spd_solve(system, coords)  # (..., r)
    correction = (solved.unsqueeze(-1) * v).sum(-2)  # V (.)^{-1} V^T y: (..., D)
    return torch.addcmul(y, beta, correction, value=-1.0).to(update.dtype)  # y - beta V (.)^{-1} V^T y


# --------------------------------------------------------------------------------------------------------------------
# Connection observables (docs/design.md 1.4), all from r x r Gram matrices
# --------------------------------------------------------------------------------------------------------------------
def curvature_proxy(factors: torch.Tensor, alpha: torch.Tensor, token_mask: torch.Tensor | None = None):
    """Mean over i of ||G_{i+1} - G_i||_F^2 / ||G_i||_F^2, per head-averaged, from r x r Grams only.

    factors (B, H, n, r, d) in each token's own frame; alpha (H,); token_mask (B, n) bool or None. Returns a scalar.
    ||A A^T - B B^T||_F^2 = ||A^T A||^2 + ||B^T B||^2 - 2 ||A^T B||^2 and ||G||_F^2 = d + 2 a tr(B^T B) + a^2 ||B^T B||^2.
    """
    d = factors.shape[-1]
    a = alpha.view(1, -1, 1).to(factors.dtype)
    nxt, cur = factors[:, :, 1:], factors[:, :, :-1]  # (B, H, n-1, r, d)
    gram_cur = metric_gram(cur)
    cross = torch.matmul(nxt, cur.transpose(-1, -2))  # A^T B: (B, H, n-1, r, r)
    sq = lambda m: m.pow(2).sum(dim=(-2, -1))  # noqa: E731  squared Frobenius norm of r x r matrices
    diff = a.pow(2) * (sq(metric_gram(nxt)) + sq(gram_cur) - 2 * sq(cross))
    norm = d + 2 * a * cur.square().sum((-2, -1)) + a.pow(2) * sq(gram_cur)  # tr(B^T B) = ||B||_F^2
    ratio = diff.clamp_min(0) / norm  # (B, H, n-1)
    if token_mask is None:  # why not mean(): a one-token input (a decode step) has no pair, and its mean is NaN
        return ratio.sum() / max(ratio.numel(), 1)
    pair = (token_mask[:, 1:] & token_mask[:, :-1])[:, None, :].to(ratio.dtype)  # (B, 1, n-1)
    return (ratio * pair).sum() / (pair.sum() * ratio.shape[1]).clamp_min(1)


def torsion_proxy(
    factors: torch.Tensor,
    key: torch.Tensor,
    alpha: torch.Tensor,
    block_size: int,
    token_mask: torch.Tensor | None = None,
):
    """||D - D^T||_F / ||D||_F with D_ij = (k_i - k_j)^T G_i (k_i - k_j), on pairs inside blocks of consecutive tokens.

    factors (B, H, n, r, d), key (B, H, n, d) both in each token's own frame (before RoPE); alpha (H,).
    Cost O(n * block * d * r); zero for a homogeneous metric. Returns a scalar.
    """
    b, h, n, r, d = factors.shape
    pad = (-n) % block_size
    if pad:  # why: pad to whole blocks; padded tokens are masked out below
        factors = torch.nn.functional.pad(factors, (0, 0, 0, 0, 0, pad))
        key = torch.nn.functional.pad(key, (0, 0, 0, pad))
    valid = torch.ones(b, n, dtype=torch.bool, device=key.device) if token_mask is None else token_mask.bool()
    valid = torch.nn.functional.pad(valid, (0, pad))
    nb = (n + pad) // block_size
    u = factors.reshape(b, h, nb, block_size, r, d)  # (B, H, nb, T, r, d)
    k = key.reshape(b, h, nb, block_size, d)  # (B, H, nb, T, d)
    diff = k[:, :, :, :, None, :] - k[:, :, :, None, :, :]  # k_i - k_j: (B, H, nb, T, T, d)
    coords = torch.einsum("bhnird,bhnijd->bhnijr", u, diff)  # U_i^T (k_i - k_j): (B, H, nb, T, T, r)
    a = alpha.view(1, -1, 1, 1, 1).to(key.dtype)
    dist = diff.pow(2).sum(-1) + a * coords.pow(2).sum(-1)  # D_ij: (B, H, nb, T, T)
    v = valid.view(b, 1, nb, block_size)
    pair = (v[..., :, None] & v[..., None, :]).to(dist.dtype)  # (B, 1, nb, T, T)
    asym = ((dist - dist.transpose(-1, -2)).pow(2) * pair).sum()
    total = (dist.pow(2) * pair).sum()
    # why the where: sqrt has an infinite slope at 0, and asym is exactly 0 at the graft (alpha = 0)
    nonzero = asym > 0
    root = torch.where(nonzero, torch.where(nonzero, asym, torch.ones_like(asym)).sqrt(), torch.zeros_like(asym))
    return root / torch.sqrt(total.clamp_min(torch.finfo(dist.dtype).tiny))


def anisotropy(factors: torch.Tensor, alpha: torch.Tensor, token_mask: torch.Tensor | None = None):
    """Mean over tokens and heads of log(1 + alpha sigma_max(U_i)^2), sigma_max^2 from the r x r Gram. Scalar."""
    sigma_sq = torch.linalg.eigvalsh(metric_gram(factors).to(torch.promote_types(factors.dtype, torch.float32)))
    value = torch.log1p(alpha.view(1, -1, 1).to(sigma_sq.dtype) * sigma_sq[..., -1])  # (B, H, n)
    if token_mask is None:
        return value.mean()
    w = token_mask[:, None, :].to(value.dtype)
    return (value * w).sum() / (w.sum() * value.shape[1]).clamp_min(1)
