"""Training from scratch: a freshly initialised ``FiberBundleForCausalLM`` built from a configuration (a JSON file or a
size preset) and a byte-level tokenizer. Its corpus, the standard library's own source and documentation split by
module, is ``data.stdlib_corpus``.

Why byte-level by default: a small model's parameters should be its layers. SmolLM2's 49,152-token vocabulary at width
192 is 9.4 M embedding parameters against 1.7 M in four layers; 256 byte tokens (+ 2 special) cost 50 k. Any
tokenizer can be given instead (``--tokenizer FOLDER_OR_HUB_ID``).

The gates' initial values are free choices here (a conversion must start them at 0, the graft value, to reproduce its
source): ``metric_gate_init`` (alpha of G_i = I + alpha U_i U_i^T), ``flatness_gate_init`` (gamma, 1 for the exact
squared geodesic distance) and ``ffn_gate_init`` (beta of M_i = I + beta V_i V_i^T); ``metric_rank = 0`` and
``ffn_metric_rank = 0`` give the Euclidean twin (LLaMA's attention and MLP).
"""

import dataclasses
import json
from pathlib import Path

from .errors import TrainingError

BYTE_TOKENIZER = "byte"
# one byte per token, then the two special tokens
END_OF_TEXT, PADDING = "<|endoftext|>", "<|pad|>"

# size presets for --from-config; every other field takes FiberBundleConfig's default (metric rank 2, gates 0)
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, metric_hidden=16),
    "small": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, metric_hidden=32),
    "base": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                 num_key_value_heads=2, metric_hidden=64),
}
# what a preset shares: a short context, tied embeddings (the vocabulary is small), no cache during training
PRESET_COMMON = dict(max_position_embeddings=2048, tie_word_embeddings=True, use_cache=True)


def byte_tokenizer():
    """A byte-level tokenizer: ids 0-255 are the bytes of the UTF-8 text (so any text round-trips), 256 is
    ``<|endoftext|>`` (BOS and EOS), 257 is ``<|pad|>``. A ``PreTrainedTokenizerFast``: it saves as tokenizer.json and
    loads back with ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))  # byte b -> its printable stand-in
    vocab = {char: byte for byte, char in enumerate(alphabet)}
    vocab.update({END_OF_TEXT: 256, PADDING: 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    # why use_regex=False, add_prefix_space=False: map bytes one to one, without GPT-2's word splitting or an added space
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                   pad_token=PADDING)


def _byte_of(char: str) -> int:
    """The byte that GPT-2's byte-to-unicode table shows as ``char``: printable Latin-1 bytes as themselves, the others
    shifted to 256 + k in byte order."""
    code = ord(char)
    if code < 256:
        return code
    unprintable = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return unprintable[code - 256]


def load_tokenizer(name: str | None):
    """``byte_tokenizer()`` for None or "byte", else ``AutoTokenizer.from_pretrained(name)`` (a folder or Hub id)."""
    if name in (None, BYTE_TOKENIZER):
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as error:
        raise TrainingError(f"could not load the tokenizer {name!r} ({error}); pass a tokenizer folder, a Hub id, or "
                            f"{BYTE_TOKENIZER!r} for the byte-level tokenizer.") from error


def scratch_config(spec: str | Path | dict, tokenizer, **overrides):
    """The ``FiberBundleConfig`` of a fresh model: ``spec`` is a preset name (``PRESETS``), a JSON file of config
    fields, or a dict of them; ``overrides`` win. The vocabulary follows the tokenizer (``vocab_size`` defaults to
    ``len(tokenizer)`` and may not be smaller), and so do the BOS / EOS / padding ids. An unknown field is refused
    (a misspelt ``metric_gate_init`` would otherwise be kept as an unused attribute)."""
    from modeling_fiber_bundle import FiberBundleConfig

    if isinstance(spec, dict):
        fields, where = dict(spec), "the config"
    elif str(spec) in PRESETS:
        fields, where = {**PRESET_COMMON, **PRESETS[str(spec)]}, f"preset {spec!r}"
    else:
        path = Path(spec)
        if not path.is_file():
            raise TrainingError(f"--from-config {spec}: no such file and not a preset; give a JSON file of "
                                f"FiberBundleConfig fields or one of the presets {', '.join(PRESETS)}.")
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise TrainingError(f"--from-config {path}: not valid JSON ({error.msg} at line {error.lineno}).") from error
        if not isinstance(fields, dict):
            raise TrainingError(f"--from-config {path}: a JSON object of FiberBundleConfig fields is expected, got a "
                                f"{type(fields).__name__}.")
        where = str(path)
    fields.update(overrides)
    model_type = fields.pop("model_type", FiberBundleConfig.model_type)
    if model_type != FiberBundleConfig.model_type:
        raise TrainingError(f"{where}: model_type {model_type!r}; a from-scratch model is a "
                            f"{FiberBundleConfig.model_type!r} model (use fiber-bundle convert for a {model_type} "
                            "checkpoint).")
    for ignored in ("architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(ignored, None)  # a saved config.json is a valid spec: these are written by save_pretrained
    known = {f.name for f in dataclasses.fields(FiberBundleConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TrainingError(f"{where}: unknown FiberBundleConfig field(s) {', '.join(unknown)}; see "
                            "docs/design.md or FiberBundleConfig's docstring for the fields.")
    size = len(tokenizer)
    fields.setdefault("vocab_size", size)
    if fields["vocab_size"] < size:
        raise TrainingError(f"{where}: vocab_size {fields['vocab_size']} is smaller than the tokenizer's {size} "
                            "tokens; drop vocab_size (it then follows the tokenizer) or raise it.")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        fields[name] = getattr(tokenizer, name)
    try:
        return FiberBundleConfig(**fields)
    except ValueError as error:
        raise TrainingError(f"{where}: {error}") from error


def fresh_model(config, seed: int):
    """A ``FiberBundleForCausalLM`` initialised by its own ``_init_weights`` from ``seed`` (float32): every backbone
    weight drawn, the metric generators drawn, the gates at the config's ``*_gate_init``."""
    import torch

    from modeling_fiber_bundle import FiberBundleForCausalLM

    torch.manual_seed(seed)
    return FiberBundleForCausalLM(config)
