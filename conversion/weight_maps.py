"""Weight-name maps, one small table per source architecture: source template -> Fiber Bundle template, or None for a
tensor that is consumed and not copied. ``{}`` stands for a layer index. The conversion engine looks every source
tensor up here and fails on any name no table lists, so an architecture we do not know can never convert silently.

Fiber Bundle keeps transformers' parameter names for the whole backbone, so every table is almost the identity;
what differs between families is which tensors exist (Qwen2's q/k/v biases, Qwen3's per-head q/k norms). The task
head is a table of its own, added to the family's: ``lm_head`` for a causal LM, ``score`` for sequence classification.
"""

LAYER_PATTERN = r"\.(\d+)\."  # the layer index in a parameter name

_BACKBONE = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.{}.input_layernorm.weight",
    "model.layers.{}.post_attention_layernorm.weight",
    "model.layers.{}.self_attn.q_proj.weight",
    "model.layers.{}.self_attn.k_proj.weight",
    "model.layers.{}.self_attn.v_proj.weight",
    "model.layers.{}.self_attn.o_proj.weight",
    "model.layers.{}.mlp.gate_proj.weight",
    "model.layers.{}.mlp.up_proj.weight",
    "model.layers.{}.mlp.down_proj.weight",
]
_ROTARY_BUFFERS = {  # old checkpoints saved RoPE frequencies; they are recomputed from the config
    "model.rotary_emb.inv_freq": None,
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
}
_QKV_BIAS = ["model.layers.{}.self_attn.q_proj.bias", "model.layers.{}.self_attn.k_proj.bias",
             "model.layers.{}.self_attn.v_proj.bias"]
_O_BIAS = ["model.layers.{}.self_attn.o_proj.bias"]
_MLP_BIAS = ["model.layers.{}.mlp.gate_proj.bias", "model.layers.{}.mlp.up_proj.bias",
             "model.layers.{}.mlp.down_proj.bias"]
_QK_NORM = ["model.layers.{}.self_attn.q_norm.weight", "model.layers.{}.self_attn.k_norm.weight"]


def _identity(*groups: list[str]) -> dict[str, str | None]:
    table = {name: name for group in groups for name in group}
    table.update(_ROTARY_BUFFERS)
    return table


# LLaMA may carry attention / MLP biases (config.attention_bias, config.mlp_bias); Mistral is LLaMA with a window.
LLAMA = _identity(_BACKBONE, _QKV_BIAS, _O_BIAS, _MLP_BIAS)
MISTRAL = _identity(_BACKBONE)
QWEN2 = _identity(_BACKBONE, _QKV_BIAS)
QWEN3 = _identity(_BACKBONE, _QKV_BIAS, _O_BIAS, _QK_NORM)

WEIGHT_MAPS = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3}
# Task heads, by the suffix of the source class; the converted model is "FiberBundle" + suffix (same head names).
HEADS = {
    "ForCausalLM": {"lm_head.weight": "lm_head.weight"},
    "ForSequenceClassification": {"score.weight": "score.weight"},  # reward models: a score head, no lm_head
}
# The source classes a checkpoint may declare in config.json "architectures": (family, head).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "ForCausalLM"),
    "LlamaForSequenceClassification": ("llama", "ForSequenceClassification"),
    "MistralForCausalLM": ("mistral", "ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "ForCausalLM"),
    "Qwen2ForSequenceClassification": ("qwen2", "ForSequenceClassification"),
    "Qwen3ForCausalLM": ("qwen3", "ForCausalLM"),
}


def weight_map(family: str, head: str) -> dict[str, str | None]:
    """The whole table for a source: its family's backbone and its head."""
    return {**WEIGHT_MAPS[family], **HEADS[head]}
