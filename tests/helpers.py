"""Shared test helpers (imported by the test modules as ``helpers``): tiny configs, gates set awake, random ids, tiny
tokenizers and the backbone twins built with transformers' own classes. Importing it first sets the offline
environment (conftest.py does so before any test module is collected)."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import pytest  # noqa: E402

import modeling_fiber_bundle  # noqa: E402  registers the Auto classes
from modeling_fiber_bundle import FiberBundleConfig, FiberBundleForCausalLM  # noqa: E402

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


# The source families that Fiber Bundle models reproduce and conversion reads: transformers' config and causal-LM
# classes, and the config fields a tiny twin of each needs beyond TINY.
SOURCE_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 6}),
}


# torch's compiled flex_attention kernel refuses the CPU under ATEN_CPU_CAPABILITY=default (its check_cpu_supported), the
# second kernel path CI runs (docs/testing.md): a test that runs that kernel itself is skipped there
FLEX_KERNEL = pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") == "default",
                                 reason="torch's compiled flex_attention does not run on CPU under ATEN_CPU_CAPABILITY="
                                        "default")


def tiny_config(**overrides) -> FiberBundleConfig:
    return FiberBundleConfig(**{**TINY, **overrides})


def tiny_model(seed=0, dtype=torch.float64, **overrides) -> FiberBundleForCausalLM:
    torch.manual_seed(seed)
    return FiberBundleForCausalLM(tiny_config(**overrides)).to(dtype).eval()


def set_gates(model, alpha=0.7, gamma=0.4, beta=0.5, noise=0.3, seed=1):
    """Move every gate off its graft value, by a different amount per head and layer (a 'trained' geometry)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            fiber = getattr(layer, "fiber", None)
            if fiber is None:
                continue
            if hasattr(fiber, "attn_gate"):
                n = fiber.attn_gate.numel()
                a = alpha * (1 + noise * torch.randn(n, generator=gen, dtype=torch.float64))
                fiber.attn_gate.copy_(torch.log1p(a.clamp_min(-0.9)))
                fiber.flatness_gate.copy_(gamma * (1 + noise * torch.randn(n, generator=gen, dtype=torch.float64)))
            if hasattr(fiber, "ffn_gate"):
                fiber.ffn_gate.fill_(float(torch.log1p(torch.tensor(beta))))
    return model


def awake_model(dtype=torch.float64, seed=0, **overrides) -> FiberBundleForCausalLM:
    """A tiny model with every gate and factor generator moved off the graft (at the graft the model computes its
    backbone's function, which a path that ignored the metric would reproduce)."""
    model = set_gates(tiny_model(seed=seed, dtype=dtype, **overrides))
    with torch.no_grad():
        for p in model.geometry_parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def decisive_geometry(seed=0) -> FiberBundleForCausalLM:
    """A tiny float32 model whose geometry decides its greedy tokens: strong gates, and factors near the bounded map's
    limit, so that each token's metric and the factors' turn by its own position change what it generates (used where
    a test compares tokens, not logits)."""
    model = set_gates(tiny_model(seed=seed, dtype=torch.float32), alpha=4.0, gamma=1.0)
    with torch.no_grad():
        for p in model.geometry_parameters():
            p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.fiber.attn_factor_proj.weight.mul_(30.0)
    return model


def random_ids(batch, length, vocab=TINY["vocab_size"], seed=0, low=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, length), generator=gen)


# Fresh processes where this project cannot be imported: the library's one implementation
from fiber_bundle.conversion.fresh_process import run_without_project  # noqa: E402,F401


def torchrun_command(nproc: int) -> list[str]:
    """``torchrun --standalone --nproc_per_node NPROC`` from this interpreter's environment (then the script and its
    arguments)."""
    import shutil
    import sys
    from pathlib import Path

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    return [torchrun, "--standalone", "--nproc_per_node", str(nproc)]


def geometry_step_change(model, ids, lr=1e-2) -> float:
    """Freeze the backbone, take one AdamW step on the geometry parameters alone, return max |change of logits|."""
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    geometry = model.geometry_parameters()
    for p in geometry:
        p.requires_grad_(True)
    with torch.no_grad():
        before = model(ids).logits
    model(ids, labels=ids).loss.backward()
    torch.optim.AdamW(geometry, lr=lr).step()
    with torch.no_grad():
        return (model(ids).logits - before).abs().max().item()


def tiny_tokenizer(vocab_size=TINY["vocab_size"]):
    """A word-level tokenizer over "w3" ... "w{vocab_size-1}" (unknown words become <pad>), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    return tokenizer


def tiny_char_tokenizer(vocab_size=TINY["vocab_size"]):
    """A character-level tokenizer for the tiny models, so that real text (pydoc topics, arithmetic) has real tokens:
    ids 3 ... vocab_size-1 are newline and the printable ASCII characters in order (those past the vocabulary, and any
    other character, become <pad>)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    alphabet = "\n" + "".join(map(chr, range(32, 127)))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet[: vocab_size - 3])}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def fake_stdlib(root, modules: int = 12):
    """A stand-in standard library: single-file modules, two packages (one with a tests folder) and site-packages."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(modules):
        (root / f"mod{i:02d}.py").write_text(f'"""Module {i}."""\n' + f"VALUE_{i} = {i}\n" * (20 + 7 * i))
    for package in ("pkga", "pkgb"):
        (root / package / "sub").mkdir(parents=True)
        (root / package / "__init__.py").write_text(f"# {package}\n" * 40)
        (root / package / "sub" / "inner.py").write_text(f"def {package}():\n    return 1\n" * 30)
    (root / "pkga" / "tests").mkdir()
    (root / "pkga" / "tests" / "test_x.py").write_text("assert True\n")
    (root / "site-packages" / "third").mkdir(parents=True)
    (root / "site-packages" / "third" / "x.py").write_text("import os\n")
    (root / "config-3.11-x86_64-linux-gnu").mkdir()
    (root / "config-3.11-x86_64-linux-gnu" / "python-config.py").write_text("print(1)\n")
    return root


def dense_metric(factors: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """G = I + alpha U U^T as a dense d x d matrix, against which the tests check the model's low-rank forms (the model
    never builds it). factors (B, H, n, r, d), row-wise as the model keeps them; alpha (H,). Returns (B, H, n, d, d)."""
    d = factors.shape[-1]
    eye = torch.eye(d, dtype=factors.dtype, device=factors.device)
    outer = torch.matmul(factors.transpose(-1, -2), factors)  # U U^T: (B, H, n, d, d)
    return eye + alpha.view(1, -1, 1, 1, 1).to(factors.dtype) * outer
