"""Run by tests/test_fsdp.py under ``torchrun --standalone --nproc_per_node 2``: torch's FSDP2 (``fully_shard`` on
every decoder layer and on the root, gloo on CPU) trains the saved folder given, each rank on its own rows of
``ids.pt``; rank 0 writes ``fsdp.pt``: the loss of every step, the full gradients of the first, the full weights after
the last, the weights after one more step from a ``torch.distributed.checkpoint`` restore, and the logits of a model
built on the meta device, sharded, and initialised by ``init_geometry`` over the backbone's weights."""

import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from modeling_fiber_bundle import FiberBundleConfig, FiberBundleForCausalLM

STEPS = 3
LR = 1e-2


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def sharded_model(config, mesh):
    """The model built on the meta device (no memory), every decoder layer and the root sharded, then given CPU memory:
    FSDP2's usual path for a model too large for one process."""
    with torch.device("meta"):
        model = FiberBundleForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # why: gloo has no ReduceOp.AVG for reduce-scatter (pytorch#162338): sum, then divide by the world size
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    # to_empty leaves every tensor uninitialised, the buffers no state dict holds (RoPE's frequencies) included:
    # transformers' init_weights fills them, and the parameters until a state dict is loaded
    model.init_weights()
    return model


def load_full(model, state_dict, strict=True):
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))


folder = Path(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
config = FiberBundleConfig.from_pretrained(folder)
weights = load_file(folder / "model.safetensors")
ids = torch.load(folder / "ids.pt")
rows = ids.chunk(world)[rank]  # this rank's rows: as many tokens per rank, so the average of the ranks' mean losses
# is the one-process mean loss

model = sharded_model(config, mesh)
load_full(model, weights)
shapes = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
losses, grads, seconds = [], None, []
for step in range(STEPS):
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model.train()(rows, labels=rows).loss
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean / world)
    if step == 0:
        grads = {name: full(p.grad) for name, p in model.named_parameters()}
    optimizer.step()
    seconds.append(time.perf_counter() - start)
weights_after = {name: full(p.detach()) for name, p in model.named_parameters()}

# a sharded checkpoint, restored into a fresh sharded model and optimiser, resumes to the same weights
checkpoint = folder / "dcp"
dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
         checkpoint_id=checkpoint)
restored = sharded_model(config, mesh)
restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=LR)
state = {"model": get_model_state_dict(restored), "optim": get_optimizer_state_dict(restored, restored_optimizer)}
dcp.load(state, checkpoint_id=checkpoint)
set_model_state_dict(restored, state["model"])
set_optimizer_state_dict(restored, restored_optimizer, state["optim"])
for m, opt in ((model, optimizer), (restored, restored_optimizer)):  # one more step on both
    opt.zero_grad(set_to_none=True)
    m.train()(rows, labels=rows).loss.backward()
    opt.step()
resumed = {name: (full(p.detach()), full(q.detach()))
           for (name, p), (_, q) in zip(model.named_parameters(), restored.named_parameters(), strict=True)}

# meta-device initialisation: the backbone's weights loaded, the metric initialised by init_geometry (its graft)
fresh = sharded_model(config, mesh)
load_full(fresh, {k: v for k, v in weights.items() if ".fiber." not in k}, strict=False)
fresh.init_geometry(seed=0)
with torch.no_grad():
    fresh_logits = fresh.eval()(ids).logits
fresh_params = {name: full(p.detach()) for name, p in fresh.named_parameters() if ".fiber." in name}

everyone = [None] * world
dist.all_gather_object(everyone, shapes)
# what each process cost: the median training step after the first, and its peak resident memory
costs = [None] * world
dist.all_gather_object(costs, (sorted(seconds[1:])[len(seconds[1:]) // 2], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
if rank == 0:
    torch.save({"losses": torch.stack(losses), "grads": grads, "weights": weights_after, "resumed": resumed,
                "fresh_logits": fresh_logits, "fresh_fiber": fresh_params, "shapes": everyone}, folder / "fsdp.pt")
    for r, (step_s, peak_mib) in enumerate(costs):
        print(f"rank {r}: step {1000 * step_s:.1f} ms (median after the first), peak RSS {peak_mib:.0f} MiB")
dist.barrier()  # why: an undestroyed gloo group can abort a rank at interpreter exit (SIGABRT)
dist.destroy_process_group()
