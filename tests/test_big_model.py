"""Big models. Loading: ``from_pretrained(..., device_map="auto", max_memory=..., offload_folder=...)`` with a budget
smaller than the model (part on the CPU, the rest offloaded to disk) gives the tokens of a normal load, and loading
never holds the model's weights twice (transformers builds the model on the meta device and fills it from the
checkpoint). Sharded training: what FSDP through the Trainer does on this CPU-only machine (docs/distributed.md)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import random_ids, set_gates, tiny_model
from modeling_fiber_bundle import FiberBundleConfig, FiberBundleForCausalLM


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def offloaded_load(folder, budget_bytes, offload_folder, **kwargs):
    """``folder`` loaded with at most ``budget_bytes`` of weights in CPU memory, the rest offloaded to disk."""
    return FiberBundleForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": budget_bytes},
                                                  offload_folder=offload_folder, **kwargs)


def check_placement(model):
    """The first decoder layer on the CPU and later ones on disk, and no decoder layer split (``_no_split_modules``):
    every entry of the device map is a whole layer or a module outside the layers."""
    device_map = model.hf_device_map
    assert device_map["model.layers.0"] == "cpu" and "disk" in device_map.values(), device_map
    for name in device_map:
        if name.startswith("model.layers."):
            assert name.count(".") == 2, f"{name}: a decoder layer is split across devices"


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_model_offloaded_to_disk_generates_as_a_normal_load(tmp_path, tie):
    # the metric away from its graft; 4 layers, so that the budget (60% of the weights' bytes) holds one of them
    model = set_gates(tiny_model(dtype=torch.float32, tie_word_embeddings=tie, num_hidden_layers=4))
    model.save_pretrained(tmp_path / "model")
    ids = random_ids(2, 9)
    normal = FiberBundleForCausalLM.from_pretrained(tmp_path / "model")
    offloaded = offloaded_load(tmp_path / "model", int(0.6 * parameter_bytes(normal)), tmp_path / "offload")
    check_placement(offloaded)
    assert (offloaded.lm_head.weight is offloaded.model.embed_tokens.weight) == tie
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, normal(ids).logits, rtol=0, atol=0)
    want = normal.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    got = offloaded.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.heavy
def test_converted_smollm2_offloaded_to_disk_generates_as_a_normal_load(converted, tmp_path):
    """The real checkpoint, loaded as a user does (AutoModelForCausalLM, trust_remote_code; in this process the
    package's registered class answers) with 40% of its weights' bytes as the CPU budget: the rest goes to disk, and
    greedy decoding gives the normal load's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted, trust_remote_code=True)
    ids = tokenizer("The capital of France is", return_tensors="pt")
    normal = AutoModelForCausalLM.from_pretrained(converted, trust_remote_code=True)
    want = normal.generate(**ids, max_new_tokens=4, do_sample=False)
    budget = int(0.4 * parameter_bytes(normal))
    del normal
    offloaded = AutoModelForCausalLM.from_pretrained(converted, trust_remote_code=True, device_map="auto",
                                                     max_memory={"cpu": budget}, offload_folder=tmp_path / "offload")
    check_placement(offloaded)
    assert offloaded.lm_head.weight is offloaded.model.embed_tokens.weight  # SmolLM2 ties its embeddings
    assert torch.equal(offloaded.generate(**ids, max_new_tokens=4, do_sample=False), want)


# Run in a fresh process: the growth of peak resident memory (VmHWM, reset first through /proc/self/clear_refs) while
# from_pretrained runs, as a multiple of the loaded model's parameter bytes. Resident memory counts the checkpoint's
# pages that the load reads through its memory map as well as the tensors it allocates.
MEASURE_LOAD = textwrap.dedent(
    """
    import json, sys
    import torch
    from modeling_fiber_bundle import FiberBundleForCausalLM

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    folder, kwargs = sys.argv[1], json.loads(sys.argv[2])
    if "dtype" in kwargs:
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size
    before = status("VmHWM")
    model = FiberBundleForCausalLM.from_pretrained(folder, **kwargs)
    growth = status("VmHWM") - before
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak_growth": growth, "parameter_bytes": size}))
    """
)


def peak_load_growth(folder, **kwargs) -> dict:
    result = subprocess.run([sys.executable, "-c", MEASURE_LOAD, str(folder), json.dumps(kwargs)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mid_size_folder(tmp_path_factory):
    """A randomly initialised model of about 100 MB in float32, large enough for its weights to dominate the memory a
    load measures."""
    folder = tmp_path_factory.mktemp("mid") / "model"
    config = FiberBundleConfig(vocab_size=16000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                               tie_word_embeddings=False)
    FiberBundleForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.heavy  # three fresh processes, about 45 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_never_holds_the_weights_twice(mid_size_folder, tmp_path):
    """In the checkpoint's dtype the loaded parameters are views of the memory-mapped file: peak memory grows by a
    small fraction of the model (0.11-0.14 measured, with and without disk offload), where a model allocated before
    being filled would add 1. Cast to bfloat16, the load reads the float32 file (2x the loaded bytes) and allocates the
    model once (1x): 3.14x measured, where a second allocation would make it 4.1x."""
    same = peak_load_growth(mid_size_folder)
    assert same["parameter_bytes"] > 90e6
    assert same["peak_growth"] < 0.5 * same["parameter_bytes"], same
    offloaded = peak_load_growth(mid_size_folder, device_map="auto", max_memory={"cpu": 40_000_000},
                                 offload_folder=str(tmp_path / "offload"))
    assert offloaded["peak_growth"] < 0.5 * offloaded["parameter_bytes"], offloaded
    cast = peak_load_growth(mid_size_folder, dtype="bfloat16")
    file_bytes = 2 * cast["parameter_bytes"]
    assert cast["peak_growth"] < file_bytes + 1.6 * cast["parameter_bytes"], cast


@pytest.mark.heavy  # two processes under a launcher, 20-40 s
@pytest.mark.parametrize("launch", ["trainer-fsdp", "accelerate-use-fsdp"])
def test_fsdp_on_cpu_is_refused_not_silently_replaced_by_ddp(tmp_path, launch):
    """Two processes with use_cpu=True (gloo) and FSDP asked for, through TrainingArguments under torchrun or through
    ``accelerate launch --use_fsdp``: accelerate 1.15 applies FSDP only on accelerators, and the Trainer would train
    plain DDP; training refuses with the fix instead, before the first step. (FSDP version 1 is refused by accelerate
    itself, no accelerator device; docs/distributed.md has both.)"""
    import shutil
    from pathlib import Path

    from helpers import torchrun_command

    worker = [str(Path(__file__).parent / "ddp_worker.py"), str(tmp_path), "4"]
    if launch == "trainer-fsdp":
        fsdp_config = {"version": 2, "transformer_layer_cls_to_wrap": ["FiberBundleDecoderLayer"]}
        fields = {"fsdp": True, "fsdp_config": fsdp_config}
        command = [*torchrun_command(2), *worker, json.dumps(fields)]
    else:
        accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
        command = [accelerate, "launch", "--use_fsdp", "--fsdp_version", "2", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *worker]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0, result.stderr[-3000:]
    assert "fsdp was asked for, but accelerate runs this job as MULTI_CPU without FSDP" in result.stderr
    assert "Drop fsdp / fsdp_config to train with DDP on CPU" in result.stderr
    assert not (tmp_path / "result.json").exists() and not any(tmp_path.glob("run/checkpoint-*"))
