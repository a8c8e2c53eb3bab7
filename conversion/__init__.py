"""Convert pretrained LLaMA / Mistral / Qwen2 / Qwen3 checkpoints into Fiber Bundle models (``fiber-bundle convert``),
and load models from any source (``sources``).

Installed as ``fiber_bundle.conversion``.
"""

from .convert import ConversionResult, convert_checkpoint, fiber_config_from_source
from .sources import ConversionError, load_model, load_tokenizer, locate, open_source

__all__ = ["ConversionError", "ConversionResult", "convert_checkpoint", "fiber_config_from_source", "load_model",
           "load_tokenizer", "locate", "open_source"]
