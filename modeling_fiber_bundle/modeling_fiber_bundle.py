"""PyTorch Fiber Bundle Transformer: a LLaMA-family decoder whose tokens carry their own low-rank Riemannian metric.

Per layer (section 1 of docs/design.md in the Fiber Bundle Transformers repository):
    z_i   = act(W_z RMSNorm(x_i))                               the fibre code (``fiber.code_proj``)
    U_i   = bounded(W_U z_i) in R^{d x r} per head / KV group   attention metric factors (``fiber.attn_factor_proj``)
    G_i   = I + alpha U_i U_i^T,  alpha = exp(theta) - 1        (``fiber.attn_gate`` holds theta)
    s_ij  = scale [(G_i q_i).k_j - gamma/2 ||k_j||^2 - alpha/2 ||U_i^T k_j||^2]   (``fiber.flatness_gate`` is gamma)
    x_i  <- x_i + M_i^{-1} MLP(RMSNorm(x_i)),  M_i = I + beta V_i V_i^T,  beta = exp(phi) - 1   (``fiber.ffn_gate``)

Backbone modules keep transformers' names (``q_proj``, ``gate_proj``, ``input_layernorm``, ...); all new parameters sit in
one submodule per layer, ``model.layers.{i}.fiber``. With every gate at 0 the model is exactly its backbone.

Only torch, transformers and sibling files are imported: this file is copied into every published Hub folder.
"""

import math
import re
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.dynamic_module_utils import custom_object_save
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .configuration_fiber_bundle import FiberBundleConfig
from .fiber_attention import (
    anisotropy,
    apply_rotary,
    blocked_attention_probs,
    blocked_geodesic_attention,
    bounded_factors,
    compute_dtype,
    curvature_proxy,
    draw_dropout,
    key_norms,
    mask_terms,
    metric_gate,
    reference_geodesic_attention,
    rotate_factors,
    torsion_proxy,
    zero_empty_rows,
)
from .fused_attention import (
    cpp_geodesic_attention,
    triton_geodesic_attention,
    use_cpp_kernel,
    use_triton_kernel,
    woodbury_step,
)

GEOMETRY_KEYS = ("curvature", "torsion", "anisotropy")


def _pop_deprecated_cache(cache, kwargs):
    """Accept ``past_key_values`` as an alias of ``cache``, with a FutureWarning: it is the cache's name in
    transformers before 5.24, which code written against those releases still passes."""
    if "past_key_values" in kwargs:
        legacy = kwargs.pop("past_key_values")
        warnings.warn(
            "`past_key_values` is deprecated for Fiber Bundle models; pass the cache as `cache=` (transformers 5.24 "
            "naming).",
            FutureWarning,
            stacklevel=3,
        )
        if cache is None:
            cache = legacy
    return cache


# ----------------------------------------------------------------------------------------------------------------------
# Backbone helpers
# ----------------------------------------------------------------------------------------------------------------------
class FiberBundleRMSNorm(nn.Module):
    # Copied from transformers 5.24 models/llama/modeling_llama.py (LlamaRMSNorm)
    def __init__(self, hidden_size, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FiberBundleRotaryEmbedding(nn.Module):
    # LlamaRotaryEmbedding of transformers 5.24 (models/llama/modeling_llama.py) with one method more,
    # ``factor_rotation``: the metric factors turn with their token as q and k do, but by the pure rotation
    def __init__(self, config: FiberBundleConfig):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings  # read and updated by dynamic_rope_update
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")  # one of ROPE_TYPES (the config checks)
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        # not dead: dynamic_rope_update reads it (dynamic types reset to it below the original length, longrope
        # picks it as the short factors)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: FiberBundleConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    def _angles(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return torch.cat((freqs, freqs), dim=-1)  # (B, n, d), float32

    @dynamic_rope_update  # dynamic and longrope types update inv_freq (and attention_scaling) from the positions
    def forward(self, x, position_ids):
        emb = self._angles(x, position_ids)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def factor_rotation(self, x, position_ids):
        """cos, sin (B, n, d) of the pure rotation, in at least float32, for the metric factors. Call after ``forward``
        (which updates a dynamic type's frequencies). Why not forward's: its ``attention_scaling`` (YaRN, longrope)
        would scale the factors past spectral norm 1, and in bf16 its rounded cos/sin are no rotation."""
        emb = self._angles(x, position_ids)
        dtype = compute_dtype(x.dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class FiberBundleMLP(nn.Module):
    # Copied from transformers 5.24 models/llama/modeling_llama.py (LlamaMLP)
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    # Copied from transformers 5.24 models/llama/modeling_llama.py
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    # LLaMA's eager attention (transformers 5.24 models/llama/modeling_llama.py), the backbone's attention where
    # metric_rank == 0, reading masks as the geodesic paths do: blocked entries clamped, empty rows attending to nothing
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        # why the clamp: the mask's dtype minimum plus a negative score overflows to -inf (NaN rows in float64)
        attn_weights = (attn_weights + attention_mask).clamp_min(torch.finfo(attn_weights.dtype).min)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))
    allowed = mask_terms(attention_mask, query.shape[2], key.shape[2]).allowed
    attn_weights = zero_empty_rows(attn_weights, allowed).to(query.dtype)  # padding rows attend to nothing
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


# ----------------------------------------------------------------------------------------------------------------------
# The fibre: per-token metric generators and gates
# ----------------------------------------------------------------------------------------------------------------------
class FiberState(NamedTuple):
    """What the fibre module hands to attention and MLP for one layer (factors row-wise, in the token's own frame)."""

    # factors and gates in at least float32 (docs/design.md 1.1: SPD in every dtype the model runs in)
    attn_factors: torch.Tensor | None  # (B, Hf, n, r, d), spectral norm < 1
    alpha: torch.Tensor | None  # (H,)  alpha = exp(theta) - 1 >= GATE_FLOOR > -1
    gamma: torch.Tensor | None  # (H,)
    ffn_factors: torch.Tensor | None  # (B, n, r_f, D), spectral norm < 1 (built when no update is given)
    beta: torch.Tensor | None  # (1,)  beta = exp(phi) - 1 >= GATE_FLOOR > -1
    ffn_update: torch.Tensor | None = None  # M_i^{-1} update (B, n, D), when the forward was given the MLP's update


class AttentionMetric(NamedTuple):
    """Everything a layer's geodesic attention reads of the geometry, as one argument (docs/design.md 1.1, 1.2, 1.4).

    ``FiberBundleModel`` builds the part every layer shares once per forward (``rotation``, ``token_mask``); each layer
    adds its own factors and gates (``FiberBundleDecoderLayer.fiber_state``). A tuple of tensors, so that
    torch.compile, torch.export and gradient checkpointing pass it through as they pass ``position_embeddings``.
    """

    # cos, sin (B, n, d) of the pure rotation (``FiberBundleRotaryEmbedding.factor_rotation``): each token's factors
    # turn with its query
    rotation: tuple[torch.Tensor, torch.Tensor]
    token_mask: torch.Tensor | None = None  # (B, n) bool, the real tokens: what the geometry proxies average over
    factors: torch.Tensor | None = None  # (B, Hf, n, r, d) in each token's own frame (``FiberState.attn_factors``)
    alpha: torch.Tensor | None = None  # (H,)
    gamma: torch.Tensor | None = None  # (H,)


class FiberBundleMetric(nn.Module):
    """All new parameters of one layer: the fibre code, the factor generators and the gates.

    Everything is returned by ``forward`` (not read as attributes) so that wrappers such as PEFT's ``modules_to_save``
    see and train the copy they hold.
    """

    def __init__(self, config: FiberBundleConfig):
        super().__init__()
        self.metric_rank = config.metric_rank
        self.ffn_metric_rank = config.ffn_metric_rank
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self.factor_heads = (
            config.num_attention_heads if config.metric_factor_sharing == "head" else config.num_key_value_heads
        )
        self.code_proj = nn.Linear(config.hidden_size, config.metric_hidden, bias=False)  # W_z
        self.code_act = nn.Identity() if config.metric_act == "identity" else ACT2FN[config.metric_act]
        if self.metric_rank > 0:
            self.attn_factor_proj = nn.Linear(  # W_U
                config.metric_hidden, self.factor_heads * self.metric_rank * self.head_dim, bias=True
            )
            self.attn_gate = nn.Parameter(torch.zeros(config.num_attention_heads))  # theta
            self.flatness_gate = nn.Parameter(torch.zeros(config.num_attention_heads))  # gamma
        if self.ffn_metric_rank > 0:
            self.ffn_factor_proj = nn.Linear(  # W_V
                config.metric_hidden, self.ffn_metric_rank * config.hidden_size, bias=True
            )
            # phi, of shape (1,): torch's FSDP2 (``fully_shard``) refuses 0-dim parameters. A checkpoint holding it as
            # a 0-dim tensor still loads (``ZERO_DIM_GATES``)
            self.ffn_gate = nn.Parameter(torch.zeros(1))
            self.register_load_state_dict_pre_hook(_gates_from_zero_dim)

    def forward(self, normed_hidden: torch.Tensor, part: str = "all", update: torch.Tensor | None = None,
                kernel: str = "auto") -> FiberState:
        """The layer's metric field: every token's factors and the gates, of ``part`` ("attention", "ffn" or "all"; None
        for the other part and for a part whose rank is 0). Given the MLP's ``update`` (B, n, D), the MLP part is the
        preconditioned step M_i^{-1} update (``ffn_update``, docs/design.md 1.3) instead of the factors: computed here,
        while wrappers that hold this module's weights only during its forward (accelerate's offload hooks, FSDP) hold
        them; ``kernel`` (config.fiber_attention_kernel) says whether CPU inference may run it on the C++ operator
        (``woodbury_step``)."""
        b, n, _ = normed_hidden.shape
        if self.code_proj.weight.is_floating_point():  # kept in float32 under a float16 load (_keep_in_fp32_modules)
            normed_hidden = normed_hidden.to(self.code_proj.weight.dtype)
        code = self.code_act(self.code_proj(normed_hidden))  # z: (B, n, m)
        attn_factors = alpha = gamma = ffn_factors = beta = ffn_update = None
        if self.metric_rank > 0 and part != "ffn":
            # -1: the factor heads this module computes (all of them, or this rank's under tensor parallelism)
            raw = self.attn_factor_proj(code).view(b, n, -1, self.metric_rank, self.head_dim)
            attn_factors = bounded_factors(raw.transpose(1, 2))  # (B, Hf, n, r, d)
            alpha = metric_gate(self.attn_gate)
            gamma = self.flatness_gate
        if self.ffn_metric_rank > 0 and part != "attention":
            beta = metric_gate(self.ffn_gate)
            raw = self.ffn_factor_proj(code).view(b, n, self.ffn_metric_rank, self.hidden_size)
            ffn_factors = bounded_factors(raw)  # (B, n, r_f, D)
            if update is not None:
                ffn_update = woodbury_step(update, ffn_factors, beta, kernel)
        return FiberState(attn_factors, alpha, gamma, ffn_factors, beta, ffn_update)


# Gates of shape (1,) that a checkpoint may hold as 0-dim tensors (the shape FSDP2 cannot shard). One conversion,
# ``gate_to_one_dim``, reaches them on each of the two ways a checkpoint enters the model, because neither way runs the
# other's mechanism: transformers' ``from_pretrained`` sets every parameter itself and calls no ``load_state_dict``
# hook, but applies the weight conversions registered for this model type (``GateToOneDim``, registered below); torch's
# ``load_state_dict`` (PEFT's adapter loading, a user's own state dict) knows no transformers conversion, but runs the
# module's pre-hook (``_gates_from_zero_dim``, registered by ``FiberBundleMetric``).
ZERO_DIM_GATES = ("ffn_gate",)


def gate_to_one_dim(tensor: torch.Tensor) -> torch.Tensor:
    """A gate of ``ZERO_DIM_GATES`` as the model holds it: a 0-dim tensor becomes shape (1,); any other passes."""
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _gates_from_zero_dim(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook of ``FiberBundleMetric``: ``gate_to_one_dim`` on each gate of ``ZERO_DIM_GATES``."""
    for name in ZERO_DIM_GATES:
        value = state_dict.get(prefix + name)
        if value is not None:
            state_dict[prefix + name] = gate_to_one_dim(value)


class GateToOneDim(ConversionOps):
    """``from_pretrained``'s weight conversion of a gate of ``ZERO_DIM_GATES``: ``gate_to_one_dim``. Its own reverse:
    ``save_pretrained`` writes the (1,) shape."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (value,) = input_dict.values()
        return {target_patterns[0]: gate_to_one_dim(value[0] if isinstance(value, list) else value)}

    @property
    def reverse_op(self) -> ConversionOps:
        return self


# transformers looks a model's weight conversions up by class name, then by model type. Every copy of this file
# registers the same conversion (a Hub folder's remote code is imported under its own module name): hence overwrite.
register_checkpoint_conversion_mapping(
    FiberBundleConfig.model_type,
    [WeightConverter(f"fiber.{name}", f"fiber.{name}", operations=[GateToOneDim()]) for name in ZERO_DIM_GATES],
    overwrite=True,
)


def expand_factors(factors: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, Hf, n, r, d) -> (B, H, n, r, d): a KV group's factors serve each of its query heads (repeat_kv order)."""
    b, hf, n, r, d = factors.shape
    if hf == num_heads:
        return factors
    return factors[:, :, None].expand(b, hf, num_heads // hf, n, r, d).reshape(b, num_heads, n, r, d)


# ----------------------------------------------------------------------------------------------------------------------
# Attention, decoder layer
# ----------------------------------------------------------------------------------------------------------------------
# The key term's ||k_j||^2, computed once when a key enters the cache rather than over every cached key at each decoding
# step: cache layer -> (weak reference to the keys tensor the norms describe, that tensor's in-place version, the
# norms (B, Hk, kv)). A weak map beside transformers' objects: nothing is added to them, nothing outlives them.
_KEY_NORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _appending_layer(cache: Cache, layer_idx: int):
    """The cache's layer ``layer_idx`` where its update is known to append (a plain ``DynamicLayer``: its keys become
    torch.cat((old keys, new keys)), returned as stored); None for every other layer or cache (sliding windows, static,
    quantized, offloaded and paged caches), whose attention computes the norms itself."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or layer_idx >= len(layers) or type(layers[layer_idx]) is not DynamicLayer:
        return None
    return layers[layer_idx]


def update_cache(cache: Cache, layer_idx: int, key_states, value_states, kwargs, keep_key_norms: bool):
    """``cache.update``, returning the keys and values to attend to and, where ``keep_key_norms`` (inference outside
    torch.compile) and the layer appends (``_appending_layer``), their ``key_norms`` (B, Hk, kv) in at least float32:
    the new keys' norms appended to those kept for the layer's previous keys, or all of them computed afresh when the
    layer's keys were replaced or edited in place since (beam reordering, cropping, a reset). Otherwise None."""
    layer = _appending_layer(cache, layer_idx) if keep_key_norms else None
    previous = getattr(layer, "keys", None) if layer is not None and layer.is_initialized else None
    keys, values = cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
    if not keep_key_norms:
        return keys, values, None
    layer = _appending_layer(cache, layer_idx)
    if layer is None or keys is not layer.keys:
        return keys, values, None
    dtype = compute_dtype(keys.dtype)
    record = _KEY_NORMS.get(layer)
    appended = (
        record is not None and previous is not None and record[0]() is previous
        and record[1] == previous._version and record[2].dtype == dtype
        and keys.shape[-2] == previous.shape[-2] + key_states.shape[-2]
    )
    norms = torch.cat((record[2], key_norms(key_states, dtype)), -1) if appended else key_norms(keys, dtype)
    _KEY_NORMS[layer] = (weakref.ref(keys), keys._version, norms)
    return keys, values, norms


def geodesic_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    dropout: float = 0.0,
    factors: torch.Tensor,
    alpha: torch.Tensor,
    gamma: torch.Tensor,
    key_sq: torch.Tensor | None = None,
    kernel: Callable | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Geodesic attention (docs/design.md 1.2) as an attention function with transformers' signature
    (``eager_attention_forward`` and every ``ALL_ATTENTION_FUNCTIONS`` entry), the geometry passed as keywords, run on
    ``kernel``: the blocked path (``blocked_geodesic_attention``, extra memory O(q x block), shared KV-group factors
    unexpanded; None) or a fused one of the same arguments (``triton_geodesic_attention``, ``cpp_geodesic_attention``),
    as ``attention_function`` picks it.

    query (B, H, q, d) and key, value (B, Hk, kv, d) after RoPE and the cache update; factors (B, Hf, q, r, d), each
    query token's factors turned with its pure rotation (``rotate_factors``), Hf = H or Hk; alpha, gamma (H,); key_sq
    the keys' ``key_norms`` (B, Hk, kv) where the cache keeps them (``update_cache``), else None. ``module`` gives the
    query block (``config.attention_block_size``). Returns the output (B, q, H, d) and None: these paths build no
    probabilities (``probabilities_attention_forward`` does).
    """
    attention = blocked_geodesic_attention if kernel is None else kernel
    attn_output = attention(
        query, factors, key, value, alpha, gamma, scaling, attention_mask, module.config.attention_block_size,
        draw_dropout(dropout), key_sq=key_sq,
    )
    return attn_output.transpose(1, 2).contiguous(), None  # (B, q, H, d)


def reference_attention_forward(module, query, key, value, attention_mask, *, scaling, dropout=0.0, factors, alpha,
                                gamma, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``geodesic_attention_forward`` on the readable path (``config.fiber_attention_path == "reference"``): every query
    head with its own factors, keys and values, materialising (B, H, q, r, kv). Returns the output (B, q, H, d) and the
    probabilities (B, H, q, kv)."""
    groups = module.num_key_value_groups
    attn_output, attn_weights = reference_geodesic_attention(
        query, expand_factors(factors, query.shape[1]), repeat_kv(key, groups), repeat_kv(value, groups),
        alpha, gamma, scaling, attention_mask, dropout, module.training,
    )
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def probabilities_attention_forward(module, query, key, value, attention_mask, *, scaling, dropout=0.0, factors,
                                    alpha, gamma, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``geodesic_attention_forward`` where the probabilities are asked for (``output_attentions``): they are
    materialised (as eager attention does) by the blocked path's own block functions, and the output is computed from
    them, so that they carry the gradient of everything downstream. Returns the output (B, q, H, d) and the
    probabilities (B, H, q, kv)."""
    attn_weights = blocked_attention_probs(
        query, factors, key, alpha, gamma, scaling, attention_mask, module.config.attention_block_size,
        draw_dropout(dropout),
    )
    attn_output = torch.matmul(attn_weights, repeat_kv(value, module.num_key_value_groups))  # (B, H, q, d)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def attention_function(config: FiberBundleConfig, query, key, value, attention_mask, dropout: float, operands: dict,
                       output_attentions: bool) -> Callable:
    """The attention function that computes this call, with transformers' signature: the one place that decides the
    attention path (LLaMA's lookup in transformers' attention interface, with the geodesic paths of docs/design.md 1.5).

    ``operands`` are the geometry keywords a layer with an attention metric passes (``factors`` turned, ``alpha``,
    ``gamma``, ``key_sq``), empty for the backbone's attention; ``dropout`` the probability applied (0 in evaluation).
    The first that applies, in this order:

    - no attention metric (metric_rank 0): transformers' function for ``config._attn_implementation`` (eager, sdpa,
      flex, ...);
    - ``config.fiber_attention_path == "reference"``: ``reference_attention_forward``;
    - ``output_attentions``: ``probabilities_attention_forward``;
    - ``geodesic_attention_forward`` on the fused Triton kernel (on a GPU) or C++ operator (on the CPU) where
      ``config.fiber_attention_kernel`` asks for it and, under "auto", it applies and has passed its self-check on this
      call's signature (``use_triton_kernel``, ``use_cpp_kernel``: they also raise where a forced kernel cannot run);
      else on the blocked PyTorch path.

    The blocked path and the C++ operator take a one-token step of inference by their own decode step
    (``geodesic_decode_step``, ``cpp_decode_step``): the same function in the fewest ops, not another path.
    """
    if not operands:
        return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
    if config.fiber_attention_path == "reference":
        return reference_attention_forward
    if output_attentions:
        return probabilities_attention_forward
    factors, alpha, gamma = operands["factors"], operands["alpha"], operands["gamma"]
    call = (config.fiber_attention_kernel, query, dropout, factors, key, attention_mask, (value, alpha, gamma))
    kernel = blocked_geodesic_attention
    if use_triton_kernel(*call):
        kernel = triton_geodesic_attention
    elif use_cpp_kernel(*call):
        kernel = cpp_geodesic_attention
    return partial(geodesic_attention_forward, kernel=kernel)


class FiberBundleAttention(nn.Module):
    """Grouped-query attention whose scores are geodesic distances in the query token's metric (a layer with attention
    factors), or the backbone's own attention through transformers' attention interface (metric_rank == 0): the
    function ``attention_function`` picks."""

    def __init__(self, config: FiberBundleConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_out_bias)
        if config.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE
            self.q_norm = FiberBundleRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = FiberBundleRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        metric: AttentionMetric | None = None,
        output_attentions: bool = False,
        output_geometry: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict | None]:
        """``hidden_states`` is the layer's normalised input and ``metric`` what the attention reads of the layer's
        geometry (``FiberBundleDecoderLayer.fiber_state``; None for the backbone's attention). ``position_embeddings``
        turn q and k as the backbone does; ``metric.rotation`` turns the metric factors. Returns the attention output
        (B, n, D), the probabilities when ``output_attentions``, and the geometry proxies when ``output_geometry``."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)  # (B, n, H, d)
        key_states = self.k_proj(hidden_states).view(hidden_shape)  # (B, n, Hk, d)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hk, n, d)
        if self.config.qk_norm:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)  # (B, H|Hk, n, d)

        geometry = None
        if output_geometry and metric is not None:
            # measured in each token's own frame (before RoPE), where a homogeneous metric is one constant matrix
            geometry = layer_geometry(
                expand_factors(metric.factors, query_states.shape[1]),  # (B, H, n, r, d)
                repeat_kv(key_states, self.num_key_value_groups),  # (B, H, n, d)
                metric.alpha,
                self.config.geometry_block_size,
                metric.token_mask,
            )

        cos, sin = position_embeddings  # (B, n, d)
        query_states = apply_rotary(query_states, cos[:, None], sin[:, None])
        key_states = apply_rotary(key_states, cos[:, None], sin[:, None])
        key_sq = None
        if cache is not None:
            keep_key_norms = metric is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            key_states, value_states, key_sq = update_cache(
                cache, self.layer_idx, key_states, value_states, kwargs, keep_key_norms
            )

        operands = {}
        if metric is not None:
            operands = {
                # turned with the query's pure rotation: U_i^T R_i^T R_j k_j then depends on j - i only
                "factors": rotate_factors(metric.factors, *metric.rotation),  # (B, Hf, n, r, d)
                "alpha": metric.alpha,
                "gamma": metric.gamma,
                "key_sq": key_sq,  # ||k_j||^2 kept by the cache (inference), or None
            }
        dropout = self.attention_dropout if self.training else 0.0
        attention_interface = attention_function(
            self.config, query_states, key_states, value_states, attention_mask, dropout, operands, output_attentions
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **operands,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (B, n, H, d) -> (B, n, H*d)
        return self.o_proj(attn_output), (attn_weights if output_attentions else None), geometry


def layer_geometry(factors, keys, alpha, block_size, token_mask=None) -> dict[str, torch.Tensor]:
    """The connection observables of docs/design.md 1.4 for one layer (scalars)."""
    return {
        "curvature": curvature_proxy(factors, alpha, token_mask),
        "torsion": torsion_proxy(factors, keys.to(factors.dtype), alpha, block_size, token_mask),
        "anisotropy": anisotropy(factors, alpha, token_mask),
    }


class FiberBundleDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: FiberBundleConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = FiberBundleAttention(config=config, layer_idx=layer_idx)
        self.input_layernorm = FiberBundleRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if not config.attention_only:  # attention_only: the rank-collapse studies' layer, attention and skip alone
            self.mlp = FiberBundleMLP(config)
            self.post_attention_layernorm = FiberBundleRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.config = config
        if config.metric_rank > 0 or config.ffn_metric_rank > 0:
            self.fiber = FiberBundleMetric(config)

    def fiber_state(self, normed: torch.Tensor, metric: AttentionMetric | None) -> AttentionMetric | None:
        """``metric`` (the part the model builds once per forward) completed with this layer's attention factors and
        gates, computed from the layer's normalised input: what its attention reads. None where the model passes none
        (metric_rank 0); the MLP part of the layer's metric field is ``precondition``'s.

        In training with ``config.geometry_recompute`` it is checkpointed as a whole: the backward keeps only its input
        and recomputes the O(n d r) intermediates (code, raw factors, bounded map) there."""
        if metric is None:
            return None
        if self._recomputes():
            state = torch.utils.checkpoint.checkpoint(self.fiber, normed, "attention", use_reentrant=False)
        else:
            state = self.fiber(normed, "attention")
        return metric._replace(factors=state.attn_factors, alpha=state.alpha, gamma=state.gamma)

    def _recomputes(self) -> bool:
        """Whether the metric's intermediates are recomputed in the backward: ``geometry_recompute`` in training mode
        with gradients enabled. Why training mode too: recomputation is a training matter, and an eval-mode trace with
        gradients on (``torch.export``) cannot take a checkpoint."""
        return self.config.geometry_recompute and self.training and torch.is_grad_enabled()

    def precondition(self, normed: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """The metric-preconditioned step M_i^{-1} update (docs/design.md 1.3), Woodbury inverse, never D x D, computed
        by the fibre module from the layer's normalised input (the code the attention's metric reads).

        Checkpointed with its factors when recomputing: the backward keeps only ``normed`` and ``update``, since the
        (n, r_f, D) factors and the step's intermediates would be most of the metric's saved activations."""
        if self._recomputes():
            return torch.utils.checkpoint.checkpoint(lambda n, u: self.fiber(n, "ffn", u).ffn_update, normed, update,
                                                     use_reentrant=False)
        return self.fiber(normed, "ffn", update, self.config.fiber_attention_kernel).ffn_update

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        metric: AttentionMetric | None = None,
        output_attentions: bool = False,
        output_geometry: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict | None]:
        """``metric`` is the geometry every layer shares (``FiberBundleModel`` builds it; None where metric_rank == 0),
        which the layer completes with its own factors and gates for its attention (``fiber_state``)."""
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)
        hidden_states, attn_weights, geometry = self.self_attn(
            normed,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            metric=self.fiber_state(normed, metric),
            output_attentions=output_attentions,
            output_geometry=output_geometry,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        if self.config.attention_only:
            return hidden_states, attn_weights, geometry

        residual = hidden_states
        update = self.mlp(self.post_attention_layernorm(hidden_states))
        if self.config.ffn_metric_rank > 0:  # x <- x + M^{-1} MLP(RMSNorm(x))
            update = self.precondition(normed, update)
        hidden_states = residual + update
        return hidden_states, attn_weights, geometry


# ----------------------------------------------------------------------------------------------------------------------
# Pretrained model classes
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class FiberBundleModelOutputWithPast(BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus ``geometry``: per-layer curvature, torsion and anisotropy proxies, each a
    tensor of shape (num_metric_layers,), when called with ``output_geometry=True``."""

    geometry: dict[str, torch.Tensor] | None = None


@dataclass
class FiberBundleCausalLMOutputWithPast(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``geometry`` (see ``FiberBundleModelOutputWithPast``)."""

    geometry: dict[str, torch.Tensor] | None = None


class FiberBundlePreTrainedModel(PreTrainedModel):
    config_class = FiberBundleConfig
    config: FiberBundleConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["FiberBundleDecoderLayer"]
    # The metric stays in full precision: bitsandbytes 4/8-bit loading leaves these modules unquantised (its skip list
    # matches a module name's suffix: hence the fiber Linears by name) and a float16 load keeps them in float32 (its
    # dtype plan searches parameter names: "fiber" covers the gates too). They train beside a quantised backbone.
    _keep_in_fp32_modules = ["fiber", "fiber.code_proj", "fiber.attn_factor_proj", "fiber.ffn_factor_proj"]
    _supports_sdpa = True  # metric_rank == 0 dispatches to sdpa; geodesic layers accept sdpa and eager masks
    _supports_flash_attn = False
    _supports_flex_attn = True  # metric_rank == 0 dispatches to flex; geodesic layers read its BlockMask
    _supports_attention_backend = False
    _can_compile_fullgraph = True  # static cache + torch.compile(fullgraph=True): tested, no graph break
    _can_record_outputs = None

    def init_parallel_plans(self) -> None:
        super().init_parallel_plans()
        # the config's tensor-parallel plan names optional modules (Qwen3's q/k norms, each part of the metric): keep
        # the rules that name something this model has, so that a tensor-parallel load warns of no unused rule
        # (assigned, not set through the validating `tp_plan` setter: a torch without distributed registers no style)
        names = chain(self.named_modules(), self.named_parameters())
        names = {re.sub(r"\.\d+(\.|$)", r".*\1", name) for name, _ in names}  # layer numbers as the rules write them
        self._tp_plan = {rule: style for rule, style in self._tp_plan.items() if rule in names}

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        # transformers would split a head between two ranks (its colwise style allows a shorter last slice) and fail
        # later in a reshape: say so before anything is sharded
        tp_size = getattr(distributed_config, "tp_size", None) or 1
        heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        if tp_size > 1 and (heads % tp_size or kv_heads % tp_size):
            fits = [size for size in range(2, kv_heads + 1) if kv_heads % size == 0]
            raise ValueError(
                f"Tensor parallelism splits attention by head: num_attention_heads ({heads}) and num_key_value_heads "
                f"({kv_heads}) must be multiples of tp_size ({tp_size}). Run a number of processes that divides both "
                f"({', '.join(map(str, fits)) or 'none above 1'}), or leave tensor parallelism off."
            )
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    def train(self, mode: bool = True):
        # before any forward can repack a 4-bit weight (``keep_4bit_weights_trainable``, near the end of this file,
        # says why)
        keep_4bit_weights_trainable(self, training=mode)
        return super().train(mode)

    def save_pretrained(self, save_directory, *args, **kwargs):
        self._name_every_auto_class()  # transformers' save_pretrained then writes the code as save_code does
        return super().save_pretrained(save_directory, *args, **kwargs)

    def save_code(self, save_directory) -> list:
        """Write the code half of a Hub folder, as ``save_pretrained`` does, for a writer that saves the weights itself
        (conversion streams them shard by shard): transformers' ``custom_object_save`` copies this file and its
        relative imports and records the model's Auto class in ``config.auto_map``, beside every other Auto class.
        Returns the paths written; saving the config (which writes the auto_map) is the caller's next step."""
        self._name_every_auto_class()
        return custom_object_save(self, save_directory, config=self.config)

    def _name_every_auto_class(self):
        # custom_object_save records only the class being saved; a Hub folder must also load with AutoModel and
        # every task head
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}

    def init_geometry(self, seed: int) -> None:
        """(Re)initialise every layer's ``fiber`` module in place at its graft values (gates 0, generators random,
        drawn from ``seed``), with the model's own ``_init_weights``: the model then computes its backbone's function
        again. The same seed gives the same parameters (conversion draws a converted folder's with it); a module still
        on the meta device is first given CPU memory."""
        torch.manual_seed(seed)
        for layer in self.base_model.layers:
            fiber = getattr(layer, "fiber", None)
            if fiber is not None:
                if fiber.code_proj.weight.is_meta:
                    fiber.to_empty(device="cpu")
                for param in fiber.parameters():  # why: transformers' init functions skip tensors flagged as loaded
                    param._is_hf_initialized = False
                self._init_weights(fiber)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, FiberBundleMetric):
            cfg = self.config
            factor_std = cfg.metric_factor_init_std or 1.0 / math.sqrt(cfg.metric_hidden)
            # W_z small random (the code), W_U / W_V random (bounded by the map): never zero, since a metric
            # I + U U^T with U = 0 is a saddle whose gradient in U vanishes. The gates carry the graft.
            init.normal_(module.code_proj.weight, mean=0.0, std=cfg.initializer_range)
            if module.metric_rank > 0:
                init.normal_(module.attn_factor_proj.weight, mean=0.0, std=factor_std)
                init.zeros_(module.attn_factor_proj.bias)
                init.constant_(module.attn_gate, math.log1p(cfg.metric_gate_init))
                init.constant_(module.flatness_gate, cfg.flatness_gate_init)
            if module.ffn_metric_rank > 0:
                init.normal_(module.ffn_factor_proj.weight, mean=0.0, std=factor_std)
                init.zeros_(module.ffn_factor_proj.bias)
                init.constant_(module.ffn_gate, math.log1p(cfg.ffn_gate_init))

    def geometry_parameters(self) -> list[nn.Parameter]:
        """The parameters of every layer's ``fiber`` module (metric generators and gates)."""
        return [p for name, p in self.named_parameters() if ".fiber." in f".{name}"]


def _returns_dict(return_dict, config) -> bool:
    """``return_dict`` as transformers reads it: the argument, else ``config.return_dict`` (True by default)."""
    return return_dict if return_dict is not None else bool(getattr(config, "return_dict", True))


def _as_flags(kwargs, config):
    output_attentions = kwargs.pop("output_attentions", None)
    output_hidden_states = kwargs.pop("output_hidden_states", None)
    if output_attentions is None:
        output_attentions = bool(getattr(config, "output_attentions", False))
    if output_hidden_states is None:
        output_hidden_states = bool(getattr(config, "output_hidden_states", False))
    return output_attentions, output_hidden_states


class FiberBundleModel(FiberBundlePreTrainedModel):
    def __init__(self, config: FiberBundleConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [FiberBundleDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = FiberBundleRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = FiberBundleRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_geometry: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> FiberBundleModelOutputWithPast | tuple:
        cache = _pop_deprecated_cache(cache, kwargs)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        output_attentions, output_hidden_states = _as_flags(kwargs, self.config)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False  # the layers would drop it anyway; do not build a cache nobody fills

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        if not isinstance(mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                "cache": cache,
                "position_ids": position_ids,
            }
            mask_mapping = {"full_attention": create_causal_mask(**mask_kwargs)}
            if "sliding_attention" in self.config.layer_types:
                mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        metric = None  # the geometry every layer's attention shares: only geodesic layers read one
        if self.config.metric_rank > 0:
            token_mask = None  # which query positions are real tokens (for the geometry averages)
            if output_geometry and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                token_mask = attention_mask[:, -inputs_embeds.shape[1] :].bool()
            metric = AttentionMetric(self.rotary_emb.factor_rotation(hidden_states, position_ids), token_mask)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        geometry = {key: [] for key in GEOMETRY_KEYS} if output_geometry else None
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, attn_weights, layer_geo = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping[self.config.layer_types[decoder_layer.self_attn.layer_idx]],
                position_embeddings=position_embeddings,
                metric=metric,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                output_attentions=output_attentions,
                output_geometry=bool(output_geometry),
                **kwargs,
            )
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if output_attentions:
                all_attentions += (attn_weights,)
            if layer_geo is not None:
                for key in GEOMETRY_KEYS:
                    geometry[key].append(layer_geo[key])

        hidden_states = self.norm(hidden_states)
        if output_hidden_states:  # transformers convention: the last entry is the normed final state
            all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        if geometry is not None:
            geometry = {k: torch.stack(v) for k, v in geometry.items()} if geometry["curvature"] else None
        output = FiberBundleModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            geometry=geometry,
        )
        return output if _returns_dict(return_dict, self.config) else output.to_tuple()


class FiberBundleForCausalLM(FiberBundlePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: FiberBundleConfig):
        super().__init__(config)
        self.model = FiberBundleModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_geometry: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> FiberBundleCausalLMOutputWithPast:
        r"""
        Causal LM forward. ``output_geometry=True`` adds ``geometry``: per-layer curvature, torsion and anisotropy
        proxies. With labels and non-zero ``config.curvature_weight`` / ``config.torsion_weight``, the weighted layer
        means of those proxies are added to the loss.

        Example:

        ```python
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> model = AutoModelForCausalLM.from_pretrained("path/to/fiber-bundle-model", trust_remote_code=True)
        >>> tokenizer = AutoTokenizer.from_pretrained("path/to/fiber-bundle-model")
        >>> out = model(**tokenizer("The capital of France is", return_tensors="pt"), output_geometry=True)
        >>> out.geometry["curvature"]  # one value per layer
        ```"""
        cache = _pop_deprecated_cache(cache, kwargs)
        regularise = labels is not None and (self.config.curvature_weight > 0 or self.config.torsion_weight > 0)
        outputs: FiberBundleModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_geometry=bool(output_geometry) or regularise,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if regularise and outputs.geometry is not None:
                loss = loss + self.config.curvature_weight * outputs.geometry["curvature"].mean()
                loss = loss + self.config.torsion_weight * outputs.geometry["torsion"].mean()

        output = FiberBundleCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            geometry=outputs.geometry if output_geometry else None,
        )
        return output if _returns_dict(return_dict, self.config) else output.to_tuple()


# Task heads: transformers' generic heads, as LLaMA uses them (the forward, last-non-pad pooling and losses are theirs).
# Each builds its backbone as FiberBundleModel(config) rather than through the generic AutoModel.from_config, which in a
# trust_remote_code load (this file in a Hub folder) finds no AutoModel for the folder's config class and stops at the
# remote-code prompt.
class FiberBundleForSequenceClassification(GenericForSequenceClassification, FiberBundlePreTrainedModel):
    def __init__(self, config: FiberBundleConfig):
        FiberBundlePreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = FiberBundleModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class FiberBundleForTokenClassification(GenericForTokenClassification, FiberBundlePreTrainedModel):
    def __init__(self, config: FiberBundleConfig):
        FiberBundlePreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = FiberBundleModel(config)
        dropout = getattr(config, "classifier_dropout", None)
        if dropout is None:
            dropout = getattr(config, "hidden_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)  # the generic head's default
        self.score = nn.Linear(config.hidden_size, config.num_labels,
                               bias=getattr(config, "token_classification_bias", True))
        self.post_init()


class FiberBundleForQuestionAnswering(GenericForQuestionAnswering, FiberBundlePreTrainedModel):
    def __init__(self, config: FiberBundleConfig):
        FiberBundlePreTrainedModel.__init__(self, config)
        self.model = FiberBundleModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


# ----------------------------------------------------------------------------------------------------------------------
# bitsandbytes' in-place CPU repack, kept off: ``FiberBundlePreTrainedModel.train`` runs this on every mode change
# ----------------------------------------------------------------------------------------------------------------------
# bitsandbytes 0.50 (a Linear4bit with `support_avx512bf16_for_cpu`) repacks a 4-bit weight in place, on a CPU with
# AVX-512 BF16, into a layout only its inference kernel reads, the first time the layer runs in eval mode without
# gradient (every held-out evaluation before training is such a forward). From then on its matmul bypasses autograd
# (no gradient crosses the layer: LoRA below it learns nothing), and its inverse does not give the weight back (the
# block scales stay rounded to bfloat16, and unless double-quantised in the kernel's transposed order). So the
# repack is kept from happening, not undone: set on every mode change, which from_pretrained (its closing eval()),
# PEFT and the Trainer (train() / eval()) all make before a forward. docs/quantization.md has the reproduction.
BITSANDBYTES_REPACK_FIXED_IN: tuple[int, ...] | None = None  # the first bitsandbytes release without it, once known


def bitsandbytes_repacks_in_place() -> bool:
    """Whether the installed bitsandbytes is one that repacks 4-bit weights in place (every release with the CPU
    repack, until ``BITSANDBYTES_REPACK_FIXED_IN``)."""
    if BITSANDBYTES_REPACK_FIXED_IN is None:
        return True
    from importlib.metadata import version

    release = tuple(int(part) for part in re.findall(r"\d+", version("bitsandbytes"))[:3])
    return release < BITSANDBYTES_REPACK_FIXED_IN


def keep_4bit_weights_trainable(model: nn.Module, training: bool = False) -> None:
    """Switch bitsandbytes' in-place CPU repack off on every 4-bit layer of ``model`` (any model: the Fiber Bundle
    classes call it on every train() / eval()); with ``training``, refuse a layer whose weight was already repacked.
    Costs one walk over the modules, as train() makes anyway."""
    for module in model.modules():
        if "support_avx512bf16_for_cpu" not in module.__dict__:  # not a bitsandbytes 4-bit layer that repacks
            continue  # (a plain attribute: a dict lookup, where hasattr would raise inside nn.Module.__getattr__)
        if not bitsandbytes_repacks_in_place():
            return
        module.support_avx512bf16_for_cpu = False
        if training and getattr(module.weight.quant_state, "packing_format_for_cpu", False):
            name = next(name for name, candidate in model.named_modules() if candidate is module)
            raise RuntimeError(
                f"{name} holds its 4-bit weight in bitsandbytes' CPU inference layout (repacked in place by an "
                "eval-mode forward without gradient): no gradient would cross it, and bitsandbytes' inverse does not "
                "restore it exactly. Reload the model, and leave `support_avx512bf16_for_cpu` off on a model that "
                "trains."
            )


# save_pretrained copies this file and its relative imports and writes auto_map (AUTO_MAP, read from these
# registrations: every Auto class named once), also after a trust_remote_code load.
AUTO_CLASSES = {
    FiberBundleConfig: "AutoConfig",
    FiberBundleModel: "AutoModel",
    FiberBundleForCausalLM: "AutoModelForCausalLM",
    FiberBundleForSequenceClassification: "AutoModelForSequenceClassification",
    FiberBundleForTokenClassification: "AutoModelForTokenClassification",
    FiberBundleForQuestionAnswering: "AutoModelForQuestionAnswering",
}
for _cls, _auto in AUTO_CLASSES.items():
    _cls.register_for_auto_class(_auto)
# module file name (as in the Hub folder) . class name
AUTO_MAP = {auto: f"{cls.__module__.rpartition('.')[2]}.{cls.__name__}" for cls, auto in AUTO_CLASSES.items()}

__all__ = [
    "FiberBundleForCausalLM",
    "FiberBundleForQuestionAnswering",
    "FiberBundleForSequenceClassification",
    "FiberBundleForTokenClassification",
    "FiberBundleModel",
    "FiberBundlePreTrainedModel",
]
