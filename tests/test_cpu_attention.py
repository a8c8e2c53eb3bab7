"""The fused C++ operator of the geodesic attention on the CPU (modeling_fiber_bundle/fused_attention.py): the blocked
path's function, forward and every gradient, for every mask, KV grouping, rank and dtype; torch.library's opcheck and
gradcheck; what "auto" does with it (used where it has proved itself, skipped where it fails its self-check or cannot
be built, one graph node per layer under torch.compile); built once and cached on disk."""

import logging
import textwrap

import pytest
import torch
from transformers.testing_utils import CaptureLogger

from helpers import awake_model, random_ids, run_without_project, tiny_tokenizer
from modeling_fiber_bundle import fused_attention
from modeling_fiber_bundle import modeling_fiber_bundle as modeling
from modeling_fiber_bundle.fiber_attention import (
    grouped_kernel_mask,
    blocked_geodesic_attention,
    bounded_factors,
    geodesic_decode_step,
    key_norms,
    prepare_geodesic_inputs,
    woodbury_precondition,
)
from modeling_fiber_bundle.fused_attention import KernelSignature, check_kernel, cpp_geodesic_attention
from test_fiber_attention import MASK_CASES, make_inputs, padding_bool_mask

F64 = torch.float64
NAMES = ("query", "factors", "key", "value", "alpha", "gamma")


@pytest.fixture(scope="module", autouse=True)
def built():
    """The operator, built here (CI has a compiler: a failure to build fails these tests, it does not skip them)."""
    ops = fused_attention.cpu_operator()
    assert ops is not None, fused_attention._cpu_operator["why"]
    return ops


def packed_mask(b, q, kv, documents=(5, 9)):
    """Packed sequences: a boolean (B, 1, q, kv) mask, causal inside each document and blind across them."""
    doc = torch.zeros(kv, dtype=torch.long)
    for start in documents:
        doc[start:] += 1
    rows = torch.arange(q) + (kv - q)
    allowed = (doc[rows][:, None] == doc[None, :]) & (torch.arange(kv)[None, :] <= rows[:, None])
    return allowed[None, None].expand(b, 1, q, kv)


MASKS = {**MASK_CASES, "packed": packed_mask}


def compare(inputs, mask, scale=0.35, tiles=(8, 16), tolerance=1e-12):
    """The operator against the blocked path: output and every gradient under a random weighting of the output
    (rows with no allowed key included: 0 on both)."""
    out = cpp_geodesic_attention(*inputs, scale, mask, tiles=tiles)
    ref = blocked_geodesic_attention(*inputs, scale, mask)
    torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=ref.dtype)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    expected = torch.autograd.grad((ref * weight).sum(), inputs)
    for name, grad, exp in zip(NAMES, grads, expected):
        scale_of = exp.abs().max().clamp_min(1.0)
        torch.testing.assert_close(grad / scale_of, exp / scale_of, rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------------------------------
# the operator's function
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("hk", [1, 2, 4])
@pytest.mark.parametrize("shared", [False, True], ids=["per-head", "shared"])
def test_operator_equals_the_blocked_path_for_every_mask_and_grouping(mask_name, hk, shared):
    """Causal (None), padded, per-head, sliding-window, packed and 4-D float masks; GQA groups of 4, 2 and 1 with
    factors per head or shared by the group; 37 tokens in tiles of 8 queries and 16 keys (partial last tiles)."""
    b, h, n = 2, 4, 37
    inputs = make_inputs(b=b, h=h, hk=hk, q=n, kv=n, d=16, requires_grad=True, hf=hk if shared else h)
    compare(inputs, MASKS[mask_name](b, n, n))


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("d", [8, 24, 64])
def test_operator_equals_the_blocked_path_for_every_rank_and_head_dim(r, d):
    """r in {1, 2, 4}; head dims below, between and at multiples of the products' vector width; the default tiles
    (CPU_TILES) over 150 tokens, and fewer queries than keys (a prompt after a cached prefix, bottom-right mask)."""
    inputs = make_inputs(b=1, h=4, hk=2, q=150, kv=150, d=d, r=r, requires_grad=True, hf=2)
    compare(inputs, None, tiles=None)
    inputs = make_inputs(b=2, h=4, hk=2, q=70, kv=150, d=d, r=r, requires_grad=True, hf=4)
    compare(inputs, padding_bool_mask(2, 70, 150, pad=[0, 20]), tiles=None)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("hf", [1, 2])
def test_operator_gradcheck_in_float64(masked, hf):
    inputs = make_inputs(b=1, h=2, hk=1, q=6, kv=6, d=4, r=2, requires_grad=True, hf=hf)
    mask = MASK_CASES["float-additive-per-head"](2, 6, 6)[:1, :2] if masked else None  # per head, one empty row

    def fn(q, f, k, v, a, g):
        return cpp_geodesic_attention(q, f, k, v, a, g, 0.5, mask, tiles=(4, 4))

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("hk, shared", [(1, True), (2, False), (2, True), (4, False)])
@pytest.mark.parametrize("kv", [1, 37, 300])
def test_decode_equals_the_short_path_for_every_mask_and_grouping(mask_name, hk, shared, kv):
    """The operator's one-row ``decode`` (generation's step) against ``geodesic_decode_step``: every mask's last row
    (padded, per head, sliding window, packed, float), GQA groups of 4, 2 and 1 with factors per head or shared, one
    key, one partial chunk and three chunks of keys (combined across chunks), with the cache's key norms and
    without."""
    b, h = 2, 4
    query, factors, key, value, alpha, gamma = make_inputs(b=b, h=h, hk=hk, q=1, kv=kv, d=16, hf=hk if shared else h)
    full = MASKS[mask_name](b, kv, kv)
    mask = None if full is None else full[..., -1:, :]
    expected = geodesic_decode_step(query, factors, key, value, alpha, gamma, 0.35, mask)
    for key_sq in (None, key_norms(key, F64)):
        out = fused_attention.cpp_decode_step(query, factors, key, value, alpha, gamma, 0.35, mask, key_sq)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("attention", [blocked_geodesic_attention, cpp_geodesic_attention], ids=["blocked", "cpp"])
def test_kept_key_norms_are_ignored_where_a_gradient_flows_through_the_keys(attention):
    """A cache's key norms serve inference only: given them in training (wrong ones here), the output and every
    gradient are those computed from the keys themselves."""
    inputs = make_inputs(b=1, h=4, hk=2, q=9, kv=9, d=16, requires_grad=True, hf=2)
    stale = torch.zeros(1, 2, 9, dtype=F64)
    outs = [attention(*inputs, 0.3, key_sq=key_sq) for key_sq in (None, stale)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    grads = [torch.autograd.grad(out.square().sum(), inputs) for out in outs]
    for fresh, kept in zip(*grads):
        torch.testing.assert_close(kept, fresh, rtol=0, atol=0)


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("d", [8, 24, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64], ids=str)
def test_decode_is_within_the_kernel_tolerance_for_every_rank_head_dim_and_dtype(r, d, dtype):
    """r in {1, 2, 4}; head dims below, between and at multiples of the vector width (the dot products' tails); the
    query, keys and values in the dtype, factors and gates in at least float32 (as the model passes them), against the
    same values in float64: within ``KERNEL_TOLERANCE``; a row whose keys are all blocked gives 0 (as the short path)."""
    inputs = make_inputs(b=2, h=6, hk=2, q=1, kv=200, d=d, r=r, hf=2)
    geometry = torch.promote_types(dtype, torch.float32)
    low = [t.to(dt) for t, dt in zip(inputs, (dtype, geometry, dtype, dtype, geometry, geometry))]
    allowed = torch.ones(2, 1, 1, 200, dtype=torch.bool)
    allowed[1] = False  # the second sequence sees no key
    out = fused_attention.cpp_decode_step(*low, d**-0.5, allowed)
    expected = geodesic_decode_step(*(t.to(F64) for t in low), d**-0.5, allowed)
    assert out.dtype == dtype and torch.all(out[1] == 0)
    assert fused_attention.relative_error(out, expected) <= fused_attention.KERNEL_TOLERANCE[dtype]


@pytest.mark.parametrize("r", [1, 2, 4, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64], ids=str)
def test_woodbury_operator_equals_the_pytorch_step(r, dtype):
    """The operator's ``woodbury`` (the MLP's preconditioned step in CPU inference) against ``woodbury_precondition``:
    ranks up to the unrolled solve's and beyond it, D not a multiple of the vector width, negative and positive gates,
    every dtype within ``KERNEL_TOLERANCE`` of the float64 step."""
    gen = torch.Generator().manual_seed(r)
    update = torch.randn(2, 5, 100, generator=gen, dtype=F64)
    factors = bounded_factors(torch.randn(2, 5, r, 100, generator=gen, dtype=F64))
    for beta in (-0.9, 0.7, 40.0):
        beta = torch.tensor([beta], dtype=F64)
        expected = woodbury_precondition(update, factors, beta)
        geometry = torch.promote_types(dtype, torch.float32)
        out = fused_attention.woodbury_step(update.to(dtype), factors.to(geometry), beta.to(geometry))
        assert out.dtype == dtype
        assert fused_attention.relative_error(out, expected) <= fused_attention.KERNEL_TOLERANCE[dtype]


def test_woodbury_operator_serves_inference_only_and_a_wrong_one_is_caught(monkeypatch):
    """Training (gradients flowing) and "pytorch" keep the PyTorch step; a wrong operator fails its self-check with one
    warning and the PyTorch step runs from then on."""
    calls = []
    real = fused_attention._cpp_woodbury

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(fused_attention, "_cpp_woodbury", spy)
    monkeypatch.setattr(fused_attention, "_woodbury_verdicts", {})
    update = torch.randn(1, 3, 40)
    factors = bounded_factors(torch.randn(1, 3, 2, 40))
    beta = torch.tensor([0.5])
    fused_attention.woodbury_step(update, factors, beta)
    assert calls[-1] == (1, 3, 40)  # after the self-check's own call
    calls.clear()
    fused_attention.woodbury_step(update, factors, beta, "pytorch")
    fused_attention.woodbury_step(update, factors.requires_grad_(True), beta).sum().backward()
    assert calls == [] and factors.grad is not None

    monkeypatch.setattr(fused_attention, "_woodbury_verdicts", {})
    monkeypatch.setattr(fused_attention, "_cpp_woodbury", lambda *args: 1.01 * real(*args))
    with pytest.warns(RuntimeWarning, match="The C.. step of the metric-preconditioned MLP failed its self-check"):
        out = fused_attention.woodbury_step(update, factors.detach(), beta)
    torch.testing.assert_close(out, woodbury_precondition(update, factors.detach(), beta), rtol=0, atol=0)


def operator_args(mask=None, dtype=F64):
    """The forward operator's arguments for a small case (as ``cpp_geodesic_attention`` passes them)."""
    query, factors, key, value, alpha, gamma = make_inputs(b=1, h=4, hk=2, q=20, kv=20, d=16, r=2, hf=2)
    grouped = prepare_geodesic_inputs(*(t.to(dtype) for t in (query, factors, key, alpha, gamma)), 0.3)
    masks = grouped_kernel_mask(mask, 20, 20, 2, 2, dtype)
    tensors = [t.detach().requires_grad_(True) for t in (*grouped, key.to(dtype), value.to(dtype))]
    return (*tensors, *masks, 0.3, 8, 16)


@pytest.mark.parametrize("mask", ["causal", "boolean", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_operators_pass_torch_library_opcheck(mask, dtype):
    """Schema, fake implementation, autograd registration and AOT dispatch of the forward operator; schema and fake
    implementation of the backward operator (the same checks as the Triton operators')."""
    allowed = padding_bool_mask(1, 20, 20, pad=[3])
    masks = {"causal": None, "boolean": allowed,
             "float": torch.randn(1, 1, 20, 20, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)}
    args = operator_args(masks[mask], dtype)
    torch.library.opcheck(fused_attention.cpp_forward_op, args)
    out, lse = fused_attention.cpp_forward_op(*args)
    backward_args = (*[a.detach() if isinstance(a, torch.Tensor) else a for a in args[:8]], out.detach(),
                     lse.detach(), torch.randn_like(out), *args[8:])
    torch.library.opcheck(fused_attention.cpp_backward_op, backward_args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, F64], ids=str)
@pytest.mark.parametrize("mask", fused_attention.MASK_KINDS)
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-head"])
def test_every_dtype_is_within_the_kernel_tolerance(dtype, mask, training, shared):
    """The self-check's own measure (``check_kernel``: the operator on inputs of the dtype, the blocked path on the same
    values in float64, and in inference each sequence's last row alone): within ``KERNEL_TOLERANCE`` for the output and
    every gradient, with factors shared by each KV group and per head."""
    signature = KernelSignature("cpu", None, dtype, 2, 32, 3, shared, mask, training, "cpp")
    errors = check_kernel(signature, torch.device("cpu"), tokens=96)
    tolerances = fused_attention.kernel_tolerances(dtype, 32)
    assert set(errors) == ({"output", *fused_attention.GRADIENT_NAMES} if training else {"output"})
    assert all(errors[name] <= tolerances[name] for name in errors), errors


def test_thread_count_changes_nothing_beyond_rounding():
    """The backward splits each KV group's query tiles into as many chunks as the threads need: 1 and 2 threads give
    the same gradients up to float64 rounding."""
    inputs = make_inputs(b=1, h=4, hk=2, q=100, kv=100, d=16, requires_grad=True)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = cpp_geodesic_attention(*inputs, 0.3, tiles=(8, 16))
            results.append((out, *torch.autograd.grad(out.square().sum(), inputs)))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        torch.testing.assert_close(one, two, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# the model under fiber_attention_kernel="auto"
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def operator_calls(monkeypatch):
    """The model's calls of the operator (not the self-check's), one entry per layer call; a fresh verdict cache."""
    monkeypatch.setattr(fused_attention, "_verdicts", {})
    calls = []
    real = modeling.cpp_geodesic_attention

    def spy(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling, "cpp_geodesic_attention", spy)
    return calls


def step(model, kernel):
    """Logits and every parameter gradient of one training forward and backward on a left-padded batch."""
    model.config.fiber_attention_kernel = kernel
    model.zero_grad()
    ids = random_ids(2, 40)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype, tolerance", [(F64, 1e-10), (torch.float32, 1e-4)], ids=["float64", "float32"])
def test_auto_runs_the_operator_on_the_cpu_with_the_blocked_paths_values(operator_calls, dtype, tolerance):
    model = awake_model(dtype)
    logits, grads = step(model, "auto")
    assert len(operator_calls) == model.config.num_hidden_layers  # every layer, once
    assert set(fused_attention._verdicts.values()) == {True}
    operator_calls.clear()
    ref_logits, ref_grads = step(model, "pytorch")
    assert operator_calls == []
    torch.testing.assert_close(logits, ref_logits, rtol=tolerance, atol=tolerance)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        scale = ref_grads[name].abs().max().clamp_min(1e-3)
        torch.testing.assert_close(grads[name] / scale, ref_grads[name] / scale, rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_first_self_check_inside_a_checkpointed_layer_passes(operator_calls, reentrant):
    """Under gradient checkpointing (TRL's default) a signature's first call, and so its self-check, comes inside a
    checkpointed layer, in its forward or in its recomputation: the check's own forward and backward must not be taken
    for the layer's (the checkpoint's saved-tensor hooks), so it passes, and the step equals the blocked path's."""
    model = awake_model(torch.float32).train()
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    logits, grads = step(model, "auto")
    assert set(fused_attention._verdicts.values()) == {True} and operator_calls
    model.activation_checkpointing_disable()
    ref_logits, ref_grads = step(model, "pytorch")
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for name in grads:
        scale = ref_grads[name].abs().max().clamp_min(1e-3)
        torch.testing.assert_close(grads[name] / scale, ref_grads[name] / scale, rtol=1e-4, atol=1e-4)


def test_decoding_runs_the_operators_decode_and_dropout_stays_on_the_blocked_path(operator_calls):
    """Generation's one-token steps in inference run the operator (its ``decode``) with the blocked path's tokens;
    attention dropout in training the blocked path (the operator has none); "cpp" with dropout is refused with the fix."""
    model = awake_model(torch.float32, attention_dropout=0.1).eval()
    ids, mask = random_ids(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding: the decode steps get a mask
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                pad_token_id=0)
    layers = model.config.num_hidden_layers
    assert [shape[2] for shape in operator_calls] == [12] * layers + [1] * (3 * layers)  # the prompt, then 3 steps
    model.config.fiber_attention_kernel = "pytorch"
    with torch.no_grad():
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                          do_sample=False, pad_token_id=0), tokens)
    model.config.fiber_attention_kernel = "auto"
    operator_calls.clear()
    model.train()
    model(ids, labels=ids).loss.backward()
    assert operator_calls == []
    model.config.fiber_attention_kernel = "cpp"
    with pytest.raises(ValueError, match="fiber_attention_kernel='cpp' runs on CPU tensors without attention dropout"):
        model(ids, labels=ids)


def test_a_wrong_decode_is_caught_by_the_self_check(operator_calls, monkeypatch):
    """The self-check of an inference signature checks the one-row decode too: a wrong one is warned about and the
    blocked path's short step runs instead."""
    real = fused_attention.cpp_decode_step
    monkeypatch.setattr(fused_attention, "cpp_decode_step", lambda *args: 1.01 * real(*args))
    model = awake_model(torch.float32).eval()
    ids = random_ids(1, 12)
    with pytest.warns(RuntimeWarning, match="failed its self-check on CPU, float32, .*inference"):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert operator_calls == []


def test_a_wrong_operator_is_caught_warned_about_once_and_replaced_by_the_blocked_path(operator_calls, monkeypatch):
    real = fused_attention._cpp_forward

    def wrong(*args):
        out, lse = real(*args)
        return out * 1.01, lse

    monkeypatch.setattr(fused_attention, "_cpp_forward", wrong)
    model = awake_model(torch.float32)
    with pytest.warns(RuntimeWarning) as caught:
        logits, grads = step(model, "auto")
        step(model, "auto")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "The fused C++ operator of the geodesic attention failed its self-check on CPU, float32" in messages[0]
    assert "fiber_attention_kernel='cpp' to force it anyway" in messages[0]
    assert operator_calls == []
    ref_logits, ref_grads = step(model, "pytorch")
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(grads[name], ref_grads[name]) for name in grads)


def test_compiled_model_keeps_one_operator_node_per_layer(monkeypatch):
    """torch.compile(fullgraph=True) of a training forward: one graph, the forward operator once per layer in it (no
    Python loop unrolled), and the eager values."""
    monkeypatch.setattr(fused_attention, "_verdicts", {})
    torch.compiler.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = awake_model(torch.float32, num_hidden_layers=3)
    ids = random_ids(2, 40)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = compiled(ids, labels=ids)
    eager = model(ids, labels=ids)
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum("geodesic_cpp_forward" in t for t in targets) == 3, targets
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-6, atol=1e-6)
    torch.compiler.reset()


# ---------------------------------------------------------------------------------------------------------------------
# building: cached, and where it cannot be built the blocked path with one info line
# ---------------------------------------------------------------------------------------------------------------------
def test_a_built_operator_is_loaded_from_the_cache_without_compiling(monkeypatch):
    commands = []
    real_run = fused_attention.subprocess.run

    def recording_run(command, *args, **kwargs):
        commands.append(command)
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(fused_attention.subprocess, "run", recording_run)
    monkeypatch.setattr(fused_attention, "_cpu_operator", {})
    assert fused_attention.cpu_operator() is not None
    assert [c[1:] for c in commands] == [["--version"]]  # the compiler's version (part of the cache key) only
    assert list(fused_attention.cpu_cache_dir().glob("fiber_bundle_cpu_*.so"))


def test_without_a_compiler_auto_runs_the_blocked_path_after_one_info_line(monkeypatch, tmp_path, operator_calls):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # an empty cache
    monkeypatch.setattr(fused_attention, "_cpu_operator", {})
    logger = fused_attention.logger
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with CaptureLogger(logger) as captured:
            model = awake_model(torch.float32)
            logits, grads = step(model, "auto")
            step(model, "auto")
    finally:
        logger.setLevel(level)
    assert captured.out.count("The fused C++ geodesic attention is not available here") == 1, captured.out
    assert "no C++ compiler" in captured.out and "the blocked PyTorch path computes the attention" in captured.out
    assert operator_calls == [] and fused_attention._verdicts == {}
    ref_logits, ref_grads = step(model, "pytorch")
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(grads[name], ref_grads[name]) for name in grads)
    with pytest.raises(RuntimeError, match="The fused C.. geodesic attention cannot run here .no C.. compiler"):
        step(model, "cpp")


CHILD = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_info()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save(model(ids).logits, sys.argv[3])
    """
)


def test_a_hub_folder_runs_where_the_operator_cannot_be_built(tmp_path, monkeypatch):
    """trust_remote_code on a machine without a compiler: the folder's copy of this file tries once, says why in one
    info line, and the blocked path gives the model's logits."""
    folder = tmp_path / "folder"
    model = awake_model(torch.float32).eval()
    model.save_pretrained(folder)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(folder)
    ids = random_ids(2, 30)
    torch.save(ids, tmp_path / "ids.pt")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    result = run_without_project(CHILD, folder, tmp_path / "ids.pt", tmp_path / "logits.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count("The fused C++ geodesic attention is not available here") == 1, result.stderr[-4000:]
    assert "no C++ compiler: `/nonexistent/c++` is not on PATH" in result.stderr
    model.config.fiber_attention_kernel = "pytorch"
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), model(ids).logits, rtol=0, atol=0)

