"""Quantised loading and QLoRA on tiny models: under bitsandbytes 4-bit (NF4) and 8-bit loading the metric (every
layer's ``fiber`` module) stays in full precision and trains, a float16 load keeps it in float32, ``fiber-bundle
train --mode lora --load-in-4bit`` / ``--load-in-8bit`` trains adapters plus the metric, the adapter reloads onto a
fresh quantised base, ``fiber-bundle merge`` folds it into a full-precision folder, and the modes that cannot train a
quantised model are refused with the fix. The converted SmolLM2 is quantised in test_smollm2.py."""

import json
import re

import pytest
import torch
from torch import nn

from helpers import set_gates, tiny_model, tiny_tokenizer
from fiber_bundle.cli import main
from fiber_bundle.training import prepare_for_training

bnb = pytest.importorskip("bitsandbytes")  # the quantization extra (CI installs it with the test extra)

# peft 0.21 itself reads the deprecated `is_gradient_checkpointing` property; nothing of ours does
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

IDS = torch.tensor([[5, 8, 11, 14, 17, 20, 23, 26]])


def quantization(bits: int):
    from transformers import BitsAndBytesConfig

    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    return BitsAndBytesConfig(load_in_8bit=True)


BNB_LINEAR = {4: "Linear4bit", 8: "Linear8bitLt"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Fiber Bundle folder with its gates awake (so every metric parameter has a gradient) and a tokenizer."""
    path = tmp_path_factory.mktemp("quantised") / "model"
    model = tiny_model(dtype=torch.float32)
    set_gates(model)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs)


@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_loading_keeps_the_metric_in_full_precision_and_it_trains(folder, bits):
    """A plain from_pretrained with a BitsAndBytesConfig: the backbone's projections are bnb layers, every fiber module
    a float nn.Linear / Parameter (the model declares it), and under the project's LoRA recipe the gates and the
    generators train beside the adapters."""
    model = load(folder, quantization_config=quantization(bits))
    for layer in model.model.layers:
        assert type(layer.self_attn.q_proj).__name__ == BNB_LINEAR[bits]
        assert type(layer.mlp.down_proj).__name__ == BNB_LINEAR[bits]
        for name in ("code_proj", "attn_factor_proj", "ffn_factor_proj"):
            assert type(getattr(layer.fiber, name)) is nn.Linear, name
        assert all(p.dtype == torch.float32 for p in layer.fiber.parameters())

    wrapped = prepare_for_training(model, "lora", lora_r=4)  # before the fix: "only Tensors of floating point dtype ..."
    wrapped(input_ids=IDS, labels=IDS).loss.backward()
    fiber = {n: p for n, p in wrapped.named_parameters() if ".fiber." in n and p.requires_grad}
    names = {n.rsplit(".fiber.", 1)[1].removeprefix("modules_to_save.default.") for n in fiber}  # PEFT's trained copy
    assert {"attn_gate", "flatness_gate", "ffn_gate", "code_proj.weight", "attn_factor_proj.weight",
            "ffn_factor_proj.weight"} <= names
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in fiber.values()), \
        [n for n, p in fiber.items() if p.grad is None or not p.grad.abs().max() > 0]
    assert any(".lora_A." in n and p.grad is not None for n, p in wrapped.named_parameters())


def test_float16_load_keeps_the_metric_in_float32_and_generates(folder):
    """``_keep_in_fp32_modules`` also upcasts the metric under a float16 load: the fibre module reads float16 hidden
    states with float32 weights, and the layers hand on float16."""
    model = load(folder, dtype=torch.float16).eval()
    fiber = {n: p.dtype for n, p in model.named_parameters() if ".fiber." in n}
    assert fiber and set(fiber.values()) == {torch.float32}
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16
    with torch.no_grad():
        out = model(IDS, output_hidden_states=True)
        reference = load(folder, dtype=torch.float32)(IDS).logits
    assert out.logits.dtype == torch.float16 and all(h.dtype == torch.float16 for h in out.hidden_states)
    torch.testing.assert_close(out.logits.float(), reference, rtol=0, atol=1e-2)  # measured: 5e-4
    generated = model.generate(IDS, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, IDS.shape[1] + 4)


def train_text(tmp_path, words=1200):
    path = tmp_path / "train.txt"
    path.write_text(" ".join(f"w{3 + (3 * i) % 90}" for i in range(words)) + "\n")
    return path


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_command_trains_and_the_adapter_merges(folder, tmp_path, bits):
    """fiber-bundle train --mode lora --load-in-{4,8}bit, then fiber-bundle merge: the adapter holds LoRA pairs and the
    trained metric; the merged folder loads with trust_remote_code, without PEFT, and computes what the full-precision
    base plus the adapter computes."""
    from peft import PeftModel

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["train", str(folder), str(adapter), "--data", str(train_text(tmp_path)), "--mode", "lora",
                 f"--load-in-{bits}bit", "--lora-r", "4", "--block-size", "32", "--batch-size", "4", "--max-steps", "3",
                 "--learning-rate", "1e-2", "--quiet"]) == 0
    metrics = json.loads((adapter / "training_metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["quantization"] == {4: "4-bit NF4", 8: "8-bit"}[bits]
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == ["fiber"]

    assert main(["merge", str(adapter), str(merged)]) == 0
    files = {p.name for p in merged.iterdir()}
    assert {"modeling_fiber_bundle.py", "config.json", "tokenizer.json", "training_metrics.json"} <= files
    assert "adapter_config.json" not in files and "quantization_config" not in json.loads(
        (merged / "config.json").read_text())
    with torch.no_grad():
        expected = PeftModel.from_pretrained(load(folder), adapter).eval()(IDS).logits
        got = load(merged).eval()(IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (got - load(folder).eval()(IDS).logits).abs().max() > 1e-4  # the adapter and the metric were trained


def test_adapter_trained_on_a_4bit_base_reloads_onto_a_fresh_4bit_base(folder, tmp_path):
    from datasets import Dataset
    from peft import PeftModel

    from fiber_bundle.training.trainer import train_model
    from modeling_fiber_bundle import FiberBundleForCausalLM

    ids = ((torch.arange(16)[:, None] + 3 * torch.arange(16)[None]) % 90 + 3).tolist()
    model = FiberBundleForCausalLM.from_pretrained(folder, quantization_config=quantization(4))
    trainer = train_model(model, Dataset.from_dict({"input_ids": ids, "labels": ids}), tmp_path / "run", mode="lora", max_steps=3, learning_rate=1e-2,
                          lora_r=4, batch_size=4, use_cpu=True, quiet=True)
    trained = trainer.model.eval()
    with torch.no_grad():
        expected = trained(IDS).logits
    trained.save_pretrained(tmp_path / "adapter")
    fresh = FiberBundleForCausalLM.from_pretrained(folder, quantization_config=quantization(4))
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, expected, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# bitsandbytes' in-place CPU repack (docs/quantization.md)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def repacking_cpu(monkeypatch):
    """Linear4bit layers built as on a CPU with AVX-512 BF16, on any host: the one CPU query their constructor makes
    answers yes, so an eval-mode forward without gradient repacks their weights in place (where the host lacks the
    instructions, bitsandbytes' generic kernel then reads the repacked layout as if it were the plain one; the defect,
    no gradient through the layer, is the same)."""
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)


@pytest.fixture(scope="module")
def repackable(tmp_path_factory):
    """As ``folder``, with every projection one that bitsandbytes can repack (its repack needs in_features a multiple of
    the 64-value block: the tiny model's down_proj, 96 wide, makes it fail loudly instead of training silently less)."""
    path = tmp_path_factory.mktemp("repackable") / "model"
    model = tiny_model(dtype=torch.float32, intermediate_size=128)
    set_gates(model)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def is_repacked(module) -> bool:
    return getattr(module.weight.quant_state, "packing_format_for_cpu", False)


def test_qlora_command_after_its_evaluation_trains_as_without_it(repackable, tmp_path, repacking_cpu):
    """fiber-bundle train --load-in-4bit evaluates the held-out data before training: the adapter it trains is the one
    trained without that evaluation, and it learned (before the fix the evaluation repacked the base in place, no
    gradient crossed a 4-bit layer, and the adapters differed)."""
    from safetensors.torch import load_file

    eval_data = tmp_path / "eval.txt"
    eval_data.write_text(" ".join(f"w{3 + (3 * i) % 90}" for i in range(7, 307)) + "\n")  # the training pattern
    args = ["--data", str(train_text(tmp_path)), "--mode", "lora", "--load-in-4bit", "--lora-r", "4", "--block-size",
            "32", "--batch-size", "4", "--max-steps", "3", "--learning-rate", "1e-2", "--quiet"]
    assert main(["train", str(repackable), str(tmp_path / "evaluated"), *args, "--eval-data", str(eval_data)]) == 0
    assert main(["train", str(repackable), str(tmp_path / "plain"), *args]) == 0
    metrics = json.loads((tmp_path / "evaluated" / "training_metrics.json").read_text())
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]
    evaluated, plain = (load_file(tmp_path / run / "adapter_model.safetensors") for run in ("evaluated", "plain"))
    assert evaluated.keys() == plain.keys() and any(".lora_A." in name for name in plain)
    for name, value in plain.items():
        assert torch.equal(evaluated[name], value), name


def test_plain_peft_after_a_no_grad_forward_trains_and_its_adapter_reloads(repackable, tmp_path, repacking_cpu):
    """PEFT and a hand-written loop, no project code but the model: a no-grad forward of the freshly loaded 4-bit
    model (eval mode, as from_pretrained leaves it) changes nothing of what training then does, no 4-bit weight is in
    the inference layout while it trains, and the adapter reloads onto a fresh 4-bit base with the trained model's
    logits."""
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    from modeling_fiber_bundle import FiberBundleForCausalLM

    def train(forward_first: bool):
        model = prepare_model_for_kbit_training(
            FiberBundleForCausalLM.from_pretrained(repackable, quantization_config=quantization(4)),
            use_gradient_checkpointing=False)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"],
                                                 modules_to_save=["fiber"]))
        if forward_first:
            with torch.no_grad():
                model(IDS)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            model(IDS, labels=IDS).loss.backward()
            assert not any(is_repacked(m) for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu"))
            optimizer.step()
            optimizer.zero_grad()
        return model

    plain, forwarded = train(False), train(True)
    for (name, a), b in zip(plain.state_dict().items(), forwarded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    forwarded.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = forwarded.eval()(IDS).logits
        fresh = FiberBundleForCausalLM.from_pretrained(repackable, quantization_config=quantization(4))
        untrained = fresh(IDS).logits
        got = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()(IDS).logits
    assert (expected - untrained).abs().max() > 1e-2  # it trained
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_repack_is_kept_off_exactly_while_bitsandbytes_needs_it(repackable, repacking_cpu, monkeypatch):
    """The workaround goes when bitsandbytes fixes its repack: transformers' own LLaMA under the installed bitsandbytes
    still repacks in place and stays repacked in training mode (when this fails, set BITSANDBYTES_REPACK_FIXED_IN to
    the installed release); the version check turns the workaround off from the release it names; and a model whose
    weight was repacked anyway is refused when it is put into training mode."""
    from importlib.metadata import version

    from transformers import LlamaConfig, LlamaForCausalLM

    from modeling_fiber_bundle import FiberBundleForCausalLM, modeling_fiber_bundle as modeling

    llama = repackable.parent / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(llama)
    source = LlamaForCausalLM.from_pretrained(llama, quantization_config=quantization(4))
    with torch.no_grad():
        source(IDS)
    assert is_repacked(source.train().model.layers[0].self_attn.q_proj), \
        f"bitsandbytes {version('bitsandbytes')} no longer repacks a 4-bit weight in place for good: set " \
        "BITSANDBYTES_REPACK_FIXED_IN to its release, so that the workaround goes"
    assert modeling.bitsandbytes_repacks_in_place()
    untouched = LlamaForCausalLM.from_pretrained(llama, quantization_config=quantization(4))
    modeling.keep_4bit_weights_trainable(untouched)  # any model, not only this project's
    with torch.no_grad():
        untouched(IDS)
    assert not is_repacked(untouched.model.layers[0].self_attn.q_proj)

    installed = tuple(int(part) for part in re.findall(r"\d+", version("bitsandbytes"))[:3])
    for fixed_in, kept_off in ((installed, False), ((*installed[:2], installed[2] + 1), True)):
        monkeypatch.setattr(modeling, "BITSANDBYTES_REPACK_FIXED_IN", fixed_in)
        model = FiberBundleForCausalLM.from_pretrained(repackable, quantization_config=quantization(4))
        with torch.no_grad():
            model(IDS)
        assert is_repacked(model.model.layers[0].mlp.down_proj) is not kept_off, fixed_in

    model.model.layers[0].mlp.down_proj.support_avx512bf16_for_cpu = True  # switched back on by hand
    with torch.no_grad():
        model(IDS)
    with pytest.raises(RuntimeError, match="model.layers.0.mlp.down_proj holds its 4-bit weight in bitsandbytes' CPU "
                                           "inference layout .* Reload the model"):
        model.train()


def test_bitsandbytes_optional_kernel_notice_is_dropped_and_nothing_else():
    """Importing the project, then peft (which imports bitsandbytes), prints nothing of bitsandbytes' notice that an
    optional CPU kernel did not load (logged on CPUs with AVX-512 BF16 at import; sent here by hand too, so the filter
    is checked on every host), nor the `kernels` package's notice that precedes it offline, while any other warning
    from the same loggers still reaches the user."""
    import os
    import subprocess
    import sys

    script = """
import logging
import modeling_fiber_bundle  # every command imports it first
import peft  # imports bitsandbytes
logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please ...")
logger.warning("another bitsandbytes warning")
offline = logging.getLogger("kernels._internals.hf_hub")  # the `kernels` package, before that notice, when offline
offline.warning("Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging ...")
offline.warning("Skipping publisher trust check for 'someone/other-kernel' because Hugging Face Hub is offline.")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernels-community" not in result.stderr and "another bitsandbytes warning" in result.stderr, result.stderr
    assert "someone/other-kernel" in result.stderr, result.stderr


def test_modes_that_cannot_train_a_quantised_model_are_refused(folder, tmp_path, capsys, monkeypatch):
    """Before any weight is loaded: full (every weight would need a gradient) and metric-only (the Trainer trains a
    quantised model only through adapters), each naming --mode lora; both bit widths at once; and the same refusal
    from prepare_for_training on a model already loaded quantised."""
    from modeling_fiber_bundle import FiberBundleForCausalLM

    data = train_text(tmp_path, 400)
    quantised = FiberBundleForCausalLM.from_pretrained(folder, quantization_config=quantization(4))

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(FiberBundleForCausalLM, "from_pretrained", refuse)
    cases = [("full", "--load-in-4bit", "the model's weights are quantised (bitsandbytes) and --mode full trains "
                                        "every weight, which needs full-precision weights: use --mode lora"),
             ("metric-only", "--load-in-8bit", "the model's weights are quantised (bitsandbytes) and transformers' "
                                               "Trainer trains a quantised model only through adapters: use --mode "
                                               "lora")]
    for mode, flag, message in cases:
        code = main(["train", str(folder), str(tmp_path / "out"), "--data", str(data), "--mode", mode, flag])
        assert code == 1 and f"fiber-bundle train: error: {message}" in capsys.readouterr().err, mode
    code = main(["train", str(folder), str(tmp_path / "out"), "--data", str(data), "--mode", "lora",
                 "--load-in-4bit", "--load-in-8bit"])
    assert code == 1 and "pass one of --load-in-4bit and --load-in-8bit, not both" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    for mode in ("full", "metric-only"):
        with pytest.raises(ValueError, match=f"quantised \\(bitsandbytes\\) and .*--mode lora"):
            prepare_for_training(quantised, mode)


def test_merge_names_what_is_missing(folder, tmp_path, capsys):
    assert main(["merge", str(folder), str(tmp_path / "out")]) == 1
    assert "holds no adapter_config.json: pass the OUTPUT of fiber-bundle train --mode lora" in capsys.readouterr().err
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    assert main(["merge", str(adapter), str(tmp_path / "out")]) == 1
    assert "names no base model: pass --base" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
