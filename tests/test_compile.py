"""Compiled training (docs/design.md 1.5, "Compiled"): ``torch.compile(model, fullgraph=True)`` of the causal LM's forward
with labels and its backward, in every configuration users train, gives the eager loss and gradients, compiles as one
graph, and compiles once per shape.

Tiny shapes in float32 (what compiled training runs in). Tolerances: inductor fuses and reorders float32 reductions, so
the compiled step differs from the eager one by rounding only: loss to ``LOSS_TOL`` relative, every gradient to
``GRAD_TOL`` of its largest entry (measured differences are about 1e-7 and 1e-6 of those)."""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import random_ids, set_gates, tiny_model

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
LENGTH = 16


def lora(model):
    from fiber_bundle.training.modes import prepare_for_training

    return prepare_for_training(model, "lora", lora_r=4)


def metric_only(model):
    from fiber_bundle.training.modes import prepare_for_training

    return prepare_for_training(model, "metric-only")


def checkpointed(model):
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


# configuration name -> (config overrides, how the model is prepared, whether the batch is left-padded). The first
# runs in every pass of the suite: both metrics, geometry_recompute (the default), the MLP step in the code's
# coordinates, the geometry regularisers and a left-padded batch in one graph; the others are heavy (each compiles for
# 20-60 s on 2 cores).
CASES = {
    "regularisers-padding": (dict(curvature_weight=0.3, torsion_weight=0.2), None, True),
    "plain": ({}, None, False),
    "no-recompute": (dict(geometry_recompute=False), None, False),
    "factor-route": (dict(metric_hidden=64), None, False),  # r_f m > D: the MLP step builds its factors
    "activation-checkpointing": ({}, checkpointed, False),
    "lora": ({}, lora, False),
    "metric-only": ({}, metric_only, False),
    "padding": ({}, None, True),
}


def batch(seed, length=LENGTH, padded=False):
    ids = random_ids(2, length, seed=seed)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0  # left padding, as generation batches and padded fine-tuning batches have
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def step(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def build(case):
    overrides, prepare, _ = CASES[case]
    model = set_gates(tiny_model(dtype=torch.float32, **{"metric_hidden": 16, **overrides})).train()
    return prepare(model) if prepare else model


def assert_same_step(eager, compiled):
    (loss_e, grads_e), (loss_c, grads_c) = eager, compiled
    torch.testing.assert_close(loss_c, loss_e, rtol=LOSS_TOL, atol=0)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name, grad in grads_e.items():
        scale = grad.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(grads_c[name], grad, rtol=0, atol=GRAD_TOL * float(scale),
                                   msg=lambda m: f"{name}: {m}")


# peft 0.21 itself reads the deprecated `is_gradient_checkpointing` property; nothing of ours does
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("case", [case if i == 0 else pytest.param(case, marks=pytest.mark.heavy)
                                  for i, case in enumerate(CASES)])
def test_compiled_training_step_is_one_graph_with_the_eager_loss_and_gradients(case):
    torch.compiler.reset()
    eager = build(case)
    compiled_model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(compiled_model, fullgraph=True, backend=counter)  # fullgraph: a graph break raises
    padded = CASES[case][2]
    for seed in (0, 1):  # a second batch of the same shape: the same graph, no recompile
        inputs = batch(seed, padded=padded)
        assert_same_step(step(eager, inputs), step(compiled, inputs))
        assert counter.frame_count == 1, f"{case}: {counter.frame_count} graphs after batch {seed}"


@pytest.mark.heavy
def test_train_command_with_torch_compile_compiles_without_a_graph_break(tmp_path, capsys):
    """`fiber-bundle train --torch-compile` (transformers' TrainingArguments.torch_compile) trains a from-scratch model
    through the compiled model, with no graph break, and lowers the held-out loss."""
    from torch._dynamo.utils import counters

    from fiber_bundle.cli import main

    torch.compiler.reset()
    counters.clear()
    text = (tmp_path / "train.txt", tmp_path / "eval.txt")
    text[0].write_text("def add(a, b):\n    return a + b\n" * 60)
    text[1].write_text("def add(x, y):\n    return x + y\n" * 10)
    assert main(["train", str(tmp_path / "out"), "--from-config", "tiny", "--max-steps", "6", "--batch-size", "2",
                 "--block-size", "32", "--learning-rate", "1e-2", "--torch-compile", "--quiet",
                 "--data", str(text[0]), "--eval-data", str(text[1])]) == 0
    printed = capsys.readouterr().out
    before, after = (float(x) for x in printed.split("eval loss: ")[1].split()[0::2])
    assert after < before
    assert counters["stats"]["unique_graphs"] >= 1, "the Trainer did not compile the model"
    assert not counters["graph_break"], dict(counters["graph_break"])
