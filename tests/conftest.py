"""pytest's fixtures. The helpers the test modules share are in helpers.py (a plain module, imported by name)."""

import getpass
import os
import tempfile

import pytest
import torch

# Triton decides at definition time whether its kernels run compiled or interpreted, so this is set before anything
# imports modeling_fiber_bundle: without a GPU the fused kernel's tests run on CPU tensors under the interpreter
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under ATEN_CPU_CAPABILITY=default (CI's second pass: docs/testing.md) torch 2.13's inductor takes the capability for
# its own code too and emits vectorised C++ that it then cannot compile ("'at::vec' has not been declared"): inductor
# gets a vector width of its own (AVX2's 256 bits, which every x86-64 host CI runs on has) while ATen's kernels stay on
# the default path that the pass is for
if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 256
# inductor's on-disk cache does not tell kernel paths apart: a kernel compiled in a native (AVX-512) run, loaded by a run
# under ATEN_CPU_CAPABILITY=avx2, aborted the process (seen with torch 2.13); each capability gets its own cache
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}"))

import helpers  # noqa: E402, F401  first of the project: sets the offline environment before transformers is imported


@pytest.fixture
def tmp_hub_home(tmp_path, monkeypatch):
    """An empty HF cache so nothing cached elsewhere is picked up."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def gguf():
    """SmolLM2-135M-Instruct's GGUF file (fetched once into the cache, ``fiber_bundle.conversion.assets``)."""
    from fiber_bundle.conversion.assets import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="session")
def converted(gguf, tmp_path_factory):
    """The GGUF converted to a Fiber Bundle Hub folder, once per session for every test module that reads it (tests
    must not write into it)."""
    from fiber_bundle.conversion import convert_checkpoint
    from fiber_bundle.conversion.assets import SMOLLM2_HUB_ID

    out = tmp_path_factory.mktemp("smollm2") / "fbt"
    convert_checkpoint(gguf, out, base_model=SMOLLM2_HUB_ID, license="apache-2.0")
    return out
