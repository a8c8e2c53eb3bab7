"""Run by tests/test_tensor_parallel.py under ``torchrun --standalone --nproc_per_node 2``: each saved folder given is
loaded with transformers' tensor parallelism (``DistributedConfig(tp_plan="auto")``, gloo on CPU); rank 0 writes the
logits of ``ids.pt``, the loss and full gradients of one training step, 8 greedy tokens, and what every rank
holds."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


for folder in map(Path, sys.argv[1:]):
    ids = torch.load(folder / "ids.pt")
    model = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto")
    )
    with torch.no_grad():
        logits = model.eval()(ids).logits
    loss = model.train()(ids, labels=ids).loss  # the training path: checkpointed metric, DTensor layers
    loss.backward()
    grads = {name: full(p.grad) for name, p in model.named_parameters()}
    with torch.no_grad():
        geometry = model.eval()(ids, output_geometry=True).geometry
    tokens = model.generate(ids[:1], max_new_tokens=8, min_new_tokens=8, do_sample=False)  # through the KV cache
    rank = {  # what each rank holds: its parameter shards, its replicated gradients, its geometry proxies
        "shapes": {name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
                   for name, p in model.named_parameters()},
        "replicated_grads": {name: p.grad for name, p in model.named_parameters() if not isinstance(p, DTensor)},
        "geometry": geometry,
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rank)
    if dist.get_rank() == 0:
        torch.save({"logits": logits, "loss": loss.detach(), "grads": grads, "tokens": tokens, "ranks": ranks},
                   folder / "tp.pt")
    del model
dist.barrier()  # why: an undestroyed gloo group can abort a rank at interpreter exit (SIGABRT)
dist.destroy_process_group()
