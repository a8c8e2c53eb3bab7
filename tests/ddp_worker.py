"""Run by tests/test_training.py under ``torchrun --standalone --nproc_per_node N``: a few full-mode steps of the tiny
model with DDP over gloo on CPU (a checkpoint every 2 steps), then the parameter checksums and peak memory of every rank,
the training time, and rank 0's weights. Arguments: OUT PER_DEVICE_BATCH [JSON of further train_model fields]."""

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from helpers import tiny_model  # noqa: E402
from test_training import pattern_dataset  # noqa: E402

from fiber_bundle.training.trainer import train_model  # noqa: E402

out, per_device = Path(sys.argv[1]), int(sys.argv[2])
fields = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
trainer = train_model(
    tiny_model(dtype=torch.float32), pattern_dataset(n=8), out / "run", mode="full", max_steps=4,
    learning_rate=3e-3, batch_size=per_device, use_cpu=True, ddp_find_unused_parameters=False, seed=0,
    save_strategy="steps", save_steps=2,  # staged checkpoints: every rank's files are in before the rename
    **fields,
)
model = trainer.model
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
world = trainer.args.world_size
peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # this process's peak resident memory
checksums, peaks = [None] * world, [None] * world
if dist.is_initialized():
    dist.all_gather_object(checksums, checksum)
    dist.all_gather_object(peaks, peak_mib)
else:
    checksums, peaks = [checksum], [peak_mib]
runtime = next((entry["train_runtime"] for entry in trainer.state.log_history if "train_runtime" in entry), None)
if trainer.args.process_index == 0:
    torch.save(model.state_dict(), out / "weights.pt")
    (out / "result.json").write_text(json.dumps({"world_size": world, "checksums": checksums,
                                                 "parallel_mode": str(trainer.args.parallel_mode),
                                                 "peak_rss_mib": peaks, "train_runtime_s": runtime}))
if dist.is_initialized():  # why: an undestroyed gloo group can abort a rank at interpreter exit (SIGABRT)
    dist.barrier()
    dist.destroy_process_group()
