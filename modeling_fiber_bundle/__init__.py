"""Fiber Bundle Transformers: per-token Riemannian metrics and geodesic attention for the Hugging Face ecosystem.

Importing this package registers the model with transformers' Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForCausalLM`` and the task heads ``AutoModelForSequenceClassification``, ``AutoModelForTokenClassification``,
``AutoModelForQuestionAnswering``). ``save_pretrained`` writes a folder holding the configuration and modeling files
and an ``auto_map`` for all of them, so the folder loads with ``trust_remote_code=True`` where this package is not
installed.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import modeling_fiber_bundle
from .configuration_fiber_bundle import FiberBundleConfig
from .modeling_fiber_bundle import (
    FiberBundleForCausalLM,
    FiberBundleForQuestionAnswering,
    FiberBundleForSequenceClassification,
    FiberBundleForTokenClassification,
    FiberBundleModel,
    FiberBundlePreTrainedModel,
)

__version__ = "0.1.0"

AutoConfig.register(FiberBundleConfig.model_type, FiberBundleConfig, exist_ok=True)
AutoModel.register(FiberBundleConfig, FiberBundleModel, exist_ok=True)
AutoModelForCausalLM.register(FiberBundleConfig, FiberBundleForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(FiberBundleConfig, FiberBundleForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(FiberBundleConfig, FiberBundleForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(FiberBundleConfig, FiberBundleForQuestionAnswering, exist_ok=True)

__all__ = ["FiberBundleConfig", *modeling_fiber_bundle.__all__]
