"""pytest's fixtures. The helpers the test modules share are in helpers.py (a plain module, imported by name)."""

import os

import pytest
import torch

# Triton decides at definition time whether its kernels run compiled or interpreted, so this is set before anything
# imports modeling_fiber_bundle: without a GPU the fused kernel's tests run on CPU tensors under the interpreter
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import helpers  # noqa: E402, F401  first of the project: sets the offline environment before transformers is imported


@pytest.fixture
def tmp_hub_home(tmp_path, monkeypatch):
    """An empty HF cache so nothing cached elsewhere is picked up."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def smollm2_gguf_file():
    """SmolLM2-135M-Instruct's GGUF file (fetched once into the cache, ``fiber_bundle.conversion.assets``)."""
    from fiber_bundle.conversion.assets import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_converted(smollm2_gguf_file, tmp_path_factory):
    """SmolLM2 converted once per test session (read-only for the tests that share it)."""
    from fiber_bundle.conversion import convert_checkpoint
    from fiber_bundle.conversion.assets import SMOLLM2_HUB_ID

    out = tmp_path_factory.mktemp("smollm2") / "fbt"
    convert_checkpoint(smollm2_gguf_file, out, base_model=SMOLLM2_HUB_ID, license="apache-2.0")
    return out
