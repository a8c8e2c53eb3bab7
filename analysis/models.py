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
