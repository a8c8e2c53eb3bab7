"""The geometry of the Fiber Bundle Transformer as small pure functions (DESIGN.md sections 1.1-1.4).

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

import torch


# --------------------------------------------------------------------------------------------------------------------
# Metric field
# --------------------------------------------------------------------------------------------------------------------
def bounded_factors(raw: torch.Tensor) -> torch.Tensor:
    """Map raw factors (..., r, d) to factors of spectral norm < 1: u = raw / sqrt(1 + ||raw||_F^2).

    Why this map: ||u||_2 <= ||u||_F < 1, so I + a u^T u is SPD for every gate a > -1; it is smooth, and close to the
    identity for small raw factors (so gradients flow at initialisation).
    """
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

    factors (B, Hf, n, r, d); cos, sin (B, n, d). Why: the factors live in the token's own frame, like q_i; rotating them
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


def dense_metric(factors: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """G = I + alpha U U^T as a dense d x d matrix. For tests and small analyses only (the model never builds it).

    factors (B, H, n, r, d); alpha (H,). Returns (B, H, n, d, d).
    """
    d = factors.shape[-1]
    eye = torch.eye(d, dtype=factors.dtype, device=factors.device)
    outer = torch.matmul(factors.transpose(-1, -2), factors)  # U U^T: (B, H, n, d, d)
    return eye + alpha.view(1, -1, 1, 1, 1).to(factors.dtype) * outer


# --------------------------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------------------------
def allowed_from_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
    """Normalise transformers' mask formats to a boolean "may attend" tensor (B or 1, 1, q, kv), or None.

    sdpa masks are boolean (True = attend); eager masks are additive floats (0 or a very negative number).
    None means what it means to SDPA: causal with upper-left alignment when q_len > 1, everything when q_len == 1.
    """
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return attention_mask[..., :q_len, :kv_len]


def causal_allowed(q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """The boolean mask that a None mask stands for (see ``allowed_from_mask``)."""
    if q_len == 1:
        return None
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows)[None, None]  # (1, 1, q, kv)


def _key_range(allowed: torch.Tensor | None, i0: int, i1: int, q_len: int, kv_len: int) -> tuple[int, int]:
    """The smallest key interval [start, end) that holds every allowed key of query rows [i0, i1).

    Why: causal and sliding-window masks allow a band, so blocks skip the keys no row of theirs can see.
    """
    if allowed is None:
        return 0, (kv_len if q_len == 1 else min(i1, kv_len))
    cols = allowed[..., i0:i1, :].any(dim=-2).flatten(0, -2).any(dim=0).nonzero()  # (n_allowed, 1)
    if cols.numel() == 0:  # every row fully masked (padding): any range gives the same uniform garbage
        return 0, kv_len
    return int(cols[0]), int(cols[-1]) + 1


def _block_allowed(allowed, i0, i1, k0, k1, q_len, device):
    """The boolean mask of query rows [i0, i1) and keys [k0, k1), shaped to broadcast over (B, Hk, g, Bq, nk)."""
    if allowed is not None:
        return allowed[..., i0:i1, k0:k1]
    if q_len == 1:
        return None
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(k0, k1, device=device)[None, :]
    return cols <= rows  # upper-left causal, as SDPA's is_causal (Bq, nk)


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
    """s_ij of DESIGN 1.2, written out term by term. Materialises (B, H, q, r, kv): tests and short inputs only.

    query (B, H, q, d); factors (B, H, q, r, d); key (B, H, kv, d); alpha, gamma (H,). Returns (B, H, q, kv).
    """
    gq = metric_query(query, factors, alpha)
    linear = torch.einsum("bhid,bhjd->bhij", gq, key)  # (G_i q_i) . k_j
    coords = torch.einsum("bhird,bhjd->bhirj", factors, key)  # U_i^T k_j: (B, H, q, r, kv)
    quadratic = coords.pow(2).sum(-2)  # ||U_i^T k_j||^2: (B, H, q, kv)
    a = alpha.view(1, -1, 1, 1).to(query.dtype)
    g = gamma.view(1, -1, 1, 1).to(query.dtype)
    return scale * (linear - 0.5 * g * key.pow(2).sum(-1)[:, :, None, :] - 0.5 * a * quadratic)


def reference_geodesic_attention(
    query, factors, key, value, alpha, gamma, scale, attention_mask=None, dropout=0.0, training=False
):
    """Softmax over geodesic scores, values aggregated unchanged. Returns output (B, H, q, d) and probabilities."""
    q_len, kv_len = query.shape[2], key.shape[2]
    compute = torch.promote_types(query.dtype, torch.float32)  # softmax in fp32 at least, fp64 stays fp64
    scores = geodesic_scores_reference(query, factors, key, alpha, gamma, scale).to(compute)
    allowed = allowed_from_mask(attention_mask, q_len, kv_len)
    if allowed is None:
        allowed = causal_allowed(q_len, kv_len, query.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = zero_empty_rows(torch.softmax(scores, dim=-1), allowed).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=training)
    return torch.matmul(probs, value), probs


# --------------------------------------------------------------------------------------------------------------------
# Blocked path (default)
# --------------------------------------------------------------------------------------------------------------------
def _block_products(gq_blk, factors_blk, key_blk):
    """One matmul of a query block's stacked pseudo-queries with a key slice, grouped by KV head.

    gq_blk (B, Hk, g, Bq, d): G_i q_i per query head; factors_blk (B, Hk, gf, Bq, r, d) with gf = 1 when a KV group
    shares its factors (then U_i^T k_j is computed once for the whole group, not g times); key_blk (B, Hk, nk, d).
    Returns the stacked rows (B, Hk, g*Bq + gf*Bq*r, d) and their products with the keys (B, Hk, rows, nk).
    """
    b, hk, g, bq, d = gq_blk.shape
    rows = torch.cat((gq_blk.reshape(b, hk, g * bq, d), factors_blk.reshape(b, hk, -1, d)), dim=2)
    return rows, torch.matmul(rows, key_blk.transpose(-1, -2))


def _block_logits(prods, shape, bias_blk, half_alpha, allowed_blk):
    """Combine the products into scores (G_i q_i).k_j + bias_j - (alpha/2) ||U_i^T k_j||^2 and mask them.

    The softmax scale is already folded into the inputs (see ``_kernel_operands``).
    prods (B, Hk, g*Bq + gf*Bq*r, nk); shape = (g, gf, Bq, r); bias_blk (B, Hk, g, nk); half_alpha (1, Hk, g, 1, 1).
    Returns logits (B, Hk, g, Bq, nk), coords U_i^T k_j (B, Hk, gf, Bq, r, nk) and their squared norms (.., gf, Bq, nk).
    """
    g, gf, bq, r = shape
    b, hk, _, nk = prods.shape
    linear = prods[:, :, : g * bq].view(b, hk, g, bq, nk)  # (G_i q_i) . k_j
    coords = prods[:, :, g * bq :].view(b, hk, gf, bq, r, nk)  # U_i^T k_j
    quadratic = coords.square().sum(-2)  # (B, Hk, gf, Bq, nk), broadcast over the g heads of a shared group
    logits = torch.add(linear, bias_blk[:, :, :, None, :]).addcmul_(half_alpha, quadratic, value=-1.0)
    if allowed_blk is not None:
        logits.masked_fill_(~allowed_blk, torch.finfo(logits.dtype).min)
    return logits, coords, quadratic


def _blocked_forward(gq, factors, half_alpha, bias, key, value, allowed, block_size):
    """Forward of the blocked kernel (shapes as in ``_BlockedGeodesicAttention``): output (compute dtype) and the
    per-row log-sum-exp that the backward needs to recompute the probabilities."""
    b, hk, g, q_len, d = gq.shape
    gf, r = factors.shape[2], factors.shape[4]
    kv_len = key.shape[2]
    compute = torch.promote_types(gq.dtype, torch.float32)  # why: low-precision inputs combine in fp32
    gq_c, factors_c, key_c, value_c = (t.to(compute) for t in (gq, factors, key, value))
    bias_c, ha = bias.to(compute), half_alpha.to(compute).view(1, hk, g, 1, 1)
    out = gq_c.new_empty((b, hk, g, q_len, d))
    lse = gq_c.new_empty((b, hk, g, q_len))
    for i0 in range(0, q_len, block_size):
        i1 = min(i0 + block_size, q_len)
        k0, k1 = _key_range(allowed, i0, i1, q_len, kv_len)
        allowed_blk = _block_allowed(allowed, i0, i1, k0, k1, q_len, gq.device)
        _, prods = _block_products(gq_c[:, :, :, i0:i1], factors_c[:, :, :, i0:i1], key_c[:, :, k0:k1])
        logits, _, _ = _block_logits(prods, (g, gf, i1 - i0, r), bias_c[..., k0:k1], ha, allowed_blk)
        # softmax in place, keeping its log-normaliser for the backward
        row_max = logits.amax(dim=-1, keepdim=True)
        probs = logits.sub_(row_max).exp_()
        row_sum = probs.sum(dim=-1, keepdim=True)
        probs = zero_empty_rows(probs.div_(row_sum), allowed_blk)
        # (B, Hk, g*Bq, nk) @ (B, Hk, nk, d) -> (B, Hk, g*Bq, d)
        blk = torch.matmul(probs.view(b, hk, g * (i1 - i0), -1), value_c[:, :, k0:k1])
        out[:, :, :, i0:i1] = blk.view(b, hk, g, i1 - i0, d)
        lse[:, :, :, i0:i1] = (row_max + row_sum.log()).squeeze(-1)
    return out, lse


def _kernel_operands(query, factors, alpha, scale):
    """scale * G_i q_i, sqrt(scale) * U_i and alpha / 2: the blocked loop's operands, with the scale folded in.
    Why fold the scale here: these O(n d) tensors absorb it instead of every O(n * block) score tile."""
    hk, g = alpha.shape
    lifted = _lift(query, factors)  # U_i (U_i^T q_i): (B, Hk, g, q, d), factors broadcast over a shared group
    gq = query + alpha.view(1, hk, g, 1, 1) * lifted  # G_i q_i
    return gq * scale, factors * scale**0.5, 0.5 * alpha, lifted


class _BlockedGeodesicAttention(torch.autograd.Function):
    """Memory-bounded geodesic attention with a recomputing backward (flash-attention style, on plain matmuls).

    Grouped by KV head so keys are never repeated: query (B, Hk, g, q, d); factors (B, Hk, gf, q, r, d), gf in {1, g};
    alpha (Hk, g); bias (B, Hk, g, kv) with the softmax scale folded in; key, value (B, Hk, kv, d); allowed
    (B|1, 1, 1, q, kv) bool or None. Saves only these inputs, the output and the log-sum-exp: G_i q_i is rebuilt in
    the backward, so training keeps no extra (n x d) tensor per head.
    """

    @staticmethod
    def forward(ctx, query, factors, alpha, bias, key, value, allowed, scale, block_size):
        gq, factors_s, half_alpha, _ = _kernel_operands(query, factors, alpha, scale)
        out, lse = _blocked_forward(gq, factors_s, half_alpha, bias, key, value, allowed, block_size)
        ctx.save_for_backward(query, factors, alpha, bias, key, value, allowed, out, lse)
        ctx.scale, ctx.block_size = scale, block_size
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, factors_in, alpha, bias, key, value, allowed, out, lse = ctx.saved_tensors
        scale, block_size = ctx.scale, ctx.block_size
        gq, factors, half_alpha, lifted = _kernel_operands(query, factors_in, alpha, scale)
        b, hk, g, q_len, d = gq.shape
        gf, r = factors.shape[2], factors.shape[4]
        kv_len = key.shape[2]
        compute = out.dtype
        gq_c, factors_c, key_c, value_c = (t.to(compute) for t in (gq, factors, key, value))
        bias_c, ha = bias.to(compute), half_alpha.to(compute).view(1, hk, g, 1, 1)
        grad_out = grad_out.to(compute)
        d_gq, d_factors = torch.empty_like(gq_c), torch.empty_like(factors_c)
        d_half_alpha, d_bias = out.new_zeros((hk, g)), torch.zeros_like(bias_c)
        d_key, d_value = torch.zeros_like(key_c), torch.zeros_like(value_c)
        # D_i = sum_j P_ij dP_ij = dO_i . O_i (softmax backward without storing P)
        delta = (grad_out * out).sum(-1, keepdim=True)  # (B, Hk, g, q, 1)
        for i0 in range(0, q_len, block_size):
            i1 = min(i0 + block_size, q_len)
            bq = i1 - i0
            k0, k1 = _key_range(allowed, i0, i1, q_len, kv_len)
            allowed_blk = _block_allowed(allowed, i0, i1, k0, k1, q_len, gq.device)
            k_blk, v_blk = key_c[:, :, k0:k1], value_c[:, :, k0:k1]
            rows, prods = _block_products(gq_c[:, :, :, i0:i1], factors_c[:, :, :, i0:i1], k_blk)
            logits, coords, quadratic = _block_logits(prods, (g, gf, bq, r), bias_c[..., k0:k1], ha, allowed_blk)
            probs = zero_empty_rows(logits.sub_(lse[:, :, :, i0:i1, None]).exp_(), allowed_blk)  # (B, Hk, g, Bq, nk)
            go = grad_out[:, :, :, i0:i1].reshape(b, hk, g * bq, d)
            d_value[:, :, k0:k1] += torch.matmul(probs.view(b, hk, g * bq, -1).transpose(-1, -2), go)
            d_probs = torch.matmul(go, v_blk.transpose(-1, -2)).view(b, hk, g, bq, -1)
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
        # chain rule through the operands: gq = scale (q + alpha U U^T q), factors = sqrt(scale) U, half_alpha = alpha/2
        d_gq = d_gq * scale  # d/d(G_i q_i)
        a = alpha.to(compute).view(1, hk, g, 1, 1)
        q_c, u_c = query.to(compute), factors_in.to(compute)
        coords = torch.matmul(u_c, q_c.unsqueeze(-1))  # U^T q: (B, Hk, g, q, r, 1)
        d_coords = torch.matmul(u_c, d_gq.unsqueeze(-1))  # U^T dgq: (B, Hk, g, q, r, 1)
        d_query = d_gq + a * torch.matmul(d_coords.transpose(-1, -2), u_c).squeeze(-2)  # G is symmetric
        # d/dU of alpha U U^T q: alpha (U^T q) dgq^T + alpha (U^T dgq) q^T, summed over the heads sharing U
        d_lift = a.unsqueeze(-1) * (coords * d_gq.unsqueeze(-2) + d_coords * q_c.unsqueeze(-2))
        if gf == 1:
            d_lift = d_lift.sum(2, keepdim=True)
        d_factors = d_factors * scale**0.5 + d_lift
        d_alpha = 0.5 * d_half_alpha + (d_gq * lifted.to(compute)).sum(dim=(0, 3, 4))
        return (
            d_query.to(query.dtype),
            d_factors.to(factors_in.dtype),
            d_alpha.to(alpha.dtype),
            d_bias.to(bias.dtype),
            d_key.to(key.dtype),
            d_value.to(value.dtype),
            None,
            None,
            None,
        )


def prepare_geodesic_inputs(query, factors, key, alpha, gamma, scale):
    """The O(n d r) inputs of the blocked kernel, grouped by KV head.

    query (B, H, q, d) after RoPE; factors (B, Hf, q, r, d) after RoPE, Hf = H (per head) or Hk (shared by each KV
    group); key (B, Hk, kv, d); alpha, gamma (H,). Returns query (B, Hk, g, q, d), factors (B, Hk, gf, q, r, d),
    alpha (Hk, g) and the key term -scale (gamma/2) ||k_j||^2 (B, Hk, g, kv).
    """
    b, h, q_len, d = query.shape
    hk = key.shape[1]
    g, gf = h // hk, factors.shape[1] // hk
    grouped_q = query.view(b, hk, g, q_len, d)  # heads h = kv_head * g + j, as repeat_kv orders them
    grouped_f = factors.view(b, hk, gf, q_len, factors.shape[-2], d)
    # -(gamma/2)||k_j||^2 per query head: (B, Hk, 1, kv) * (Hk, g) -> (B, Hk, g, kv)
    bias = (-0.5 * scale) * key.pow(2).sum(-1)[:, :, None, :] * gamma.view(1, hk, g, 1).to(key.dtype)
    return grouped_q, grouped_f, alpha.view(hk, g).to(query.dtype), bias


def blocked_geodesic_kernel(prepared, key, value, scale, attention_mask=None, block_size=64) -> torch.Tensor:
    """Geodesic attention from ``prepare_geodesic_inputs``'s output; key, value (B, Hk, kv, d) (not repeated).
    Returns the attention output (B, H, q, d)."""
    query, factors, alpha, bias = prepared
    b, hk, g, q_len, d = query.shape
    allowed = allowed_from_mask(attention_mask, q_len, key.shape[2])
    if allowed is not None:
        allowed = allowed.unsqueeze(2)  # (B|1, 1, 1, q, kv): broadcast over (Hk, g)
    inputs = (query, factors, alpha, bias, key, value)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        out = _BlockedGeodesicAttention.apply(*inputs, allowed, scale, block_size)
    else:  # inference (generation): no autograd bookkeeping, no saved tensors
        gq, factors_s, half_alpha, _ = _kernel_operands(query, factors, alpha, scale)
        if q_len == 1 and query.dtype in (torch.float32, torch.float64):
            out = _decode_step(gq, factors_s, half_alpha, bias, key, value, allowed)
        else:
            out = _blocked_forward(gq, factors_s, half_alpha, bias, key, value, allowed, block_size)[0]
    return out.to(query.dtype).view(b, hk * g, q_len, d)


def _decode_step(gq, factors, half_alpha, bias, key, value, allowed):
    """One new token against the cache: the blocked forward's math for a single row, without the loop, the key-range
    search and the log-sum-exp (nothing is saved for a backward). Why: decoding is bound by the number of ops."""
    b, hk, g, _, d = gq.shape
    _, prods = _block_products(gq, factors, key)
    logits, _, _ = _block_logits(prods, (g, factors.shape[2], 1, factors.shape[4]), bias,
                                 half_alpha.view(1, hk, g, 1, 1), allowed)
    probs = zero_empty_rows(torch.softmax(logits, dim=-1), allowed)  # (B, Hk, g, 1, kv)
    return torch.matmul(probs.view(b, hk, g, -1), value).view(b, hk, g, 1, d)


def blocked_geodesic_attention(
    query, factors, key, value, alpha, gamma, scale, attention_mask=None, block_size=64
) -> torch.Tensor:
    """The default path: same function as ``reference_geodesic_attention``, extra memory O(n * block).

    query (B, H, q, d) after RoPE; factors (B, Hf, q, r, d) after RoPE, Hf = H (per head) or Hk (shared by each KV
    group); key, value (B, Hk, kv, d) (not repeated); alpha, gamma (H,). Returns the attention output (B, H, q, d).
    """
    prepared = prepare_geodesic_inputs(query, factors, key, alpha, gamma, scale)
    return blocked_geodesic_kernel(prepared, key, value, scale, attention_mask, block_size)


def blocked_attention_probs(query, factors, key, alpha, gamma, scale, attention_mask=None, block_size=64):
    """Attention probabilities (B, H, q, kv), computed block by block (for ``output_attentions``; no gradient)."""
    with torch.no_grad():
        blocks = []
        for i0 in range(0, query.shape[2], block_size):
            i1 = min(i0 + block_size, query.shape[2])
            mask = None if attention_mask is None else attention_mask[..., i0:i1, :]
            if attention_mask is None and query.shape[2] > 1:
                mask = causal_allowed(query.shape[2], key.shape[2], query.device)[..., i0:i1, :]
            scores = geodesic_scores_reference(query[:, :, i0:i1], factors[:, :, i0:i1], key, alpha, gamma, scale)
            allowed = allowed_from_mask(mask, i1 - i0, key.shape[2])
            if allowed is not None:
                scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            compute = torch.promote_types(scores.dtype, torch.float32)
            blocks.append(zero_empty_rows(torch.softmax(scores.to(compute), dim=-1), allowed).to(query.dtype))
        return torch.cat(blocks, dim=2)


# --------------------------------------------------------------------------------------------------------------------
# Metric-preconditioned MLP step (DESIGN 1.3)
# --------------------------------------------------------------------------------------------------------------------
def woodbury_precondition(update: torch.Tensor, factors: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """M^{-1} y with M = I_D + beta V V^T, by Woodbury: y - beta V (I_r + beta V^T V)^{-1} V^T y.

    update y (..., D); factors (..., r, D) row-wise (V^T); beta scalar tensor. O(D r^2 + r^3) per token, never D x D.
    """
    compute = torch.promote_types(update.dtype, torch.float32)  # why: linalg.solve has no half-precision kernels
    y, v = update.to(compute), factors.to(compute)
    beta = beta.to(compute)
    # why elementwise products for V^T y and V s: per token they are (r x D) matrix-vector products, which batched
    # matmul runs far below its speed; a multiply and a sum over D stream through memory once.
    coords = (v * y.unsqueeze(-2)).sum(-1, keepdim=True)  # V^T y: (..., r, 1)
    gram = metric_gram(v)  # V^T V: (..., r, r)
    system = beta * gram
    system.diagonal(dim1=-2, dim2=-1).add_(1.0)  # I + beta V^T V: SPD since beta > -1 and ||V||_2 < 1
    solved = torch.linalg.solve(system, coords)  # (..., r, 1)
    correction = (solved * v).sum(-2)  # V (.)^{-1} V^T y: (..., D)
    return (y - beta * correction).to(update.dtype)


# --------------------------------------------------------------------------------------------------------------------
# Connection observables (DESIGN 1.4), all from r x r Gram matrices
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
    norm = d + 2 * a * gram_cur.diagonal(dim1=-2, dim2=-1).sum(-1) + a.pow(2) * sq(gram_cur)
    ratio = diff.clamp_min(0) / norm  # (B, H, n-1)
    if token_mask is None:
        return ratio.mean()
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
