"""FiberBundleForCausalLM: parity with transformers' own models, causality, cache, generation, training contracts."""

import warnings

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, CompileConfig, LlamaConfig, LlamaForCausalLM

from helpers import FLEX_KERNEL, SOURCE_FAMILIES, TINY, geometry_step_change, random_ids, set_gates, tiny_config, tiny_model
from modeling_fiber_bundle import FiberBundleConfig, FiberBundleForCausalLM, FiberBundleModel
from modeling_fiber_bundle import modeling_fiber_bundle as modeling
from modeling_fiber_bundle.fiber_attention import key_norms, metric_gram, reference_geodesic_attention

F64 = torch.float64
BACKBONE_KEYS = {k: v for k, v in TINY.items() if k not in ("pad_token_id",)}

# Each source family: its transformers classes (helpers.SOURCE_FAMILIES) and the FiberBundleConfig fields that
# reproduce it.
FIBER_FIELDS = {
    "llama": {},
    "qwen2": {"attention_bias": True, "attention_out_bias": False},
    "qwen3": {"qk_norm": True},
    "mistral": {"sliding_window": 6, "layer_types": ["sliding_attention"] * 2},
}
FAMILIES = {family: (*SOURCE_FAMILIES[family], fields) for family, fields in FIBER_FIELDS.items()}


def backbone_pair(family, tie, seed=0, **fiber_overrides):
    """A transformers model and a Fiber Bundle model holding the same backbone weights (gates at graft values)."""
    config_cls, model_cls, source_extra, fiber_extra = FAMILIES[family]
    torch.manual_seed(seed)
    source = model_cls(config_cls(**BACKBONE_KEYS, tie_word_embeddings=tie, **source_extra)).to(F64).eval()
    fiber = tiny_model(seed=seed + 1, tie_word_embeddings=tie, **fiber_extra, **fiber_overrides)
    missing, unexpected = fiber.load_state_dict(source.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(".fiber." in k for k in missing), missing  # only the new geometry is not in the source
    return source, fiber


def left_padded(batch=3, length=12, pads=(0, 4, 7), seed=0):
    ids = random_ids(batch, length, seed=seed)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = TINY["pad_token_id"]
        mask[row, :pad] = 0
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------------
# the graft: with all gates at 0 the model is its backbone
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("path", ["blocked", "reference"])
def test_graft_logits_equal_transformers_model(family, tie, path):
    source, fiber = backbone_pair(family, tie, fiber_attention_path=path, attention_block_size=5)
    ids, mask = left_padded(length=14)
    with torch.no_grad():
        expected = source(ids, attention_mask=mask).logits
        got = fiber(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-12, atol=1e-12)
    if tie:
        assert fiber.lm_head.weight.data_ptr() == fiber.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_graft_greedy_and_beam_generation_equal_transformers_model(family):
    source, fiber = backbone_pair(family, tie=False)
    ids, mask = left_padded(batch=2, length=6, pads=(0, 2))
    for kwargs in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}):
        args = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, pad_token_id=0, **kwargs)
        torch.testing.assert_close(fiber.generate(ids, **args), source.generate(ids, **args), rtol=0, atol=0)


def test_metric_rank_zero_is_exactly_the_backbone_and_uses_the_attention_interface():
    source, fiber = backbone_pair("llama", tie=False, metric_rank=0, ffn_metric_rank=0)
    assert not hasattr(fiber.model.layers[0], "fiber")
    ids, mask = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(fiber(ids, attention_mask=mask).logits, source(ids, attention_mask=mask).logits)
    assert fiber.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------------------------------------
# attention paths and masks
# ---------------------------------------------------------------------------------------------------------------------
PATHS = {
    "blocked-sdpa-mask": dict(fiber_attention_path="blocked", attention_block_size=4),
    "blocked-eager-mask": dict(fiber_attention_path="blocked", attention_block_size=4, attn_implementation="eager"),
    "reference": dict(fiber_attention_path="reference"),
    "rank0-sdpa": dict(metric_rank=0),
    "rank0-eager": dict(metric_rank=0, attn_implementation="eager"),
    "sliding-window": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
}


def path_model(name, seed=0):
    overrides = dict(PATHS[name])
    attn = overrides.pop("attn_implementation", None)
    model = set_gates(tiny_model(seed=seed, **overrides))
    if attn is not None:
        model.set_attn_implementation(attn)
    return model


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", list(PATHS))
def test_causality(name, padded):
    """Changing token t leaves every logit before t unchanged (and changes the ones after)."""
    model = path_model(name)
    ids, mask = left_padded(batch=2, length=12, pads=(0, 3) if padded else (0, 0))
    t = 8
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 5) % TINY["vocab_size"]
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = model(changed, attention_mask=mask).logits
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-13)
    assert (a[:, t:] - b[:, t:]).abs().amax() > 1e-6


def test_all_paths_agree():
    """Blocked (either mask format) == reference, for the same weights and a left-padded batch."""
    ids, mask = left_padded(batch=2, length=11, pads=(0, 3))
    real = mask.bool()
    with torch.no_grad():
        logits = {name: path_model(name)(ids, attention_mask=mask).logits for name in ("blocked-sdpa-mask",
                                                                                          "blocked-eager-mask",
                                                                                          "reference")}
        rank0 = {name: path_model(name)(ids, attention_mask=mask).logits for name in ("rank0-sdpa", "rank0-eager")}
    torch.testing.assert_close(logits["blocked-sdpa-mask"][real], logits["reference"][real], rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(logits["blocked-eager-mask"][real], logits["reference"][real], rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(rank0["rank0-sdpa"][real], rank0["rank0-eager"][real], rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:_compile flag on create_block_mask:DeprecationWarning")  # torch, via transformers
@pytest.mark.parametrize("name", ["blocked-sdpa-mask", "sliding-window", pytest.param("rank0-sdpa", marks=FLEX_KERNEL)])
def test_flex_attention_masks_are_read_like_the_others(name):
    """attn_implementation="flex_attention": geodesic layers read the BlockMask token by token (flex's kernel cannot
    compute geodesic scores), rank-0 layers run flex itself; same logits and greedy tokens as sdpa, padded."""
    model = path_model(name).float()
    ids, mask = left_padded(batch=2, length=10, pads=(0, 3))
    args = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    # (rank 0 runs torch's own flex kernel, whose CPU build fails to compile a decode step in torch 2.13 -- a
    # CppCompileError for LlamaForCausalLM too -- so its generation is not compared here)
    generate = name != "rank0-sdpa"
    with torch.no_grad():
        sdpa = model(ids, attention_mask=mask).logits
        sdpa_tokens = model.generate(ids, **args) if generate else None
        model.set_attn_implementation("flex_attention")
        flex = model(ids, attention_mask=mask).logits
        flex_tokens = model.generate(ids, **args) if generate else None
    real = mask.bool()
    torch.testing.assert_close(flex[real], sdpa[real], rtol=1e-5, atol=1e-5)
    assert not generate or torch.equal(flex_tokens, sdpa_tokens)


@pytest.mark.parametrize("path", ["blocked", "reference"])
def test_geodesic_attention_function_has_transformers_signature_and_is_the_layers_attention(path):
    """The function ``attention_function`` picks for a geodesic layer has transformers' attention-function signature,
    (module, query, key, value, attention_mask, *, scaling, dropout, factors, alpha, gamma) -> (attn_output (B, n, H, d),
    attn_weights): called directly on the inputs the layer builds (projections, RoPE, turned factors), it gives the
    layer's attention output."""
    model = set_gates(tiny_model(fiber_attention_path=path, attention_block_size=4))
    layer = model.model.layers[0]
    attn = layer.self_attn
    b, n, d = 2, 9, TINY["head_dim"]
    hidden = torch.randn(b, n, TINY["hidden_size"], dtype=F64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(n)[None].expand(b, -1)
    cos, sin = model.model.rotary_emb(hidden, positions)
    rotation = model.model.rotary_emb.factor_rotation(hidden, positions)
    with torch.no_grad():
        metric = layer.fiber_state(hidden, modeling.AttentionMetric(rotation))
        expected, _, _ = attn(hidden, position_embeddings=(cos, sin), metric=metric)
        query = modeling.apply_rotary(attn.q_proj(hidden).view(b, n, -1, d).transpose(1, 2), cos[:, None], sin[:, None])
        key = modeling.apply_rotary(attn.k_proj(hidden).view(b, n, -1, d).transpose(1, 2), cos[:, None], sin[:, None])
        value = attn.v_proj(hidden).view(b, n, -1, d).transpose(1, 2)  # (B, Hk, n, d)
        geometry = dict(factors=modeling.rotate_factors(metric.factors, *rotation), alpha=metric.alpha,
                        gamma=metric.gamma)

        def function(output_attentions=False):
            return modeling.attention_function(attn.config, query, key, value, None, 0.0, geometry, output_attentions)

        out, weights = function()(attn, query, key, value, None, scaling=attn.scaling, dropout=0.0, **geometry)
        assert out.shape == (b, n, TINY["num_attention_heads"], d)
        groups = attn.num_key_value_groups  # and it is the geodesic attention of those inputs, written out
        reference, _ = reference_geodesic_attention(
            query, modeling.expand_factors(geometry["factors"], TINY["num_attention_heads"]),
            modeling.repeat_kv(key, groups), modeling.repeat_kv(value, groups), metric.alpha, metric.gamma,
            attn.scaling)
        torch.testing.assert_close(out, reference.transpose(1, 2), rtol=1e-10, atol=1e-12)
        assert (weights is None) == (path == "blocked")  # the blocked path builds probabilities only when asked
        torch.testing.assert_close(attn.o_proj(out.reshape(b, n, -1)), expected, rtol=1e-12, atol=1e-12)
        with_probs, probs = function(output_attentions=True)(attn, query, key, value, None, scaling=attn.scaling,
                                                             dropout=0.0, **geometry)
    torch.testing.assert_close(with_probs, out, rtol=1e-12, atol=1e-12)
    assert probs.shape == (b, TINY["num_attention_heads"], n, n) and probs.triu(1).abs().max() == 0
    torch.testing.assert_close(probs.sum(-1), torch.ones(b, TINY["num_attention_heads"], n, dtype=F64))
    for output_attentions in (False, True):  # the geometry is required, by name
        with pytest.raises(TypeError, match="factors"):
            function(output_attentions)(attn, query, key, value, None, scaling=attn.scaling, dropout=0.0)


def test_one_function_picks_every_attention_path():
    """``attention_function`` alone decides which function computes a call (docs/design.md 1.5), the first that applies
    in its order: the backbone's function of ``_attn_implementation`` without an attention metric, the reference path,
    the probabilities when asked for, then ``geodesic_attention_forward`` on a fused kernel where
    ``fiber_attention_kernel`` allows it, else on the blocked path."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from modeling_fiber_bundle import fused_attention

    config = tiny_config()
    query, key = torch.randn(1, 4, 5, 8, dtype=F64), torch.randn(1, 2, 5, 8, dtype=F64)  # (B, H | Hk, n, d)
    alpha = torch.zeros(4, dtype=F64)
    operands = dict(factors=torch.zeros(1, 2, 5, 2, 8, dtype=F64), alpha=alpha, gamma=alpha)

    def pick(output_attentions=False, operands=operands, **settings):
        for name, value in settings.items():
            setattr(config, name, value)
        return modeling.attention_function(config, query, key, key, None, 0.0, operands, output_attentions)

    for implementation in ("eager", "sdpa"):
        config._attn_implementation = implementation
        assert pick(operands={}) is ALL_ATTENTION_FUNCTIONS.get_interface(implementation,
                                                                         modeling.eager_attention_forward)
    for output_attentions in (False, True):
        assert pick(output_attentions, fiber_attention_path="reference") is modeling.reference_attention_forward
    assert pick(True, fiber_attention_path="blocked") is modeling.probabilities_attention_forward
    kernels = {"pytorch": modeling.blocked_geodesic_attention, "cpp": modeling.cpp_geodesic_attention}
    if fused_attention.triton_available():
        kernels["triton"] = modeling.triton_geodesic_attention
    for setting, kernel in kernels.items():
        function = pick(fiber_attention_kernel=setting)
        assert function.func is modeling.geodesic_attention_forward and function.keywords == {"kernel": kernel}


def test_geometry_changes_the_function_when_gates_move():
    ids = random_ids(2, 10)
    model = tiny_model()
    with torch.no_grad():
        graft = model(ids).logits
        moved = set_gates(model)(ids).logits
    assert (graft - moved).abs().amax() > 1e-3


def test_scores_depend_on_relative_positions_only(monkeypatch):
    model = set_gates(tiny_model(attention_block_size=4), alpha=3.0, gamma=1.0)
    ids = random_ids(2, 10)
    pos = torch.arange(10)[None].expand(2, -1)
    with torch.no_grad():
        a = model(ids, position_ids=pos).logits
        b = model(ids, position_ids=pos + 37).logits
    # RoPE angles are computed in float32 (as in transformers), so a shift changes the logits at float32 rounding only
    relative_error = (a - b).abs().amax()
    assert relative_error < 1e-5
    # the test has teeth: factors left in an absolute frame (not rotated with the query) break the property
    monkeypatch.setattr(modeling, "rotate_factors", lambda f, cos, sin: f)
    with torch.no_grad():
        c = model(ids, position_ids=pos).logits
        d = model(ids, position_ids=pos + 37).logits
    assert (c - d).abs().amax() > 100 * relative_error


@pytest.mark.parametrize("name", ["blocked-sdpa-mask", "reference", "rank0-sdpa"])
def test_left_padded_rows_equal_unpadded_rows_and_have_no_nan(name):
    model = path_model(name)
    ids, mask = left_padded(batch=3, length=12, pads=(0, 4, 7))
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate() builds them: real tokens start at position 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, position_ids=positions).logits
        assert torch.isfinite(batch).all()
        for row, pad in enumerate((0, 4, 7)):
            alone = model(ids[row : row + 1, pad:]).logits[0]
            torch.testing.assert_close(batch[row, pad:], alone, rtol=1e-11, atol=1e-11)


def test_padding_free_packing_equals_separate_sequences():
    """Sequences packed in one row, delimited by position_ids restarting at 0 (DataCollatorWithFlattening's format)."""
    model = path_model("blocked-sdpa-mask")
    lengths = (5, 7, 4)
    seqs = [random_ids(1, n, seed=i) for i, n in enumerate(lengths)]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        # transformers detects packing only without a cache (as in training), for its own models too
        out = model(packed, position_ids=position_ids, use_cache=False).logits[0]
        start = 0
        for seq, n in zip(seqs, lengths):
            torch.testing.assert_close(out[start : start + n], model(seq).logits[0], rtol=1e-11, atol=1e-11)
            start += n


# ---------------------------------------------------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["blocked-sdpa-mask", "reference"])
def test_output_attentions_are_the_attention_probabilities(name):
    model = path_model(name)
    ids, mask = left_padded(batch=2, length=9, pads=(0, 2))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
        ref = path_model("reference")(ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == TINY["num_hidden_layers"]
    for probs, ref_probs in zip(out.attentions, ref.attentions):
        assert probs.shape == (2, TINY["num_attention_heads"], 9, 9)
        real = mask.bool()[:, None, :, None].expand_as(probs)
        torch.testing.assert_close(probs[real], ref_probs[real], rtol=1e-11, atol=1e-12)
        row_sums = probs.sum(-1)  # 1 on real tokens; padding rows attend to nothing
        torch.testing.assert_close(row_sums, mask[:, None, :].expand_as(row_sums).to(row_sums.dtype))
        assert probs.triu(1).abs().max() == 0  # causal
    with torch.no_grad():  # asking for the probabilities does not change the function (blocked: kernel vs probs @ V)
        plain = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out.logits[mask.bool()], plain[mask.bool()], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name", ["blocked-sdpa-mask", "reference"])
def test_output_attentions_carry_the_gradient_in_training(name):
    """transformers' retain-grad test: the returned probabilities are on the path to the output, with their grad."""
    model = path_model(name).train()
    out = model(random_ids(2, 9), output_attentions=True, output_hidden_states=True)
    attentions, hidden = out.attentions[0], out.hidden_states[0]
    attentions.retain_grad()
    hidden.retain_grad()
    out.logits.flatten()[0].backward()
    assert attentions.grad is not None and attentions.grad.abs().sum() > 0
    assert hidden.grad is not None


def test_geometry_is_finite_for_every_input_length():
    """A one-token input (a decode step without a mask) has no neighbouring pair: curvature is 0, never NaN."""
    model = set_gates(tiny_model())
    ids = random_ids(2, 6)
    with torch.no_grad():
        for n in (1, 2, 6):
            geometry = model(ids[:, :n], output_geometry=True).geometry
            assert all(torch.isfinite(v).all() for v in geometry.values()), (n, geometry)
        cache = model(ids[:, :5], use_cache=True).cache
        step = model(ids[:, 5:], cache=cache, output_geometry=True).geometry
    assert all(torch.isfinite(v).all() for v in step.values())
    assert (step["curvature"] == 0).all()


def test_attention_dropout_trains_on_the_blocked_path(monkeypatch):
    """attention_dropout > 0 stays on the memory-bounded blocked path (never the reference's n x n x r), drops at
    random (reproducibly under torch.manual_seed), and is off in eval mode."""
    model = set_gates(tiny_model(attention_dropout=0.3, attention_block_size=4))
    ids = random_ids(2, 12)
    with torch.no_grad():
        eval_logits = model(ids).logits
    monkeypatch.setattr(modeling, "reference_geodesic_attention", lambda *a, **k: pytest.fail("reference path used"))
    model.train()
    losses = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        losses.append(model(ids, labels=ids).loss)
    assert losses[0] == losses[1] and losses[0] != losses[2]
    losses[0].backward()
    assert model.model.layers[0].fiber.attn_gate.grad.abs().sum() > 0
    torch.manual_seed(0)
    assert (model(ids).logits.detach() - eval_logits).abs().max() > 1e-3
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, eval_logits, rtol=0, atol=0)


def test_output_hidden_states_match_transformers_convention():
    source, fiber = backbone_pair("llama", tie=False)
    ids = random_ids(2, 7)
    with torch.no_grad():
        a = source(ids, output_hidden_states=True).hidden_states
        b = fiber(ids, output_hidden_states=True).hidden_states
    assert len(a) == len(b) == TINY["num_hidden_layers"] + 1
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_output_geometry_returns_per_layer_proxies():
    model = set_gates(tiny_model())
    ids, mask = left_padded(batch=2, length=20, pads=(0, 5))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_geometry=True)
        plain = model(ids, attention_mask=mask)
    assert plain.geometry is None
    assert set(out.geometry) == {"curvature", "torsion", "anisotropy"}
    for value in out.geometry.values():
        assert value.shape == (TINY["num_hidden_layers"],) and torch.isfinite(value).all()
    assert (out.geometry["torsion"] > 0).all() and (out.geometry["curvature"] > 0).all()
    with torch.no_grad():  # at the graft (alpha = 0) the metric is the identity everywhere
        graft = tiny_model()(ids, attention_mask=mask, output_geometry=True).geometry
    assert all((v == 0).all() for v in graft.values())


def test_geometry_regularisers_enter_the_loss():
    ids = random_ids(2, 12)
    base = set_gates(tiny_model())
    weighted = set_gates(tiny_model(curvature_weight=50.0, torsion_weight=2.0))
    out = weighted(ids, labels=ids, output_geometry=True)
    plain = base(ids, labels=ids).loss
    curvature, torsion = out.geometry["curvature"].mean(), out.geometry["torsion"].mean()
    added = out.loss - plain
    assert 50.0 * curvature > 1e-4 and 2.0 * torsion > 1e-4  # each term moves the loss far beyond the tolerance
    torch.testing.assert_close(added, 50.0 * curvature + 2.0 * torsion, rtol=1e-10, atol=1e-12)
    out.loss.backward()
    assert weighted.model.layers[0].fiber.attn_factor_proj.weight.grad.abs().sum() > 0


def test_past_key_values_is_a_deprecated_alias_of_cache():
    model = tiny_model()
    ids = random_ids(1, 6)
    with torch.no_grad():
        first = model(ids[:, :4], use_cache=True)
        with pytest.warns(FutureWarning, match="cache="):
            legacy = model(ids[:, 4:], past_key_values=first.cache, use_cache=True)
        full = model(ids).logits
    torch.testing.assert_close(legacy.logits, full[:, 4:], rtol=1e-11, atol=1e-11)


def test_tuple_output():
    model = tiny_model()
    ids = random_ids(1, 5)
    with torch.no_grad():
        logits = model(ids, return_dict=False, use_cache=False)[0]
    torch.testing.assert_close(logits, model(ids).logits)


@pytest.mark.parametrize("via", ["argument", "config"])
def test_return_dict_false_gives_the_tuples_llama_gives(via):
    """transformers' tuple/dict equivalence: the base model and the LM, asked by argument or by config.return_dict."""
    source, fiber = backbone_pair("llama", tie=False)
    ids = random_ids(2, 6)
    kwargs = dict(output_hidden_states=True, output_attentions=True, use_cache=True)
    for model in (source, fiber):
        if via == "config":
            model.config.return_dict = False
    # (LlamaForCausalLM itself crashes with config.return_dict=False in transformers 5.24: its base model returns a
    # tuple to it. Ours does not; with the config flag LLaMA is compared at the base model.)
    pairs = ((fiber.model, source.model), (fiber, source)) if via == "argument" else ((fiber.model, source.model),)
    if via == "config":
        with torch.no_grad():
            lm_tuple = fiber(ids, **kwargs)
        assert isinstance(lm_tuple, tuple) and len(lm_tuple) == 4  # logits, cache, hidden states, attentions
    with torch.no_grad():
        for mine, theirs in pairs:
            got = mine(ids, **kwargs, **({"return_dict": False} if via == "argument" else {}))
            expected = theirs(ids, **kwargs, **({"return_dict": False} if via == "argument" else {}))
            assert isinstance(got, tuple) and isinstance(expected, tuple) and len(got) == len(expected)
            torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=1e-12)
            dict_out = mine(ids, **kwargs, return_dict=True)
            assert not isinstance(dict_out, tuple)
            torch.testing.assert_close(dict_out.to_tuple()[0], got[0])


# ---------------------------------------------------------------------------------------------------------------------
# masks as the backbone reads them, RoPE types, dropout, low precision (the model meets LlamaForCausalLM's contracts)
# ---------------------------------------------------------------------------------------------------------------------
def custom_float_mask(batch, n, heads=1, seed=0):
    """A (B, heads, n, n) additive mask as users build them: causal blocks at the dtype's minimum, and allowed
    entries carrying arbitrary biases, -1e4 and -1e9 (never a whole row: the backbone's rows stay defined)."""
    gen = torch.Generator().manual_seed(seed)
    mask = 2.0 * torch.randn(batch, heads, n, n, generator=gen, dtype=F64)
    mask[..., 1::3] = -1e4
    mask[..., 2::4] = -1e9
    mask.diagonal(dim1=-2, dim2=-1).zero_()
    return mask.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), torch.finfo(F64).min)


@pytest.mark.parametrize("heads", [1, TINY["num_attention_heads"]])
@pytest.mark.parametrize("path", ["blocked", "reference"])
def test_custom_4d_masks_at_the_graft_equal_the_backbone(path, heads):
    """docs/design.md 1.2: at the graft the model equals its backbone under every mask: a 4D float mask is added whatever its
    values, a bool mask selects, and a per-head (B, H, q, kv) mask applies per query head under GQA."""
    source, fiber = backbone_pair("llama", tie=False, fiber_attention_path=path, attention_block_size=4)
    ids = random_ids(2, 11)
    float_mask = custom_float_mask(2, 11, heads)
    bool_mask = float_mask > torch.finfo(F64).min
    if heads > 1:  # heads of one KV group see different keys: a per-head sliding window
        rows, cols = torch.arange(11)[:, None], torch.arange(11)[None]
        windows = torch.stack([(cols > rows - 2 - 2 * h) for h in range(heads)])[None]
        bool_mask = bool_mask & windows
        float_mask = float_mask.masked_fill(~windows, torch.finfo(F64).min)
    with torch.no_grad():
        got = fiber(ids, attention_mask=float_mask).logits
        for impl, tol in (("eager", 1e-6), ("sdpa", 1e-12)):  # LLaMA's eager softmax runs in float32
            source.set_attn_implementation(impl)
            torch.testing.assert_close(got, source(ids, attention_mask=float_mask).logits, rtol=tol, atol=tol)
        expected = source(ids, attention_mask=bool_mask).logits  # sdpa: a bool mask selects
        torch.testing.assert_close(fiber(ids, attention_mask=bool_mask).logits, expected, rtol=1e-12, atol=1e-12)


ROPE_CASES = {  # max_position_embeddings, rope_parameters: every type transformers supports for LLaMA
    "default": (16, {"rope_type": "default"}),
    "linear": (16, {"rope_type": "linear", "factor": 2.0}),
    "dynamic": (16, {"rope_type": "dynamic", "factor": 2.0}),
    "yarn": (32, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "longrope": (32, {"rope_type": "longrope", "original_max_position_embeddings": 8,
                      "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}),
    "llama3": (16, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8}),
}


def rope_pair(name):
    max_positions, rope = ROPE_CASES[name]
    rope = {**rope, "rope_theta": 10000.0}
    torch.manual_seed(0)
    keys = {**BACKBONE_KEYS, "max_position_embeddings": max_positions, "rope_parameters": dict(rope)}
    source = LlamaForCausalLM(LlamaConfig(**keys)).to(F64).eval()
    fiber = tiny_model(seed=1, max_position_embeddings=max_positions, rope_parameters=dict(rope))
    fiber.load_state_dict(source.state_dict(), strict=False)
    return source, fiber


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_every_llama_rope_type_equals_llama_beyond_max_position_embeddings(name):
    source, fiber = rope_pair(name)
    ids = random_ids(2, 40)  # longer than max_position_embeddings (16 or 32)
    with torch.no_grad():
        torch.testing.assert_close(fiber(ids).logits, source(ids).logits, rtol=1e-12, atol=1e-12)
    prompt = random_ids(1, 10)  # generation crosses the original length (dynamic and longrope switch frequencies)
    args = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False)
    torch.testing.assert_close(fiber.generate(prompt, **args), source.generate(prompt, **args), rtol=0, atol=0)
    awake = set_gates(fiber)
    with torch.no_grad():  # with the metric awake, the cache still reproduces the full forward
        full = awake(ids, use_cache=False).logits[:, -1]
        cache = awake(ids[:, :-1], use_cache=True).cache
        step = awake(ids[:, -1:], cache=cache).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rope", ["default", "yarn", "longrope"])
def test_metric_is_spd_in_every_dtype_and_rope_type(monkeypatch, dtype, rope):
    """docs/design.md 1.1: G_i = I + alpha U_i U_i^T is SPD for every input, in the dtype the model runs in, whatever the RoPE
    type: the factors the attention uses (after their rotation) keep ||U_i||_2 < 1 (YaRN's and longrope's
    attention_scaling turn q and k only) and alpha stays above -1 where expm1 rounds to -1. So is M_i."""
    max_positions, params = ROPE_CASES[rope]
    model = tiny_model(dtype=dtype, max_position_embeddings=max_positions, rope_parameters={**params, "rope_theta": 10000.0})
    with torch.no_grad():
        for layer in model.model.layers:
            layer.fiber.attn_factor_proj.weight.mul_(1e3)  # huge raw factors: ||U_i|| right at the bound
            layer.fiber.attn_gate.fill_(-20.0)  # alpha = expm1(-20): exactly -1 in float32 without a floor
            layer.fiber.ffn_factor_proj.weight.mul_(1e3)
            layer.fiber.ffn_gate.fill_(-20.0)
    seen = []
    rotate = modeling.rotate_factors
    monkeypatch.setattr(modeling, "rotate_factors", lambda f, c, s: seen.append(rotate(f, c, s)) or seen[-1])
    calls = []
    metric_forward = modeling.FiberBundleMetric.forward
    monkeypatch.setattr(modeling.FiberBundleMetric, "forward",
                        lambda self, *a: calls.append((self, a, metric_forward(self, *a))) or calls[-1][2])
    with torch.no_grad():
        logits = model(random_ids(2, 40)).logits
    attention = [state for _, args, state in calls if args[1] == "attention"]
    ffn = [(module, args, state) for module, args, state in calls if args[1] == "ffn"]
    assert torch.isfinite(logits).all() and len(seen) == len(attention) == len(ffn) == TINY["num_hidden_layers"]
    for factors, state in zip(seen, attention):
        assert factors.dtype != torch.bfloat16 and factors.dtype != torch.float16  # computed in at least fp32
        sigma_sq = torch.linalg.eigvalsh(metric_gram(factors.double())).amax(-1)  # (B, Hk, n): ||U_i||_2^2
        alpha = state.alpha.double().view(1, factors.shape[1], -1, 1)  # (1, Hk, g, 1): the heads sharing U_i
        assert (1.0 + alpha * sigma_sq[:, :, None]).min() > 0  # G's smallest eigenvalue, from the kernel's values
    for _, (_, _, update, *_), state in ffn:
        assert torch.isfinite(state.ffn_update).all() and state.ffn_update.dtype == update.dtype
        v_sq = torch.linalg.eigvalsh(metric_gram(state.ffn_factors.double())).amax(-1)  # the factors the step used
        assert (1.0 + state.beta.double() * v_sq).min() > 0  # M_i's smallest eigenvalue


# ---------------------------------------------------------------------------------------------------------------------
# cache and generation
# ---------------------------------------------------------------------------------------------------------------------
def greedy_without_cache(model, ids, steps):
    for _ in range(steps):
        with torch.no_grad():
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("name", ["blocked-sdpa-mask", "reference", "sliding-window", "rank0-sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_generate_with_cache_equals_full_forward_without_cache(name, dtype):
    model = path_model(name).to(dtype)
    ids = random_ids(1, 5)
    generated = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(generated, greedy_without_cache(model, ids, 16))
    # incremental last-token logits equal the full forward's
    with torch.no_grad():
        step = model(generated[:, :-1], use_cache=True)
        last = model(generated[:, -1:], cache=step.cache).logits[:, -1]
        full = model(generated, use_cache=False).logits[:, -1]
    torch.testing.assert_close(last, full, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-11)


def test_static_cache_generation_equals_dynamic_cache():
    model = path_model("blocked-sdpa-mask")
    ids, mask = left_padded(batch=2, length=6, pads=(0, 2))
    args = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    dynamic = model.generate(ids, **args)
    static = model.generate(ids, cache_implementation="static", **args)
    assert torch.equal(dynamic, static)


def compiled_generation(model, ids, mask, backend, through_config):
    """Greedy tokens from a static cache with a fullgraph-compiled forward (dynamo raises on any graph break), either
    compiling model.forward by hand or through generation_config.compile_config, as transformers documents."""
    args = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    if through_config:
        config = CompileConfig(fullgraph=True, backend=backend, mode="default")
        config._compile_all_devices = True  # transformers compiles on CUDA only unless told (its own tests do this)
        model.generation_config.compile_config = config
        out = model.generate(ids, cache_implementation="static", **args)
        assert hasattr(model, "_compiled_call")  # the decode steps ran the compiled forward
        return out
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, fullgraph=True, backend=backend)
    try:  # prefill and decode steps both compiled
        return model.generate(ids, cache_implementation="static", **args)
    finally:
        model.forward = eager_forward


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_compiles_fullgraph_and_gives_the_eager_tokens(padded):
    """_can_compile_fullgraph is honest: no graph break (no .item(), no data-dependent Python branch) in prefill or
    decode, with and without padding. Dynamo only (backend "eager"): the inductor run is the heavy test below."""
    assert FiberBundleForCausalLM._can_compile_fullgraph
    torch._dynamo.reset()
    model = set_gates(tiny_model(dtype=torch.float32, attention_block_size=4))
    ids, mask = left_padded(batch=2, length=7, pads=(0, 3 if padded else 0))
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)
    assert torch.equal(compiled_generation(model, ids, mask, "eager", through_config=False), eager)


@pytest.mark.heavy
def test_compiled_generation_with_inductor_gives_the_eager_tokens():
    torch._dynamo.reset()
    model = set_gates(tiny_model(dtype=torch.float32))
    ids, mask = left_padded(batch=2, length=7, pads=(0, 3))
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)
    assert torch.equal(compiled_generation(model, ids, mask, "inductor", through_config=True), eager)


def test_beam_search_with_cache_equals_without_cache():
    model = path_model("blocked-sdpa-mask")
    ids, mask = left_padded(batch=2, length=6, pads=(0, 2))
    args = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **args), model.generate(ids, use_cache=False, **args))


def count_key_norms(monkeypatch) -> list:
    """Record the number of keys of every ``key_norms`` call the model makes (the key term's ||k_j||^2)."""
    calls = []

    def counted(key, dtype):
        calls.append(key.shape[-2])
        return key_norms(key, dtype)

    monkeypatch.setattr(modeling, "key_norms", counted)
    return calls


def test_the_cache_computes_each_keys_norm_once(monkeypatch):
    """Decoding computes ||k_j||^2 of each key when it enters the cache, not of every cached key at every step (issue
    44), and the norms kept are those of the keys the cache holds."""
    model = path_model("blocked-sdpa-mask")
    calls = count_key_norms(monkeypatch)
    ids = random_ids(2, 9)
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    layers = model.config.num_hidden_layers
    assert calls == [9] * layers + [1] * (5 * layers)  # the prompt once, then one new key per layer and step
    for layer in out.cache.layers:
        norms = modeling._KEY_NORMS[layer][2]
        torch.testing.assert_close(norms, layer.keys.pow(2).sum(-1), rtol=0, atol=1e-12)
    # in training (gradients on) nothing is kept: the key term's gradient flows through the norms
    trained = model(ids, use_cache=True)
    trained.logits.sum().backward()
    assert not any(layer in modeling._KEY_NORMS for layer in trained.cache.layers)


def test_kept_key_norms_follow_beam_reordering_cropping_and_in_place_edits():
    """Whenever the cache's keys change other than by appending, the kept norms are recomputed: beam search scores equal
    those without a cache, a cropped cache (assisted decoding) gives the full forward's logits, and keys overwritten in
    place give the logits of the cache they were copied from."""
    model = path_model("blocked-sdpa-mask")
    ids, mask = left_padded(batch=2, length=6, pads=(0, 2))
    args = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False,
                pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    cached, uncached = model.generate(ids, **args), model.generate(ids, use_cache=False, **args)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, rtol=0, atol=1e-12)

    ids = random_ids(1, 10)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        model(ids[:, -3:-1], cache=cache)  # two more steps, then cropped back as assisted decoding does
        cache.crop(-5)  # 12 keys -> 7
        stepped = model(ids[:, 7:8], cache=cache).logits[:, -1]
        full = model(ids[:, :8], use_cache=False).logits[:, -1]
        torch.testing.assert_close(stepped, full, rtol=0, atol=1e-11)

        other = random_ids(1, 11, seed=5)
        cache, source = model(ids, use_cache=True).cache, model(other[:, :10], use_cache=True).cache
        model(ids[:, :1], cache=cache)  # a step each, so that norms are kept for the keys about to be edited
        model(other[:, 10:], cache=source)
        for layer, src in zip(cache.layers, source.layers, strict=True):
            layer.keys.copy_(src.keys)
            layer.values.copy_(src.values)
        edited = model(ids[:, :1], cache=cache).logits[:, -1]
        reference = model(ids[:, :1], cache=source).logits[:, -1]
        torch.testing.assert_close(edited, reference, rtol=0, atol=0)


def test_left_padded_generation_equals_unpadded():
    model = path_model("blocked-sdpa-mask")
    ids, mask = left_padded(batch=2, length=7, pads=(0, 3))
    args = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    batch = model.generate(ids, attention_mask=mask, **args)
    alone = model.generate(ids[1:, 3:], **args)
    assert torch.equal(batch[1, 3:], alone[0])


# ---------------------------------------------------------------------------------------------------------------------
# training contracts
# ---------------------------------------------------------------------------------------------------------------------
def test_geometry_only_step_from_the_graft_changes_the_logits():
    """Backbone frozen, gates at 0: the linear gates carry gradient, and one AdamW step changes the function."""
    model = tiny_model(dtype=torch.float32)
    ids = random_ids(2, 16)
    change = geometry_step_change(model, ids)
    fiber = model.model.layers[0].fiber
    for gate in (fiber.attn_gate, fiber.flatness_gate, fiber.ffn_gate):
        assert gate.grad is not None and gate.grad.abs().sum() > 0
    assert change > 1e-5  # 100x float32 rounding of these logits


def test_zero_factors_are_a_saddle_and_init_avoids_them():
    """With U = 0 the gradient in U is exactly 0 for any gate: the trap a metric I + U U^T initialised at 0 falls in."""
    model = set_gates(tiny_model())
    fiber = model.model.layers[0].fiber
    with torch.no_grad():
        fiber.attn_factor_proj.weight.zero_()
        fiber.attn_factor_proj.bias.zero_()
    ids = random_ids(2, 10)
    model(ids, labels=ids).loss.backward()
    assert torch.equal(fiber.attn_factor_proj.weight.grad, torch.zeros_like(fiber.attn_factor_proj.weight))
    fresh = tiny_model()
    assert fresh.model.layers[0].fiber.attn_factor_proj.weight.abs().min() > 0  # the init never sits on the saddle
    assert fresh.model.layers[0].fiber.ffn_factor_proj.weight.abs().min() > 0


@pytest.mark.parametrize("overrides", [{}, {"metric_rank": 0}, {"ffn_metric_rank": 0}, {"qk_norm": True}])
def test_every_trainable_parameter_gets_a_gradient(overrides):
    """Zero allowed, None never: DDP without find_unused_parameters fails otherwise."""
    model = tiny_model(**overrides).train()
    ids = random_ids(2, 9)
    model(ids, labels=ids).loss.backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing


def test_init_weights_initialises_every_new_parameter():
    cfg = dict(metric_gate_init=0.5, flatness_gate_init=0.25, ffn_gate_init=-0.5, metric_hidden=256)
    model = tiny_model(seed=0, dtype=torch.float32, **cfg)
    fiber_params = dict(model.model.layers[1].fiber.named_parameters())
    for p in fiber_params.values():  # scribble, then ask transformers to initialise again
        p.data.fill_(float("nan"))
    for m in model.modules():
        m._is_hf_initialized = False
    model.initialize_weights()
    fiber = model.model.layers[1].fiber
    assert all(torch.isfinite(p).all() for p in fiber.parameters())
    torch.testing.assert_close(torch.expm1(fiber.attn_gate), torch.full((4,), 0.5))
    torch.testing.assert_close(fiber.flatness_gate, torch.full((4,), 0.25))
    torch.testing.assert_close(torch.expm1(fiber.ffn_gate), torch.tensor([-0.5]))
    assert abs(fiber.code_proj.weight.std().item() - 0.02) < 0.002
    assert abs(fiber.attn_factor_proj.weight.std().item() - 1 / 16) < 0.005
    assert abs(fiber.ffn_factor_proj.weight.std().item() - 1 / 16) < 0.005
    assert fiber.attn_factor_proj.bias.abs().max() == 0 and fiber.ffn_factor_proj.bias.abs().max() == 0


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    ids = random_ids(2, 12)
    grads = []
    for checkpointing in (False, True):
        model = set_gates(tiny_model()).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.model.layers[0].gradient_checkpointing
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-12, atol=1e-12)
    for name, g in grads[0][1].items():
        torch.testing.assert_close(g, grads[1][1][name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def saved_bytes(model, ids):
    """Bytes of the distinct storages autograd keeps for the backward of one training forward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    return loss, sum(storages.values())


def test_geometry_recompute_gives_the_same_gradients_with_less_saved_memory():
    ids = random_ids(2, 64)
    results = {}
    for recompute in (False, True):
        model = set_gates(tiny_model(geometry_recompute=recompute, ffn_metric_rank=4, metric_rank=4)).train()
        loss, nbytes = saved_bytes(model, ids)
        loss.backward()
        results[recompute] = (loss.detach(), nbytes, {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=0)
    for name, g in results[False][2].items():
        torch.testing.assert_close(results[True][2][name], g, rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")
    # the O(n d r) intermediates are not kept, the MLP step's (n, r_f, D) factors included (0.60 here; 0.74 with them)
    assert results[True][1] < 0.7 * results[False][1]


def test_recomputed_mlp_step_keeps_at_most_its_update():
    """With geometry_recompute the MLP step is checkpointed with its factors: turning the MLP metric on adds to the
    saved activations at most one (B, n, D) tensor per layer (the MLP's update, the checkpoint's input), none of the
    step's intermediates (a step whose intermediates were kept took peak forward+backward memory of SmolLM2's shape at
    n = 2048 from 1.12x to 1.21x the backbone's, docs/benchmarks.md)."""
    ids = random_ids(2, 64)
    saved = {}
    for ffn_rank in (0, 2):
        model = set_gates(tiny_model(geometry_recompute=True, ffn_metric_rank=ffn_rank)).train()
        saved[ffn_rank] = saved_bytes(model, ids)[1]
    update_bytes = ids.numel() * TINY["hidden_size"] * 8  # float64
    assert saved[2] - saved[0] <= TINY["num_hidden_layers"] * update_bytes


def test_recomputing_forward_builds_each_metric_part_once():
    """With geometry_recompute, the attention part of the fibre state and the MLP part (built inside the Woodbury
    step's checkpoint) are each generated once per layer in the forward, and once more in the backward."""
    model = set_gates(tiny_model(geometry_recompute=True, ffn_metric_rank=4, metric_rank=4)).train()
    calls = {"attn_factor_proj": 0, "ffn_factor_proj": 0}
    for layer in model.model.layers:
        for name in calls:
            getattr(layer.fiber, name).register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    loss = model(random_ids(2, 16), labels=random_ids(2, 16)).loss
    layers = model.config.num_hidden_layers
    assert calls == {"attn_factor_proj": layers, "ffn_factor_proj": layers}
    loss.backward()
    assert calls == {"attn_factor_proj": 2 * layers, "ffn_factor_proj": 2 * layers}


def test_bf16_forward_stays_finite_on_long_inputs():
    model = set_gates(tiny_model(max_position_embeddings=4096, attention_block_size=256), alpha=3.0, gamma=1.0)
    model = model.to(torch.bfloat16)
    ids = random_ids(1, 2048)
    with torch.no_grad():
        out = model(ids, output_geometry=True)
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(v).all() for v in out.geometry.values())


# peft 0.21 itself reads the deprecated `is_gradient_checkpointing` property; nothing of ours does
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_modules_to_save_trains_the_fiber():
    peft = pytest.importorskip("peft")
    model = set_gates(tiny_model(dtype=torch.float32))
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["fiber"], task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, lora)
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert any(".fiber." in n and "attn_gate" in n for n in trainable)
    assert any("lora_A" in n for n in trainable)
    ids = random_ids(2, 8)
    wrapped(input_ids=ids, labels=ids).loss.backward()
    copies = [p for n, p in wrapped.named_parameters() if p.requires_grad and ".fiber." in n]
    assert copies and all(p.grad is not None for p in copies)
    assert any(p.grad.abs().sum() > 0 for p in copies)


# ---------------------------------------------------------------------------------------------------------------------
# save / load and configuration
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip_is_bit_exact(tmp_path, tie):
    model = set_gates(tiny_model(dtype=torch.float32, tie_word_embeddings=tie))
    with torch.no_grad():
        for p in model.geometry_parameters():
            p.add_(torch.randn_like(p))  # non-zero values in every new parameter
    model.save_pretrained(tmp_path)
    for loaded in (
        FiberBundleForCausalLM.from_pretrained(tmp_path),
        AutoModelForCausalLM.from_pretrained(tmp_path),
    ):
        assert isinstance(loaded, FiberBundleForCausalLM)
        state, expected = loaded.state_dict(), model.state_dict()
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
    base = AutoModel.from_pretrained(tmp_path)
    assert isinstance(base, FiberBundleModel)


def test_config_rejects_invalid_values_with_the_field_name():
    bad = {
        "metric_rank": -1,
        "metric_hidden": 0,
        "metric_factor_sharing": "token",
        "metric_act": "relu6",
        "metric_gate_init": -1.0,
        "ffn_gate_init": float("nan"),
        "attention_block_size": 0,
        "fiber_attention_path": "fast",
        "curvature_weight": -0.1,
        "num_key_value_heads": 3,
        "layer_types": ["full_attention"],
    }
    for field, value in bad.items():
        with pytest.raises(ValueError, match=field):
            tiny_config(**{field: value})
    with pytest.raises(ValueError, match="metric_rank"):
        tiny_config(metric_rank=17)  # > head_dim
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="rope_type"):  # a type transformers has but not for LLaMA
        tiny_config(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0})


def test_config_round_trip_and_backbone_fields(tmp_path):
    cfg = tiny_config(
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        metric_rank=3, attention_bias=True, attention_out_bias=False, sliding_window=8,
    )
    cfg.save_pretrained(tmp_path)
    back = FiberBundleConfig.from_pretrained(tmp_path)
    for field in ("rope_parameters", "metric_rank", "attention_bias", "attention_out_bias", "sliding_window",
                  "layer_types", "head_dim"):
        assert getattr(back, field) == getattr(cfg, field), field
    assert back.layer_types == ["sliding_attention"] * 2
    FiberBundleForCausalLM(back)  # llama3 RoPE builds


def test_no_future_warnings_from_a_normal_run():
    model = tiny_model()
    ids = random_ids(1, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model.generate(ids, max_new_tokens=3, do_sample=False)
        model.train()
        model.activation_checkpointing_enable()
        model(ids, labels=ids).loss.backward()


def test_resize_token_embeddings_keeps_the_tie_and_the_existing_logits():
    model = set_gates(tiny_model(tie_word_embeddings=True))
    ids = random_ids(2, 9)
    with torch.no_grad():
        before = model(ids).logits
    model.resize_token_embeddings(TINY["vocab_size"] + 8)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == TINY["vocab_size"] + 8
    with torch.no_grad():
        after = model(ids).logits
    # equal up to float64 rounding (the wider lm_head matmul blocks differently)
    torch.testing.assert_close(after[..., : TINY["vocab_size"]], before, rtol=0, atol=1e-12)


def test_attention_only_layers_are_the_full_layers_with_a_silent_mlp(tmp_path):
    """``attention_only=True`` (the rank-collapse studies' layer) has no MLP sublayer and computes what the full model
    computes when its MLP adds nothing (down_proj zeroed, no MLP metric): the same logits with the metric awake, and the
    same greedy tokens through the cache; it saves and reloads; asking for an MLP metric without an MLP is refused."""
    full = set_gates(tiny_model(ffn_metric_rank=0))
    only = FiberBundleForCausalLM(tiny_config(ffn_metric_rank=0, attention_only=True)).to(torch.float64)
    assert not any(".mlp." in name or "post_attention_layernorm" in name for name, _ in only.named_parameters())
    missing = only.load_state_dict(full.state_dict(), strict=False)
    assert not missing.missing_keys and all(".mlp." in k or "post_attention_layernorm" in k
                                            for k in missing.unexpected_keys)
    with torch.no_grad():
        for layer in full.model.layers:
            layer.mlp.down_proj.weight.zero_()
    ids = random_ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(only(ids).logits, full(ids).logits, rtol=1e-12, atol=1e-12)
        args = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert torch.equal(only.generate(ids[:1], **args), full.generate(ids[:1], **args))
    only.save_pretrained(tmp_path / "only")
    again = FiberBundleForCausalLM.from_pretrained(tmp_path / "only", dtype=torch.float64)
    assert again.config.attention_only
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, only(ids).logits)
    with pytest.raises(ValueError, match="attention_only=True removes the MLP, .* set ffn_metric_rank=0"):
        tiny_config(attention_only=True)
