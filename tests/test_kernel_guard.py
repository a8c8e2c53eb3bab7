"""The self-check that guards the fused Triton kernel under fiber_attention_kernel="auto" (docs/design.md 1.5):
the first call of each signature compares the kernel with the blocked path on a small random problem; a kernel that
passes is used from then on, one that fails (a wrong value, a wrong gradient, an exception) is warned about once and
the blocked path runs instead; "triton" skips the check, "pytorch" never runs the kernel; a compiled forward keeps
one graph.

Without a GPU, Triton's interpreter stands in for the device: the ``auto_here`` fixture lets "auto" pick the kernel
for CPU tensors (``fused_attention.auto_device``) and gives each test a fresh verdict cache. On a GPU
(benchmarks/gpu_check.py) the same tests run the compiled kernels on CUDA tensors. The faults are made by
replacing one of the kernel's own functions for the duration of a test."""

import warnings

import pytest
import torch

pytest.importorskip("triton")

from helpers import awake_model, random_ids  # noqa: E402
from modeling_fiber_bundle import modeling_fiber_bundle as modeling  # noqa: E402
from modeling_fiber_bundle import fused_attention  # noqa: E402
from modeling_fiber_bundle.fused_attention import KernelSignature, check_kernel, kernel_tolerances  # noqa: E402
from test_triton_attention import assert_near  # noqa: E402

if not torch.cuda.is_available() and not fused_attention.INTERPRETED:
    pytest.skip("no GPU, and the kernels were defined without TRITON_INTERPRET=1 (conftest.py sets it)",
                allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# how the self-check's warning names this device
WHERE = ("CPU (Triton's interpreter)" if DEVICE == "cpu" else
         "CUDA capability {}.{}".format(*torch.cuda.get_device_capability()))
TOKENS = 40  # the self-check's problem in these tests (SELF_CHECK_TOKENS, 256, in use): the interpreter is slow


@pytest.fixture
def auto_here(monkeypatch):
    """"auto" runs the kernel on this device (on a CPU the interpreter stands in for a GPU), a fresh verdict cache, a
    smaller self-check problem, and a record of every self-check run (``checks``: the signatures, in order)."""
    monkeypatch.setattr(fused_attention, "auto_device", lambda query: True)
    monkeypatch.setattr(fused_attention, "_verdicts", {})
    monkeypatch.setattr(fused_attention, "SELF_CHECK_TOKENS", TOKENS)
    checks = []
    real_check = fused_attention.check_kernel

    def recording_check(signature, device, tokens=TOKENS, seed=0):
        checks.append(signature)
        return real_check(signature, device, tokens, seed)

    monkeypatch.setattr(fused_attention, "check_kernel", recording_check)
    return checks


@pytest.fixture
def kernel_calls(monkeypatch):
    """The model's calls of the kernel (not the self-check's): one entry per layer call."""
    calls = []
    real = modeling.triton_geodesic_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling, "triton_geodesic_attention", spy)
    return calls


def awake_on_device(kernel="auto"):
    return awake_model(torch.float32, fiber_attention_kernel=kernel).to(DEVICE)


def batch():
    """Two sequences of 20 tokens, the second left-padded by 4: the model passes a boolean mask."""
    ids = random_ids(2, 20).to(DEVICE)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4] = 0
    return ids, attention_mask


def run(model, ids, attention_mask, train: bool):
    """Logits (and every parameter gradient, in training) of one forward (and backward)."""
    model.zero_grad()
    if not train:
        with torch.no_grad():
            return model(ids, attention_mask=attention_mask).logits, None
    out = model(ids, attention_mask=attention_mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------------------------------
# the check itself
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", fused_attention.MASK_KINDS)
@pytest.mark.parametrize("training", [False, True])
def test_the_correct_kernel_passes_its_check_on_every_kind_of_signature(dtype, mask, training):
    """check_kernel on every mask kind and dtype (float16 included, which no other test runs), forward and backward,
    with GQA and shared factors: every error is within the dtype's tolerance, and the check compared what it says."""
    signature = KernelSignature(DEVICE, None, dtype, 3, 16, 2, True, mask, training)
    errors = check_kernel(signature, torch.device(DEVICE), tokens=TOKENS)
    tolerances = kernel_tolerances(dtype, 16)
    assert set(errors) == ({"output", *fused_attention.GRADIENT_NAMES} if training else {"output"})
    assert all(0 < errors[name] <= tolerances[name] for name in errors), errors


def test_the_check_leaves_the_callers_random_state_alone():
    """A training run is reproducible whether or not a self-check ran in it: the check draws from its own generator."""
    state = torch.get_rng_state()
    check_kernel(KernelSignature(DEVICE, None, torch.float32, 2, 16, 2, False, "causal", True), torch.device(DEVICE),
                 tokens=TOKENS)
    assert torch.equal(torch.get_rng_state(), state)


def test_signatures_are_read_off_the_call():
    query, key = torch.zeros(2, 8, 5, 16), torch.zeros(2, 2, 5, 16)
    shared, per_head = torch.zeros(2, 2, 5, 3, 16), torch.zeros(2, 8, 5, 3, 16)
    assert fused_attention.kernel_signature(query, shared, key, None, True) == (
        "cpu", None, torch.float32, 3, 16, 4, True, "causal", True, "triton")
    assert fused_attention.kernel_signature(query[:, :, :1], per_head[:, :, :1], key, None, False, "cpp")[6:] == (
        False, "none", False, "cpp")
    assert fused_attention.mask_kind(torch.ones(2, 1, 5, 5, dtype=torch.bool), 5) == "boolean"
    assert fused_attention.mask_kind(torch.zeros(2, 1, 5, 5), 5) == "float"


def test_a_cuda_signature_is_keyed_and_named_by_its_compute_capability(auto_here, monkeypatch):
    """On CUDA the verdict is keyed by the device's compute capability (two cards of one capability share it) and the
    warning names it; shown here with the capability read and the check replaced (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fused_attention, "check_kernel", lambda signature, device, tokens, seed=0: {"output": 1.0})
    with pytest.warns(RuntimeWarning, match=r"self-check on CUDA capability 9\.0, bfloat16, r=4, head_dim=128"):
        assert not fused_attention.kernel_passes_self_check("cuda", 1, torch.bfloat16, 4, 128, 1, False, "causal",
                                                             False)
    assert list(fused_attention._verdicts) == [KernelSignature("cuda", (9, 0), torch.bfloat16, 4, 128, 1, False,
                                                                "causal", False)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert not fused_attention.kernel_passes_self_check("cuda", 0, torch.bfloat16, 4, 128, 1, False, "causal",
                                                             False)  # another card of the same capability


# ---------------------------------------------------------------------------------------------------------------------
# "auto" on a kernel that passes
# ---------------------------------------------------------------------------------------------------------------------
def test_a_passing_kernel_is_checked_once_per_signature_and_then_used(auto_here, kernel_calls):
    """Two inference calls and two training steps on a left-padded batch: one check per signature (inference, then
    training), none on the second call of each; every layer runs the kernel; the result equals the blocked path's."""
    model = awake_on_device()
    ids, attention_mask = batch()
    layers = model.config.num_hidden_layers
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        logits, _ = run(model, ids, attention_mask, train=False)
        run(model, ids, attention_mask, train=False)
        assert len(auto_here) == 1 and not auto_here[0].training and auto_here[0].mask == "boolean"
        train_logits, grads = run(model, ids, attention_mask, train=True)
        run(model, ids, attention_mask, train=True)
    assert [s.training for s in auto_here] == [False, True]
    assert len(kernel_calls) == 4 * layers
    assert fused_attention._verdicts == {s: True for s in auto_here}
    model.config.fiber_attention_kernel = "pytorch"
    ref_logits, _ = run(model, ids, attention_mask, train=False)
    ref_train_logits, ref_grads = run(model, ids, attention_mask, train=True)
    valid = attention_mask.bool()
    assert_near(logits[valid], ref_logits[valid], 1e-5, "logits")
    assert_near(train_logits[valid], ref_train_logits[valid], 1e-5, "training logits")
    for name in ref_grads:
        assert_near(grads[name], ref_grads[name], 2e-5, name)


def test_the_default_problem_size_checks_in_one_call(auto_here, monkeypatch):
    """At the size used in practice (SELF_CHECK_TOKENS = 256 tokens), through kernel_passes_self_check itself."""
    monkeypatch.setattr(fused_attention, "SELF_CHECK_TOKENS", 256)
    seen = []
    real = fused_attention.check_kernel
    monkeypatch.setattr(fused_attention, "check_kernel",
                        lambda signature, device, tokens, seed=0: seen.append(tokens) or real(signature, device,
                                                                                               tokens))
    assert fused_attention.kernel_passes_self_check(DEVICE, None, torch.bfloat16, 2, 16, 2, False, "causal", True)
    assert seen == [256]


# ---------------------------------------------------------------------------------------------------------------------
# "auto" on a kernel made wrong on purpose
# ---------------------------------------------------------------------------------------------------------------------
def scaled_output(monkeypatch):
    real = fused_attention._forward

    def wrong(*args):
        out, lse = real(*args)
        return out * 1.01, lse

    monkeypatch.setattr(fused_attention, "_forward", wrong)


def dropped_term(monkeypatch):
    """The kernel loses -(alpha/2)||U_i^T k_j||^2 (its operands get alpha/2 = 0); the blocked path keeps it."""
    real = fused_attention.kernel_operands

    def wrong(query, factors, alpha, scale):
        gq, factors_s, half_alpha, lifted = real(query, factors, alpha, scale)
        return gq, factors_s, torch.zeros_like(half_alpha), lifted

    monkeypatch.setattr(fused_attention, "kernel_operands", wrong)


def launch_error(monkeypatch):
    def wrong(kernel, grid, *args, **meta):
        raise RuntimeError("Triton Error [CUDA]: an illegal launch (made on purpose)")

    monkeypatch.setattr(fused_attention, "_run", wrong)


def wrong_key_gradient(monkeypatch):
    real = fused_attention._backward

    def wrong(*args):
        grads = list(real(*args))
        grads[4] = grads[4] * 1.01
        return tuple(grads)

    monkeypatch.setattr(fused_attention, "_backward", wrong)


FAULTS = {"scaled-output": (scaled_output, "largest relative difference from the blocked PyTorch path is"),
          "dropped-quadratic-term": (dropped_term, "largest relative difference from the blocked PyTorch path is"),
          "exception-at-launch": (launch_error, "raised RuntimeError: Triton Error"),
          "wrong-key-gradient": (wrong_key_gradient, "in the key gradient")}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_wrong_kernel_is_caught_warned_about_once_and_replaced_by_the_blocked_path(fault, auto_here,
                                                                                     kernel_calls, monkeypatch):
    """Two training steps on a left-padded batch with the fault in place: one warning, naming the signature, what
    failed and both ways out; the kernel never runs in the model; logits and gradients are exactly the blocked
    path's ("pytorch"). A gradient-only fault passes the inference check and is caught by the training one."""
    make_fault, detail = FAULTS[fault]
    make_fault(monkeypatch)
    model = awake_on_device()
    ids, attention_mask = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fault == "wrong-key-gradient":
            run(model, ids, attention_mask, train=False)  # the forward is right: passes, the kernel runs
            assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
            assert len(kernel_calls) == model.config.num_hidden_layers
            kernel_calls.clear()
        logits, grads = run(model, ids, attention_mask, train=True)
        run(model, ids, attention_mask, train=True)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    (message,) = messages
    assert f"failed its self-check on {WHERE}, float32, r=2, head_dim=16, GQA group 2" in message
    assert "boolean mask, training (forward and backward)" in message
    assert detail in message
    assert "fiber_attention_kernel='pytorch'" in message and "fiber_attention_kernel='triton'" in message
    assert kernel_calls == []
    model.config.fiber_attention_kernel = "pytorch"
    ref_logits, ref_grads = run(model, ids, attention_mask, train=True)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_triton_skips_the_check_and_pytorch_never_runs_the_kernel(auto_here, kernel_calls, monkeypatch):
    """With a wrong kernel: "triton" runs it without a check or a warning (the user's explicit choice; its output is
    the wrong kernel's), "pytorch" never runs it nor checks it."""
    scaled_output(monkeypatch)
    model = awake_on_device(kernel="triton")
    ids, attention_mask = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        forced, _ = run(model, ids, attention_mask, train=False)
        assert auto_here == [] and len(kernel_calls) == model.config.num_hidden_layers
        model.config.fiber_attention_kernel = "pytorch"
        kernel_calls.clear()
        blocked, _ = run(model, ids, attention_mask, train=True)
        blocked, _ = run(model, ids, attention_mask, train=False)
    assert auto_here == [] and kernel_calls == []
    assert not torch.allclose(forced, blocked, rtol=1e-4, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# under torch.compile
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", [None, "scaled-output"])
def test_a_compiled_forward_takes_the_decision_outside_the_graph(fault, auto_here, monkeypatch):
    """torch.compile(fullgraph=True) of a training forward and backward under "auto": the check runs once while the
    graph is traced (no graph break: fullgraph would raise), a second step neither checks nor recompiles, and the
    result is the eager model's (the kernel's when it passes, the blocked path's when it does not)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if fault:
        FAULTS[fault][0](monkeypatch)
    torch.compiler.reset()
    model = awake_on_device()
    ids, attention_mask = batch()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [compiled(ids, attention_mask=attention_mask, labels=ids).loss for _ in range(2)]
        for loss in losses:
            loss.backward()
    assert counter.frame_count == 1
    assert len(auto_here) == 1 and auto_here[0].training
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == (1 if fault else 0)
    assert fused_attention._verdicts == {auto_here[0]: fault is None}
    model.config.fiber_attention_kernel = "pytorch"
    eager = model(ids, attention_mask=attention_mask, labels=ids).loss
    assert_near(losses[0].detach(), eager.detach(), 1e-5, "loss")
    torch.compiler.reset()
