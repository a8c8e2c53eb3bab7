"""Loading the models and the text that the analyses measure.

A Fiber Bundle folder loads as ``FiberBundleForCausalLM``; any other checkpoint (a folder, a Hub id or a .gguf file)
loads with transformers' own class, so the source of a conversion is measured exactly as its users run it.
"""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling_fiber_bundle import FiberBundleForCausalLM


def is_fiber_bundle_folder(source: str | Path) -> bool:
    config = Path(source) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "fiber_bundle"


def _gguf_parts(source: str | Path, gguf_file: str | None) -> tuple[Path, str] | None:
    path = Path(source)
    if gguf_file is not None:
        return path, gguf_file
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist.")
        return path.parent, path.name
    return None


def _plain_copy(model):
    """A GGUF-loaded model is flagged as quantized (transformers then refuses to save or fully train it); its weights are
    already dequantised, so copy them into a plain instance of the same class."""
    fields = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    plain = type(model)(type(model.config)(**fields))
    plain.load_state_dict(model.state_dict())
    return plain.to(model.dtype)


def load_causal_lm(source: str | Path, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) for a Fiber Bundle folder, a transformers checkpoint folder, a Hub id or a GGUF."""
    gguf = _gguf_parts(source, gguf_file)
    if gguf is not None:
        folder, name = gguf
        model = _plain_copy(AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    elif is_fiber_bundle_folder(source):
        model = FiberBundleForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True)
    else:
        if Path(source).exists() and not (Path(source) / "config.json").is_file():
            raise FileNotFoundError(f"{source} holds no config.json: pass a checkpoint folder, a Hub id or a .gguf file.")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    return model.eval(), tokenizer


def sample_ids(tokenizer, num_samples: int, length: int) -> torch.Tensor:
    """``num_samples`` windows of ``length`` tokens of real English text (the standard library's pydoc topics), evenly
    spaced through it so they do not overlap. Returns (num_samples, length) token ids."""
    from fiber_bundle.conversion.verify import calibration_text

    stream = tokenizer(calibration_text(), add_special_tokens=False)["input_ids"]
    if num_samples * length > len(stream):
        raise ValueError(f"{num_samples} x {length} tokens is more than the {len(stream)} tokens of sample text.")
    stride = len(stream) // num_samples
    return torch.tensor([stream[i * stride : i * stride + length] for i in range(num_samples)])


def model_label(source: str | Path) -> str:
    return Path(str(source)).name or str(source)
