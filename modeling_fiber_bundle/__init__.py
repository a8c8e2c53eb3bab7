"""Fiber Bundle Transformers: per-token Riemannian metrics and geodesic attention for the Hugging Face ecosystem.

Importing this package registers the model with transformers' Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForCausalLM`` and the task heads ``AutoModelForSequenceClassification``, ``AutoModelForTokenClassification``,
``AutoModelForQuestionAnswering``). ``save_pretrained`` writes a folder holding the configuration and modeling files
and an ``auto_map`` for all of them, so the folder loads with ``trust_remote_code=True`` where this package is not
installed. It also drops two notices of optional packages, bitsandbytes' and DeepSpeed's, that a user reads as a
failure of a run where they mean nothing (below).
"""

import logging
import os

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

# Every command of this project imports this package before anything imports bitsandbytes (peft and transformers'
# Trainer do). On a CPU with AVX-512 BF16, bitsandbytes 0.50 logs at import that an optional kernel ("kernels-community",
# which needs the `kernels` package) did not load: a user reads it as a failure of a run that quantises nothing. The
# kernel serves only 4-bit weights repacked for inference, which these models never hold (FiberBundlePreTrainedModel
# keeps the repack off), and bitsandbytes falls back to its own. Offline (HF_HUB_OFFLINE=1), the `kernels` package that
# transformers 5.25 installs logs first that it skips the kernel repository's trust check: the same event, dropped too.
# Only those two notices are dropped; anything else passes.
BITSANDBYTES_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
BITSANDBYTES_KERNEL_OFFLINE = "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not record.getMessage().startswith(BITSANDBYTES_KERNEL_NOTICE))
logging.getLogger("kernels._internals.hf_hub").addFilter(
    lambda record: not record.getMessage().startswith(BITSANDBYTES_KERNEL_OFFLINE))

# accelerate imports DeepSpeed wherever it is installed (the Trainer unwraps every model through
# `extract_model_from_parallel`, which imports `DeepSpeedEngine`), and DeepSpeed then logs on a machine without a GPU
# "[WARNING] ... Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.": noise in
# a run that never uses DeepSpeed, and on a machine that has no GPU, where CPU is the right answer. Dropped there only:
# where the machine has an NVIDIA device that torch cannot see (a CPU build of torch on a GPU machine), it passes.
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
if not os.path.exists("/dev/nvidiactl"):
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.getMessage() != DEEPSPEED_CPU_NOTICE)

__all__ = ["FiberBundleConfig", *modeling_fiber_bundle.__all__]
