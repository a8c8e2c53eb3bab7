"""Conformance with what transformers' own test suite asks of an in-library decoder (issue 11).

The properties come from transformers' `tests/test_modeling_common.py`, `tests/causal_lm_tester.py` and
`tests/generation/test_utils.py`, restricted to what applies to a decoder-only causal LM and not already covered by
test_modeling.py. Every test runs on two models built from the same tiny float64 backbone config:

* "fiber": FiberBundleForCausalLM with its gates moved off the graft (set_gates), so the geometry is active;
* "llama": transformers' LlamaForCausalLM, the control. A test that fails on it is a wrong test.

Not carried over: what transformers 5.24 removed (head masking and pruning, TorchScript, torch.fx, TF/Flax cross
tests), the generation strategies moved to Hub `custom_generate` repositories (group / constrained beam, contrastive
search, DoLa: they need the network), quantized caches (optimum-quanto, hqq: not installed), and what needs a CUDA
device (flash-attention, offloaded caches, device-map offload and model parallelism, compiled training).
"""

import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GenerationMixin,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.generation import CompileConfig, GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput
from transformers.modeling_utils import load_state_dict

from helpers import FLEX_KERNEL, TINY, random_ids, set_gates, tiny_config, tiny_model
from modeling_fiber_bundle import FiberBundleForCausalLM, FiberBundleModel

F64 = torch.float64
KINDS = ["fiber", "llama"]
CLASSES = {"fiber": (FiberBundleModel, FiberBundleForCausalLM), "llama": (LlamaModel, LlamaForCausalLM)}
L, H, KVH, D, HD, V = (TINY[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                         "hidden_size", "head_dim", "vocab_size"))


def config_for(kind, **overrides):
    return tiny_config(**overrides) if kind == "fiber" else LlamaConfig(**{**TINY, **overrides})


def awake(model):
    """Move a Fiber Bundle model's gates off the graft (the metric is active); LLaMA has no gates."""
    base = model.base_model
    if hasattr(base.layers[0], "fiber"):
        set_gates(SimpleNamespace(model=base))
    return model


def build(kind, seed=0, dtype=F64, base=False, attn=None, **overrides):
    torch.manual_seed(seed)
    model = CLASSES[kind][0 if base else 1](config_for(kind, **overrides)).to(dtype).eval()
    if attn is not None:
        model.set_attn_implementation(attn)
    return awake(model)


def prompt(batch=2, length=7, pads=(0, 2), seed=0):
    """Token ids with a left-padded row (pads[i] pad tokens in row i) and their attention mask."""
    ids = random_ids(batch, length, seed=seed)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads[:batch]):
        ids[row, :pad] = TINY["pad_token_id"]
        mask[row, :pad] = 0
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------------
# forward contracts (causal_lm_tester, modeling_common)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_base_and_causal_lm_forward_shapes(kind):
    ids, mask = prompt(batch=3, length=7, pads=(0, 2, 4))
    with torch.no_grad():
        base = build(kind, base=True)
        assert base(ids, attention_mask=mask).last_hidden_state.shape == (3, 7, D)
        assert base(ids).last_hidden_state.shape == (3, 7, D)
        out = build(kind)(ids, attention_mask=mask, labels=ids)
    assert out.logits.shape == (3, 7, V)
    assert out.loss.shape == () and torch.isfinite(out.loss)
    assert torch.isfinite(out.logits[mask.bool()]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_determinism_and_batching_equivalence(kind):
    """The same input gives the same output, and a row alone gives what it gives inside a batch (every output)."""
    model = build(kind)
    ids = random_ids(3, 9)
    with torch.no_grad():
        first = model(ids, output_hidden_states=True, use_cache=False)
        second = model(ids, output_hidden_states=True, use_cache=False)
        alone = model(ids[:1], output_hidden_states=True, use_cache=False)
    assert torch.equal(first.logits, second.logits)
    torch.testing.assert_close(first.logits[:1], alone.logits, rtol=1e-10, atol=1e-10)
    for batched, single in zip(first.hidden_states, alone.hidden_states, strict=True):
        torch.testing.assert_close(batched[:1], single, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_outputs_by_argument_and_by_config(kind):
    ids = random_ids(2, 7)
    model = build(kind, attn="eager")
    with torch.no_grad():
        by_arg = model(ids, output_attentions=True)
    assert len(by_arg.attentions) == L
    model.config.output_attentions = True
    with torch.no_grad():
        by_config = model(ids)
        both = model(ids, output_hidden_states=True)
    assert len(by_config.attentions) == L
    assert all(a.shape == (2, H, 7, 7) for a in by_config.attentions)
    for a, b in zip(by_arg.attentions, by_config.attentions, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # hidden states add exactly one output, and the attentions stay last
    assert len(both.to_tuple()) == len(by_config.to_tuple()) + 1
    assert both.to_tuple()[-1] is both.attentions and len(both.attentions) == L


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_output_by_argument_and_by_config(kind):
    ids = random_ids(2, 7)
    model = build(kind)
    with torch.no_grad():
        by_arg = model(ids, output_hidden_states=True).hidden_states
        model.config.output_hidden_states = True
        by_config = model(ids).hidden_states
    for states in (by_arg, by_config):
        assert len(states) == L + 1
        assert all(h.shape == (2, 7, D) for h in states)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("base", [False, True], ids=["causal-lm", "base"])
def test_tuple_and_dict_outputs_are_equivalent(kind, base):
    """return_dict=False gives the dict output's to_tuple(), with labels, hidden states and attentions."""
    model = build(kind, base=base, attn="eager")
    ids, mask = prompt()
    extras = [{}, {"output_hidden_states": True}, {"output_attentions": True},
              {"output_hidden_states": True, "output_attentions": True}]
    for labels in ([None] if base else [None, ids]):
        for extra in extras:
            kwargs = dict(attention_mask=mask, **extra, **({} if labels is None else {"labels": labels}))
            with torch.no_grad():
                as_tuple = model(ids, return_dict=False, **kwargs)
                as_dict = model(ids, return_dict=True, **kwargs).to_tuple()
            assert isinstance(as_tuple, tuple) and len(as_tuple) == len(as_dict)
            for a, b in zip(as_tuple, as_dict, strict=True):
                # (LLaMA's eager attention leaves NaN on fully masked padding rows in float64, as upstream allows)
                if isinstance(a, torch.Tensor):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
                elif isinstance(a, tuple):
                    for x, y in zip(a, b, strict=True):
                        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_retained_hidden_states_and_attentions(kind):
    model = build(kind, attn="eager").train()
    model.config.output_hidden_states = True
    model.config.output_attentions = True
    out = model(random_ids(2, 7))
    hidden, attentions = out.hidden_states[0], out.attentions[0]
    hidden.retain_grad()
    attentions.retain_grad()
    out.logits.flatten()[0].backward(retain_graph=True)
    assert hidden.grad is not None
    assert attentions.grad is not None, "attention probabilities are not on the path from the inputs to the output"


CHECKPOINTING = {"default": None, "reentrant": {"use_reentrant": True}, "non-reentrant": {"use_reentrant": False}}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
def test_training_step_with_activation_checkpointing(kind, checkpointing):
    """Every trainable parameter gets a gradient through checkpointed layers, equal to the plain backward's."""
    ids, mask = prompt()
    grads = []
    for enable in (False, True):
        model = build(kind).train()
        model.config.use_cache = False
        if enable:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=CHECKPOINTING[checkpointing])
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, missing
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        torch.optim.SGD(model.parameters(), lr=0.01).step()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("peft", [False, True], ids=["plain", "peft-loaded"])
def test_activation_checkpointing_enable_and_disable(kind, peft):
    model = build(kind)
    model._hf_peft_config_loaded = peft  # as PEFT marks a model it wraps (inputs then need grads for checkpointing)
    assert not model.is_activation_checkpointing
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    assert flagged and all(m.gradient_checkpointing for m in flagged)
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing
    assert not any(m.gradient_checkpointing for m in flagged)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("base", [False, True], ids=["causal-lm", "base"])
def test_inputs_embeds_match_input_ids(kind, base):
    model = build(kind, base=base)
    ids, mask = prompt()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        from_ids = model(input_ids=ids, attention_mask=mask)[0]
        from_embeds = model(inputs_embeds=embeds, attention_mask=mask)[0]
    torch.testing.assert_close(from_embeds, from_ids, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_to_keep(kind):
    model = build(kind)
    ids, mask = prompt()
    with torch.no_grad():
        every = model(ids, attention_mask=mask, logits_to_keep=0).logits
        last = model(ids, attention_mask=mask, logits_to_keep=1).logits
    assert every.shape == (2, 7, V) and last.shape == (2, 1, V)
    torch.testing.assert_close(last, every[:, -1:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_custom_4d_attention_mask_with_a_shared_prefix(kind):
    """Three sequences sharing a prefix, packed as prefix + three endings with a 4D mask in which the endings do not
    see each other, give the last-token distributions of the three sequences run separately."""
    model = build(kind)
    ids = torch.tensor([[10, 11, 12, 13], [10, 11, 12, 14], [10, 11, 12, 15]])
    packed = torch.cat([ids[0, :-1], ids[:, -1]])[None]  # (1, 6)
    allowed = torch.tensor([[1, 0, 0, 0, 0, 0],
                            [1, 1, 0, 0, 0, 0],
                            [1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 1, 0, 0],
                            [1, 1, 1, 0, 1, 0],
                            [1, 1, 1, 0, 0, 1]])[None, None]
    mask = (allowed == 0).to(F64) * torch.finfo(F64).min  # additive, in the model's dtype
    with torch.no_grad():
        separate = model(ids, position_ids=torch.arange(4)[None].expand(3, -1)).logits[:, -1]
        shared = model(packed, attention_mask=mask, position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]])).logits[0, -3:]
    torch.testing.assert_close(shared.softmax(-1), separate.softmax(-1), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# attention implementations
# ---------------------------------------------------------------------------------------------------------------------
# LLaMA's eager attention takes its softmax in float32 (and turns float64's mask minimum into -inf: NaN padding rows),
# so eager and sdpa are compared in the dtypes upstream uses. float32: upstream's CPU tolerance. Half precision:
# upstream's GPU rule (80% of the rows within 1e-2) fails LLaMA itself on CPUs with native bf16 kernels (5 of 7 rows,
# max 0.031 on AVX-512 BF16, and under ATEN_CPU_CAPABILITY=default), so there the control's own gap, measured in the
# same test on the same weights and inputs, is the bound.
def eager_and_sdpa(folder, cls, dtype):
    """Loads ``folder`` with attn_implementation "sdpa" (the default) and "eager": {case: (eager, sdpa)}, the last hidden
    states in float32 with padding zeroed, for left and right padding, with and without a mask and attention outputs."""
    default = cls.from_pretrained(folder, dtype=dtype).eval()
    sdpa = cls.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    eager = cls.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    assert default.config._attn_implementation == "sdpa"
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    ids, outputs = random_ids(7, 9), {}
    for side in ("left", "right"):
        for use_mask in (False, True):
            for output_attentions in (False, True):
                mask = torch.ones_like(ids)
                if side == "left":
                    mask[-1, :2] = 0
                else:
                    mask[-1, -2:] = 0
                kwargs = dict(attention_mask=mask if use_mask else None, output_hidden_states=True,
                              output_attentions=output_attentions)
                with torch.no_grad():
                    a = eager(ids, **kwargs).hidden_states[-1]
                    b = sdpa(ids, **kwargs).hidden_states[-1]
                real = (mask.bool() if use_mask else torch.ones_like(mask, dtype=torch.bool))[..., None]
                case = f"{side} padding, mask={use_mask}, attentions={output_attentions}"
                outputs[case] = a.float() * real, b.float() * real
    return outputs


@pytest.mark.parametrize("kind", KINDS)
def test_sdpa_and_eager_agree_and_dispatch_as_requested(kind, tmp_path):
    """One float32 checkpoint loaded with attn_implementation "sdpa" (the default) and "eager": the same hidden states
    within upstream's CPU tolerance."""
    build(kind).save_pretrained(tmp_path)
    for case, (a, b) in eager_and_sdpa(tmp_path, CLASSES[kind][1], torch.float32).items():
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{case}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sdpa_and_eager_agree_in_half_precision_as_closely_as_llama(dtype, tmp_path):
    """The same in bf16 / fp16: the Fiber Bundle model's eager-vs-sdpa gap is at most LLaMA's with the same backbone
    weights, inputs and kernels (measured here, on this host's kernel path), in every case."""
    fiber, llama = build("fiber"), build("llama")
    fiber.load_state_dict(llama.state_dict(), strict=False)  # the backbone's weights; the fibre keeps its own
    fiber.save_pretrained(tmp_path / "fiber")
    llama.save_pretrained(tmp_path / "llama")
    ours, control = ({case: (a - b).abs().max().item() for case, (a, b) in eager_and_sdpa(tmp_path / kind, cls,
                                                                                             dtype).items()}
                     for kind, cls in (("fiber", FiberBundleForCausalLM), ("llama", LlamaForCausalLM)))
    control_gap = max(control.values())  # why not per case: LLaMA's largest gap says how far the two paths may drift
    assert all(gap <= control_gap for gap in ours.values()), (ours, control)


@pytest.mark.parametrize("kind", KINDS)
def test_eager_and_sdpa_generate_the_same(kind):
    ids, mask = prompt()
    args = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                return_dict_in_generate=True, output_scores=True)
    eager = build(kind, dtype=torch.float32, attn="eager").generate(ids, **args)
    sdpa = build(kind, dtype=torch.float32, attn="sdpa").generate(ids, **args)
    assert_similar(eager, sdpa, atol=1e-4)


@pytest.mark.heavy
@pytest.mark.filterwarnings("ignore:_compile flag on create_block_mask:DeprecationWarning")  # torch, via transformers
@pytest.mark.parametrize("kind", ["fiber", pytest.param("llama", marks=FLEX_KERNEL)])  # LLaMA runs flex's kernel
def test_flex_attention_matches_eager(kind):
    """flex_attention (compiled; it runs on CPU) is a backend LLaMA supports."""
    model = build(kind, dtype=torch.float32, attn="eager")
    ids, mask = prompt()
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("flex_attention")
        flex = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(flex[real], eager[real], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# save / load, embeddings, configuration
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_save_load_writes_config_and_generation_config(kind, tmp_path):
    model = build(kind)
    ids, mask = prompt()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()
    assert model.can_generate() and (tmp_path / "generation_config.json").exists()
    assert (tmp_path / "model.safetensors").exists()
    loaded = CLASSES[kind][1].from_pretrained(tmp_path, dtype=F64).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tie", [False, True])
def test_safetensors_round_trip_reports_nothing_missing_and_keeps_shared_tensors(kind, tie, tmp_path):
    model = build(kind, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    loaded, info = CLASSES[kind][1].from_pretrained(tmp_path, dtype=F64, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state, expected = loaded.state_dict(), model.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    shared = {}
    for key, value in expected.items():
        shared.setdefault(value.data_ptr(), []).append(key)
    for names in (n for n in shared.values() if len(n) > 1):
        assert len({state[name].data_ptr() for name in names}) == 1, names
    assert (loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()) == tie


@pytest.mark.parametrize("kind", KINDS)
def test_tied_weights_keys_declare_every_shared_tensor(kind):
    model = build(kind, tie_word_embeddings=True)
    groups = {}
    for name, tensor in model.state_dict().items():
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    shared = [sorted(names) for names in groups.values() if len(names) > 1]
    declared = [sorted([target, source]) for target, source in (model._tied_weights_keys or {}).items()]
    assert shared == declared


@pytest.mark.parametrize("kind", KINDS)
def test_reload_without_weights_reports_every_parameter_missing(kind, tmp_path):
    from safetensors.torch import save_file

    model = build(kind)
    model.save_pretrained(tmp_path)
    save_file({"tensor": torch.tensor([1, 2])}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reloaded, info = CLASSES[kind][1].from_pretrained(tmp_path, output_loading_info=True)
    persistent = set(reloaded.state_dict())
    assert set(info["missing_keys"]) == persistent


@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_with_a_state_dict_and_no_checkpoint(kind):
    model = build(kind)
    state = model.state_dict()
    again = CLASSES[kind][1].from_pretrained(None, config=model.config, state_dict=state)
    for name, p in again.state_dict().items():
        assert torch.equal(p.to(state[name].dtype), state[name]), name


@pytest.mark.parametrize("kind", KINDS)
def test_torch_save_load_of_the_state_dict(kind, tmp_path):
    state = build(kind).state_dict()
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    loaded = load_state_dict(str(path))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("kind", KINDS)
def test_loading_a_base_checkpoint_into_the_causal_lm_reports_the_head_missing(kind, tmp_path):
    build(kind).base_model.save_pretrained(tmp_path)
    _, info = CLASSES[kind][1].from_pretrained(tmp_path, output_loading_info=True)
    assert "lm_head.weight" in info["missing_keys"]
    assert not any(".layers." in key for key in info["missing_keys"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("auto", [AutoModel, AutoModelForCausalLM], ids=["AutoModel", "AutoModelForCausalLM"])
def test_load_with_mismatched_shapes(kind, auto, tmp_path):
    build(kind).save_pretrained(tmp_path)
    with pytest.raises(RuntimeError):
        auto.from_pretrained(tmp_path, vocab_size=10)
    model, info = auto.from_pretrained(tmp_path, vocab_size=10, ignore_mismatched_sizes=True,
                                       output_loading_info=True)
    mismatched = {key for key, _, _ in info["mismatched_keys"]}
    assert any(key.endswith("embed_tokens.weight") for key in mismatched), mismatched
    assert ("lm_head.weight" in mismatched) == (auto is AutoModelForCausalLM), mismatched
    with torch.no_grad():
        model(random_ids(2, 8, vocab=10, low=0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tie", [False, True])
def test_resize_token_embeddings(kind, tie):
    model = build(kind, tie_word_embeddings=tie)
    old = model.get_input_embeddings().weight.detach().clone()
    count = len(list(model.parameters()))
    embed = model.resize_token_embeddings(V + 10)
    assert len(list(model.parameters())) == count  # a tied head stays one parameter
    assert type(embed) is type(model.get_input_embeddings()) and embed.weight.shape == (V + 10, D)
    assert model.config.vocab_size == V + 10 and model.get_output_embeddings().weight.shape == (V + 10, D)
    # new rows are initialised around the old rows' mean
    torch.testing.assert_close(embed.weight[-10:].mean(0), embed.weight[:-10].mean(0), atol=1e-3, rtol=1e-1)
    head = model.get_output_embeddings().weight
    torch.testing.assert_close(head[-10:].mean(0), head[:-10].mean(0), atol=1e-3, rtol=1e-1)
    with torch.no_grad():
        assert model(random_ids(2, 7, vocab=V + 10)).logits.shape == (2, 7, V + 10)
    embed = model.resize_token_embeddings(V - 15)
    assert model.config.vocab_size == V - 15 and model.get_output_embeddings().weight.shape == (V - 15, D)
    assert torch.equal(embed.weight, old[: V - 15])
    with torch.no_grad():
        assert model(random_ids(2, 7, vocab=V - 15)).logits.shape == (2, 7, V - 15)
    assert model.resize_token_embeddings(V + 13, pad_to_multiple_of=64).weight.shape[0] == 128
    with pytest.raises(ValueError, match="1.3"):
        model.resize_token_embeddings(V, pad_to_multiple_of=1.3)


@pytest.mark.parametrize("kind", KINDS)
def test_model_api_surface(kind):
    """Embedding accessors, the main input name, GenerationMixin in the bases and the size of the test model."""
    model = build(kind)
    assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)
    new = torch.nn.Embedding(10, 10)
    model.set_input_embeddings(new)
    assert model.get_input_embeddings() is new
    for cls in CLASSES[kind]:
        assert list(inspect.signature(cls.forward).parameters)[1] == cls.main_input_name == "input_ids"
    assert "GenerationMixin" in str(CLASSES[kind][1].__bases__) and isinstance(model, GenerationMixin)
    assert model.num_parameters() < 1_000_000


@pytest.mark.parametrize("kind", KINDS)
def test_builds_on_the_meta_device(kind):
    """Under a meta device context nothing is allocated: every parameter and buffer is on meta."""
    with torch.device("meta"):
        model = CLASSES[kind][1](config_for(kind))
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert all(t.device.type == "meta" for t in tensors.values()), [n for n, t in tensors.items() if not t.is_meta]


@pytest.mark.parametrize("kind", KINDS)
def test_initialization_with_zero_init_scales(kind):
    """With every *_range / *_std scale at 1e-10, each parameter's mean is 0 or 1 (nothing escapes _init_weights)."""
    config = config_for(kind)
    for key in list(config.to_dict()):
        if "_range" in key or "_std" in key or "initializer_factor" in key:
            setattr(config, key, 1e-10)
    torch.manual_seed(0)
    model = CLASSES[kind][1](config)
    for name, p in model.named_parameters():
        assert round(p.mean().item() * 1e9) / 1e9 in (0.0, 1.0), name


@pytest.mark.parametrize("kind", KINDS)
def test_config_common_properties_and_round_trips(kind, tmp_path):
    config = config_for(kind)
    for attribute in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers"):
        assert getattr(config, attribute) == TINY[attribute]
    cls = type(config)
    assert cls.from_dict(config.to_dict()).to_dict() == config.to_dict()
    config.save_pretrained(tmp_path / "sub")
    assert cls.from_pretrained(tmp_path, subfolder="sub").to_dict() == config.to_dict()
    assert len(cls(**{**TINY, "num_labels": 5}).id2label) == 5
    cls()  # constructible without arguments


HEADS = {
    "sequence-classification": AutoModelForSequenceClassification,
    "token-classification": AutoModelForTokenClassification,
    "question-answering": AutoModelForQuestionAnswering,
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head", list(HEADS))
def test_task_heads(kind, head):
    """The task heads causal_lm_tester runs for decoder LMs (LLaMA has all three)."""
    config = config_for(kind, num_labels=3)
    torch.manual_seed(0)
    model = awake(HEADS[head].from_config(config).to(F64).eval())
    ids = random_ids(4, 7)
    mask = ids.ne(1)
    with torch.no_grad():
        if head == "sequence-classification":
            assert model(ids, attention_mask=mask, labels=torch.tensor([0, 1, 2, 0])).logits.shape == (4, 3)
            model.config.problem_type = "multi_label_classification"
            out = model(ids, attention_mask=mask, labels=torch.randint(0, 2, (4, 3)).to(F64))
            assert out.logits.shape == (4, 3) and torch.isfinite(out.loss)
        elif head == "token-classification":
            out = model(ids, attention_mask=mask, labels=torch.randint(0, 3, (4, 7)))
            assert out.logits.shape == (4, 7, 3) and torch.isfinite(out.loss)
        else:
            out = model(ids, attention_mask=mask)
            assert out.start_logits.shape == out.end_logits.shape == (4, 7)


# ---------------------------------------------------------------------------------------------------------------------
# generation (generation/test_utils.py)
# ---------------------------------------------------------------------------------------------------------------------
N_NEW = 3
PROCESSORS = dict(bad_words_ids=[[1, 0]], repetition_penalty=1.2, remove_invalid_values=True)
SAMPLING = dict(top_k=10, top_p=0.7, temperature=0.7)
MODES = {
    "greedy": dict(do_sample=False, num_beams=1),
    "sample": dict(do_sample=True, num_beams=1, **SAMPLING),
    "beam": dict(do_sample=False, num_beams=2, length_penalty=2.0, early_stopping=False),
    "beam_sample": dict(do_sample=True, num_beams=2, length_penalty=2.0, early_stopping=False, **SAMPLING),
}


def generate(model, mode, ids, mask, seed=0, **kwargs):
    """generate() with the mode's settings and the logits processors the upstream mixin uses; EOS cannot stop it."""
    torch.manual_seed(seed)
    args = dict(max_new_tokens=N_NEW, min_new_tokens=N_NEW, **MODES[mode], **PROCESSORS)
    return model.generate(ids, attention_mask=mask, **{**args, **kwargs})


def assert_similar(a, b, atol=1e-5):
    """Two generate() outputs agree: equal sequences, or equal up to a first mismatch where the scores are close."""
    if torch.equal(a.sequences, b.sequences):
        return
    prompt_length = a.sequences.shape[1] - len(a.scores)
    for row in range(a.sequences.shape[0]):
        differ = (a.sequences[row] != b.sequences[row]).nonzero()
        if len(differ):
            step = int(differ[0]) - prompt_length
            torch.testing.assert_close(a.scores[step][row], b.scores[step][row], rtol=atol, atol=atol)


def check_generate_outputs(out, prompt_length, batch, use_cache, num_beams=1, num_return_sequences=1):
    """Shapes of scores, logits, attentions, hidden states and cache of a return_dict_in_generate output."""
    rows = batch * (num_beams if num_beams > 1 else num_return_sequences)
    total = out.sequences.shape[-1]
    steps = total - prompt_length
    assert out.sequences.shape[0] == batch * num_return_sequences
    assert len(out.scores) == steps and all(s.shape == (rows, V) for s in out.scores)
    assert len(out.logits) == steps and all(s.shape == (rows, V) for s in out.logits)
    assert len(out.attentions) == steps and len(out.hidden_states) == steps
    for step, (attentions, states) in enumerate(zip(out.attentions, out.hidden_states, strict=True)):
        keys = prompt_length + step
        queries = keys if (step == 0 or not use_cache) else 1  # with a cache, every step after the prefill is one token
        assert len(attentions) == L and all(a.shape == (rows, H, queries, keys) for a in attentions), step
        assert len(states) == L + 1 and all(h.shape == (rows, queries, D) for h in states), step
    if use_cache:
        assert isinstance(out.cache, DynamicCache) and len(out.cache.layers) == L
        for layer in out.cache.layers:
            assert layer.keys.shape == layer.values.shape == (rows, KVH, total - 1, HD)
    else:
        assert out.cache is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_generate_lengths_and_num_return_sequences(kind, mode):
    model = build(kind)
    ids, mask = prompt()
    for n in (1, 2):
        extra = {} if mode == "greedy" else {"num_return_sequences": n}
        if mode == "greedy" and n == 2:
            continue
        out = generate(model, mode, ids, mask, **extra)
        assert out.shape == (2 * n, 7 + N_NEW)
        if n == 2:  # the returned sequences are grouped by input row
            assert torch.equal(out[0::2, :7], ids) and torch.equal(out[1::2, :7], ids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("mode", list(MODES))
def test_generate_dict_outputs(kind, mode, use_cache):
    model = build(kind, attn="eager")
    ids, mask = prompt(pads=(0, 0))
    num_return_sequences = 2 if mode == "sample" else 1
    out = generate(model, mode, ids, mask, return_dict_in_generate=True, output_scores=True, output_logits=True,
                   output_attentions=True, output_hidden_states=True, use_cache=use_cache,
                   num_return_sequences=num_return_sequences)
    assert isinstance(out, GenerateBeamDecoderOnlyOutput if "beam" in mode else GenerateDecoderOnlyOutput)
    assert out.sequences.shape[-1] == 7 + N_NEW
    check_generate_outputs(out, 7, 2, use_cache, num_beams=MODES[mode]["num_beams"],
                           num_return_sequences=num_return_sequences)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["sample", "beam_sample"])
def test_seeded_sampling_is_reproducible_and_independent_of_the_cache(kind, mode):
    model = build(kind)
    ids, mask = prompt()
    args = dict(max_new_tokens=10, min_new_tokens=10)
    cached = generate(model, mode, ids, mask, **args)
    assert torch.equal(cached, generate(model, mode, ids, mask, **args))
    assert torch.equal(cached, generate(model, mode, ids, mask, use_cache=False, **args))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_beams", [1, 2], ids=["greedy", "beam"])
def test_generate_from_inputs_embeds(kind, num_beams):
    model = build(kind)
    ids, mask = prompt(pads=(0, 0))
    args = dict(attention_mask=mask, return_dict_in_generate=True, output_scores=True, num_beams=num_beams,
                do_sample=False, max_new_tokens=5, min_new_tokens=5)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    from_ids = model.generate(ids, **args)
    assert from_ids.sequences.shape == (2, 12)
    from_embeds = model.generate(ids, inputs_embeds=embeds, **args)
    assert_similar(from_ids, from_embeds)
    torch.manual_seed(0)
    from_random = model.generate(ids, inputs_embeds=torch.rand_like(embeds), **args)
    for a, b in zip(from_embeds.scores, from_random.scores, strict=True):
        assert not torch.allclose(a, b)
    without_ids = model.generate(inputs_embeds=embeds, **args)
    from_embeds.sequences = from_embeds.sequences[:, ids.shape[1]:]
    assert_similar(without_ids, from_embeds)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_from_inputs_embeds_with_static_cache(kind):
    model = build(kind)
    ids, mask = prompt(pads=(0, 0))
    model.generation_config.eos_token_id = -1
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    out = model.generate(inputs_embeds=embeds, attention_mask=mask, max_length=30, cache_implementation="static",
                         return_dict_in_generate=True)
    # max_length counts the prompt's embeddings; the cache holds every position but the last generated one
    assert out.sequences.shape == (2, 30 - ids.shape[1])
    assert isinstance(out.cache, StaticCache) and len(out.cache.layers) == L
    assert all(layer.keys.shape == (2, KVH, 30 - 1, HD) for layer in out.cache.layers)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_continues_from_a_returned_cache(kind):
    """4 new tokens in one call == 3 new tokens, then 1 more from the returned cache (tokens and cache)."""
    model = build(kind)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = -1
    ids, mask = prompt(pads=(0, 0))
    args = dict(do_sample=False, return_dict_in_generate=True)
    once = model.generate(ids, attention_mask=mask, max_new_tokens=4, **args)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, **args)
    mask = torch.nn.functional.pad(mask, (0, first.sequences.shape[1] - mask.shape[1]), value=1)
    then = model.generate(first.sequences, attention_mask=mask, cache=first.cache, max_new_tokens=1, **args)
    assert once.sequences.tolist() == then.sequences.tolist()
    assert len(once.cache.layers) == len(then.cache.layers) == L
    for a, b in zip(once.cache.layers, then.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a.values, b.values, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_continues_from_inputs_embeds_and_a_returned_cache(kind):
    """From embeddings: 4 new tokens == 3, then 1 more from the prompt's and the new tokens' embeddings and the cache."""
    model = build(kind)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = -1
    with torch.no_grad():
        embeds = model.get_input_embeddings()(random_ids(2, 7))
    args = dict(do_sample=False, return_dict_in_generate=True)
    once = model.generate(inputs_embeds=embeds, max_new_tokens=4, **args)
    first = model.generate(inputs_embeds=embeds, max_new_tokens=3, **args)
    with torch.no_grad():
        more = torch.cat([embeds, model.get_input_embeddings()(first.sequences)], dim=1)
    then = model.generate(inputs_embeds=more, cache=first.cache, max_new_tokens=1, **args)
    assert once.sequences.tolist() == torch.cat([first.sequences, then.sequences], dim=1).tolist()
    for a, b in zip(once.cache.layers, then.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a.values, b.values, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_generate_with_static_cache(kind, dtype):
    """A static cache has the preallocated shape and gives what the dynamic cache gives."""
    model = build(kind, dtype=dtype)
    ids, mask = prompt()
    args = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                return_dict_in_generate=True, output_scores=True)
    static = model.generate(ids, cache_implementation="static", **args)
    assert isinstance(static.cache, StaticCache) and len(static.cache.layers) == L
    assert all(layer.keys.shape == (2, KVH, 7 + 20 - 1, HD) for layer in static.cache.layers)
    assert_similar(model.generate(ids, **args), static)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_compatibility(kind):
    """The next-token logits of a batch with 32 more left pads equal those without (positions restart at 0)."""
    model = build(kind)
    ids, mask = prompt()

    def forward(ids, mask):
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        with torch.no_grad():
            return model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, -1]

    pads = torch.full((2, 32), TINY["pad_token_id"])
    padded = forward(torch.cat([pads, ids], 1), torch.cat([torch.zeros_like(pads), mask], 1))
    torch.testing.assert_close(padded, forward(ids, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_format(kind):
    ids, mask = prompt()
    with torch.no_grad():
        cache = build(kind)(ids, attention_mask=mask, use_cache=True).cache
    assert isinstance(cache, DynamicCache) and len(cache) == L
    for layer in cache.layers:
        assert layer.keys.shape == layer.values.shape == (2, KVH, 7, HD)


def assisted_args(**extra):
    return dict(eos_token_id=-1, max_new_tokens=4, num_beams=1, do_sample=False, output_scores=True,
                output_logits=True, output_hidden_states=True, output_attentions=True, return_dict_in_generate=True,
                use_cache=True, **extra)


def repetitive_prompt():
    """One row whose n-grams repeat, so prompt lookup proposes candidates (and a batch of 1: assisted decoding)."""
    ids = torch.tensor([[5, 9, 17, 33, 5, 9, 17, 33, 5, 9]])
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("assistant", ["same", "random"])
def test_assisted_decoding_matches_greedy(kind, assistant):
    """Candidates all accepted (same model) or all rejected (random model: the cache is cropped back)."""
    model = build(kind, attn="eager")
    ids, mask = repetitive_prompt()
    greedy = model.generate(ids, attention_mask=mask, **assisted_args(**PROCESSORS))
    helper = model if assistant == "same" else build(kind, seed=7, attn="eager")
    helper.generation_config.num_assistant_tokens = 2
    helper.generation_config.num_assistant_tokens_schedule = "constant"
    assisted = model.generate(ids, attention_mask=mask, assistant_model=helper, **assisted_args(**PROCESSORS))
    assert_similar(greedy, assisted)
    for out in (greedy, assisted):
        check_generate_outputs(out, ids.shape[1], 1, use_cache=True)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_lookup_decoding_matches_greedy(kind):
    model = build(kind, attn="eager")
    ids, mask = repetitive_prompt()
    greedy = model.generate(ids, attention_mask=mask, **assisted_args())
    lookup = model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=2, **assisted_args())
    assert_similar(greedy, lookup)
    for out in (greedy, lookup):
        check_generate_outputs(out, ids.shape[1], 1, use_cache=True)


@pytest.mark.parametrize("kind", KINDS)
def test_assisted_decoding_with_sampling(kind):
    model = build(kind, attn="eager")
    model.generation_config.num_assistant_tokens = 2
    model.generation_config.num_assistant_tokens_schedule = "constant"
    ids, mask = repetitive_prompt()
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, assistant_model=model, **{**assisted_args(), "do_sample": True})
    assert out.sequences.shape == (1, ids.shape[1] + 4)
    check_generate_outputs(out, ids.shape[1], 1, use_cache=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("assisted", [False, True], ids=["greedy", "assisted"])
def test_generate_with_logits_to_keep(kind, assisted):
    model = build(kind)
    ids, mask = repetitive_prompt()
    args = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                output_scores=True, **({"assistant_model": model} if assisted else {}))
    assert_similar(model.generate(ids, logits_to_keep=0, **args), model.generate(ids, **args))


@pytest.mark.parametrize("kind", KINDS)
def test_generate_without_input_ids_starts_from_bos(kind):
    out = build(kind).generate(do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW)
    assert out.shape == (1, 1 + N_NEW) and out[0, 0] == TINY["bos_token_id"]


@pytest.mark.parametrize("kind", KINDS)
def test_min_new_tokens_holds_back_eos(kind):
    model = build(kind)
    ids = random_ids(1, 5)
    first = int(model.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])
    model.generation_config.eos_token_id = first  # the token greedy decoding picks next
    assert model.generate(ids, max_new_tokens=6, do_sample=False).shape == (1, 6)
    held = model.generate(ids, max_new_tokens=6, min_new_tokens=4, do_sample=False)
    assert held.shape[1] >= 9 and first not in held[0, 5:9].tolist()


@pytest.mark.heavy
@pytest.mark.parametrize("kind", KINDS)
def test_generate_compiles_the_forward_with_a_static_cache(kind):
    """With a static cache, generate() compiles the decoding forward (fullgraph; forced on CPU) and gives the eager
    result, twice in a row (the compiled call must not keep state from the first generation)."""
    model = build(kind, dtype=torch.float32)
    ids, mask = prompt(pads=(0, 0))
    args = dict(attention_mask=mask, do_sample=False, max_new_tokens=5, min_new_tokens=5,
                return_dict_in_generate=True, output_scores=True)
    dynamic = model.generate(ids, **args)
    assert not hasattr(model, "_compiled_call")
    torch.compiler.reset()
    model.generation_config.compile_config = CompileConfig(fullgraph=True)  # no graph break allowed
    model.generation_config.compile_config._compile_all_devices = True  # compile on CPU too
    compiled = [model.generate(ids, cache_implementation="static", **args) for _ in range(2)]
    assert hasattr(model, "_compiled_call"), "generate() did not compile the forward"
    for out in compiled:
        assert out.cache.is_compileable
        assert_similar(dynamic, out, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# RoPE scaling (causal_lm_tester: test_model_rope_scaling_from_config)
# ---------------------------------------------------------------------------------------------------------------------
MAX_POSITIONS = 32
ROPE = {
    "linear": {"rope_type": "linear", "factor": 10.0},
    "dynamic": {"rope_type": "dynamic", "factor": 10.0},
    "yarn": {"rope_type": "yarn", "factor": 10.0, "original_max_position_embeddings": MAX_POSITIONS},
    "longrope": {"rope_type": "longrope", "short_factor": [1.5] * (HD // 2), "long_factor": [10.0] * (HD // 2),
                 "original_max_position_embeddings": MAX_POSITIONS},
    "llama3": {"rope_type": "llama3", "factor": 10.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": MAX_POSITIONS},
}


def rope(name):
    return {**ROPE[name], "rope_theta": 10000.0} if name != "default" else dict(TINY["rope_parameters"])


@pytest.mark.parametrize("kind", KINDS)
def test_rotary_embedding_scaling(kind):
    """The model's rotary embedding: a position's cos/sin do not depend on the sequence length (default, linear,
    YaRN); linear position p is original position p / factor; dynamic NTK equals the original on short inputs and
    lowers the frequencies beyond max_position_embeddings; YaRN differs from the original at every length."""
    x = torch.ones(1, dtype=torch.float32)  # only its dtype and device are read
    short, long = torch.arange(10)[None], torch.arange(int(MAX_POSITIONS * 1.5))[None]

    def rotary(name):
        return build(kind, base=True, max_position_embeddings=MAX_POSITIONS, rope_parameters=rope(name)).rotary_emb

    original = rotary("default")
    (cos_s, sin_s), (cos_l, sin_l) = original(x, short), original(x, long)
    torch.testing.assert_close((cos_s, sin_s), (cos_l[:, :10], sin_l[:, :10]))
    linear = rotary("linear")
    (lin_cos_s, lin_sin_s), (lin_cos_l, lin_sin_l) = linear(x, short), linear(x, long)
    torch.testing.assert_close((lin_cos_s, lin_sin_s), (lin_cos_l[:, :10], lin_sin_l[:, :10]))
    for p in range(0, long.shape[1], 10):
        torch.testing.assert_close((lin_cos_l[:, p], lin_sin_l[:, p]), (cos_l[:, p // 10], sin_l[:, p // 10]))
    dynamic = rotary("dynamic")
    torch.testing.assert_close(dynamic(x, short), (cos_s, sin_s))
    dyn_cos_l, dyn_sin_l = dynamic(x, long)
    assert not torch.allclose(dyn_cos_l, cos_l) and not torch.allclose(dyn_sin_l, sin_l)
    assert (dynamic.inv_freq <= original.inv_freq).all()
    yarn = rotary("yarn")
    (yarn_cos_s, yarn_sin_s), (yarn_cos_l, yarn_sin_l) = yarn(x, short), yarn(x, long)
    torch.testing.assert_close((yarn_cos_s, yarn_sin_s), (yarn_cos_l[:, :10], yarn_sin_l[:, :10]))
    for a, b in ((yarn_cos_s, cos_s), (yarn_sin_s, sin_s), (yarn_cos_l, cos_l), (yarn_sin_l, sin_l)):
        assert not torch.allclose(a, b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(ROPE))
def test_rope_scaling_from_config(kind, name):
    """Scaled RoPE changes the output on inputs longer than max_position_embeddings; on short inputs too, except
    dynamic NTK, which only rescales beyond max_position_embeddings."""
    short, long = random_ids(1, 10), random_ids(1, int(MAX_POSITIONS * 1.5))
    outputs = {}
    for scaling in ("default", name):
        model = build(kind, base=True, max_position_embeddings=MAX_POSITIONS, rope_parameters=rope(scaling))
        with torch.no_grad():
            outputs[scaling] = (model(short).last_hidden_state, model(long).last_hidden_state)
    (plain_short, plain_long), (scaled_short, scaled_long) = outputs["default"], outputs[name]
    if name == "dynamic":
        torch.testing.assert_close(scaled_short, plain_short, rtol=1e-10, atol=1e-10)
    else:
        assert not torch.allclose(scaled_short, plain_short, atol=1e-5)
    assert not torch.allclose(scaled_long, plain_long, atol=1e-5)


@pytest.mark.parametrize("name", ["default", *ROPE])
def test_rope_scaling_at_the_graft_equals_llama_beyond_max_positions(name):
    """Fiber model (gates at the graft) holding a LLaMA's weights: same logits past max_position_embeddings, and the
    same greedy continuation across that boundary (where dynamic / longrope switch frequencies mid-decoding)."""
    config = dict(max_position_embeddings=MAX_POSITIONS, rope_parameters=rope(name))
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**{**TINY, **config})).to(F64).eval()
    fiber = tiny_model(seed=1, **config)
    missing, unexpected = fiber.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all(".fiber." in k for k in missing)
    ids = random_ids(2, int(MAX_POSITIONS * 1.5))
    with torch.no_grad():
        torch.testing.assert_close(fiber(ids).logits, llama(ids).logits, rtol=1e-10, atol=1e-10)
    start = random_ids(1, MAX_POSITIONS - 4)
    args = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(fiber.generate(start, **args), llama.generate(start, **args))
