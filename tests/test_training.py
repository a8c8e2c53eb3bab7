"""Training: on a tiny model at its graft point (as a converted checkpoint starts) the loss falls in each mode,
metric-only changes only the metric, LoRA adapters round-trip and merge, geometry is logged, data is packed, and
``fiber-bundle train`` runs end to end."""

import pytest
import torch
from datasets import Dataset

from helpers import set_gates, tiny_model
from fiber_bundle.training import LORA_TARGET_MODULES, prepare_for_training, trainable_parameter_names
from fiber_bundle.training.trainer import train_model
from modeling_fiber_bundle import FiberBundleForCausalLM

# peft 0.21 itself reads the deprecated `is_gradient_checkpointing` property; nothing of ours does
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def pattern_dataset(n=64, length=32, seed=0):
    """Sequences that follow a learnable rule (each token predicts the next), so a few steps reduce the loss."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(3, 60, (n, 1), generator=gen)
    ids = (starts + torch.arange(length)[None] * 3) % 90 + 3
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def pretrained_tiny(tmp_path):
    """A tiny model whose backbone has learned the data a little, at the graft point of its geometry: what a converted
    checkpoint is (a random backbone has near-uniform logits that no metric can reshape)."""
    model = tiny_model(dtype=torch.float32)
    train_model(model, pattern_dataset(seed=1), tmp_path / "pretrain", mode="full", max_steps=40, learning_rate=3e-3,
                use_cpu=True)
    with torch.no_grad():  # back to the graft point: the geometry neutral, as conversion leaves it
        for name, p in model.named_parameters():
            if name.endswith(("attn_gate", "flatness_gate", "ffn_gate")):
                p.zero_()
    return model


def dataset_loss(model, dataset) -> float:
    ids = torch.tensor(dataset["input_ids"])
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


# (mode, learning rate, steps, least fall of the loss): the metric alone moves a tiny model's loss less than the
# backbone does (measured: 1.1276 -> 1.1200 in 48 steps), but far more than float rounding (~1e-6)
MODES = [("full", 3e-3, 24, 0.01), ("metric-only", 5e-2, 48, 3e-3), ("lora", 1e-2, 24, 5e-3)]


@pytest.mark.parametrize("mode,lr,steps,least_fall", MODES)
def test_training_loss_falls_in_every_mode(tmp_path, mode, lr, steps, least_fall):
    model, data = pretrained_tiny(tmp_path), pattern_dataset()
    before = dataset_loss(model, data)
    trainer = train_model(model, data, tmp_path / mode, mode=mode, max_steps=steps, learning_rate=lr, batch_size=8,
                          use_cpu=True)
    assert len(losses(trainer)) == steps  # every step logged its loss
    after = dataset_loss(trainer.model, data)
    assert after < before - least_fall, (before, after)


def test_metric_only_changes_only_the_metric(tmp_path):
    model = tiny_model(dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_model(model, pattern_dataset(), tmp_path, mode="metric-only", max_steps=5, learning_rate=3e-2, use_cpu=True)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(".fiber." in k for k in changed)
    assert {k for k in changed if "gate" in k}  # the gates moved off the graft


def test_lora_trains_adapters_and_the_fiber_and_round_trips(tmp_path):
    from peft import PeftModel

    wrapped = prepare_for_training(tiny_model(dtype=torch.float32), "lora", lora_r=4)
    names = trainable_parameter_names(wrapped)
    assert any(".fiber." in n for n in names)  # the metric trains alongside the adapters
    assert not any(n.endswith(("base_layer.weight", "embed_tokens.weight")) for n in names)
    assert {m for m in LORA_TARGET_MODULES if any(f"{m}.lora_A" in n for n in names)} == set(LORA_TARGET_MODULES)

    trainer = train_model(tiny_model(dtype=torch.float32), pattern_dataset(), tmp_path / "run", mode="lora",
                          max_steps=4, learning_rate=1e-2, use_cpu=True, lora_r=4)
    peft_model = trainer.model.eval()
    ids = torch.tensor([[5, 8, 11, 14, 17, 20]])
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_model(dtype=torch.float32), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=0, atol=1e-6)
    merged = reloaded.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    files = {p.name for p in (tmp_path / "merged").iterdir()}
    assert {"modeling_fiber_bundle.py", "fiber_attention.py", "configuration_fiber_bundle.py"} <= files
    assert "adapter_config.json" not in files


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="training mode 'half'"):
        prepare_for_training(tiny_model(), "half")


# ---------------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------------
def test_pack_blocks_cuts_the_joined_token_stream(tmp_path):
    from helpers import tiny_tokenizer
    from fiber_bundle.training.data import load_source, pack_blocks

    docs = ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11 w12"]
    (tmp_path / "a.txt").write_text("\n".join(docs) + "\n")
    tokenizer = tiny_tokenizer()
    packed = pack_blocks(load_source(tmp_path / "a.txt"), tokenizer, block_size=4)
    stream = [3, 4, 5, 2, 6, 7, 2, 8, 9, 10, 11, 12, 2]  # each document then EOS
    assert packed["input_ids"] == [stream[0:4], stream[4:8], stream[8:12]]
    assert packed["labels"] == packed["input_ids"]


def test_sources_by_extension_and_chat_messages(tmp_path):
    import json

    from helpers import tiny_tokenizer
    from fiber_bundle.training.data import load_source, pack_blocks

    rows = [{"messages": [{"role": "w3", "content": "w5 w6"}, {"role": "w4", "content": "w7"}]}] * 3
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    packed = pack_blocks(load_source(tmp_path / "chat.jsonl"), tiny_tokenizer(), block_size=5)
    # rendered "w3 w5 w6 </s> w4 w7 </s> " then EOS, per row: 7 tokens x 3 rows = 21 -> 4 blocks of 5
    assert packed["input_ids"][0] == [3, 5, 6, 2, 4] and len(packed) == 4
    Dataset.from_dict({"text": ["w3 w4"] * 4}).to_parquet(tmp_path / "p.parquet")
    assert load_source(tmp_path / "p.parquet")["text"] == ["w3 w4"] * 4
    with pytest.raises(ValueError, match="does not exist"):
        load_source(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="extensions"):
        load_source([tmp_path / "chat.jsonl", tmp_path / "p.parquet"])


def test_pydoc_topics_split_by_topic():
    from fiber_bundle.training.data import pydoc_topics

    train, held_out = pydoc_topics(eval_fraction=0.1, seed=0)
    assert not set(train["topic"]) & set(held_out["topic"])
    assert len(held_out) >= 1 and len(train) > 5 * len(held_out)
    assert sum(len(t) for t in list(train["text"]) + list(held_out["text"])) > 400_000  # ~465k characters of English


def test_geometry_is_logged_with_the_loss(tmp_path):
    trainer = train_model(tiny_model(dtype=torch.float32), pattern_dataset(), tmp_path, mode="metric-only",
                          max_steps=3, learning_rate=5e-2, use_cpu=True)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    first, last = logs[0], logs[-1]
    for key in ("geometry/curvature", "geometry/torsion", "geometry/anisotropy", "geometry/layer0/alpha",
                "geometry/layer1/gamma", "geometry/layer1/beta"):
        assert key in last, key
    assert last["geometry/layer0/alpha"] != first["geometry/layer0/alpha"]  # the gates move as the metric learns
    assert last["geometry/torsion"] > 0  # off the graft, the metric twists between tokens


def test_geometry_logging_reads_the_trained_copy_under_lora(tmp_path):
    from fiber_bundle.training.geometry_logging import gate_values

    trainer = train_model(tiny_model(dtype=torch.float32), pattern_dataset(), tmp_path, mode="lora", max_steps=3,
                          learning_rate=5e-2, use_cpu=True, lora_r=4)
    values = gate_values(trainer.model)
    assert len(values) == 2 * 3 and any(v != 0 for v in values.values())


def test_train_command_on_a_converted_folder(tmp_path):
    """fiber-bundle train end to end: a converted folder with a tokenizer, text files, metric-only training."""
    from helpers import tiny_tokenizer
    from fiber_bundle.cli import main

    folder = tmp_path / "model"
    pretrained_tiny(tmp_path).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    words = lambda seed: " ".join(f"w{3 + (seed + 3 * i) % 90}" for i in range(400))  # noqa: E731
    (tmp_path / "train.txt").write_text("\n".join(words(s) for s in range(8)) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(words(s) for s in range(50, 52)) + "\n")
    code = main(["train", str(folder), str(tmp_path / "out"), "--data", str(tmp_path / "train.txt"),
                 "--eval-data", str(tmp_path / "eval.txt"), "--block-size", "32", "--max-steps", "30",
                 "--learning-rate", "0.05", "--batch-size", "4"])
    assert code == 0
    trained = FiberBundleForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.expm1(trained.model.layers[0].fiber.attn_gate).abs().max() > 0  # the gates moved
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "modeling_fiber_bundle.py").is_file()
    assert main(["train", str(folder), str(tmp_path / "o2"), "--data", str(tmp_path / "missing.txt")]) == 1


# (mode, optimizer, block): AdamW in each mode, and Riemannian optimisers whose momentum state must come back from the
# checkpoint (an embedded pair's transported tangent, a block Grassmann pair's per-factor buffers, W_Q / W_K per head)
RESUMES = [("full", "adamw", False), ("lora", "adamw", False), ("metric-only", "adamw", False),
           ("lora", "riemannian-embedded", True), ("metric-only", "grassmann", False),
           ("full", "riemannian-quotient", True)]


@pytest.mark.parametrize("mode,optimizer,block", RESUMES)
def test_killed_run_resumes_to_the_same_weights(tmp_path, monkeypatch, mode, optimizer, block):
    """A run stopped after its step-4 checkpoint and restarted from it ends with the weights of an uninterrupted run,
    the optimiser's state (AdamW moments, Riemannian momentum) saved and restored through the Trainer's checkpoint."""
    from transformers import TrainerCallback, set_seed

    from fiber_bundle.training.geometry_logging import GeometryLoggingTrainer

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise KeyboardInterrupt  # the process dies one step after checkpoint-4

    riemannian = dict(optimizer=optimizer, block=block, riemannian_learning_rate=3e-2) if optimizer != "adamw" else {}
    common = dict(mode=mode, max_steps=8, learning_rate=3e-3, batch_size=4, use_cpu=True, save_strategy="steps",
                  save_steps=4, seed=7, quiet=True, **riemannian)
    whole = train_model(tiny_model(dtype=torch.float32), pattern_dataset(), tmp_path / "whole", **common).model
    original_init = GeometryLoggingTrainer.__init__

    def init_with_kill(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(Kill())

    with monkeypatch.context() as patch:
        patch.setattr(GeometryLoggingTrainer, "__init__", init_with_kill)
        with pytest.raises(KeyboardInterrupt):
            train_model(tiny_model(dtype=torch.float32), pattern_dataset(), tmp_path / "killed", **common)
    assert (tmp_path / "killed" / "checkpoint-4").is_dir() and not (tmp_path / "killed" / "checkpoint-8").exists()
    trainer = train_model(tiny_model(dtype=torch.float32), pattern_dataset(), tmp_path / "killed",
                          resume_from_checkpoint=True, **common)
    set_seed(7)  # as train_model does before drawing LoRA's A
    start = prepare_for_training(tiny_model(dtype=torch.float32), mode).state_dict()
    moved = 0
    for (name, a), b in zip(whole.state_dict().items(), trainer.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        moved += name in start and not torch.equal(a, start[name])
    assert moved > 0  # the comparison is of trained weights
    if optimizer != "adamw":
        state = trainer.optimizer.optimizer.state
        assert type(trainer.optimizer.optimizer).__name__ == "FactoredRiemannianOptimizer"
        assert any(key.endswith(("left", "tangent_a", "momentum0")) for s in state.values() for key in s)


@pytest.mark.heavy
def test_two_process_ddp_matches_one_process(tmp_path):
    """torchrun --standalone --nproc_per_node 2 with use_cpu=True (gloo): world size 2, identical parameters on both
    ranks, and the result of one process with the same global batch (every step sees the whole 8-block dataset) within
    what float32 reordering alone makes of it; the staged checkpoints hold both ranks' RNG states."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import torchrun_command

    worker = Path(__file__).parent / "ddp_worker.py"
    runs = {}
    for name, command in (
        ("ddp", [*torchrun_command(2), str(worker), str(tmp_path / "ddp"), "4"]),
        ("single", [sys.executable, str(worker), str(tmp_path / "single"), "8"]),
        # the control: one process computing as each DDP rank does (one thread, as torchrun sets) the same 8 blocks
        # per step as two halves of 4 (gradient accumulation): the float32 sums split as DDP splits them
        ("halves", [sys.executable, str(worker), str(tmp_path / "halves"), "4",
                    json.dumps({"gradient_accumulation_steps": 2})]),
    ):
        (tmp_path / name).mkdir()
        env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if name == "halves" else {})}
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "result.json").read_text())
    assert runs["ddp"]["world_size"] == 2 and "DISTRIBUTED" in runs["ddp"]["parallel_mode"]
    assert runs["ddp"]["checksums"][0] == runs["ddp"]["checksums"][1]  # the ranks hold identical parameters
    assert runs["single"]["world_size"] == 1
    for step in (2, 4):  # written by both processes into the staging folder, renamed into place when complete
        files = {p.name for p in (tmp_path / "ddp" / "run" / f"checkpoint-{step}").iterdir()}
        assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "optimizer.pt"} <= files
    assert not (tmp_path / "ddp" / "run" / ".staging").exists()
    ddp, single, halves = (torch.load(tmp_path / name / "weights.pt") for name in ("ddp", "single", "halves"))
    # The bound: float32 gradients summed in another order (threads, halves) differ in their last bits, and four AdamW
    # steps carry that on, amplified where a gradient is near zero (an update of lr * m / sqrt(v): relative gradient
    # noise becomes weight noise of up to lr per step). The control measures it on this host's kernels; DDP's own sum
    # (gloo's) may reorder a little more, hence 4x, and 1e-6 below which nothing is asked (the old fixed atol). Ranks
    # that train on half the data (both taking rank 0's gradient) are 1.5e-2 away.
    reordering = max((halves[name] - value).abs().max().item() for name, value in single.items())
    bound = max(4 * reordering, 1e-6)
    worst = max(single, key=lambda name: (ddp[name] - single[name]).abs().max().item())
    gap = (ddp[worst] - single[worst]).abs().max().item()
    assert gap <= bound, (worst, gap, bound, reordering)


def test_quiet_training_prints_nothing_but_still_logs(tmp_path, capsys):
    trainer = train_model(tiny_model(dtype=torch.float32), pattern_dataset(), tmp_path, mode="metric-only",
                          max_steps=2, learning_rate=1e-2, use_cpu=True, quiet=True)
    assert "geometry/torsion" not in capsys.readouterr().out
    assert any("geometry/torsion" in entry for entry in trainer.state.log_history)


def test_lora_adapter_loads_with_autopeft_in_a_fresh_process(tmp_path):
    """A LoRA adapter trained on a Fiber Bundle folder reloads with AutoPeftModelForCausalLM + trust_remote_code where
    this project cannot be imported (task_type CAUSAL_LM keeps peft's auto mapping on the Auto classes)."""
    import json

    from helpers import run_without_project

    base = tmp_path / "base"
    tiny_model(dtype=torch.float32).save_pretrained(base)
    model = FiberBundleForCausalLM.from_pretrained(base)
    trainer = train_model(model, pattern_dataset(), tmp_path / "run", mode="lora", max_steps=2, learning_rate=1e-2,
                          use_cpu=True, lora_r=4, quiet=True)
    trainer.model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == str(base)
    ids = torch.tensor([[5, 8, 11, 14]])
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=ids).logits
    script = """
        import torch
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        with torch.no_grad():
            torch.save(model(input_ids=torch.load(sys.argv[2])).logits, sys.argv[3])
    """
    result = run_without_project(script, tmp_path / "adapter", tmp_path / "ids.pt", tmp_path / "out.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=0, atol=1e-6)


def test_train_command_checkpoints_and_resumes(tmp_path):
    from helpers import tiny_tokenizer
    from fiber_bundle.cli import main

    folder = tmp_path / "model"
    tiny_model(dtype=torch.float32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (tmp_path / "train.txt").write_text(" ".join(f"w{3 + i % 90}" for i in range(2000)) + "\n")
    args = ["train", str(folder), str(tmp_path / "out"), "--data", str(tmp_path / "train.txt"), "--block-size", "32",
            "--batch-size", "4", "--save-steps", "3"]
    assert main(args + ["--max-steps", "3"]) == 0
    assert (tmp_path / "out" / "checkpoints" / "checkpoint-3").is_dir()
    assert main(args + ["--max-steps", "6", "--resume"]) == 1  # OUTPUT holds the step-3 model: not replaced unasked
    assert main(args + ["--max-steps", "6", "--resume", "--overwrite"]) == 0  # continues from step 3
    assert (tmp_path / "out" / "checkpoints" / "checkpoint-6").is_dir()
    metrics = __import__("json").loads((tmp_path / "out" / "training_metrics.json").read_text())
    assert metrics["steps"] == 6


def test_lora_run_records_the_hub_base_in_the_adapter(tmp_path):
    import json

    from helpers import tiny_tokenizer
    from fiber_bundle.cli import main

    folder = tmp_path / "model"
    tiny_model(dtype=torch.float32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (tmp_path / "train.txt").write_text(" ".join(f"w{3 + i % 90}" for i in range(800)) + "\n")
    assert main(["train", str(folder), str(tmp_path / "adapter"), "--data", str(tmp_path / "train.txt"),
                 "--mode", "lora", "--lora-r", "4", "--block-size", "32", "--batch-size", "4", "--max-steps", "2",
                 "--base-model-id", "someone/fbt-base"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "someone/fbt-base" and config["task_type"] == "CAUSAL_LM"


def test_train_command_with_a_riemannian_optimizer(tmp_path, capsys):
    """--optimizer grassmann: the metric generators train on the manifold (they end orthonormal), the gates with AdamW;
    the choice is recorded; combinations that cannot work are refused with the fix."""
    import json

    from helpers import tiny_tokenizer
    from fiber_bundle.cli import main
    from fiber_bundle.training import manifolds

    folder = tmp_path / "model"
    tiny_model(dtype=torch.float32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (tmp_path / "train.txt").write_text(" ".join(f"w{3 + (7 * i) % 90}" for i in range(2000)) + "\n")
    args = ["train", str(folder), str(tmp_path / "out"), "--data", str(tmp_path / "train.txt"), "--block-size", "32",
            "--batch-size", "4", "--max-steps", "4", "--learning-rate", "0.05"]
    assert main(args + ["--optimizer", "grassmann", "--riemannian-learning-rate", "0.1", "--retraction", "polar"]) == 0
    metrics = json.loads((tmp_path / "out" / "training_metrics.json").read_text())
    assert [metrics[k] for k in ("optimizer", "riemannian_learning_rate", "block", "retraction")] == [
        "grassmann", 0.1, False, "polar"]
    fiber = FiberBundleForCausalLM.from_pretrained(tmp_path / "out").model.layers[0].fiber
    start = FiberBundleForCausalLM.from_pretrained(folder).model.layers[0].fiber
    generators = torch.cat([fiber.attn_factor_proj.weight, fiber.ffn_factor_proj.weight]).double()
    assert manifolds.orthonormality_error(generators) < 1e-5
    assert manifolds.orthonormality_error(fiber.code_proj.weight.T.double()) < 1e-5
    assert manifolds.orthonormality_error(start.code_proj.weight.T.double()) > 0.5  # it was not, before training
    assert fiber.attn_gate.abs().max() > 0
    capsys.readouterr()
    fresh = args[:2] + [str(tmp_path / "fresh")] + args[3:]  # OUTPUT now holds a model, which is refused first
    assert main(fresh + ["--optimizer", "grassmann", "--block"]) == 1  # a head's W_U block is wider than tall here
    assert "fewer rows than its rank" in capsys.readouterr().err
    assert main(fresh + ["--block"]) == 1
    assert "apply to a Riemannian optimizer" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# what a run records is what it saved
# ----------------------------------------------------------------------------------------------------------------------
RECORDED_RUNS = {  # fiber-bundle train's arguments past MODEL OUTPUT, for each mode (the QLoRA ones need bitsandbytes)
    "full": ["--mode", "full"],
    "metric-only": ["--mode", "metric-only"],
    "lora": ["--mode", "lora"],
    "qlora-4bit": ["--mode", "lora", "--load-in-4bit"],
    "qlora-8bit": ["--mode", "lora", "--load-in-8bit"],
    "from-config": ["--from-config", "CONFIG"],
}

RELOAD_AND_EVALUATE = """
import json, sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from fiber_bundle.training.data import load_source, training_blocks
from fiber_bundle.training.trainer import evaluation_loss

eval_file, outputs = sys.argv[1], sys.argv[2:]
losses = {}
for out in map(Path, outputs):
    metrics = json.loads((out / "training_metrics.json").read_text())
    blocks = training_blocks(load_source([eval_file]), AutoTokenizer.from_pretrained(out), metrics["block_size"],
                             name="eval data")
    quantised = {"4-bit NF4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"), "8-bit": dict(load_in_8bit=True)}
    kwargs = ({"quantization_config": BitsAndBytesConfig(**quantised[metrics["quantization"]])}
              if "quantization" in metrics else {})
    if (out / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained(out, trust_remote_code=True, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, **kwargs)
    losses[out.name] = evaluation_loss(model, blocks, batch_size=metrics["batch_size"])
print(json.dumps(losses))
"""


@pytest.fixture(scope="module")
def recorded_runs(tmp_path_factory):
    """Every mode of fiber-bundle train on the tiny model (a few steps, held-out data given), then one fresh process
    that reloads each OUTPUT as a user would (the Auto classes with the folder's own code; an adapter through
    AutoPeftModelForCausalLM on its base, quantised as it was trained) and evaluates it on the same held-out blocks.
    Returns {mode: (the loss training_metrics.json records, the reloaded output's loss)}."""
    import importlib.util
    import json
    import subprocess
    import sys

    from helpers import tiny_tokenizer
    from test_scratch import write_config

    from fiber_bundle.cli import main

    root = tmp_path_factory.mktemp("recorded")
    base = root / "base"
    model = tiny_model(dtype=torch.float32, intermediate_size=128)
    set_gates(model)
    model.save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    words = [f"w{3 + (3 * i) % 90}" for i in range(1500)]
    (root / "train.txt").write_text(" ".join(words[:1200]) + "\n")
    (root / "eval.txt").write_text(" ".join(words[1200:]) + "\n")
    config = write_config(root / "config.json", metric_gate_init=1.0, flatness_gate_init=1.0)
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    outputs = []
    for mode, extra in RECORDED_RUNS.items():
        if mode.startswith("qlora") and not has_bnb:
            continue
        model_arg = [] if mode == "from-config" else [str(base)]
        extra = [str(config) if arg == "CONFIG" else arg for arg in extra]
        out = root / mode
        assert main(["train", *model_arg, str(out), *extra, "--data", str(root / "train.txt"), "--eval-data",
                     str(root / "eval.txt"), "--block-size", "32", "--batch-size", "4", "--max-steps", "3",
                     "--learning-rate", "1e-2", "--lora-r", "4", "--quiet"]) == 0, mode
        outputs.append(out)
    result = subprocess.run([sys.executable, "-c", RELOAD_AND_EVALUATE, str(root / "eval.txt"), *map(str, outputs)],
                            capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    reloaded = json.loads(result.stdout.strip().splitlines()[-1])
    return {out.name: (json.loads((out / "training_metrics.json").read_text())["eval_loss_after"],
                       reloaded[out.name]) for out in outputs}


@pytest.mark.parametrize("mode", list(RECORDED_RUNS))
def test_the_recorded_loss_is_the_saved_outputs_in_a_fresh_process(recorded_runs, mode):
    """The held-out loss fiber-bundle train records after training (training_metrics.json) is the loss of what it saved,
    reloaded in a fresh process: the same number, since the same weights meet the same blocks in the same batches."""
    if mode.startswith("qlora"):
        pytest.importorskip("bitsandbytes")
    recorded, reloaded = recorded_runs[mode]
    assert reloaded == recorded, (mode, recorded, reloaded)
