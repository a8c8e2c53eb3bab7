"""Tensor parallelism: the model's plan (``FiberBundleConfig.base_model_tp_plan``) splits the metric by head as it
splits q/k/v, and transformers' ``tp_plan="auto"`` on two CPU processes (gloo) gives the one-process logits and
gradients (docs/distributed.md, "Tensor parallelism")."""

import re

import pytest
import torch
from helpers import set_gates, tiny_model

# The per-head parameters: one slice per query head (q_proj's split) or per KV head (k_proj's split), on dimension 0
PER_HEAD = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fiber.attn_factor_proj", "fiber.attn_gate",
            "fiber.flatness_gate")
# The metric's parameters shared by every head: whole on every rank, under no rule
SHARED = ("fiber.code_proj.weight", "fiber.ffn_factor_proj.weight", "fiber.ffn_factor_proj.bias", "fiber.ffn_gate")
FULL_CONFIG = dict(qk_norm=True, attention_bias=True, mlp_bias=True)


def style_of(plan, name):
    """The plan's style for a parameter, as transformers looks it up: a rule naming the parameter, else its module."""
    generic = re.sub(r"\.\d+(\.|$)", r".*\1", name)
    return plan.get(generic, plan.get(generic.rpartition(".")[0]))


@pytest.mark.parametrize("sharing", ["head", "kv_group"])
def test_plan_splits_every_per_head_parameter_like_q_proj(sharing):
    """Every per-head parameter (q/k/v, the metric factors W_U, the gates theta and gamma) is split on its head axis
    with q_proj's style; every other parameter of the metric (W_z, W_V, beta: they act on the whole hidden vector, which
    the MLP preconditioner sees after down_proj's all-reduce) is known and kept whole; the metric module, which reads
    its gates itself, runs on its local shards."""
    model = tiny_model(metric_factor_sharing=sharing, **FULL_CONFIG)
    plan = model.tp_plan
    q_style = style_of(plan, "model.layers.0.self_attn.q_proj.weight")
    assert q_style == "colwise"
    for name, _ in model.named_parameters():
        style = style_of(plan, name)
        if any(f".{part}." in f"{name}." for part in PER_HEAD):
            assert style == q_style, f"{name} holds one slice per head but the plan gives it {style!r}"
        elif ".fiber." in name:
            assert name.endswith(SHARED), f"{name}: a new parameter of the metric; give it its rule in the plan"
            # None, or for a bare parameter (beta) its module's local_params rule, which shards nothing
            assert style in (None, "local_params"), f"{name} is shared by every head, but the plan gives it {style!r}"
    assert plan["model.layers.*.fiber"] == "local_params"
    for norm in ("q_norm", "k_norm"):  # one weight for every head: whole, its gradient summed over the ranks
        assert style_of(plan, f"model.layers.0.self_attn.{norm}.weight") == "replicated_with_grad_allreduce"


def test_plan_keeps_only_the_rules_that_name_something():
    """A model without the optional modules (no q/k norm, no attention metric) carries no rule for them, so a
    tensor-parallel load warns of no unused rule; the full model keeps every rule of the config's plan."""
    full = tiny_model(**FULL_CONFIG)
    assert {f"model.{rule}" for rule in full.config.base_model_tp_plan} <= set(full.tp_plan)
    plain = tiny_model(metric_rank=0)
    names = {re.sub(r"\.\d+(\.|$)", r".*\1", n) for n, _ in [*plain.named_modules(), *plain.named_parameters()]}
    assert set(plain.tp_plan) <= names
    assert "model.layers.*.fiber" in plain.tp_plan  # the MLP metric is still there
    assert "model.layers.*.fiber.attn_gate" not in plain.tp_plan
    assert "model.layers.*.self_attn.q_norm" not in plain.tp_plan


@pytest.mark.heavy
def test_two_process_tensor_parallel_matches_one_process(tmp_path):
    """torchrun --standalone --nproc_per_node 2, ``from_pretrained(..., distributed_config=DistributedConfig(
    tp_plan="auto"))`` over gloo on CPU, the metric awake: with factors per KV group, and per head with Qwen3's q/k
    norms and q/k/v/o biases, the logits, the loss, every gradient and 8 greedy tokens (through the cache) equal one
    process's; each rank holds half the heads of q_proj, of W_U and of the gates, and all of W_z and W_V, whose
    gradients agree on both ranks."""
    import subprocess
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from helpers import random_ids, torchrun_command

    folders = []
    for sharing, extra in (("kv_group", {}), ("head", dict(qk_norm=True, attention_bias=True))):
        folder = tmp_path / sharing
        set_gates(tiny_model(dtype=torch.float32, metric_factor_sharing=sharing, **extra)).save_pretrained(folder)
        torch.save(random_ids(2, 12), folder / "ids.pt")
        folders.append(folder)
    worker = Path(__file__).parent / "tp_worker.py"
    command = [*torchrun_command(2), str(worker), *map(str, folders)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    for folder in folders:
        tp = torch.load(folder / "tp.pt")
        ids = torch.load(folder / "ids.pt")
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
        with torch.no_grad():
            logits = model.eval()(ids).logits
        loss = model.train()(ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(tp["logits"], logits, rtol=1e-5, atol=1e-5)
        expected = model.generate(ids[:1], max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert torch.equal(tp["tokens"], expected)
        torch.testing.assert_close(tp["loss"], loss.detach(), rtol=1e-6, atol=1e-6)
        for name, param in model.named_parameters():
            torch.testing.assert_close(tp["grads"][name], param.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{folder.name} {name}: {m}")
        ranks = tp["ranks"]
        assert len(ranks) == 2
        layer = "model.layers.0"
        for part in ("self_attn.q_proj.weight", "fiber.attn_factor_proj.weight", "fiber.attn_factor_proj.bias",
                     "fiber.attn_gate", "fiber.flatness_gate"):
            full = model.get_parameter(f"{layer}.{part}").shape
            assert all(rank["shapes"][f"{layer}.{part}"] == (full[0] // 2, *full[1:]) for rank in ranks), part
        for part in ("fiber.code_proj.weight", "fiber.ffn_factor_proj.weight", "fiber.ffn_gate"):
            assert all(rank["shapes"][f"{layer}.{part}"] == tuple(model.get_parameter(f"{layer}.{part}").shape)
                       for rank in ranks), part
        for name, grad in ranks[0]["replicated_grads"].items():  # replicated weights stay equal after a step
            torch.testing.assert_close(ranks[1]["replicated_grads"][name], grad, rtol=0, atol=0)


def test_a_head_count_the_processes_do_not_divide_is_refused_before_sharding():
    """transformers would give a rank half a head (its colwise split allows a shorter last slice) and fail later in a
    reshape; the model refuses at load time, naming the counts and the process counts that fit."""
    from transformers.distributed import DistributedConfig

    from modeling_fiber_bundle import FiberBundleForCausalLM

    model = tiny_model(num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) and num_key_value_heads \(3\) must be multiples "
                                         r"of tp_size \(2\).*divides both \(3\)"):
        FiberBundleForCausalLM.maybe_distribute_model(model, DistributedConfig(tp_size=2), None)
    for tp_size in (1, 3):  # no mesh: transformers returns the model as it is
        assert FiberBundleForCausalLM.maybe_distribute_model(model, DistributedConfig(tp_size=tp_size), None) is model
