"""DeepSpeed ZeRO-3 through the Trainer on two CPU processes (DeepSpeed's CPU accelerator, gloo) trains the model as
DDP does (docs/distributed.md, "DeepSpeed")."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, torchrun_command

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
}


@pytest.mark.heavy
def test_zero3_trains_as_ddp_and_saves_a_loadable_model(tmp_path):
    """torchrun --standalone --nproc_per_node 2 with ``DS_ACCELERATOR=cpu``, ``train_model(..., deepspeed=ZeRO-3
    config)``, every parameter partitioned across the two ranks: the loss of each of four steps equals DDP's on the same
    data, and the checkpoint DeepSpeed gathers at save time reloads (``trust_remote_code=True``) with DDP's weights, the
    metric's included, which the optimiser moved off their initial values."""
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    worker = Path(__file__).parent / "ddp_worker.py"
    histories = {}
    for name, fields in (("ddp", {}), ("zero3", {"deepspeed": ZERO3})):
        out = tmp_path / name
        out.mkdir()
        command = [*torchrun_command(2), str(worker), str(out), "2", json.dumps({"logging_steps": 1, **fields})]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                                env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert result.returncode == 0, result.stderr[-3000:]
        state = json.loads((out / "run" / "checkpoint-4" / "trainer_state.json").read_text())
        histories[name] = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
        costs = json.loads((out / "result.json").read_text())
        print(f"{name}: losses {histories[name]}, {costs['train_runtime_s']:.1f} s for 4 steps, peak RSS per process "
              f"{[round(m) for m in costs['peak_rss_mib']]} MiB")  # the figures of docs/distributed.md (pytest -s)
    assert len(histories["ddp"]) == 4
    assert (tmp_path / "zero3" / "run" / "checkpoint-4" / "global_step4").is_dir()  # DeepSpeed's own checkpoint
    torch.testing.assert_close(torch.tensor(histories["zero3"]), torch.tensor(histories["ddp"]), rtol=1e-5, atol=1e-5)

    saved = tmp_path / "zero3" / "run" / "checkpoint-4"
    model = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True, dtype=torch.float32)
    ddp = torch.load(tmp_path / "ddp" / "weights.pt")
    initial = dict(tiny_model(dtype=torch.float32).named_parameters())  # the worker's starting point
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), ddp[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        if ".fiber." in name and not name.endswith("bias"):
            assert (param.detach() - initial[name].detach()).abs().max() > 0, f"{name} did not train"
