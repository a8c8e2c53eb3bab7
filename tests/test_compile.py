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
# runs in every pass of the suite: both metrics, geometry_recompute (the default), the geometry regularisers and a
# left-padded batch in one graph; the others are heavy (each compiles for 20-60 s on 2 cores).
CASES = {
    "regularisers-padding": (dict(curvature_weight=0.3, torsion_weight=0.2), None, True),
    "plain": ({}, None, False),
    "no-recompute": (dict(geometry_recompute=False), None, False),
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
    # a compiled module's parameters are named through its wrapper(s): "_orig_mod." (the whole model, or each layer)
    return loss.detach(), {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters()
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


def test_regional_compilation_compiles_one_layer_for_every_layer_with_the_eager_step():
    """How --torch-compile trains (accelerate's ``compile_regions``, fullgraph; docs/design.md 1.5 "Compiled"; no KV
    cache, as the Trainer's ``use_cache=False`` sets): each decoder layer compiled alone gives the eager loss and
    gradients (left-padded batch, regularisers on), and a model twice as deep compiles exactly as many frames, the
    layers' code compiled once and reused by every layer."""
    from accelerate.utils import compile_regions

    frames = {}
    for layers in (2, 4):
        torch.compiler.reset()
        eager = set_gates(tiny_model(dtype=torch.float32, metric_hidden=16, num_hidden_layers=layers,
                                     curvature_weight=0.3, torsion_weight=0.2)).train()
        counter = CompileCounterWithBackend("inductor")
        compiled = compile_regions(copy.deepcopy(eager), fullgraph=True, backend=counter)
        for seed in (0, 1):
            inputs = {**batch(seed, padded=True), "use_cache": False}
            assert_same_step(step(eager, inputs), step(compiled, inputs))
        frames[layers] = counter.frame_count
    assert frames[2] == frames[4] >= 1, frames
    torch.compiler.reset()


@pytest.mark.heavy
def test_train_command_with_torch_compile_compiles_without_a_graph_break(tmp_path, capsys):
    """`fiber-bundle train --torch-compile` (transformers' TrainingArguments.torch_compile) trains a from-scratch model
    through the compiled model, with no graph break, and lowers the held-out loss; it compiles by layer, so a model
    twice as deep traces exactly as many operations (the decoder layer's code once for every layer; the whole model as
    one graph traces every layer's copy)."""
    import json

    from torch._dynamo.utils import counters

    from fiber_bundle.cli import main
    from fiber_bundle.training.scratch import PRESET_COMMON, PRESETS

    text = (tmp_path / "train.txt", tmp_path / "eval.txt")
    text[0].write_text("def add(a, b):\n    return a + b\n" * 60)
    text[1].write_text("def add(x, y):\n    return x + y\n" * 10)
    deeper = tmp_path / "tiny-4-layers.json"
    deeper.write_text(json.dumps({**PRESET_COMMON, **PRESETS["tiny"], "num_hidden_layers": 4}))
    graphs = {}
    for layers, config in ((2, "tiny"), (4, str(deeper))):
        torch.compiler.reset()
        counters.clear()
        assert main(["train", str(tmp_path / f"out-{layers}"), "--from-config", config, "--max-steps", "6",
                     "--batch-size", "2", "--block-size", "32", "--learning-rate", "1e-2", "--torch-compile", "--quiet",
                     "--data", str(text[0]), "--eval-data", str(text[1])]) == 0
        printed = capsys.readouterr().out
        before, after = (float(x) for x in printed.split("eval loss: ")[1].split()[0::2])
        assert after < before
        assert counters["stats"]["unique_graphs"] >= 1, "the Trainer did not compile the model"
        assert not counters["graph_break"], dict(counters["graph_break"])
        graphs[layers] = counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]
    assert graphs[2] == graphs[4], graphs
    torch.compiler.reset()


@pytest.mark.parametrize("kernel", ["cpp", pytest.param("pytorch", marks=pytest.mark.heavy)])
def test_design_properties_hold_on_the_compiled_path(kernel):
    """docs/design.md's bold properties that compilation could break, on the fused C++ operator (what "auto" runs on a
    CPU) and on the blocked path, through one compiled training graph (compiled
    once: inductor takes parameters as inputs, so changing their values reuses it): **the converted model's logits equal
    the source model's**; a left-padded row equals the same tokens unpadded, and a query with no allowed key gives no
    NaN; the linear gates carry gradient at the graft and **one optimiser step on a converted model must change its
    logits**; **the gradient with respect to U at U = 0 is exactly zero**; and **SPD holds in every dtype** for the
    compiled MLP step (bfloat16, the smallest gate, raw factors of scale 1e4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import TINY
    from modeling_fiber_bundle.fiber_attention import bounded_factors, metric_gate, woodbury_precondition

    torch.compiler.reset()
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "pad_token_id"})).float().eval()
    model = tiny_model(seed=1, dtype=torch.float32, metric_hidden=16, fiber_attention_kernel=kernel).train()
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    assert not unexpected and missing and all(".fiber." in k for k in missing)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, backend=counter)

    pad = 5  # row 1 holds row 0's first LENGTH - pad tokens after `pad` left-padding positions
    ids = random_ids(2, LENGTH)
    ids[1, pad:] = ids[0, :LENGTH - pad]
    ids[1, :pad] = TINY["pad_token_id"]
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        out = compiled(**inputs)
        out.loss.backward()
        logits = out.logits.detach()
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(logits[1, pad:], logits[0, :LENGTH - pad], rtol=1e-5, atol=1e-5)
        return logits

    # the graft: the source's logits, and gradient in every gate
    logits = forward_backward()
    with torch.no_grad():
        expected = source(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-5, atol=1e-5)
    fiber = model.model.layers[0].fiber
    for gate in (fiber.attn_gate, fiber.flatness_gate, fiber.ffn_gate):
        assert gate.grad is not None and gate.grad.abs().sum() > 0
    # one AdamW step on the geometry alone moves the compiled model's logits off the source's
    torch.optim.AdamW(model.geometry_parameters(), lr=1e-2).step()
    assert (forward_backward() - logits).abs().max() > 1e-5  # 100x float32 rounding of these logits

    # awake, with layer 0's attention factors at U = 0: the saddle, exactly, through inductor's fused backward
    set_gates(model)
    with torch.no_grad():
        fiber.attn_factor_proj.weight.zero_()
        fiber.attn_factor_proj.bias.zero_()
    forward_backward()
    assert torch.equal(fiber.attn_factor_proj.weight.grad, torch.zeros_like(fiber.attn_factor_proj.weight))
    assert model.model.layers[1].fiber.attn_factor_proj.weight.grad.abs().max() > 0  # the other layer's is not zero
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: changing parameter values recompiled"

    # the compiled MLP step in bfloat16 at the smallest gate, from raw factors of scale 1e4: finite
    gen = torch.Generator().manual_seed(3)
    update = torch.randn(4, 8, 9, 8, generator=gen).bfloat16()
    raw = (1e4 * torch.randn(4, 8, 9, 3, 8, generator=gen)).bfloat16()
    step = torch.compile(lambda y, u, b: woodbury_precondition(y, bounded_factors(u), metric_gate(b)), fullgraph=True)
    out = step(update, raw, torch.tensor(-20.0, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
