"""Loading the models and the text that the analyses measure, through conversion's one loader
(``fiber_bundle.conversion.sources``).

A Fiber Bundle folder loads as ``FiberBundleForCausalLM``; any other checkpoint (a folder, a Hub id or a .gguf file)
loads with transformers' own class, so the source of a conversion is measured exactly as its users run it.
"""

from pathlib import Path

import torch

from fiber_bundle.conversion.sources import calibration_text, load_model, load_tokenizer, locate


def load_causal_lm(source: str | Path, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) for a Fiber Bundle folder, a transformers checkpoint folder, a Hub id or a GGUF
    (``sources.load_model``)."""
    where = locate(source, gguf_file=gguf_file)
    return load_model(where, dtype=dtype), load_tokenizer(where)


def sample_ids(tokenizer, num_samples: int, length: int) -> torch.Tensor:
    """``num_samples`` windows of ``length`` tokens of real English text (the standard library's pydoc topics), evenly
    spaced through it so they do not overlap. Returns (num_samples, length) token ids."""
    stream = tokenizer(calibration_text(), add_special_tokens=False)["input_ids"]
    if num_samples * length > len(stream):
        raise ValueError(f"{num_samples} x {length} tokens is more than the {len(stream)} tokens of sample text.")
    stride = len(stream) // num_samples
    return torch.tensor([stream[i * stride : i * stride + length] for i in range(num_samples)])


def model_label(source: str | Path) -> str:
    return Path(str(source)).name or str(source)


def model_labels(models, labels=None) -> list[str]:
    """One distinct name per model for tables and figures: ``labels`` when given, else each folder's name (a GGUF file's
    stem); a count that differs from the models', or a repeated name, is refused with the option that fixes it."""
    if labels is None:
        names = [Path(str(m)).stem if str(m).endswith(".gguf") else model_label(m) for m in models]
    else:
        names = list(labels)
    if len(names) != len(models):
        raise ValueError(f"{len(names)} labels for {len(models)} models: give one --labels entry per model.")
    if len(set(names)) != len(names):
        raise ValueError(f"labels must be distinct, got {names}: pass --labels.")
    return names


def pydoc_blocks(tokenizer, block_size: int):
    """The main job's corpus as packed blocks, (train set, held-out set): pydoc topics split by topic with split seed 0,
    so every analysis scores on the same held-out blocks the main job does."""
    from fiber_bundle.training.data import pack_blocks, pydoc_topics

    train_text, eval_text = pydoc_topics(seed=0)
    return pack_blocks(train_text, tokenizer, block_size), pack_blocks(eval_text, tokenizer, block_size)


def held_out_ids(tokenizer, blocks: int, block_size: int = 256) -> torch.Tensor:
    """The first ``blocks`` blocks of the main job's held-out split (``pydoc_blocks``), as (blocks, block_size) ids."""
    packed = pydoc_blocks(tokenizer, block_size)[1]
    return torch.tensor(packed[: min(blocks, len(packed))]["input_ids"])
