"""The fused geodesic attention (docs/design.md 1.2 and 1.5), forward and backward: Triton kernels on a GPU and a C++
operator on the CPU (section "The C++ operator" below), each a pair of PyTorch custom operators of one schema, and the
self-check that proves either before its first use (the last section).

Same function, arguments and result as ``fiber_attention.blocked_geodesic_attention``; the operands are prepared by the
same helpers (``prepare_geodesic_inputs``, ``kernel_operands``, ``grouped_kernel_mask``). Per query tile and key tile
the Triton forward does, in one kernel, what the blocked path does with separate ops: two matmuls of the key tile with
the tile's stacked pseudo-queries -- scale G_i q_i (one row per query) and sqrt(scale) u_i1 .. u_ir (r rows per query),
i.e. r + 1 query-key products per pair --, the combine lin_ij + bias_j - (alpha/2) sum_a coords_ija^2 (the blocked
path's ``_block_logits``), the masks, an online softmax and the value product, keeping the log-sum-exp per row (as
FlashAttention does). The backward recomputes the probabilities from it in two kernels: one per key tile (dK, dV and the
key term's gradient, looping over the query heads of the KV group and their query tiles) and one per query tile (d(G q),
dU and the gate's gradient); ``fiber_attention.operand_grads`` then carries them back to query, factors and alpha, as
the blocked backward does.

Triton is optional: this file imports without it (a Hub folder must load where it is absent; transformers' import
check skips the try block below), and ``triton_available()`` says whether the kernel can run. The kernels run on
CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before this file is imported,
as the tests do). Attention dropout is not in the kernel. Float16, bfloat16 and float32 inputs; every product
accumulates in float32 (the pseudo-query tiles are cast to the key dtype for the tensor-core matmul, the metric
combine and the softmax stay in float32).
"""

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from transformers.utils import logging

from .fiber_attention import (
    blocked_geodesic_attention,
    bounded_factors,
    compute_dtype,
    gradients_flow,
    grouped_kernel_mask,
    kernel_operands,
    operand_grads,
    prepare_geodesic_inputs,
    woodbury_precondition,
)

try:  # optional: nothing below needs Triton unless the kernel runs
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# under transformers' logger, so that its verbosity (transformers.logging.set_verbosity_info(), TRANSFORMERS_VERBOSITY)
# shows this file's info lines, from this package or from a Hub folder's copy (transformers_modules.*) alike
logger = logging.get_logger(f"transformers.{__name__}")

# Triton decides when a kernel is defined (at import) whether it runs compiled (CUDA) or interpreted (CPU tensors)
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The kernels launch one program per (tile, batch x head) on a grid whose second axis holds batch x heads; CUDA allows
# at most 65535 there, so a larger batch x heads cannot launch (and the self-check, at batch 2, would not see it).
MAX_GRID_HEADS = 65535


def triton_available() -> bool:
    """Whether Triton imports here (the kernels are defined)."""
    return triton is not None


def use_triton_kernel(kernel: str, query: torch.Tensor, dropout: float, factors: torch.Tensor | None = None,
                      key: torch.Tensor | None = None, attention_mask=None, others: tuple = ()) -> bool:
    """Whether the default (blocked) branch of ``geodesic_attention_forward`` runs this kernel.

    ``kernel`` is ``config.fiber_attention_kernel``: "pytorch" never; "triton" always, or a clear error where it cannot
    run; "auto" where the kernel applies (``kernel_applies``: CUDA tensors of a kernel dtype, Triton imports, no
    attention dropout) and has passed its self-check on this call's signature (``kernel_signature``,
    ``kernel_passes_self_check``), which needs ``factors``, ``key``, ``attention_mask`` and the call's ``others``
    (value, alpha, gamma: whether gradients flow is read off all of them, and only here, off the hot path of the CPU).
    ``dropout`` is the probability actually applied (0 in evaluation).
    """
    if kernel in ("pytorch", "cpp"):
        return False
    if kernel == "auto":
        if not kernel_applies(query, dropout):
            return False
        training = gradients_flow(query, factors, key, *others)
        return kernel_passes_self_check(*kernel_signature(query, factors, key, attention_mask, training))
    if triton is None:
        raise ImportError(
            "fiber_attention_kernel='triton' needs Triton, which is not installed: `pip install triton` (or "
            "`pip install fiber-bundle-transformers[kernels]`), or set fiber_attention_kernel='auto' or 'pytorch'."
        )
    if dropout > 0:
        raise ValueError(
            f"fiber_attention_kernel='triton' has no attention dropout (attention_dropout={dropout} in training): set "
            "attention_dropout=0.0, or fiber_attention_kernel='auto' (which then uses the blocked PyTorch path)."
        )
    return True


def kernel_applies(query: torch.Tensor, dropout: float) -> bool:
    """The rule of "auto" before its self-check: Triton imports, ``query`` is on a device "auto" runs the kernel on
    (``auto_device``), of a kernel dtype, with at most ``MAX_GRID_HEADS`` (batch x heads), and no attention dropout
    applies (inside ``torch.compile`` too: the kernels are custom operators)."""
    return (triton is not None and auto_device(query) and query.dtype in KERNEL_DTYPES and dropout == 0
            and query.shape[0] * query.shape[1] <= MAX_GRID_HEADS)


def auto_device(query: torch.Tensor) -> bool:
    """Whether "auto" runs the kernel on ``query``'s device: CUDA only (on CPU tensors Triton's interpreter is far
    slower than the blocked path; the tests replace this function to let the interpreter stand in for a GPU)."""
    return query.is_cuda


def use_cpp_kernel(kernel: str, query: torch.Tensor, dropout: float, factors: torch.Tensor, key: torch.Tensor,
                   attention_mask=None, others: tuple = ()) -> bool:
    """Whether the default (blocked) branch of ``geodesic_attention_forward`` runs the fused C++ operator.

    "pytorch" and "triton" never; "cpp" always, or a clear error where it cannot run (tensors not on the CPU,
    attention dropout); "auto" for CPU tensors of ``CPU_KERNEL_DTYPES`` without attention dropout (the one-token step
    in inference too, by the operator's ``decode``, except under torch.compile, where that step stays the traced
    ``geodesic_decode_step``), once the operator has been built here and has passed its self-check on this call's
    signature (``kernel_passes_self_check``). Arguments as ``use_triton_kernel``'s.
    """
    if kernel in ("pytorch", "triton"):
        return False
    if kernel == "cpp":
        if query.device.type != "cpu" or dropout > 0:
            raise ValueError(
                f"fiber_attention_kernel='cpp' runs on CPU tensors without attention dropout; got tensors on "
                f"{query.device} and attention dropout {dropout}: set fiber_attention_kernel='auto' (or attention_"
                "dropout=0.0)."
            )
        return True
    if query.device.type != "cpu" or auto_device(query) or query.dtype not in CPU_KERNEL_DTYPES or dropout > 0:
        return False  # (auto_device: where the tests let Triton's interpreter stand in for a GPU, Triton is the one)
    training = gradients_flow(query, factors, key, *others)
    if query.shape[2] == 1 and not training and torch.compiler.is_compiling():
        return False  # a compiled one-token step: inductor fuses geodesic_decode_step's few ops into the graph
    return kernel_passes_self_check(*kernel_signature(query, factors, key, attention_mask, training, "cpp"))


def _tiles(r: int, dtype: torch.dtype) -> tuple[int, int]:
    """Query and key tile sizes: the stacked factor tile (BLOCK_M * r rows) stays at most 128 rows of 16-bit values
    (64 of float32), and the key tile 64 (32), so that a program's tiles fit in a GPU's shared memory."""
    rows = 128 if dtype.itemsize <= 2 else 64
    return max(16, rows // max(triton.next_power_of_2(r), 2)), rows // 2


# the software-pipelining depths tried in turn: a deeper pipeline is faster where the tiles fit in shared memory
STAGES = (3, 2, 1)
_stages_found: dict = {}


def _run(kernel, grid, *args, **meta):
    """Launch ``kernel`` with the deepest pipeline that fits (Triton raises OutOfResources at compile time for one that
    does not); the depth found is remembered per kernel and constants, so a failing depth is compiled once. Launched
    on the device of the first tensor argument (Triton launches on the current CUDA device: a model placed on
    cuda:1 by a device map must not have its kernels run on cuda:0)."""
    key = (kernel.fn.__name__, *sorted(meta.items()))
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    on_device = torch.cuda.device if device is not None and device.type == "cuda" else contextlib.nullcontext
    for stages in STAGES[STAGES.index(_stages_found.get(key, STAGES[0])):]:
        try:
            with on_device(device):
                kernel[grid](*args, **meta, num_stages=stages)
        except triton.runtime.errors.OutOfResources:
            if stages == STAGES[-1]:
                raise
            continue
        _stages_found[key] = stages
        return


def _broadcast_strides(t: torch.Tensor | None, ndim: int) -> list[int]:
    """Strides of ``t`` with 0 on every size-1 dimension (a broadcast mask is read with them), or zeros for None."""
    if t is None:
        return [0] * ndim
    return [s if n > 1 else 0 for n, s in zip(t.shape, t.stride())]


def _tile_ranges(allowed: torch.Tensor, tile: int, along_queries: bool) -> torch.Tensor:
    """For each tile of query rows (``along_queries``) the interval [lo, hi) of keys holding every allowed key of its
    rows, or for each tile of keys that of query rows: (n_tiles, 2) int32, on the mask's device (no host sync).

    Why: causal, sliding-window and padding masks allow a band; a kernel skips the tiles no row of its own can see
    (the mask still applies inside the interval). Merged over batch and heads, as the blocked path's ``_key_range``.
    """
    band = allowed.any(dim=(0, 1, 2))  # (q, kv)
    if not along_queries:
        band = band.transpose(0, 1)
    n, other = band.shape
    pad = (-n) % tile
    band = torch.nn.functional.pad(band, (0, 0, 0, pad)).view(-1, tile, other).any(1)  # (n_tiles, other)
    seen = band.any(-1)
    lo = band.int().argmax(-1)
    hi = other - band.flip(-1).int().argmax(-1)
    return torch.stack((torch.where(seen, lo, 0), torch.where(seen, hi, 0)), dim=-1).to(torch.int32).contiguous()


if triton is not None:

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr):
        """a @ b with float32 accumulation. PRECISION "upcast": Triton's interpreter multiplies bfloat16 tiles as raw
        integers, so there the already rounded operands are multiplied in float32 (the same products)."""
        if PRECISION == "upcast":
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b, input_precision=PRECISION)
        return out

    @triton.jit
    def _tile_logits(gq, u, key, bias, half_alpha, q_offs, k_offs, mask_ptrs, add_ptrs, q_len, kv_len,
                     CAUSAL: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_ADD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RP: tl.constexpr, PRECISION: tl.constexpr):
        """Masked logits (BLOCK_M, BLOCK_N) of a query tile against a key tile, -inf where blocked, and the
        coordinates U_i^T k_j (BLOCK_M * RP, BLOCK_N): ``_block_logits`` of the blocked path, fused."""
        key_t = tl.trans(key)
        lin = _dot(gq, key_t, PRECISION)  # (G_i q_i) . k_j, scale folded in
        coords = _dot(u, key_t, PRECISION)  # U_i^T k_j for the RP stacked rows of each query
        quadratic = tl.sum(tl.reshape(coords * coords, (BLOCK_M, RP, BLOCK_N)), axis=1)
        logits = lin + bias[None, :] - half_alpha * quadratic
        keep = k_offs[None, :] < kv_len
        inside = (q_offs[:, None] < q_len) & keep  # the mask is read inside its (q, kv) extent only
        if HAS_ADD:  # a float mask is added whatever its values; clamped as the blocked path clamps (never -inf)
            logits = tl.maximum(logits + tl.load(add_ptrs, mask=inside, other=0.0), -3.4028234663852886e38)
        if HAS_ALLOWED:
            keep = keep & (tl.load(mask_ptrs, mask=inside, other=0) != 0)
        elif CAUSAL:  # upper-left causal, as SDPA's is_causal
            keep = keep & (k_offs[None, :] <= q_offs[:, None])
        return tl.where(keep, logits, float("-inf")), coords

    @triton.jit
    def _query_program(GQ, U, HALF_ALPHA, K, hk, g, gf, q_len, r, d,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, RP: tl.constexpr):
        """Where a program of the forward or of the query-side backward works, one per (query tile, batch x KV head x
        query head): the tile ``pid_m``, the head's (b, kh, j) and flat index ``head``, and its operands, the tile's
        pseudo-query rows (``_load_query_tile``, in the key dtype for the products) and alpha/2."""
        pid_m = tl.program_id(0)
        pid = tl.program_id(1).to(tl.int64)
        b, kh, j = pid // (hk * g), (pid // g) % hk, pid % g
        head = pid  # (b, kh, j) flattened, the row-major index of a (B, Hk, g) tensor
        head_f = (b * hk + kh) * gf + j % gf  # the factors of this head: its own (gf = g) or its group's (gf = 1)
        q_offs, gq, u = _load_query_tile(GQ, U, head * q_len * d, head_f * q_len * r * d, pid_m * BLOCK_M, q_len,
                                         r, d, BLOCK_M, BLOCK_D, RP)
        dot_dtype = K.dtype.element_ty
        gq, u = gq.to(dot_dtype), u.to(dot_dtype)
        half_alpha = tl.load(HALF_ALPHA + kh * g + j)
        return pid_m, b, kh, j, head, q_offs, gq, u, half_alpha

    @triton.jit
    def _key_bounds(RANGES, pid_m, kv_len, CAUSAL: tl.constexpr, HAS_RANGES: tl.constexpr, BLOCK_M: tl.constexpr):
        """The keys [lo, hi) that query tile ``pid_m`` may see: its interval of a dense mask (``_tile_ranges``), those
        up to its last row under the causal mask, else all."""
        if HAS_RANGES:
            lo = tl.load(RANGES + 2 * pid_m)
            hi = tl.load(RANGES + 2 * pid_m + 1)
        elif CAUSAL:
            lo, hi = 0, tl.minimum(kv_len, (pid_m + 1) * BLOCK_M)
        else:
            lo, hi = 0, kv_len
        return lo, hi

    @triton.jit
    def _load_query_tile(GQ, U, base_q, base_u, q_start, q_len, r, d,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, RP: tl.constexpr):
        """The query tile's pseudo-query rows: G_i q_i (BLOCK_M, BLOCK_D) and u_ia stacked row i * RP + a
        (BLOCK_M * RP, BLOCK_D), zero outside the tensor (contiguous (q, d) and (q, r, d) layouts)."""
        q_offs = q_start + tl.arange(0, BLOCK_M)
        d_offs = tl.arange(0, BLOCK_D)
        gq = tl.load(GQ + base_q + q_offs[:, None] * d + d_offs[None, :],
                     mask=(q_offs[:, None] < q_len) & (d_offs[None, :] < d), other=0.0)
        u_rows = tl.arange(0, BLOCK_M * RP)
        u_q, u_a = q_start + u_rows // RP, u_rows % RP
        u = tl.load(U + base_u + (u_q[:, None] * r + u_a[:, None]) * d + d_offs[None, :],
                    mask=(u_q[:, None] < q_len) & (u_a[:, None] < r) & (d_offs[None, :] < d), other=0.0)
        return q_offs, gq, u

    @triton.jit
    def _geodesic_fwd(
        GQ, U, HALF_ALPHA, BIAS, K, V, ALLOWED, ADD, RANGES, OUT, LSE,
        sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        sm_b, sm_h, sm_g, sm_q, sm_k, sa_b, sa_h, sa_g, sa_q, sa_k,
        hk, g, gf, q_len, kv_len, r, d,
        CAUSAL: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_ADD: tl.constexpr, HAS_RANGES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RP: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program per (query tile, batch x KV head x query head): online softmax over the key tiles."""
        pid_m, b, kh, j, head, q_offs, gq, u, half_alpha = _query_program(GQ, U, HALF_ALPHA, K, hk, g, gf, q_len, r, d,
                                                                           BLOCK_M, BLOCK_D, RP)
        d_offs = tl.arange(0, BLOCK_D)
        lo, hi = _key_bounds(RANGES, pid_m, kv_len, CAUSAL, HAS_RANGES, BLOCK_M)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            k_offs = start + tl.arange(0, BLOCK_N)
            kv_ok = (k_offs[:, None] < kv_len) & (d_offs[None, :] < d)
            key = tl.load(K + b * sk_b + kh * sk_h + k_offs[:, None] * sk_n + d_offs[None, :] * sk_d, mask=kv_ok,
                          other=0.0)
            bias = tl.load(BIAS + head * kv_len + k_offs, mask=k_offs < kv_len, other=0.0)
            mask_ptrs = ALLOWED + b * sm_b + kh * sm_h + j * sm_g + q_offs[:, None] * sm_q + k_offs[None, :] * sm_k
            add_ptrs = ADD + b * sa_b + kh * sa_h + j * sa_g + q_offs[:, None] * sa_q + k_offs[None, :] * sa_k
            logits, _ = _tile_logits(gq, u, key, bias, half_alpha, q_offs, k_offs, mask_ptrs, add_ptrs, q_len, kv_len,
                                     CAUSAL, HAS_ALLOWED, HAS_ADD, BLOCK_M, BLOCK_N, RP, PRECISION)
            m_new = tl.maximum(m_i, tl.max(logits, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet: no inf - inf
            p = tl.exp(logits - m_safe[:, None])
            correction = tl.exp(m_i - m_safe)
            l_i = l_i * correction + tl.sum(p, 1)
            value = tl.load(V + b * sv_b + kh * sv_h + k_offs[:, None] * sv_n + d_offs[None, :] * sv_d, mask=kv_ok,
                            other=0.0)
            acc = acc * correction[:, None] + _dot(p.to(value.dtype), value, PRECISION)
            m_i = m_new
        # a row with no allowed key attends to nothing (``zero_empty_rows``): output 0, and a log-sum-exp of +inf
        # makes every recomputed probability of the row 0 in the backward
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        q_ok = q_offs < q_len
        tl.store(OUT + head * q_len * d + q_offs[:, None] * d + d_offs[None, :], out,
                 mask=q_ok[:, None] & (d_offs[None, :] < d))
        tl.store(LSE + head * q_len + q_offs, lse, mask=q_ok)

    @triton.jit
    def _geodesic_bwd_kv(
        GQ, U, HALF_ALPHA, BIAS, K, V, ALLOWED, ADD, RANGES, LSE, DELTA, DOUT, DK, DV, DBIAS,
        sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        sm_b, sm_h, sm_g, sm_q, sm_k, sa_b, sa_h, sa_g, sa_q, sa_k,
        hk, g, gf, q_len, kv_len, r, d,
        CAUSAL: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_ADD: tl.constexpr, HAS_RANGES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RP: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program per (key tile, batch x KV head): dK, dV and d(key term), summed over the group's query heads
        and every query tile that sees the key tile."""
        pid_n = tl.program_id(0)
        pid = tl.program_id(1).to(tl.int64)
        b, kh = pid // hk, pid % hk
        k_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        d_offs = tl.arange(0, BLOCK_D)
        kv_ok = (k_offs[:, None] < kv_len) & (d_offs[None, :] < d)
        key = tl.load(K + b * sk_b + kh * sk_h + k_offs[:, None] * sk_n + d_offs[None, :] * sk_d, mask=kv_ok,
                      other=0.0)
        value = tl.load(V + b * sv_b + kh * sv_h + k_offs[:, None] * sv_n + d_offs[None, :] * sv_d, mask=kv_ok,
                        other=0.0)
        dot_dtype = key.dtype
        d_key = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        d_value = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        if HAS_RANGES:
            lo = tl.load(RANGES + 2 * pid_n)
            hi = tl.load(RANGES + 2 * pid_n + 1)
        elif CAUSAL:
            lo, hi = pid_n * BLOCK_N, q_len  # row i sees keys <= i only
        else:
            lo, hi = 0, q_len
        for j in range(0, g):
            head = pid * g + j
            head_f = pid * gf + j % gf
            half_alpha = tl.load(HALF_ALPHA + kh * g + j)
            bias = tl.load(BIAS + head * kv_len + k_offs, mask=k_offs < kv_len, other=0.0)
            d_bias = tl.zeros((BLOCK_N,), tl.float32)
            for start in range(lo, hi, BLOCK_M):
                q_offs, gq, u = _load_query_tile(GQ, U, head * q_len * d, head_f * q_len * r * d, start, q_len, r, d,
                                                 BLOCK_M, BLOCK_D, RP)
                gq, u = gq.to(dot_dtype), u.to(dot_dtype)
                mask_ptrs = ALLOWED + b * sm_b + kh * sm_h + j * sm_g + q_offs[:, None] * sm_q + k_offs[None, :] * sm_k
                add_ptrs = ADD + b * sa_b + kh * sa_h + j * sa_g + q_offs[:, None] * sa_q + k_offs[None, :] * sa_k
                logits, coords = _tile_logits(gq, u, key, bias, half_alpha, q_offs, k_offs, mask_ptrs, add_ptrs,
                                              q_len, kv_len, CAUSAL, HAS_ALLOWED, HAS_ADD, BLOCK_M, BLOCK_N, RP,
                                              PRECISION)
                q_ok = q_offs < q_len
                lse = tl.load(LSE + head * q_len + q_offs, mask=q_ok, other=float("inf"))
                delta = tl.load(DELTA + head * q_len + q_offs, mask=q_ok, other=0.0)
                d_out = tl.load(DOUT + head * q_len * d + q_offs[:, None] * d + d_offs[None, :],
                                mask=q_ok[:, None] & (d_offs[None, :] < d), other=0.0)
                probs = tl.exp(logits - lse[:, None])  # (BLOCK_M, BLOCK_N); 0 on blocked entries and empty rows
                d_value += _dot(tl.trans(probs.to(dot_dtype)), d_out.to(dot_dtype), PRECISION)
                d_probs = _dot(d_out.to(dot_dtype), tl.trans(value), PRECISION)
                d_logits = probs * (d_probs - delta[:, None])  # softmax backward
                d_bias += tl.sum(d_logits, 0)
                # d/d coords of -(alpha/2) ||U^T k||^2
                d_quadratic = -2.0 * half_alpha * d_logits
                d_coords = tl.reshape(tl.reshape(coords, (BLOCK_M, RP, BLOCK_N)) * d_quadratic[:, None, :],
                                      (BLOCK_M * RP, BLOCK_N))
                d_key += _dot(tl.trans(d_logits.to(dot_dtype)), gq, PRECISION)
                d_key += _dot(tl.trans(d_coords.to(dot_dtype)), u, PRECISION)
            tl.store(DBIAS + head * kv_len + k_offs, d_bias, mask=k_offs < kv_len)
        out_offs = pid * kv_len * d + k_offs[:, None] * d + d_offs[None, :]
        tl.store(DK + out_offs, d_key, mask=kv_ok)
        tl.store(DV + out_offs, d_value, mask=kv_ok)

    @triton.jit
    def _geodesic_bwd_q(
        GQ, U, HALF_ALPHA, BIAS, K, V, ALLOWED, ADD, RANGES, LSE, DELTA, DOUT, DGQ, DU, DHALF,
        sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        sm_b, sm_h, sm_g, sm_q, sm_k, sa_b, sa_h, sa_g, sa_q, sa_k,
        hk, g, gf, q_len, kv_len, r, d,
        CAUSAL: tl.constexpr, HAS_ALLOWED: tl.constexpr, HAS_ADD: tl.constexpr, HAS_RANGES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RP: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program per (query tile, batch x KV head x query head): d(scale G q), d(sqrt(scale) U) of this
        head (summed over a shared group by the caller) and its partial d(alpha/2)."""
        pid_m, b, kh, j, head, q_offs, gq, u, half_alpha = _query_program(GQ, U, HALF_ALPHA, K, hk, g, gf, q_len, r, d,
                                                                           BLOCK_M, BLOCK_D, RP)
        dot_dtype = K.dtype.element_ty
        d_offs = tl.arange(0, BLOCK_D)
        q_ok = q_offs < q_len
        lse = tl.load(LSE + head * q_len + q_offs, mask=q_ok, other=float("inf"))
        delta = tl.load(DELTA + head * q_len + q_offs, mask=q_ok, other=0.0)
        d_out = tl.load(DOUT + head * q_len * d + q_offs[:, None] * d + d_offs[None, :],
                        mask=q_ok[:, None] & (d_offs[None, :] < d), other=0.0).to(dot_dtype)
        lo, hi = _key_bounds(RANGES, pid_m, kv_len, CAUSAL, HAS_RANGES, BLOCK_M)
        d_gq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        d_u = tl.zeros((BLOCK_M * RP, BLOCK_D), tl.float32)
        d_half = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            k_offs = start + tl.arange(0, BLOCK_N)
            kv_ok = (k_offs[:, None] < kv_len) & (d_offs[None, :] < d)
            key = tl.load(K + b * sk_b + kh * sk_h + k_offs[:, None] * sk_n + d_offs[None, :] * sk_d, mask=kv_ok,
                          other=0.0)
            value = tl.load(V + b * sv_b + kh * sv_h + k_offs[:, None] * sv_n + d_offs[None, :] * sv_d, mask=kv_ok,
                            other=0.0)
            bias = tl.load(BIAS + head * kv_len + k_offs, mask=k_offs < kv_len, other=0.0)
            mask_ptrs = ALLOWED + b * sm_b + kh * sm_h + j * sm_g + q_offs[:, None] * sm_q + k_offs[None, :] * sm_k
            add_ptrs = ADD + b * sa_b + kh * sa_h + j * sa_g + q_offs[:, None] * sa_q + k_offs[None, :] * sa_k
            logits, coords = _tile_logits(gq, u, key, bias, half_alpha, q_offs, k_offs, mask_ptrs, add_ptrs, q_len,
                                          kv_len, CAUSAL, HAS_ALLOWED, HAS_ADD, BLOCK_M, BLOCK_N, RP, PRECISION)
            probs = tl.exp(logits - lse[:, None])
            d_probs = _dot(d_out, tl.trans(value), PRECISION)
            d_logits = probs * (d_probs - delta[:, None])
            coords3 = tl.reshape(coords, (BLOCK_M, RP, BLOCK_N))
            d_half -= tl.sum(d_logits * tl.sum(coords3 * coords3, axis=1), 1)
            d_coords = tl.reshape(coords3 * (-2.0 * half_alpha * d_logits)[:, None, :], (BLOCK_M * RP, BLOCK_N))
            d_gq += _dot(d_logits.to(dot_dtype), key, PRECISION)
            d_u += _dot(d_coords.to(dot_dtype), key, PRECISION)
        tl.store(DGQ + head * q_len * d + q_offs[:, None] * d + d_offs[None, :], d_gq,
                 mask=q_ok[:, None] & (d_offs[None, :] < d))
        u_rows = tl.arange(0, BLOCK_M * RP)
        u_q, u_a = pid_m * BLOCK_M + u_rows // RP, u_rows % RP
        tl.store(DU + head * q_len * r * d + (u_q[:, None] * r + u_a[:, None]) * d + d_offs[None, :], d_u,
                 mask=(u_q[:, None] < q_len) & (u_a[:, None] < r) & (d_offs[None, :] < d))
        tl.store(DHALF + head * tl.num_programs(0) + pid_m, tl.sum(d_half, 0))


class _Launch:
    """The arguments every kernel shares: shapes, strides of key, value and the mask parts, tile sizes, flags."""

    def __init__(self, gq, factors, key, value, allowed, additive, tiles=None):
        b, hk, g, q_len, d = gq.shape
        gf, r = factors.shape[2], factors.shape[4]
        self.grid_heads = b * hk * g
        self.b, self.hk, self.g = b, hk, g
        self.q_len, self.kv_len = q_len, key.shape[2]
        self.block_m, self.block_n = tiles or _tiles(r, key.dtype)
        self.block_d = max(16, triton.next_power_of_2(d))
        self.rp = triton.next_power_of_2(r)
        # a boolean mask is read as bytes (a view, no copy); an absent part is a stand-in pointer the kernel never reads
        self.allowed = allowed.view(torch.uint8) if allowed is not None else gq
        self.additive = additive if additive is not None else gq
        causal = allowed is None and q_len > 1
        self.flags = dict(CAUSAL=causal, HAS_ALLOWED=allowed is not None, HAS_ADD=additive is not None,
                          BLOCK_D=self.block_d, RP=self.rp,
                          PRECISION=_dot_precision(key.dtype))
        self.allowed_bool = allowed
        self.scalars = (*key.stride(), *value.stride(), *_broadcast_strides(allowed, 5),
                        *_broadcast_strides(additive, 5), hk, g, gf, q_len, self.kv_len, r, d)
        self.num_warps = 4 if self.block_d <= 64 else 8

    def ranges(self, along_queries: bool):
        """The tile ranges of a dense mask (see ``_tile_ranges``), or the kernel's own causal / full range."""
        tile = self.block_m if along_queries else self.block_n
        if self.allowed_bool is None:
            return self.allowed, False
        return _tile_ranges(self.allowed_bool, tile, along_queries), True


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 tiles multiply in full precision (no TF32: the kernel matches the PyTorch path); see ``_dot``."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if INTERPRETED and dtype == torch.bfloat16 else "tf32"


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Errors naming the fix where the kernel cannot run: no Triton, a dtype it lacks, CPU tensors when compiled."""
    if triton is None:
        use_triton_kernel("triton", query, 0.0)  # raises the install hint
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"The Triton geodesic attention takes float16, bfloat16 or float32 tensors, got {name} in {t.dtype}: "
                "cast the model (model.to(torch.bfloat16)) or set fiber_attention_kernel='pytorch'."
            )
    if query.shape[0] * query.shape[1] > MAX_GRID_HEADS:
        raise ValueError(
            f"The Triton geodesic attention launches at most {MAX_GRID_HEADS} (batch x heads) programs per tile; got "
            f"batch {query.shape[0]} x {query.shape[1]} heads: split the batch, or set fiber_attention_kernel='auto' "
            "or 'pytorch' (the blocked PyTorch path)."
        )
    if not query.is_cuda and not INTERPRETED:
        raise ValueError(
            "The Triton geodesic attention runs on CUDA tensors (or on CPU under Triton's interpreter, with "
            "TRITON_INTERPRET=1 set before the model is imported); got tensors on "
            f"{query.device}: move the model to a GPU or set fiber_attention_kernel='pytorch'."
        )


def _forward(query, factors, alpha, bias, key, value, allowed, additive, scale, block_m, block_n):
    """The forward kernel: output (compute dtype) and log-sum-exp. Arguments as ``_BlockedGeodesicAttention``'s
    (query (B, Hk, g, q, d), factors (B, Hk, gf, q, r, d), alpha (Hk, g), bias (B, Hk, g, kv) in the compute dtype;
    key, value (B, Hk, kv, d); the grouped mask parts), plus the tile sizes."""
    gq, factors_s, half_alpha, _ = kernel_operands(query, factors, alpha, scale)
    gq, factors_s, bias = gq.contiguous(), factors_s.contiguous(), bias.contiguous()
    launch = _Launch(gq, factors_s, key, value, allowed, additive, (block_m, block_n))
    out = gq.new_empty(gq.shape)
    lse = gq.new_empty(gq.shape[:-1])
    ranges, has_ranges = launch.ranges(along_queries=True)
    grid = (triton.cdiv(launch.q_len, launch.block_m), launch.grid_heads)
    _run(_geodesic_fwd, grid, gq, factors_s, half_alpha.contiguous(), bias, key, value, launch.allowed,
         launch.additive, ranges, out, lse, *launch.scalars, HAS_RANGES=has_ranges, BLOCK_M=launch.block_m,
         BLOCK_N=launch.block_n, **launch.flags, num_warps=launch.num_warps)
    return out, lse


def _backward(query, factors_in, alpha, bias, key, value, allowed, additive, out, lse, grad_out, scale, block_m,
              block_n):
    """The two backward kernels and the chain rule to the inputs: d query, factors, alpha, bias, key, value."""
    gq, factors_s, half_alpha, lifted = kernel_operands(query, factors_in, alpha, scale)
    gq, factors_s, half_alpha = gq.contiguous(), factors_s.contiguous(), half_alpha.contiguous()
    launch = _Launch(gq, factors_s, key, value, allowed, additive, (block_m, block_n))
    grad_out = grad_out.to(out.dtype).contiguous()
    delta = (grad_out * out).sum(-1)  # D_i = dO_i . O_i, (B, Hk, g, q)
    d_key = torch.empty(key.shape, dtype=out.dtype, device=key.device)
    d_value = torch.empty_like(d_key)
    d_bias = torch.empty_like(bias)
    ranges, has_ranges = launch.ranges(along_queries=False)
    grid = (triton.cdiv(launch.kv_len, launch.block_n), launch.b * launch.hk)
    args = (gq, factors_s, half_alpha, bias.contiguous(), key, value, launch.allowed, launch.additive)
    meta = dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, **launch.flags, num_warps=launch.num_warps)
    _run(_geodesic_bwd_kv, grid, *args, ranges, lse, delta, grad_out, d_key, d_value, d_bias, *launch.scalars,
         HAS_RANGES=has_ranges, **meta)
    b, hk, g, q_len, d = gq.shape
    r = factors_s.shape[4]
    n_tiles = triton.cdiv(q_len, launch.block_m)
    d_gq = torch.empty_like(gq)
    d_factors = gq.new_empty((b, hk, g, q_len, r, d))  # per query head; a shared group's are summed below
    d_half = gq.new_empty((b, hk, g, n_tiles))
    ranges, has_ranges = launch.ranges(along_queries=True)
    _run(_geodesic_bwd_q, (n_tiles, launch.grid_heads), *args, ranges, lse, delta, grad_out, d_gq, d_factors,
         d_half, *launch.scalars, HAS_RANGES=has_ranges, **meta)
    if factors_s.shape[2] == 1:
        d_factors = d_factors.sum(2, keepdim=True)
    d_query, d_factors, d_alpha = operand_grads(query, factors_in, alpha, lifted, scale, d_gq, d_factors,
                                                 d_half.sum(dim=(0, 3)))
    return d_query, d_factors, d_alpha, d_bias, d_key.to(key.dtype), d_value.to(value.dtype)


# The kernels as PyTorch custom operators, so that a compiled training step keeps them inside its graph (one opaque
# node each, forward and backward) instead of breaking the graph around them. One namespace per loaded copy of this
# file (the project's, a Hub folder's transformers_modules copy), so that both can be registered in one process.
OP_NAMESPACE = "".join(c if c.isalnum() else "_" for c in __name__)


def _define_operators(name: str, forward, backward) -> tuple:
    """Register ``forward`` and ``backward`` (the signatures of ``_forward`` and ``_backward``) as the custom operators
    ``OP_NAMESPACE::{name}_forward`` and ``..._backward``, with fake implementations (shapes for torch.compile) and
    autograd (the backward operator as the forward's derivative). The Triton kernels and the C++ operator share this
    schema, so the model's dispatch does not care which backs it. Returns (forward operator, backward operator)."""
    Tensor = torch.Tensor

    @torch.library.custom_op(f"{OP_NAMESPACE}::{name}_forward", mutates_args=())
    def forward_op(query: Tensor, factors: Tensor, alpha: Tensor, bias: Tensor, key: Tensor, value: Tensor,
                   allowed: Tensor | None, additive: Tensor | None, scale: float, block_m: int,
                   block_n: int) -> tuple[Tensor, Tensor]:
        """The fused forward: (output in the compute dtype (B, Hk, g, q, d), log-sum-exp (B, Hk, g, q))."""
        return forward(query, factors, alpha, bias, key, value, allowed, additive, scale, block_m, block_n)

    @forward_op.register_fake
    def _(query, factors, alpha, bias, key, value, allowed, additive, scale, block_m, block_n):
        return query.new_empty(query.shape), query.new_empty(query.shape[:-1])

    @torch.library.custom_op(f"{OP_NAMESPACE}::{name}_backward", mutates_args=())
    def backward_op(query: Tensor, factors: Tensor, alpha: Tensor, bias: Tensor, key: Tensor, value: Tensor,
                    allowed: Tensor | None, additive: Tensor | None, out: Tensor, lse: Tensor, grad_out: Tensor,
                    scale: float, block_m: int, block_n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The fused backward: gradients of query, factors, alpha, bias, key and value."""
        return backward(query, factors, alpha, bias, key, value, allowed, additive, out, lse, grad_out, scale,
                        block_m, block_n)

    @backward_op.register_fake
    def _(query, factors, alpha, bias, key, value, allowed, additive, out, lse, grad_out, scale, block_m, block_n):
        return (query.new_empty(query.shape), factors.new_empty(factors.shape), alpha.new_empty(alpha.shape),
                bias.new_empty(bias.shape), key.new_empty(key.shape), value.new_empty(value.shape))

    def setup_context(ctx, inputs, output):
        query, factors, alpha, bias, key, value, allowed, additive, scale, block_m, block_n = inputs
        out, lse = output
        # saved: the inputs, the output and the log-sum-exp only; G_i q_i is rebuilt in the backward
        ctx.save_for_backward(query, factors, alpha, bias, key, value, allowed, additive, out, lse)
        ctx.scale, ctx.tiles = scale, (block_m, block_n)

    def autograd_backward(ctx, grad_out, grad_lse):
        grads = backward_op(*ctx.saved_tensors, grad_out, ctx.scale, *ctx.tiles)
        return (*grads, None, None, None, None, None)

    forward_op.register_autograd(autograd_backward, setup_context=setup_context)
    return forward_op, backward_op


geodesic_forward_op = geodesic_backward_op = None
if triton is not None:
    # looked up at each call (not bound here), so that a test may replace _forward or _backward
    geodesic_forward_op, geodesic_backward_op = _define_operators(
        "geodesic", lambda *args: _forward(*args), lambda *args: _backward(*args))


def triton_geodesic_attention(
    query, factors, key, value, alpha, gamma, scale, attention_mask=None, block_size=64, dropout=None, *, tiles=None,
    key_sq=None,
) -> torch.Tensor:
    """``blocked_geodesic_attention`` on the fused Triton kernels: same arguments, same result.

    query (B, H, q, d) after RoPE; factors (B, Hf, q, r, d) after RoPE, Hf = H or Hk; key, value (B, Hk, kv, d) (not
    repeated); alpha, gamma (H,); attention_mask as transformers passes it (None: causal when q > 1). Returns the
    output (B, H, q, d) in value's dtype. ``block_size`` (the blocked path's query block) is accepted and unused: the
    kernel's tiles are chosen from r and d, or given as ``tiles`` = (query tile, key tile), powers of two >= 16.
    ``dropout`` must be None (the kernel has no attention dropout).
    """
    if dropout is not None:
        raise ValueError("The Triton geodesic attention has no attention dropout: pass dropout=None, or use "
                         "blocked_geodesic_attention (fiber_attention_kernel='pytorch').")
    _check_inputs(query, key, value)
    return fused_forward(geodesic_forward_op, tiles or _tiles(factors.shape[-2], key.dtype), query, factors, key,
                         value, alpha, gamma, scale, attention_mask, key_sq)


def fused_forward(forward_op, tiles: tuple[int, int], query, factors, key, value, alpha, gamma, scale, attention_mask,
                  key_sq) -> torch.Tensor:
    """The forward operator of a fused path (``geodesic_forward_op``: Triton, ``cpp_forward_op``: C++) with the query
    and key tiles ``tiles``, on the operands and mask as the blocked path groups them (``prepare_geodesic_inputs``,
    ``grouped_kernel_mask``). Arguments and result as ``triton_geodesic_attention``'s."""
    grouped_q, grouped_f, grouped_alpha, bias = prepare_geodesic_inputs(query, factors, key, alpha, gamma, scale,
                                                                        key_sq)
    b, hk, g, q_len, d = grouped_q.shape
    mask = grouped_kernel_mask(attention_mask, q_len, key.shape[2], hk, g, grouped_q.dtype)
    out, _ = forward_op(grouped_q, grouped_f, grouped_alpha, bias, key, value, *mask, scale, *tiles)
    return out.to(value.dtype).view(b, hk * g, q_len, d)


# ---------------------------------------------------------------------------------------------------------------------
# The C++ operator (CPU; docs/design.md 1.5)
# ---------------------------------------------------------------------------------------------------------------------
# What the Triton kernels do on a GPU, as one C++ operator on the CPU: per (batch, KV group, query tile) an online
# softmax over key tiles, the tile's stacked pseudo-queries (g + gf r rows) multiplied by the key tile once, the combine,
# the masks and the softmax on cache-resident tiles, the backward recomputing the probabilities; torch's intra-op
# threads take the tiles in turn. No n x n x r tensor and no per-block Python. Built from CPU_SOURCE by the machine's
# C++ compiler on first use (about 10 s) and cached on disk (``cpu_operator``), as inductor builds its own C++ (a pip
# install has no build step, and a Hub folder carries this source in this file); where it cannot be built, the blocked
# PyTorch path runs and one info line says why.
CPU_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # computed in float32 or float64
# Query and key tile: 32 x 64 was fastest of 32/64/128 x 32/64/128 at the `small` training shape and about equal at
# SmolLM2's n = 512 and 2048 (AMD EPYC, 2 threads; docs/benchmarks.md)
CPU_TILES = (32, 64)
# -fopenmp: torch's at::parallel_for is a header template that runs in parallel only where the including file is
# compiled with OpenMP (torch's own libgomp is already loaded, so no second runtime comes in). The instruction set
# comes from ``cpu_arch_flags``.
CPU_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++20", "-shared", "-fPIC", "-w")


def cpu_arch_flags() -> list[str]:
    """-march=native: the tiles' products and exp use the machine's widest vectors (the cache key holds the CPU's model
    and flags, so a cache shared by different machines keeps one build each); under ATEN_CPU_CAPABILITY, ATen's own
    switch for its kernels, the instruction set it names: AVX2 and FMA for "avx2", the compiler's baseline for
    "default" (so CI's second pass runs the operator's narrow-vector code too)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return {"default": [], "avx2": ["-mavx2", "-mfma"]}.get(capability, ["-march=native"])
CPU_SOURCE = r"""// The fused geodesic attention on the CPU, forward and backward (docs/design.md 1.5). Built by fused_attention.py
// with the flags of CPU_FLAGS and loaded with torch.ops.load_library; NAMESPACE is defined on the command line.
//
// Layout (row-major, contiguous, all in one floating dtype T, float or double): query (B, Hk, g, q, d) of each query
// head after RoPE; factors (B, Hk, gf, q, r, d) after RoPE, gf = 1 (shared by a KV group) or g; alpha (Hk, g); bias
// (B, Hk, g, kv) the key term -scale (gamma/2) ||k_j||^2; key, value (B, Hk, kv, d); the mask parts broadcast to (B,
// Hk, g, q, kv) by their strides; scale the softmax scale. The operator builds each tile's pseudo-queries itself and
// returns the gradients of these inputs (the chain rule through G_i q_i included).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

// ---------------------------------------------------------------------------------------------------------------
// Vector helpers. Why explicit vectors: the compiler vectorises neither exp nor a float max reduction by itself.
// ---------------------------------------------------------------------------------------------------------------
typedef float vfloat __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register or two AVX2 ones
typedef int32_t vint __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// exp by Cody-Waite reduction x = n ln2 + t and a degree-6 polynomial for e^t; relative error ~2e-7
inline vfloat vexp(vfloat x) {
  x = x > -87.0f ? x : vfloat{} - 87.0f;
  const vfloat n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: + - 1.5 * 2^23
  const vfloat t = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;  // ln 2 in two parts
  vfloat p = vfloat{} + 1.0f / 720;
  p = p * t + 1.0f / 120;
  p = p * t + 1.0f / 24;
  p = p * t + 1.0f / 6;
  p = p * t + 0.5f;
  p = p * t + 1.0f;
  p = p * t + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;  // 2^n
  return p * reinterpret_cast<const vfloat&>(bits);
}

inline float exp_one(float x) {
  float in[kLanes] = {x}, out[kLanes];
  vstore(out, vexp(vload(in)));
  return out[0];
}

inline double exp_one(double x) { return std::exp(x); }

// max of x[0, n)
inline float row_max(const float* x, int64_t n) {
  vfloat m = vfloat{} - std::numeric_limits<float>::infinity();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const vfloat v = vload(x + k);
    m = m > v ? m : v;
  }
  float out = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < kLanes; ++j) out = std::max(out, m[j]);
  for (; k < n; ++k) out = std::max(out, x[k]);
  return out;
}

inline double row_max(const double* x, int64_t n) {
  double out = -std::numeric_limits<double>::infinity();
  for (int64_t k = 0; k < n; ++k) out = std::max(out, x[k]);
  return out;
}

// x[k] <- exp(x[k] - shift), exactly 0 where x[k] is -inf (a blocked key); returns the row's sum
inline float exp_shifted(float* x, int64_t n, float shift) {
  constexpr float blocked = -std::numeric_limits<float>::infinity();
  vfloat sum{};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const vfloat v = vload(x + k);
    const vfloat e = v == blocked ? vfloat{} : vexp(v - shift);
    vstore(x + k, e);
    sum += e;
  }
  float out = 0;
  for (int j = 0; j < kLanes; ++j) out += sum[j];
  for (; k < n; ++k) {
    x[k] = x[k] == blocked ? 0.0f : exp_one(x[k] - shift);
    out += x[k];
  }
  return out;
}

inline double exp_shifted(double* x, int64_t n, double shift) {
  double out = 0;
  for (int64_t k = 0; k < n; ++k) {
    x[k] = x[k] == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(x[k] - shift);
    out += x[k];
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Products of cache-resident tiles: C (m x n, row-major, ldc) = [C +] A B, A's element (i, k) at a[i sai + k sak]
// (A may be read transposed), B row-major (k x n, ldb). Why not BLAS: a BLAS call inside our threads runs its own
// threading (MKL's cost twice the product here), and these tiles fit a register-blocked kernel that reaches the
// core's peak; each MR x NR block of C stays in vector registers over the whole k loop.
// ---------------------------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
constexpr int kRows = 8;  // 16 accumulators of 32 registers
#else
constexpr int kVectorBytes = 32;
constexpr int kRows = 6;  // 12 accumulators of 16 registers
#endif

template <typename T, int MR>
inline void micro_kernel(int64_t kc, const T* a, int64_t sai, int64_t sak, const T* b, int64_t ldb, T* c, int64_t ldc,
                         bool accumulate) {
  typedef T V __attribute__((vector_size(kVectorBytes)));
  constexpr int W = kVectorBytes / sizeof(T);
  V acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    if (accumulate) {
      std::memcpy(&acc[i][0], c + i * ldc, sizeof(V));
      std::memcpy(&acc[i][1], c + i * ldc + W, sizeof(V));
    } else {
      acc[i][0] = V{};
      acc[i][1] = V{};
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    V b0, b1;  // a row of B in registers, used by every row of A
    std::memcpy(&b0, b + k * ldb, sizeof(V));
    std::memcpy(&b1, b + k * ldb + W, sizeof(V));
    for (int i = 0; i < MR; ++i) {
      const T av = a[i * sai + k * sak];
      acc[i][0] += av * b0;
      acc[i][1] += av * b1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    std::memcpy(c + i * ldc, &acc[i][0], sizeof(V));
    std::memcpy(c + i * ldc + W, &acc[i][1], sizeof(V));
  }
}

template <typename T>
void tile_product(int64_t m, int64_t n, int64_t kc, const T* a, int64_t sai, int64_t sak, const T* b, int64_t ldb,
                  T* c, int64_t ldc, bool accumulate) {
  constexpr int64_t NR = 2 * kVectorBytes / sizeof(T);
  const int64_t n_full = n - n % NR, m_full = m - m % kRows;
  for (int64_t j = 0; j < n_full; j += NR) {
    int64_t i = 0;
    for (; i < m_full; i += kRows)
      micro_kernel<T, kRows>(kc, a + i * sai, sai, sak, b + j, ldb, c + i * ldc + j, ldc, accumulate);
    for (; i < m; ++i) micro_kernel<T, 1>(kc, a + i * sai, sai, sak, b + j, ldb, c + i * ldc + j, ldc, accumulate);
  }
  for (int64_t i = 0; i < m && n_full < n; ++i) {  // the last columns, fewer than NR
    for (int64_t j = n_full; j < n; ++j) {
      T s = accumulate ? c[i * ldc + j] : T(0);
      for (int64_t k = 0; k < kc; ++k) s += a[i * sai + k * sak] * b[k * ldb + j];
      c[i * ldc + j] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The problem, its mask, its tiles
// ---------------------------------------------------------------------------------------------------------------
struct Problem {
  int64_t b, hk, g, gf, q, kv, r, d;
  int64_t bm, bn;  // query and key tile
};

struct Mask {
  const bool* allowed = nullptr;  // True where the key may be attended; strides over (B, Hk, g, q, kv), 0 if broadcast
  int64_t as[5] = {0, 0, 0, 0, 0};
  const void* additive = nullptr;  // the float mask, added to the scores
  int64_t fs[5] = {0, 0, 0, 0, 0};
  bool causal = false;  // no mask and several query rows: key j <= row i (upper-left, as SDPA's is_causal)
};

// Run fn(item) for every item of [0, n) on torch's intra-op threads, each taking the next item in turn (causal
// query tiles differ in cost, so a static split would leave threads idle)
template <typename F>
void parallel_items(int64_t n, const F& fn) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w)
      for (int64_t item = next++; item < n; item = next++) fn(item);
  });
}

// The key tiles the rows [i0, i1) of KV group (b, h) may attend to: under the causal mask those up to row i1 - 1;
// under a boolean mask those with an allowed key for some row of some head of the group (padding and sliding
// windows skip whole tiles); else all
std::vector<int64_t> key_tiles(const Problem& p, const Mask& m, int64_t b, int64_t h, int64_t i0, int64_t i1) {
  std::vector<int64_t> tiles;
  const int64_t n_tiles = (p.kv + p.bn - 1) / p.bn;
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t k0 = t * p.bn, k1 = std::min(p.kv, k0 + p.bn);
    if (m.causal && k0 >= i1) break;
    bool any = m.allowed == nullptr;
    for (int64_t j = 0; j < p.g && !any; ++j) {
      for (int64_t i = i0; i < i1 && !any; ++i) {
        const bool* row = m.allowed + b * m.as[0] + h * m.as[1] + j * m.as[2] + i * m.as[3];
        for (int64_t k = k0; k < k1 && !any; ++k) any = row[k * m.as[4]];
      }
    }
    if (any) tiles.push_back(t);
  }
  return tiles;
}

template <typename T>
T dot(const T* x, const T* y, int64_t n) {
  T sum = 0;
  for (int64_t c = 0; c < n; ++c) sum += x[c] * y[c];
  return sum;
}

// The stacked pseudo-queries of a query tile (rows x d): g blocks of bm rows of scale G_i q_i = scale (q_i + alpha
// sum_a (u_ia . q_i) u_ia), then gf blocks of bm r factor rows sqrt(scale) u_ia. Why here and not in PyTorch: these
// O(n d r) steps are a few passes over the query that would each be a separate op (and, in a compiled graph, unfused
// work inside the operator), while here they are done on rows already in cache
template <typename T>
void gather_rows(const Problem& p, const T* q, const T* u, const T* alpha, T scale, int64_t bh, int64_t i0,
                 int64_t bm, T* rows) {
  const T root = std::sqrt(scale);
  for (int64_t j = 0; j < p.g; ++j) {
    const T a = alpha[(bh % p.hk) * p.g + j];
    for (int64_t i = 0; i < bm; ++i) {
      const T* qi = q + ((bh * p.g + j) * p.q + i0 + i) * p.d;
      const T* ui = u + ((bh * p.gf + (p.gf == 1 ? 0 : j)) * p.q + i0 + i) * p.r * p.d;
      T* row = rows + (j * bm + i) * p.d;
      for (int64_t c = 0; c < p.d; ++c) row[c] = qi[c];
      for (int64_t k = 0; k < p.r; ++k) {
        const T w = a * dot(ui + k * p.d, qi, p.d);
        for (int64_t c = 0; c < p.d; ++c) row[c] += w * ui[k * p.d + c];
      }
      for (int64_t c = 0; c < p.d; ++c) row[c] *= scale;
    }
  }
  for (int64_t f = 0; f < p.gf; ++f) {
    const T* uf = u + ((bh * p.gf + f) * p.q + i0) * p.r * p.d;
    T* out = rows + (p.g * bm + f * bm * p.r) * p.d;
    for (int64_t c = 0; c < bm * p.r * p.d; ++c) out[c] = root * uf[c];
  }
}

// The chain rule from the gradients of one query tile's stacked rows (d_rows: d(scale G_i q_i), d(sqrt(scale) u_ia))
// to the query, the factors and alpha (adds sum_i dG_i . U_i U_i^T q_i to d_alpha). With dG = scale d(scale G q):
// d q = dG + alpha U (U^T dG) (G is symmetric); d u_a = sqrt(scale) d(row u_a) + alpha ((u_a . q) dG + (u_a . dG) q),
// summed over the heads that share U.
template <typename T>
void scatter_row_grads(const Problem& p, const T* q, const T* u, const T* alpha, T scale, int64_t bh, int64_t i0,
                       int64_t bm, const T* d_rows, T* d_q, T* d_u, T* d_alpha) {
  const T root = std::sqrt(scale);
  std::vector<T> dg(p.d);
  for (int64_t f = 0; f < p.gf; ++f) {
    const T* drf = d_rows + (p.g * bm + f * bm * p.r) * p.d;
    T* duf = d_u + ((bh * p.gf + f) * p.q + i0) * p.r * p.d;
    for (int64_t c = 0; c < bm * p.r * p.d; ++c) duf[c] = root * drf[c];
  }
  for (int64_t j = 0; j < p.g; ++j) {
    const T a = alpha[(bh % p.hk) * p.g + j];
    for (int64_t i = 0; i < bm; ++i) {
      const T* qi = q + ((bh * p.g + j) * p.q + i0 + i) * p.d;
      const int64_t fi = ((bh * p.gf + (p.gf == 1 ? 0 : j)) * p.q + i0 + i) * p.r * p.d;
      const T* ui = u + fi;
      T* dui = d_u + fi;
      T* dqi = d_q + ((bh * p.g + j) * p.q + i0 + i) * p.d;
      const T* dr = d_rows + (j * bm + i) * p.d;
      for (int64_t c = 0; c < p.d; ++c) dg[c] = scale * dr[c];
      for (int64_t c = 0; c < p.d; ++c) dqi[c] = dg[c];
      for (int64_t k = 0; k < p.r; ++k) {
        const T* uk = ui + k * p.d;
        const T coord = dot(uk, qi, p.d), d_coord = dot(uk, dg.data(), p.d);
        d_alpha[j] += coord * d_coord;
        for (int64_t c = 0; c < p.d; ++c) {
          dqi[c] += a * d_coord * uk[c];
          dui[k * p.d + c] += a * (coord * dg[c] + d_coord * qi[c]);
        }
      }
    }
  }
}

// The logits of one (query tile, key tile), as the blocked path's _block_logits: lin_ij + bias_j - (alpha/2)
// ||U_i^T k_j||^2, the float mask added (clamped to the dtype's lowest), -inf where blocked. prods (rows x ldp) are
// the products of the stacked rows with the key tile; writes logits (g bm x ldp) and the quadratic terms
// (gf bm x ldp) into quad.
template <typename T>
void tile_logits(const Problem& p, const Mask& m, const T* prods, const T* bias, const T* alpha, int64_t bh,
                 int64_t i0, int64_t bm, int64_t k0, int64_t bn, T* logits, T* quad) {
  const int64_t ld = p.bn, b = bh / p.hk, h = bh % p.hk;
  const T* coords = prods + p.g * bm * ld;  // U_i^T k_j: (gf, bm, r) rows
  for (int64_t f = 0; f < p.gf; ++f) {
    for (int64_t i = 0; i < bm; ++i) {
      T* qd = quad + (f * bm + i) * ld;
      const T* c = coords + (f * bm + i) * p.r * ld;
      for (int64_t k = 0; k < bn; ++k) qd[k] = c[k] * c[k];
      for (int64_t a = 1; a < p.r; ++a)
        for (int64_t k = 0; k < bn; ++k) qd[k] += c[a * ld + k] * c[a * ld + k];
    }
  }
  const T blocked = -std::numeric_limits<T>::infinity(), lowest = std::numeric_limits<T>::lowest();
  for (int64_t j = 0; j < p.g; ++j) {
    const T half_alpha = T(0.5) * alpha[h * p.g + j];
    const T* bias_j = bias + (bh * p.g + j) * p.kv + k0;
    for (int64_t i = 0; i < bm; ++i) {
      const T* lin = prods + (j * bm + i) * ld;
      const T* qd = quad + ((p.gf == 1 ? 0 : j) * bm + i) * ld;  // a shared group's quadratic serves its g heads
      T* l = logits + (j * bm + i) * ld;
      for (int64_t k = 0; k < bn; ++k) l[k] = lin[k] + bias_j[k] - half_alpha * qd[k];
      const int64_t row = i0 + i;
      if (m.additive != nullptr) {
        const T* add = static_cast<const T*>(m.additive) + b * m.fs[0] + h * m.fs[1] + j * m.fs[2] + row * m.fs[3];
        for (int64_t k = 0; k < bn; ++k) l[k] = std::max(l[k] + add[(k0 + k) * m.fs[4]], lowest);
      }
      if (m.allowed != nullptr) {
        const bool* al = m.allowed + b * m.as[0] + h * m.as[1] + j * m.as[2] + row * m.as[3];
        for (int64_t k = 0; k < bn; ++k) l[k] = al[(k0 + k) * m.as[4]] ? l[k] : blocked;
      } else if (m.causal) {
        for (int64_t k = std::max<int64_t>(0, row + 1 - k0); k < bn; ++k) l[k] = blocked;  // keys after the row
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Forward: per (batch, KV group, query tile) an online softmax over the key tiles (as FlashAttention), the output
// and the log-sum-exp of each row (+inf for a row with no allowed key, whose output is 0).
// ---------------------------------------------------------------------------------------------------------------
template <typename T>
void forward_tiles(const Problem& p, const Mask& m, const T* q, const T* u, const T* alpha, T scale, const T* bias,
                   const T* key_t, const T* value, T* out, T* lse) {
  const int64_t n_q = (p.q + p.bm - 1) / p.bm, max_rows = p.g * p.bm + p.gf * p.bm * p.r;
  constexpr T none = -std::numeric_limits<T>::infinity();
  parallel_items(p.b * p.hk * n_q, [&](int64_t item) {
    const int64_t t = n_q - 1 - item % n_q, bh = item / n_q;  // the longest causal tiles first
    const int64_t i0 = t * p.bm, bm = std::min(p.bm, p.q - i0), n_rows = p.g * bm + p.gf * bm * p.r;
    std::vector<T> rows(max_rows * p.d), prods(max_rows * p.bn), probs(p.g * p.bm * p.bn), quad(p.gf * p.bm * p.bn);
    std::vector<T> acc(p.g * bm * p.d, T(0)), run_max(p.g * bm, none), run_sum(p.g * bm, T(0));
    gather_rows(p, q, u, alpha, scale, bh, i0, bm, rows.data());
    const T* kt = key_t + bh * p.d * p.kv;  // keys transposed: (d, kv)
    const T* v = value + bh * p.kv * p.d;
    for (int64_t tile : key_tiles(p, m, bh / p.hk, bh % p.hk, i0, i0 + bm)) {
      const int64_t k0 = tile * p.bn, bn = std::min(p.bn, p.kv - k0);
      // (rows x d) @ (d x bn): every pseudo-query with every key of the tile, r + 1 products per (query, key)
      tile_product<T>(n_rows, bn, p.d, rows.data(), p.d, 1, kt + k0, p.kv, prods.data(), p.bn, false);
      tile_logits<T>(p, m, prods.data(), bias, alpha, bh, i0, bm, k0, bn, probs.data(), quad.data());
      for (int64_t row = 0; row < p.g * bm; ++row) {
        T* l = probs.data() + row * p.bn;
        const T new_max = std::max(run_max[row], row_max(l, bn));
        if (new_max == none) {  // no allowed key in this row so far
          std::fill(l, l + bn, T(0));
          continue;
        }
        const T rescale = exp_one(run_max[row] - new_max);  // exp(-inf) = 0 on the first allowed tile
        run_sum[row] = run_sum[row] * rescale + exp_shifted(l, bn, new_max);
        run_max[row] = new_max;
        for (int64_t c = 0; c < p.d; ++c) acc[row * p.d + c] *= rescale;
      }
      // (g bm x bn) @ (bn x d): the tile's probabilities times its values
      tile_product<T>(p.g * bm, p.d, bn, probs.data(), p.bn, 1, v + k0 * p.d, p.d, acc.data(), p.d, true);
    }
    for (int64_t j = 0; j < p.g; ++j) {
      for (int64_t i = 0; i < bm; ++i) {
        const int64_t row = j * bm + i, o = (bh * p.g + j) * p.q + i0 + i;
        const bool empty = run_sum[row] == T(0);
        const T inv = empty ? T(0) : T(1) / run_sum[row];
        for (int64_t c = 0; c < p.d; ++c) out[o * p.d + c] = acc[row * p.d + c] * inv;
        lse[o] = empty ? std::numeric_limits<T>::infinity() : run_max[row] + std::log(run_sum[row]);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Backward: the probabilities recomputed from the log-sum-exp. Work items are (batch, KV group, chunk of query
// tiles); each chunk accumulates its own key-side gradients (dK, dV, d bias, d alpha), summed over chunks after, so
// no two threads write the same memory. The query-side gradients of a tile (d rows) are its own.
// ---------------------------------------------------------------------------------------------------------------
template <typename T>
void backward_tiles(const Problem& p, const Mask& m, const T* q, const T* u, const T* alpha, T scale, const T* bias,
                    const T* key, const T* key_t, const T* value_t, const T* out, const T* lse, const T* grad_out,
                    T* d_q, T* d_u, T* d_alpha, T* d_bias, T* d_key, T* d_value, int64_t chunks) {
  const int64_t n_q = (p.q + p.bm - 1) / p.bm, max_rows = p.g * p.bm + p.gf * p.bm * p.r;
  parallel_items(p.b * p.hk * chunks, [&](int64_t item) {
    const int64_t c = item % chunks, bh = item / chunks;
    std::vector<T> rows(max_rows * p.d), prods(max_rows * p.bn), probs(p.g * p.bm * p.bn), quad(p.gf * p.bm * p.bn);
    std::vector<T> d_out(p.g * p.bm * p.d), d_probs(p.g * p.bm * p.bn), d_rows(max_rows * p.d), delta(p.g * p.bm);
    std::vector<T> d_half(p.g, T(0)), d_lift(p.g, T(0));  // d(alpha/2) from the scores, d alpha from G q
    const T* k = key + bh * p.kv * p.d;
    const T* kt = key_t + bh * p.d * p.kv;
    const T* vt = value_t + bh * p.d * p.kv;
    T* dk = d_key + (c * p.b * p.hk + bh) * p.kv * p.d;
    T* dv = d_value + (c * p.b * p.hk + bh) * p.kv * p.d;
    T* db = d_bias + (c * p.b * p.hk + bh) * p.g * p.kv;
    for (int64_t t = n_q - 1 - c; t >= 0; t -= chunks) {  // this chunk's query tiles, interleaved with the others'
      const int64_t i0 = t * p.bm, bm = std::min(p.bm, p.q - i0), n_rows = p.g * bm + p.gf * bm * p.r;
      gather_rows(p, q, u, alpha, scale, bh, i0, bm, rows.data());
      for (int64_t j = 0; j < p.g; ++j) {
        const int64_t o = ((bh * p.g + j) * p.q + i0) * p.d;
        std::memcpy(d_out.data() + j * bm * p.d, grad_out + o, sizeof(T) * bm * p.d);
        for (int64_t i = 0; i < bm; ++i)  // D_i = dO_i . O_i, the softmax backward's row term
          delta[j * bm + i] = dot(grad_out + o + i * p.d, out + o + i * p.d, p.d);
      }
      std::fill(d_rows.begin(), d_rows.begin() + n_rows * p.d, T(0));
      for (int64_t tile : key_tiles(p, m, bh / p.hk, bh % p.hk, i0, i0 + bm)) {
        const int64_t k0 = tile * p.bn, bn = std::min(p.bn, p.kv - k0);
        tile_product<T>(n_rows, bn, p.d, rows.data(), p.d, 1, kt + k0, p.kv, prods.data(), p.bn, false);
        tile_logits<T>(p, m, prods.data(), bias, alpha, bh, i0, bm, k0, bn, probs.data(), quad.data());
        for (int64_t j = 0; j < p.g; ++j) {
          for (int64_t i = 0; i < bm; ++i) {
            const T row_lse = lse[(bh * p.g + j) * p.q + i0 + i];
            T* l = probs.data() + (j * bm + i) * p.bn;
            if (row_lse == std::numeric_limits<T>::infinity())  // a row that attends to nothing
              std::fill(l, l + bn, T(0));
            else
              exp_shifted(l, bn, row_lse);  // P = exp(logits - lse)
          }
        }
        // dV += P^T dO: (bn x g bm) @ (g bm x d); dP = dO V^T: (g bm x d) @ (d x bn)
        tile_product<T>(bn, p.d, p.g * bm, probs.data(), 1, p.bn, d_out.data(), p.d, dv + k0 * p.d, p.d, true);
        tile_product<T>(p.g * bm, bn, p.d, d_out.data(), p.d, 1, vt + k0, p.kv, d_probs.data(), p.bn, false);
        // softmax backward dS = P (dP - D_i), written over the products' linear rows; the key term's and the
        // gate's gradients: d bias_j = sum_i dS_ij, d(alpha/2) = -sum_ij dS_ij ||U_i^T k_j||^2
        T* d_logits = prods.data();
        for (int64_t j = 0; j < p.g; ++j) {
          T* dbj = db + j * p.kv + k0;
          T gate = 0;
          for (int64_t i = 0; i < bm; ++i) {
            const T dl = delta[j * bm + i];
            const T* pr = probs.data() + (j * bm + i) * p.bn;
            const T* dp = d_probs.data() + (j * bm + i) * p.bn;
            const T* qd = quad.data() + ((p.gf == 1 ? 0 : j) * bm + i) * p.bn;
            T* ds = d_logits + (j * bm + i) * p.bn;
            for (int64_t kk = 0; kk < bn; ++kk) {
              ds[kk] = pr[kk] * (dp[kk] - dl);
              dbj[kk] += ds[kk];
              gate += ds[kk] * qd[kk];
            }
          }
          d_half[j] -= gate;
        }
        // d coords U_i^T k_j = -2 (alpha/2) dS_ij U_i^T k_j, summed over the heads that share the factors, written
        // over the products' factor rows (the quadratic terms' buffer holds the weights)
        T* coords = prods.data() + p.g * bm * p.bn;
        for (int64_t f = 0; f < p.gf; ++f) {
          for (int64_t i = 0; i < bm; ++i) {
            T* w = quad.data() + (f * bm + i) * p.bn;
            std::fill(w, w + bn, T(0));
            for (int64_t j = (p.gf == 1 ? 0 : f); j < (p.gf == 1 ? p.g : f + 1); ++j) {
              const T weight = -alpha[(bh % p.hk) * p.g + j];  // -2 (alpha/2)
              const T* ds = d_logits + (j * bm + i) * p.bn;
              for (int64_t kk = 0; kk < bn; ++kk) w[kk] += weight * ds[kk];
            }
            for (int64_t a = 0; a < p.r; ++a) {
              T* ca = coords + ((f * bm + i) * p.r + a) * p.bn;
              for (int64_t kk = 0; kk < bn; ++kk) ca[kk] *= w[kk];
            }
          }
        }
        // d rows += d prods K: (rows x bn) @ (bn x d); dK += d prods^T rows: (bn x rows) @ (rows x d)
        tile_product<T>(n_rows, p.d, bn, prods.data(), p.bn, 1, k + k0 * p.d, p.d, d_rows.data(), p.d, true);
        tile_product<T>(bn, p.d, n_rows, prods.data(), 1, p.bn, rows.data(), p.d, dk + k0 * p.d, p.d, true);
      }
      scatter_row_grads(p, q, u, alpha, scale, bh, i0, bm, d_rows.data(), d_q, d_u, d_lift.data());
    }
    for (int64_t j = 0; j < p.g; ++j) d_alpha[(bh * chunks + c) * p.g + j] = T(0.5) * d_half[j] + d_lift[j];
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Decode: one query row per head against the cache, without autograd (generation's one-token step). Work items are
// (batch, KV group, chunk of DECODE_CHUNK keys), each a partial softmax (its max, its sum and sum_j p_j v_j per head),
// combined after. Why chunks: a sequence has few KV groups (3 in SmolLM2), fewer than the cores would need, and a
// fixed chunk keeps the result independent of the thread count. Each key row is read once for all g + gf r rows.
// ---------------------------------------------------------------------------------------------------------------
constexpr int64_t kDecodeChunk = 128;

inline float lane_sum(vfloat v) {  // a tree of halves: 4 vector adds, not 15 scalar ones
  typedef float half8 __attribute__((vector_size(32)));
  typedef float half4 __attribute__((vector_size(16)));
  const half8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const half4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// out[row] = rows[row] . k for n_rows rows of length n (and ||k||^2 into *sq when sq is not null): each vector of
// the key loaded once for every row
template <int R>
inline void dot_rows_fixed(const float* rows, const float* k, int64_t n, float* out, float* sq) {
  vfloat acc[R + 1] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    const vfloat kv = vload(k + c);
    for (int i = 0; i < R; ++i) acc[i] += vload(rows + i * n + c) * kv;
    if (sq != nullptr) acc[R] += kv * kv;
  }
  for (int i = 0; i < R; ++i) out[i] = lane_sum(acc[i]);
  float tail_sq = sq != nullptr ? lane_sum(acc[R]) : 0.0f;
  for (; c < n; ++c) {
    for (int i = 0; i < R; ++i) out[i] += rows[i * n + c] * k[c];
    tail_sq += k[c] * k[c];
  }
  if (sq != nullptr) *sq = tail_sq;
}

inline void dot_rows(const float* rows, int64_t n_rows, const float* k, int64_t n, float* out, float* sq) {
  int64_t i = 0;
  for (; i + 4 <= n_rows; i += 4) dot_rows_fixed<4>(rows + i * n, k, n, out + i, i == 0 ? sq : nullptr);
  for (; i < n_rows; ++i) dot_rows_fixed<1>(rows + i * n, k, n, out + i, i == 0 ? sq : nullptr);
}

inline void dot_rows(const double* rows, int64_t n_rows, const double* k, int64_t n, double* out, double* sq) {
  for (int64_t i = 0; i < n_rows; ++i) out[i] = dot(rows + i * n, k, n);
  if (sq != nullptr) *sq = dot(k, k, n);
}

// logits (g x n) and the partial softmax of the keys [k0, k0 + n) of KV group bh: part_max, part_sum (g) and
// part_acc (g x d) of this chunk
template <typename T>
void decode_chunk(const Problem& p, const Mask& m, const T* rows, const T* alpha, const T* gamma, T scale,
                  const T* key_sq, const T* key, const T* value, int64_t bh, int64_t k0, int64_t n, T* logits,
                  T* part_max, T* part_sum, T* part_acc) {
  const int64_t b = bh / p.hk, h = bh % p.hk, n_rows = p.g + p.gf * p.r;
  const T blocked = -std::numeric_limits<T>::infinity(), lowest = std::numeric_limits<T>::lowest();
  std::vector<T> prods(n_rows);
  for (int64_t k = 0; k < n; ++k) {
    const T* kk = key + (bh * p.kv + k0 + k) * p.d;
    T sq = key_sq != nullptr ? key_sq[bh * p.kv + k0 + k] : T(0);  // ||k_j||^2, kept by the cache or computed here
    dot_rows(rows, n_rows, kk, p.d, prods.data(), key_sq != nullptr ? nullptr : &sq);
    for (int64_t j = 0; j < p.g; ++j) {
      const T* coords = prods.data() + p.g + (p.gf == 1 ? 0 : j) * p.r;  // sqrt(scale) U_i^T k_j
      T quad = 0;
      for (int64_t a = 0; a < p.r; ++a) quad += coords[a] * coords[a];
      // scale [(G q).k - (gamma/2)||k||^2 - (alpha/2)||U^T k||^2], the scale already in the rows
      T l = prods[j] - T(0.5) * scale * gamma[h * p.g + j] * sq - T(0.5) * alpha[h * p.g + j] * quad;
      if (m.additive != nullptr)
        l = std::max(l + static_cast<const T*>(m.additive)[b * m.fs[0] + h * m.fs[1] + j * m.fs[2] +
                                                            (k0 + k) * m.fs[4]], lowest);
      if (m.allowed != nullptr && !m.allowed[b * m.as[0] + h * m.as[1] + j * m.as[2] + (k0 + k) * m.as[4]])
        l = blocked;
      logits[j * n + k] = l;
    }
  }
  for (int64_t j = 0; j < p.g; ++j) {
    T* l = logits + j * n;
    T* acc = part_acc + j * p.d;
    std::fill(acc, acc + p.d, T(0));
    const T mx = row_max(l, n);
    part_max[j] = mx;
    part_sum[j] = 0;
    if (mx == blocked) continue;  // no allowed key in this chunk
    part_sum[j] = exp_shifted(l, n, mx);
    for (int64_t k = 0; k < n; ++k) {
      if (l[k] == T(0)) continue;
      const T* vk = value + (bh * p.kv + k0 + k) * p.d;
      for (int64_t c = 0; c < p.d; ++c) acc[c] += l[k] * vk[c];
    }
  }
}

template <typename T>
void decode_rows(const Problem& p, const Mask& m, const T* q, const T* u, const T* alpha, const T* gamma, T scale,
                 const T* key_sq, const T* key, const T* value, T* out) {
  const int64_t chunks = std::max<int64_t>(1, (p.kv + kDecodeChunk - 1) / kDecodeChunk), groups = p.b * p.hk;
  std::vector<T> part_max(groups * chunks * p.g), part_sum(groups * chunks * p.g), part_acc(groups * chunks * p.g * p.d);
  parallel_items(groups * chunks, [&](int64_t item) {
    const int64_t bh = item / chunks, c = item % chunks;
    const int64_t k0 = c * kDecodeChunk, n = std::max<int64_t>(0, std::min(p.kv, k0 + kDecodeChunk) - k0);
    std::vector<T> rows((p.g + p.gf * p.r) * p.d), logits(p.g * std::max<int64_t>(n, 1));
    gather_rows(p, q, u, alpha, scale, bh, 0, 1, rows.data());
    decode_chunk(p, m, rows.data(), alpha, gamma, scale, key_sq, key, value, bh, k0, n, logits.data(),
                 part_max.data() + item * p.g, part_sum.data() + item * p.g, part_acc.data() + item * p.g * p.d);
  });
  // combine the chunks of each head: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) s_c, 0 where no key is allowed
  for (int64_t bh = 0; bh < groups; ++bh) {
    for (int64_t j = 0; j < p.g; ++j) {
      T* o = out + (bh * p.g + j) * p.d;
      std::fill(o, o + p.d, T(0));
      T mx = -std::numeric_limits<T>::infinity(), sum = 0;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part_max[(bh * chunks + c) * p.g + j]);
      if (mx == -std::numeric_limits<T>::infinity()) continue;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = (bh * chunks + c) * p.g + j;
        if (part_sum[at] == T(0)) continue;
        const T w = std::exp(part_max[at] - mx);
        sum += w * part_sum[at];
        for (int64_t e = 0; e < p.d; ++e) o[e] += w * part_acc[at * p.d + e];
      }
      for (int64_t e = 0; e < p.d; ++e) o[e] /= sum;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The MLP's preconditioned step in inference (woodbury_precondition in fiber_attention.py), token by token:
// M^{-1} y = y - beta V (I + beta V^T V)^{-1} V^T y, the r x r system solved by Cholesky, the pivots clamped at the
// dtype's smallest normal number as there. Why here: per token these are a few dot products of length D, which as
// PyTorch ops are some thirty calls per layer and decoding step.
// ---------------------------------------------------------------------------------------------------------------
template <typename T>
void woodbury_rows(int64_t n, int64_t r, int64_t dim, const T* y, const T* v, T beta, T* out) {
  at::parallel_for(0, n, 64, [&](int64_t t0, int64_t t1) {
    std::vector<T> coords(r), gram(r * r), low(r * r), x(r);
    const T tiny = std::numeric_limits<T>::min();
    for (int64_t t = t0; t < t1; ++t) {
      const T* yt = y + t * dim;
      const T* vt = v + t * r * dim;
      dot_rows(vt, r, yt, dim, coords.data(), nullptr);  // V^T y
      for (int64_t a = 0; a < r; ++a) dot_rows(vt, a + 1, vt + a * dim, dim, gram.data() + a * r, nullptr);  // V^T V
      for (int64_t j = 0; j < r; ++j) {  // Cholesky of I + beta V^T V (lower triangle: gram[i r + j], i >= j)
        T pivot = T(1) + beta * gram[j * r + j];
        for (int64_t k = 0; k < j; ++k) pivot -= low[j * r + k] * low[j * r + k];
        low[j * r + j] = std::sqrt(std::max(pivot, tiny));
        for (int64_t i = j + 1; i < r; ++i) {
          T entry = beta * gram[i * r + j];
          for (int64_t k = 0; k < j; ++k) entry -= low[i * r + k] * low[j * r + k];
          low[i * r + j] = entry / low[j * r + j];
        }
      }
      for (int64_t i = 0; i < r; ++i) {  // L z = V^T y
        T value = coords[i];
        for (int64_t k = 0; k < i; ++k) value -= low[i * r + k] * x[k];
        x[i] = value / low[i * r + i];
      }
      for (int64_t i = r - 1; i >= 0; --i) {  // L^T x = z
        T value = x[i];
        for (int64_t k = i + 1; k < r; ++k) value -= low[k * r + i] * x[k];
        x[i] = value / low[i * r + i];
      }
      T* ot = out + t * dim;
      for (int64_t c = 0; c < dim; ++c) ot[c] = yt[c];
      for (int64_t a = 0; a < r; ++a) {
        const T w = beta * x[a];
        for (int64_t c = 0; c < dim; ++c) ot[c] -= w * vt[a * dim + c];
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The operators
// ---------------------------------------------------------------------------------------------------------------
// is_bias: whether ``bias`` is the key term (B, Hk, g, kv) (forward, backward) or gamma (Hk, g) (decode)
Problem read_problem(const Tensor& q, const Tensor& u, const Tensor& alpha, const Tensor& bias, const Tensor& key,
                     const Tensor& value, int64_t bm, int64_t bn, bool is_bias = true) {
  TORCH_CHECK(q.dim() == 5 && u.dim() == 6 && key.dim() == 4 && value.dim() == 4,
              "geodesic attention (CPU): expected query (B, Hk, g, q, d), factors (B, Hk, gf, q, r, d), key and value "
              "(B, Hk, kv, d)");
  Problem p{q.size(0), q.size(1), q.size(2), u.size(2), q.size(3), key.size(2), u.size(4), q.size(4), bm, bn};
  TORCH_CHECK(p.gf == 1 || p.gf == p.g, "geodesic attention (CPU): factors per KV group or per query head");
  TORCH_CHECK(bm > 0 && bn > 0, "geodesic attention (CPU): tiles must be positive");
  for (const Tensor* t : {&q, &u, &alpha, &bias, &key, &value}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == q.scalar_type(),
                "geodesic attention (CPU): contiguous CPU tensors of one dtype (float32 or float64) expected");
  }
  TORCH_CHECK(key.size(0) == p.b && key.size(1) == p.hk && key.size(3) == p.d && value.sizes() == key.sizes() &&
                  u.size(0) == p.b && u.size(1) == p.hk && u.size(3) == p.q && u.size(5) == p.d &&
                  alpha.numel() == p.hk * p.g && bias.numel() == (is_bias ? p.b * p.kv : 1) * p.hk * p.g,
              "geodesic attention (CPU): inconsistent shapes");
  return p;
}

Mask read_mask(const std::optional<Tensor>& allowed, const std::optional<Tensor>& additive, const Problem& p,
               at::ScalarType dtype, std::vector<Tensor>& keep) {
  Mask m;
  const std::vector<int64_t> full{p.b, p.hk, p.g, p.q, p.kv};
  if (allowed.has_value()) {
    TORCH_CHECK(allowed->scalar_type() == at::kBool && allowed->dim() == 5, "geodesic attention (CPU): bool mask");
    keep.push_back(allowed->expand(full));  // a view: strides 0 where the mask broadcasts
    m.allowed = keep.back().data_ptr<bool>();
    for (int i = 0; i < 5; ++i) m.as[i] = keep.back().stride(i);
  }
  if (additive.has_value()) {
    TORCH_CHECK(additive->scalar_type() == dtype && additive->dim() == 5,
                "geodesic attention (CPU): the float mask in the compute dtype");
    keep.push_back(additive->expand(full));
    m.additive = keep.back().data_ptr();
    for (int i = 0; i < 5; ++i) m.fs[i] = keep.back().stride(i);
  }
  m.causal = !allowed.has_value() && p.q > 1;
  return m;
}

std::tuple<Tensor, Tensor> geodesic_forward(const Tensor& query, const Tensor& factors, const Tensor& alpha,
                                            const Tensor& bias, const Tensor& key, const Tensor& value,
                                            const std::optional<Tensor>& allowed,
                                            const std::optional<Tensor>& additive, double scale, int64_t bm,
                                            int64_t bn) {
  const Problem p = read_problem(query, factors, alpha, bias, key, value, bm, bn);
  std::vector<Tensor> keep;
  const Mask m = read_mask(allowed, additive, p, query.scalar_type(), keep);
  Tensor out = at::empty(query.sizes(), query.options());
  Tensor lse = at::empty({p.b, p.hk, p.g, p.q}, query.options());
  Tensor key_t = key.transpose(2, 3).contiguous();  // (B, Hk, d, kv): a key tile's columns are contiguous rows
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "geodesic_forward", [&] {
    forward_tiles<scalar_t>(p, m, query.data_ptr<scalar_t>(), factors.data_ptr<scalar_t>(),
                            alpha.data_ptr<scalar_t>(), scalar_t(scale), bias.data_ptr<scalar_t>(),
                            key_t.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            lse.data_ptr<scalar_t>());
  });
  return {out, lse};
}

std::vector<Tensor> geodesic_backward(const Tensor& query, const Tensor& factors, const Tensor& alpha,
                                      const Tensor& bias, const Tensor& key, const Tensor& value,
                                      const std::optional<Tensor>& allowed, const std::optional<Tensor>& additive,
                                      const Tensor& out, const Tensor& lse, const Tensor& grad_out, double scale,
                                      int64_t bm, int64_t bn) {
  const Problem p = read_problem(query, factors, alpha, bias, key, value, bm, bn);
  std::vector<Tensor> keep;
  const Mask m = read_mask(allowed, additive, p, query.scalar_type(), keep);
  for (const Tensor* t : {&out, &lse, &grad_out}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == query.scalar_type(),
                "geodesic attention (CPU): out, lse and grad_out contiguous in the compute dtype");
  }
  const int64_t n_q = (p.q + p.bm - 1) / p.bm, groups = p.b * p.hk;
  // chunks of query tiles per KV group: enough work items for every thread twice over, at most one per tile
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(n_q, (2 * at::get_num_threads() + groups - 1) / groups));
  Tensor d_query = at::empty(query.sizes(), query.options());
  Tensor d_factors = at::empty(factors.sizes(), factors.options());
  Tensor d_alpha = at::empty({p.b, p.hk, chunks, p.g}, query.options());
  Tensor d_bias = at::zeros({chunks, p.b, p.hk, p.g, p.kv}, query.options());
  Tensor d_key = at::zeros({chunks, p.b, p.hk, p.kv, p.d}, query.options());
  Tensor d_value = at::zeros({chunks, p.b, p.hk, p.kv, p.d}, query.options());
  Tensor key_t = key.transpose(2, 3).contiguous(), value_t = value.transpose(2, 3).contiguous();
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "geodesic_backward", [&] {
    backward_tiles<scalar_t>(
        p, m, query.data_ptr<scalar_t>(), factors.data_ptr<scalar_t>(), alpha.data_ptr<scalar_t>(),
        scalar_t(scale), bias.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), key_t.data_ptr<scalar_t>(),
        value_t.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
        grad_out.data_ptr<scalar_t>(), d_query.data_ptr<scalar_t>(), d_factors.data_ptr<scalar_t>(),
        d_alpha.data_ptr<scalar_t>(), d_bias.data_ptr<scalar_t>(), d_key.data_ptr<scalar_t>(),
        d_value.data_ptr<scalar_t>(), chunks);
  });
  // per chunk -> summed: d alpha (Hk, g), d bias (B, Hk, g, kv), dK and dV (B, Hk, kv, d)
  return {d_query, d_factors, d_alpha.sum({0, 2}), d_bias.sum(0), d_key.sum(0), d_value.sum(0)};
}

Tensor geodesic_decode(const Tensor& query, const Tensor& factors, const Tensor& alpha, const Tensor& gamma,
                       const std::optional<Tensor>& key_sq, const Tensor& key, const Tensor& value,
                       const std::optional<Tensor>& allowed, const std::optional<Tensor>& additive, double scale) {
  TORCH_CHECK(query.dim() == 5 && query.size(3) == 1, "geodesic decode (CPU): expected query (B, Hk, g, 1, d)");
  // the forward's checks, gamma (Hk, g) in the bias's place (the key term is computed here)
  const Problem p = read_problem(query, factors, alpha, gamma, key, value, 1, kDecodeChunk, /*is_bias=*/false);
  if (key_sq.has_value()) {
    TORCH_CHECK(key_sq->is_contiguous() && key_sq->scalar_type() == query.scalar_type() &&
                    key_sq->numel() == p.b * p.hk * p.kv,
                "geodesic decode (CPU): key_sq (B, Hk, kv) contiguous in the compute dtype");
  }
  std::vector<Tensor> keep;
  const Mask m = read_mask(allowed, additive, p, query.scalar_type(), keep);
  Tensor out = at::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "geodesic_decode", [&] {
    decode_rows<scalar_t>(p, m, query.data_ptr<scalar_t>(), factors.data_ptr<scalar_t>(), alpha.data_ptr<scalar_t>(),
                          gamma.data_ptr<scalar_t>(), scalar_t(scale),
                          key_sq.has_value() ? key_sq->data_ptr<scalar_t>() : nullptr, key.data_ptr<scalar_t>(),
                          value.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}

Tensor woodbury(const Tensor& update, const Tensor& factors, double beta) {
  TORCH_CHECK(update.dim() == 2 && factors.dim() == 3 && factors.size(0) == update.size(0) &&
                  factors.size(2) == update.size(1) && update.is_contiguous() && factors.is_contiguous() &&
                  factors.scalar_type() == update.scalar_type() && update.device().is_cpu(),
              "woodbury (CPU): expected contiguous update (N, D) and factors (N, r, D) of one dtype");
  Tensor out = at::empty(update.sizes(), update.options());
  AT_DISPATCH_FLOATING_TYPES(update.scalar_type(), "woodbury", [&] {
    woodbury_rows<scalar_t>(update.size(0), factors.size(1), update.size(1), update.data_ptr<scalar_t>(),
                            factors.data_ptr<scalar_t>(), scalar_t(beta), out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, lib) {
  lib.def("forward(Tensor query, Tensor factors, Tensor alpha, Tensor bias, Tensor key, Tensor value, "
          "Tensor? allowed, Tensor? additive, float scale, int bm, int bn) -> (Tensor, Tensor)");
  lib.def("backward(Tensor query, Tensor factors, Tensor alpha, Tensor bias, Tensor key, Tensor value, "
          "Tensor? allowed, Tensor? additive, Tensor out, Tensor lse, Tensor grad_out, float scale, int bm, "
          "int bn) -> Tensor[]");
  lib.def("decode(Tensor query, Tensor factors, Tensor alpha, Tensor gamma, Tensor? key_sq, Tensor key, Tensor value, "
          "Tensor? allowed, Tensor? additive, float scale) -> Tensor");
  lib.def("woodbury(Tensor update, Tensor factors, float beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(NAMESPACE, CPU, lib) {
  lib.impl("forward", &geodesic_forward);
  lib.impl("backward", &geodesic_backward);
  lib.impl("decode", &geodesic_decode);
  lib.impl("woodbury", &woodbury);
}
"""

_cpu_operator: dict = {}  # "ops": the loaded operators (torch.ops namespace) or None, "why": why not


def cpu_operator():
    """The C++ operator's ``torch.ops`` namespace (``forward`` and ``backward``), built on first use and loaded from
    the cache after; None where it cannot be built or loaded here, after one info line saying why (once per process)."""
    if "ops" not in _cpu_operator:
        try:
            ops, why = _build_cpu_operator(), None
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            ops, why = None, " ".join(str(exc).split())[:500]
        _cpu_operator.update(ops=ops, why=why)
        if ops is None:
            logger.info(f"The fused C++ geodesic attention is not available here ({why}); the blocked PyTorch path "
                        "computes the attention on the CPU (the same function, slower).")
    return _cpu_operator["ops"]


def cpu_cache_dir() -> Path:
    """Where built operators are kept: $TORCH_EXTENSIONS_DIR (torch's setting for its own C++ extensions) or
    ~/.cache/torch_extensions, under fiber_bundle_attention/."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torch_extensions")
    return Path(root) / "fiber_bundle_attention"


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f.read().splitlines()[:60] if line.startswith(("model name", "flags"))]
    except OSError:
        lines = []
    return "\n".join(lines) or platform.processor() or platform.machine()


def _build_cpu_operator():
    """Compile CPU_SOURCE (unless the cache holds it) and load it; raises with the reason where that fails."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"it is built on Linux only, this is {sys.platform}")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: `{compiler}` is not on PATH (install g++, or set CXX)")
    from torch.utils import cpp_extension  # noqa: PLC0415  (imported only where a build may run)

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = [*CPU_FLAGS, *cpu_arch_flags()]
    key = hashlib.sha256("\0".join([CPU_SOURCE, *flags, torch.__version__, str(torch.version.git_version),
                                     version, _cpu_identity()]).encode()).hexdigest()[:16]
    namespace = f"fiber_bundle_cpu_{key}"  # one per source and machine: copies of the same file share it
    path = cpu_cache_dir() / f"{namespace}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then moved in whole (atomic)
            source = Path(tmp) / "geodesic_attention.cpp"
            source.write_text(CPU_SOURCE)
            command = [compiler, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                       f"-DNAMESPACE={namespace}", *(f"-I{p}" for p in cpp_extension.include_paths()), str(source),
                       "-o", str(Path(tmp) / path.name), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch",
                       f"-Wl,-rpath,{torch_lib}"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
            os.replace(Path(tmp) / path.name, path)
    torch.ops.load_library(str(path))
    return getattr(torch.ops, namespace)


def _cpp_operands(query, factors, alpha, bias, key, value) -> list:
    """The operands as the C++ operator takes them: contiguous, in the compute dtype (the grouped query, factors and
    alpha already are: ``prepare_geodesic_inputs``)."""
    compute = query.dtype
    return [t.contiguous() for t in (query, factors, alpha, bias, key.to(compute), value.to(compute))]


def _cpp_forward(query, factors, alpha, bias, key, value, allowed, additive, scale, block_m, block_n):
    """The C++ forward: output (compute dtype) and log-sum-exp; arguments as ``_forward``'s. The operator builds
    scale G_i q_i and sqrt(scale) U_i itself, row by row."""
    operands = _cpp_operands(query, factors, alpha, bias, key, value)
    return tuple(_loaded_cpu_operator().forward(*operands, allowed, additive, scale, block_m, block_n))


def _cpp_backward(query, factors, alpha, bias, key, value, allowed, additive, out, lse, grad_out, scale, block_m,
                  block_n):
    """The C++ backward, the chain rule to the query, factors and alpha included: d query, factors, alpha, bias, key,
    value."""
    operands = _cpp_operands(query, factors, alpha, bias, key, value)
    grads = _loaded_cpu_operator().backward(*operands, allowed, additive, out.contiguous(), lse.contiguous(),
                                            grad_out.to(out.dtype).contiguous(), scale, block_m, block_n)
    d_query, d_factors, d_alpha, d_bias, d_key, d_value = grads
    return d_query, d_factors, d_alpha, d_bias, d_key.to(key.dtype), d_value.to(value.dtype)


def cpp_decode_step(query, factors, key, value, alpha, gamma, scale, attention_mask=None, key_sq=None) -> torch.Tensor:
    """``geodesic_decode_step`` (one query row against the cache, no autograd) on the C++ operator's ``decode``: same
    arguments, same result. The key term's norms are read from ``key_sq`` where the cache keeps them, else computed
    from each key row while it is loaded. Called directly (not as a torch.library custom operator): eager decoding
    is bound by the cost of each call, and under torch.compile the one-token step stays the traced PyTorch one."""
    b, h, _, d = query.shape
    hk, kv_len = key.shape[1], key.shape[2]
    g, gf = h // hk, factors.shape[1] // hk
    compute = compute_dtype(query.dtype, factors.dtype)
    mask = grouped_kernel_mask(attention_mask, 1, kv_len, hk, g, compute) if attention_mask is not None else None
    out = _loaded_cpu_operator().decode(
        query.to(compute).reshape(b, hk, g, 1, d).contiguous(),  # heads h = kv_head * g + j (repeat_kv's order)
        factors.to(compute).reshape(b, hk, gf, 1, factors.shape[-2], d).contiguous(),
        alpha.to(compute).view(hk, g).contiguous(), gamma.to(compute).view(hk, g).contiguous(),
        None if key_sq is None else key_sq.to(compute).contiguous(),
        key.to(compute).contiguous(), value.to(compute).contiguous(),
        *(mask if mask is not None else (None, None)), scale,
    )
    return out.to(value.dtype).view(b, h, 1, d)


def woodbury_step(update: torch.Tensor, factors: torch.Tensor, beta: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """``woodbury_precondition`` (the MLP's step M_i^{-1} update, docs/design.md 1.3), on the C++ operator's
    ``woodbury`` in CPU inference outside torch.compile where ``kernel`` (config.fiber_attention_kernel) is "auto" or
    "cpp" and the operator is built here and has passed its self-check for this dtype and rank; else the PyTorch
    function (training keeps it: its gradient is autograd's, and a compiled graph fuses its elementwise ops)."""
    if (kernel in ("auto", "cpp") and update.device.type == "cpu" and update.dtype in CPU_KERNEL_DTYPES
            and not gradients_flow(update, factors, beta) and not torch.compiler.is_compiling()
            and woodbury_passes_self_check(compute_dtype(update.dtype, factors.dtype), factors.shape[-2])):
        return _cpp_woodbury(update, factors, beta)
    return woodbury_precondition(update, factors, beta)


def _cpp_woodbury(update, factors, beta) -> torch.Tensor:
    compute = compute_dtype(update.dtype, factors.dtype)
    dim, r = update.shape[-1], factors.shape[-2]
    out = _loaded_cpu_operator().woodbury(update.to(compute).reshape(-1, dim).contiguous(),
                                          factors.to(compute).reshape(-1, r, dim).contiguous(), float(beta))
    return out.view(update.shape).to(update.dtype)


_woodbury_verdicts: dict = {}  # (compute dtype, rank) -> whether the C++ woodbury passed its self-check here


def woodbury_passes_self_check(dtype: torch.dtype, rank: int) -> bool:
    """Whether ``woodbury_step`` uses the C++ ``woodbury`` for this compute dtype and rank: built here, and on first
    use equal to ``woodbury_precondition`` in float64 on a random problem within ``KERNEL_TOLERANCE`` (else one warning,
    and the PyTorch function from then on)."""
    if cpu_operator() is None:
        return False
    if (dtype, rank) not in _woodbury_verdicts:
        gen = torch.Generator().manual_seed(0)
        update = torch.randn(5, 96, generator=gen, dtype=torch.float64)
        factors = bounded_factors(torch.randn(5, rank, 96, generator=gen, dtype=torch.float64))
        beta = torch.tensor([0.7], dtype=torch.float64)
        try:
            error = relative_error(_cpp_woodbury(update.to(dtype), factors.to(dtype), beta),
                                   woodbury_precondition(update, factors, beta))
        except Exception as exc:  # noqa: BLE001  a failing operator falls back safely
            error, detail = float("inf"), f"it raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        else:
            detail = f"its largest relative difference from woodbury_precondition is {error:.3g}"
        _woodbury_verdicts[(dtype, rank)] = error <= KERNEL_TOLERANCE[dtype]
        if not _woodbury_verdicts[(dtype, rank)]:
            warnings.warn(f"The C++ step of the metric-preconditioned MLP failed its self-check ({dtype}, r={rank}): "
                          f"{detail}. This process uses the PyTorch function for it from now on; set "
                          "config.fiber_attention_kernel='pytorch' to use it without the check.", RuntimeWarning,
                          stacklevel=2)
    return _woodbury_verdicts[(dtype, rank)]


def _loaded_cpu_operator():
    ops = cpu_operator()
    if ops is None:
        raise RuntimeError(f"The fused C++ geodesic attention cannot run here ({_cpu_operator['why']}): set "
                           "fiber_attention_kernel='auto' or 'pytorch' (the blocked PyTorch path).")
    return ops


cpp_forward_op, cpp_backward_op = _define_operators(
    "geodesic_cpp", lambda *args: _cpp_forward(*args), lambda *args: _cpp_backward(*args))


def cpp_geodesic_attention(
    query, factors, key, value, alpha, gamma, scale, attention_mask=None, block_size=64, dropout=None, *, tiles=None,
    key_sq=None,
) -> torch.Tensor:
    """``blocked_geodesic_attention`` on the fused C++ operator: same arguments, same result (``block_size`` unused:
    the operator's tiles are ``CPU_TILES`` or ``tiles`` = (query tile, key tile)). CPU tensors; ``dropout`` must be
    None (the operator has no attention dropout)."""
    if dropout is not None:
        raise ValueError("The C++ geodesic attention has no attention dropout: pass dropout=None, or use "
                         "blocked_geodesic_attention (fiber_attention_kernel='pytorch').")
    if query.device.type != "cpu":
        raise ValueError(f"The C++ geodesic attention runs on CPU tensors, got tensors on {query.device}: set "
                         "fiber_attention_kernel='auto' (Triton on a GPU) or 'pytorch'.")
    if query.shape[2] == 1 and not gradients_flow(query, factors, key, value, alpha, gamma) \
            and not torch.compiler.is_compiling():
        return cpp_decode_step(query, factors, key, value, alpha, gamma, scale, attention_mask, key_sq)
    return fused_forward(cpp_forward_op, tiles or CPU_TILES, query, factors, key, value, alpha, gamma, scale,
                         attention_mask, key_sq)


# ---------------------------------------------------------------------------------------------------------------------
# The self-check before first use (fiber_attention_kernel="auto"; docs/design.md 1.5)
# ---------------------------------------------------------------------------------------------------------------------
# The kernel's tolerance against the blocked path in float64, per input dtype: max |kernel - exact| <= tolerance *
# max |exact| over each whole tensor (the output and every gradient). The interpreter tests (tests/
# test_triton_attention.py) and the self-check both use it. float32 tiles multiply in full precision ("ieee"), so
# only float32 roundings of sums remain; 16-bit inputs have their pseudo-query tiles and probabilities rounded to the
# input dtype before their products (8 significant bits in bfloat16, 11 in float16).
KERNEL_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 1e-2}
# the self-check's problem: a few hundred tokens, two sequences (one left-padded where the mask allows it), two KV heads
SELF_CHECK_TOKENS = 256
MASK_KINDS = ("causal", "none", "boolean", "float")
GRADIENT_NAMES = ("query", "factors", "key", "value", "alpha", "gamma")


class KernelSignature(NamedTuple):
    """What the self-check of "auto" is keyed by: each field selects a different compiled variant of the kernels or a
    different way of running them (``kernel_signature`` reads them off a call)."""

    device: str  # "cuda", or "cpu" (Triton's interpreter, in the tests)
    capability: tuple[int, int] | None  # the CUDA compute capability, e.g. (9, 0); None on the CPU
    dtype: torch.dtype  # of query, key and value
    rank: int  # r, rows of each token's factors
    head_dim: int
    group_size: int  # query heads per KV head (GQA)
    shared_factors: bool  # one set of factors per KV group (True) or per query head
    mask: str  # one of MASK_KINDS: "causal" (None, q > 1), "none" (None, one query row), "boolean", "float"
    training: bool  # gradients flow: the backward kernels run too
    backend: str = "triton"  # "triton" (the Triton kernels) or "cpp" (the C++ operator, on the CPU)

    def describe(self) -> str:
        where = "CPU (Triton's interpreter)" if self.capability is None else (
            f"CUDA capability {self.capability[0]}.{self.capability[1]}")
        if self.backend == "cpp":
            where = "CPU"
        factors = "factors shared by each KV group" if self.shared_factors else "factors per head"
        return (f"{where}, {str(self.dtype).removeprefix('torch.')}, r={self.rank}, head_dim={self.head_dim}, "
                f"GQA group {self.group_size} ({factors}), {self.mask} mask, "
                f"{'training (forward and backward)' if self.training else 'inference (forward)'}")


def mask_kind(attention_mask, q_len) -> str:
    """Which of ``MASK_KINDS`` a mask as transformers passes it is (the kernel's CAUSAL / HAS_ALLOWED / HAS_ADD)."""
    if attention_mask is None:
        return "causal" if q_len > 1 else "none"
    if hasattr(attention_mask, "mask_mod") or attention_mask.dtype == torch.bool:  # flex's BlockMask is read as bool
        return "boolean"
    return "float"


def kernel_signature(query, factors, key, attention_mask, training: bool, backend: str = "triton") -> tuple:
    """The arguments of ``kernel_passes_self_check`` for one call (python constants, so that under ``torch.compile``
    the decision is a constant of the graph): query (B, H, q, d), factors (B, Hf, q, r, d), key (B, Hk, kv, d)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    return (query.device.type, query.device.index, query.dtype, factors.shape[-2], query.shape[-1],
            heads // kv_heads, factors.shape[1] != heads, mask_kind(attention_mask, query.shape[2]), bool(training),
            backend)


def kernel_tolerances(dtype: torch.dtype, head_dim: int) -> dict[str, float]:
    """``KERNEL_TOLERANCE`` for the output and each gradient. gamma's is sqrt(d/2) times wider: d gamma =
    -(scale/2) sum_j ||k_j||^2 d bias_j with sum_j d bias_j = 0 per row, terms of size ~d that cancel to a result of
    size ~sqrt(2 d), so rounding weighs sqrt(d/2) times more there (in the blocked path's float32 as well)."""
    base = KERNEL_TOLERANCE[dtype]
    return {"output": base, **{name: base * (max(1.0, (head_dim / 2) ** 0.5) if name == "gamma" else 1.0)
                               for name in GRADIENT_NAMES}}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| over the whole tensor (inf where ``actual`` is not finite)."""
    if not torch.isfinite(actual).all():
        return float("inf")
    err = (actual.to(torch.float64) - expected.to(torch.float64)).abs().max().item()
    return err / max(expected.abs().max().item(), 1e-30)


def self_check_problem(signature: KernelSignature, tokens: int = SELF_CHECK_TOKENS, seed: int = 0):
    """A random problem of ``signature`` in float64 on the CPU: [query (2, 2 g, q, d), factors (2, Hf, q, r, d), key,
    value (2, 2, kv, d), alpha, gamma (2 g,)] and the allowed-key mask (2, 1, q, kv) or None. q = kv = ``tokens``
    (q = 1 for the "none" kind); with a mask, the second sequence's first tokens / 8 keys are padding, so its first
    rows attend to nothing. Drawn from its own generator (the caller's random state is left alone)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    b, hk, d, r, g = 2, 2, signature.head_dim, signature.rank, signature.group_size
    h = hk * g
    q_len = 1 if signature.mask == "none" else tokens
    query, key, value = randn(b, h, q_len, d), randn(b, hk, tokens, d), randn(b, hk, tokens, d)
    factors = bounded_factors(randn(b, hk if signature.shared_factors else h, q_len, r, d))  # spectral norm < 1
    alpha = 0.9 * torch.rand(h, generator=gen, dtype=torch.float64) - 0.3  # gates awake, some negative
    gamma = torch.rand(h, generator=gen, dtype=torch.float64)
    allowed = None
    if signature.mask in ("boolean", "float"):
        allowed = torch.ones(q_len, tokens, dtype=torch.bool).tril(tokens - q_len)[None, None].repeat(b, 1, 1, 1)
        allowed[1, :, :, : tokens // 8] = False  # left padding
    return [query, factors, key, value, alpha, gamma], allowed


def check_kernel(signature: KernelSignature, device: torch.device, tokens: int = SELF_CHECK_TOKENS,
                 seed: int = 0) -> dict[str, float]:
    """The kernel against the blocked path on a random problem of ``signature`` (``self_check_problem``) on
    ``device``: the ``relative_error`` of the output and, in training, of every input's gradient under a random
    weighting of the output (for the C++ operator in inference, the output of each sequence's last row alone too: the
    one-token ``decode``). The kernel gets query, key and value in the signature's dtype and the factors and gates
    in float32 (as the model passes them); the blocked path gets the very same values in float64, so the errors are
    the kernel's own rounding. Exceptions of the kernel (a Triton compile error, a launch failure) propagate."""
    exact, allowed = self_check_problem(signature, tokens, seed)
    geometry = torch.promote_types(signature.dtype, torch.float32)  # factors and gates: float32, or float64
    low_dtypes = [signature.dtype, geometry, signature.dtype, signature.dtype, geometry, geometry]
    training = signature.training
    with torch.autocast(device.type, enabled=False), torch.set_grad_enabled(training):
        inputs = [t.to(device, dtype).requires_grad_(training) for t, dtype in zip(exact, low_dtypes)]
        references = [t.detach().to(torch.float64).requires_grad_(training) for t in inputs]
        kernel_mask = reference_mask = None if allowed is None else allowed.to(device)
        if signature.mask == "float":  # a 4-D float mask: arbitrary values added, the dtype's minimum where blocked
            values = torch.randn(allowed.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
            kernel_mask = values.to(signature.dtype).masked_fill(~allowed.to(device), torch.finfo(signature.dtype).min)
            blocked = ~allowed.to(device)
            reference_mask = kernel_mask.to(torch.float64).masked_fill(blocked, torch.finfo(torch.float64).min)
        scale = signature.head_dim**-0.5
        fused = cpp_geodesic_attention if signature.backend == "cpp" else triton_geodesic_attention
        out = fused(*inputs, scale, kernel_mask)
        ref = blocked_geodesic_attention(*references, scale, reference_mask)
        errors = {"output": relative_error(out, ref)}
        if signature.backend == "cpp" and not training and out.shape[2] > 1:
            # generation's one-token steps run the operator's decode: checked on each sequence's last row too
            rows = [t[:, :, -1:].contiguous() for t in inputs[:2]], [t[:, :, -1:].contiguous() for t in references[:2]]
            last_out = fused(*rows[0], *inputs[2:], scale, None if kernel_mask is None else kernel_mask[..., -1:, :])
            last_ref = blocked_geodesic_attention(*rows[1], *references[2:], scale,
                                                  None if reference_mask is None else reference_mask[..., -1:, :])
            errors["output"] = max(errors["output"], relative_error(last_out, last_ref))
        if training:
            weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
            weight = weight.to(device)
            grads = torch.autograd.grad((out.to(torch.float64) * weight).sum(), inputs)
            ref_grads = torch.autograd.grad((ref * weight).sum(), references)
            errors.update({name: relative_error(grad, expected)
                           for name, grad, expected in zip(GRADIENT_NAMES, grads, ref_grads)})
    return errors


# The verdict of each signature met in this process: True (the kernel passed its self-check), False (it failed; the
# blocked path runs for that signature). One dict per loaded copy of this file, like the operators' namespace.
_verdicts: dict[KernelSignature, bool] = {}


@torch.compiler.assume_constant_result
def kernel_passes_self_check(device_type: str, device_index: int | None, dtype: torch.dtype, rank: int,
                             head_dim: int, group_size: int, shared_factors: bool, mask: str, training: bool,
                             backend: str = "triton") -> bool:
    """Whether "auto" runs the kernel for this signature (the arguments of ``KernelSignature`` less the capability,
    read here from the device): the first call of a signature runs ``check_kernel`` and remembers its verdict in
    ``_verdicts``; a failure (an error above ``KERNEL_TOLERANCE`` or an exception) warns once and answers False.

    Why ``assume_constant_result``: under ``torch.compile`` this runs once while the graph is traced, outside the
    traced region, and its answer is a constant of the graph (no graph break, no recompile per step; every field of
    the signature is something the graph already guards on: device, dtype, shapes, mask type, grad mode)."""
    device = torch.device(device_type, device_index)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    signature = KernelSignature(device.type, capability, dtype, rank, head_dim, group_size, shared_factors, mask,
                                training, backend)
    if backend == "cpp" and cpu_operator() is None:
        return False  # not built here: ``cpu_operator`` said why, once
    if signature not in _verdicts:
        _verdicts[signature] = _self_check(signature, device)
    return _verdicts[signature]


def _self_check(signature: KernelSignature, device: torch.device) -> bool:
    """Run ``check_kernel``; on a failure, one warning naming the signature, what failed and the two ways out."""
    tolerances = kernel_tolerances(signature.dtype, signature.head_dim)
    try:
        # why the identity hooks: the first call of a signature may come inside a checkpointed layer (gradient
        # checkpointing), whose saved-tensor hooks would otherwise take the check's own autograd graph for the layer's
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            errors = check_kernel(signature, device, SELF_CHECK_TOKENS)
    except Exception as exc:  # noqa: BLE001  a compile error, OutOfResources, a bad launch: fall back safely
        message = " ".join(str(exc).split())
        detail = f"the kernel raised {type(exc).__name__}: {message[:300]}{'...' if len(message) > 300 else ''}"
    else:
        worst = max(errors, key=lambda name: errors[name] / tolerances[name])
        if all(errors[name] <= tolerances[name] for name in errors):
            return True
        detail = (f"its largest relative difference from the blocked PyTorch path is {errors[worst]:.3g} in the "
                  f"{worst if worst == 'output' else worst + ' gradient'} (tolerance {tolerances[worst]:.3g})")
    name = "C++ operator" if signature.backend == "cpp" else "Triton kernel"
    warnings.warn(
        f"The fused {name} of the geodesic attention failed its self-check on {signature.describe()}: {detail}. This "
        "process uses the blocked PyTorch path (the same function, slower) for that case from now on. Set "
        "config.fiber_attention_kernel='pytorch' to use it without the check (and without this warning), or "
        f"fiber_attention_kernel='{signature.backend}' to force it anyway.",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


__all__ = ["CPU_KERNEL_DTYPES", "KERNEL_DTYPES", "KERNEL_TOLERANCE", "OP_NAMESPACE", "KernelSignature", "check_kernel",
           "cpp_backward_op", "cpp_forward_op", "cpp_geodesic_attention", "cpu_operator", "geodesic_backward_op",
           "geodesic_forward_op", "kernel_passes_self_check", "triton_available", "triton_geodesic_attention",
           "use_cpp_kernel", "use_triton_kernel"]
