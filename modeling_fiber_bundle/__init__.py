"""Fiber Bundle Transformers: per-token Riemannian metrics and geodesic attention for the Hugging Face ecosystem.

Importing this package registers the model with transformers' Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForCausalLM``) and marks the classes for ``register_for_auto_class`` so that ``save_pretrained`` writes a
folder that loads with ``trust_remote_code=True`` where this package is not installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_fiber_bundle import FiberBundleConfig
from .modeling_fiber_bundle import FiberBundleForCausalLM, FiberBundleModel, FiberBundlePreTrainedModel

__version__ = "0.1.0"

AutoConfig.register(FiberBundleConfig.model_type, FiberBundleConfig, exist_ok=True)
AutoModel.register(FiberBundleConfig, FiberBundleModel, exist_ok=True)
AutoModelForCausalLM.register(FiberBundleConfig, FiberBundleForCausalLM, exist_ok=True)
FiberBundleConfig.register_for_auto_class()
FiberBundleModel.register_for_auto_class("AutoModel")
FiberBundleForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["FiberBundleConfig", "FiberBundleForCausalLM", "FiberBundleModel", "FiberBundlePreTrainedModel"]
