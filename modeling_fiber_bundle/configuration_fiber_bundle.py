"""Configuration of the Fiber Bundle Transformer.

The backbone fields follow transformers' LLaMA / Mistral / Qwen2 / Qwen3 configurations (same names, same meaning),
so a converted checkpoint keeps its config values. The geometry fields are new; see ``FiberBundleConfig``'s docstring
and docs/design.md for the equations they parametrise.
"""

import math

from transformers import PreTrainedConfig

ATTENTION_KERNELS = ("auto", "triton", "cpp", "pytorch")
ATTENTION_PATHS = ("blocked", "reference")
FACTOR_SHARING = ("head", "kv_group")
LAYER_TYPES = ("full_attention", "sliding_attention")
METRIC_ACTIVATIONS = ("tanh", "silu", "gelu", "identity")
# The RoPE types transformers supports for LLaMA, each tested against LlamaForCausalLM.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


class FiberBundleConfig(PreTrainedConfig):
    r"""
    Configuration of a [`FiberBundleForCausalLM`]: a pre-norm LLaMA-family decoder in which every token carries a
    low-rank Riemannian metric.

    Backbone arguments have the meaning they have in `LlamaConfig` / `Qwen3Config` (`vocab_size`, `hidden_size`,
    `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`, `hidden_act`,
    `max_position_embeddings`, `initializer_range`, `rms_norm_eps`, `rope_parameters`, `attention_bias` (bias of q/k/v,
    and of o unless `attention_out_bias` says otherwise: Qwen2 has q/k/v bias and no o bias), `mlp_bias`, `qk_norm` (Qwen3's per-head q/k RMSNorm), `tie_word_embeddings`, `sliding_window`, `layer_types`).

    Geometry arguments:
        metric_rank (`int`, defaults to 2):
            Rank r of each token's attention metric G_i = I + alpha U_i U_i^T (U_i is head_dim x r). 0 turns the metric
            off: the attention is then the backbone's own (dispatched through transformers' attention interface).
        metric_hidden (`int`, defaults to 64):
            Width m of the fibre code z_i = act(W_z RMSNorm(x_i)) that generates the token's metric factors.
        metric_act (`str`, defaults to "tanh"):
            Activation of the fibre code, one of "tanh", "silu", "gelu", "identity".
        metric_factor_sharing (`str`, defaults to "kv_group"):
            "head": one factor matrix per query head; "kv_group": one per key/value head, shared by its query group.
        ffn_metric_rank (`int`, defaults to 2):
            Rank r_f of the MLP preconditioner M_i = I + beta V_i V_i^T (V_i is hidden_size x r_f). 0 turns it off.
        metric_gate_init (`float`, defaults to 0.0):
            Initial alpha (attention metric gate, per head), alpha = exp(theta) - 1 > -1. 0 is the graft value.
        flatness_gate_init (`float`, defaults to 0.0):
            Initial gamma (per head weight of the -gamma/2 ||k_j||^2 term). 0 is the graft value; 1 gives the exact
            squared geodesic distance.
        ffn_gate_init (`float`, defaults to 0.0):
            Initial beta (MLP preconditioner gate, per layer), beta = exp(phi) - 1 > -1. 0 is the graft value.
        metric_factor_init_std (`float`, *optional*):
            Standard deviation of the factor generators W_U, W_V at initialisation; defaults to 1/sqrt(metric_hidden).
        curvature_weight (`float`, defaults to 0.0):
            Weight of the mean curvature proxy added to the training loss when labels are given.
        torsion_weight (`float`, defaults to 0.0):
            Weight of the mean torsion proxy added to the training loss when labels are given.
        geometry_block_size (`int`, defaults to 32):
            Torsion is measured on pairs inside blocks of this many consecutive tokens.
        attention_block_size (`int`, defaults to 64):
            Query block of the blocked geodesic attention: extra memory is O(sequence length x block size).
        fiber_attention_path (`str`, defaults to "blocked"):
            "blocked" (default, memory-bounded, custom backward) or "reference" (short and obviously correct,
            materialises the n x n x r score terms; for tests and debugging).
        fiber_attention_kernel (`str`, defaults to "auto"):
            What runs the blocked path: "triton" (the fused Triton kernel of `fused_attention.py`, forward and
            backward; needs `pip install triton`, CUDA tensors and no attention dropout), "cpp" (the fused C++
            operator of `fused_attention.py`, built on first use by the machine's C++ compiler; CPU tensors, no
            attention dropout), "pytorch" (the blocked PyTorch loop), or "auto" (Triton for CUDA tensors, the C++
            operator for CPU tensors, each where it runs and has passed its self-check and no attention dropout
            applies; the PyTorch loop everywhere else).
        geometry_recompute (`bool`, defaults to True):
            In training, keep only the inputs of the O(n d r) metric computations (the attention factors' generation;
            the Woodbury step where it builds its factors; the blocked kernel rebuilds G_i q_i itself) and recompute
            them in the backward: less activation memory for a few percent more time.
        attention_only (`bool`, defaults to False):
            Layers without their MLP sublayer (no `post_attention_layernorm`, `mlp`; needs `ffn_metric_rank=0`): each
            layer is x <- x + attention(RMSNorm(x)), the attention-only setting of the rank-collapse studies
            (docs/design.md section 4). For models trained from scratch; no pretrained checkpoint converts to it.
    """

    model_type = "fiber_bundle"
    keys_to_ignore_at_inference = ["cache"]
    # Tensor parallelism splits attention by head: each rank holds a contiguous block of query heads and of their KV
    # heads, and the metric's per-head parts follow them; what acts on the whole hidden vector is replicated.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        # Qwen3's q/k RMSNorm: one weight shared by every head; each rank's gradient covers its own heads only
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        # W_U: output laid out (factor heads, r, d), factor heads = query heads ("head") or KV heads ("kv_group"),
        # so splitting rows like q_proj / k_proj gives each rank the factors of its own heads
        "layers.*.fiber.attn_factor_proj": "colwise",
        "layers.*.fiber.attn_gate": "colwise",  # theta (H,), one per query head: split like q_proj's heads
        "layers.*.fiber.flatness_gate": "colwise",  # gamma (H,)
        "layers.*.fiber": "local_params",  # its forward reads its own gates' local shards
        # no rule, so whole on every rank: W_z (the fibre code feeds both parts), W_V and beta (M_i^{-1} acts on the MLP
        # output after down_proj's all-reduce, the whole hidden vector). Why no "replicate" rule: that style wraps the
        # module's forward, and PEFT's modules_to_save copy would then run the original module's forward
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # Backbone (LLaMA / Mistral / Qwen2 / Qwen3)
    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_out_bias: bool | None = None
    attention_dropout: float | int = 0.0
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None

    # Geometry (the fibre at each token)
    metric_rank: int = 2
    metric_hidden: int = 64
    metric_act: str = "tanh"
    metric_factor_sharing: str = "kv_group"
    ffn_metric_rank: int = 2
    metric_gate_init: float = 0.0
    flatness_gate_init: float = 0.0
    ffn_gate_init: float = 0.0
    metric_factor_init_std: float | None = None

    # Connection observables and their optional training regularisers
    curvature_weight: float = 0.0
    torsion_weight: float = 0.0
    geometry_block_size: int = 32

    # Attention kernel
    attention_block_size: int = 64
    fiber_attention_path: str = "blocked"
    fiber_attention_kernel: str = "auto"
    geometry_recompute: bool = True

    # Architecture variant for the rank-collapse studies
    attention_only: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        super().__post_init__(**kwargs)
        self._validate_fields()

    def _validate_fields(self):
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FiberBundleConfig.{name} must be an integer >= 1, got {value!r}.")

        def non_negative(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FiberBundleConfig.{name} must be an integer >= 0, got {value!r}.")

        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                raise ValueError(f"FiberBundleConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}.")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "metric_hidden", "geometry_block_size", "attention_block_size"):
            positive(name)
        for name in ("metric_rank", "ffn_metric_rank"):
            non_negative(name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"FiberBundleConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.metric_rank > self.head_dim:
            raise ValueError(
                f"FiberBundleConfig.metric_rank must be in [0, head_dim={self.head_dim}], got {self.metric_rank}."
            )
        if self.attention_only and self.ffn_metric_rank:
            raise ValueError(
                f"FiberBundleConfig.attention_only=True removes the MLP, which ffn_metric_rank={self.ffn_metric_rank} "
                "would precondition: set ffn_metric_rank=0."
            )
        if self.ffn_metric_rank > self.hidden_size:
            raise ValueError(
                f"FiberBundleConfig.ffn_metric_rank must be in [0, hidden_size={self.hidden_size}], "
                f"got {self.ffn_metric_rank}."
            )
        for name in ("metric_gate_init", "ffn_gate_init"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > -1.0):
                raise ValueError(f"FiberBundleConfig.{name} must be a finite number > -1 (gate = exp(theta) - 1), "
                                 f"got {value!r}.")
        for name in ("flatness_gate_init", "curvature_weight", "torsion_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"FiberBundleConfig.{name} must be a finite number, got {value!r}.")
        for name in ("curvature_weight", "torsion_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"FiberBundleConfig.{name} must be >= 0, got {getattr(self, name)!r}.")
        if self.metric_factor_init_std is not None and not self.metric_factor_init_std > 0:
            raise ValueError(
                f"FiberBundleConfig.metric_factor_init_std must be > 0 or None, got {self.metric_factor_init_std!r}."
            )
        choice("metric_act", METRIC_ACTIVATIONS)
        choice("metric_factor_sharing", FACTOR_SHARING)
        choice("fiber_attention_path", ATTENTION_PATHS)
        choice("fiber_attention_kernel", ATTENTION_KERNELS)
        if self.sliding_window is not None:
            positive("sliding_window")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"FiberBundleConfig.layer_types must have num_hidden_layers={self.num_hidden_layers} entries, "
                f"got {len(self.layer_types)}."
            )
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise ValueError(f"FiberBundleConfig.layer_types entries must be one of {LAYER_TYPES}, got {kind!r}.")
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"FiberBundleConfig.rope_parameters['rope_type'] must be one of {ROPE_TYPES} (the types transformers "
                f"supports for LLaMA), got {rope_type!r}."
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError(
                "FiberBundleConfig.layer_types has 'sliding_attention' layers but sliding_window is None; "
                "set sliding_window to the window length."
            )


__all__ = ["FiberBundleConfig"]
