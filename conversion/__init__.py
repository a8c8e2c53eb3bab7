"""Convert pretrained LLaMA / Mistral / Qwen2 / Qwen3 checkpoints into Fiber Bundle models (``fiber-bundle convert``).

Installed as ``fiber_bundle.conversion``.
"""

from .convert import ConversionError, ConversionResult, convert_checkpoint, fiber_config_from_source, open_source

__all__ = ["ConversionError", "ConversionResult", "convert_checkpoint", "fiber_config_from_source", "open_source"]
