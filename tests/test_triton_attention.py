"""The fused Triton kernel (modeling_fiber_bundle/fused_attention.py): forward and every gradient equal the blocked
PyTorch path, masks, GQA, ranks, dtypes; the model on either kernel; the dispatch rules; the Hub-folder import check.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before
anything imports the model); on a CUDA machine they run compiled, on CUDA tensors. Skipped where Triton is absent."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from transformers.dynamic_module_utils import check_imports, get_imports  # noqa: E402

from helpers import random_ids, set_gates, tiny_config, tiny_model  # noqa: E402
from modeling_fiber_bundle import FiberBundleConfig  # noqa: E402
from modeling_fiber_bundle import modeling_fiber_bundle as modeling  # noqa: E402
from modeling_fiber_bundle import fused_attention  # noqa: E402
from modeling_fiber_bundle.fiber_attention import Dropout, _key_range, blocked_geodesic_attention  # noqa: E402
from modeling_fiber_bundle.fused_attention import triton_geodesic_attention, use_triton_kernel  # noqa: E402
from test_fiber_attention import MASK_CASES, additive_mask, make_inputs, padding_bool_mask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not fused_attention.INTERPRETED:
    pytest.skip("no GPU, and the kernels were defined without TRITON_INTERPRET=1 (conftest.py sets it)",
                allow_module_level=True)

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


def assert_near(actual, expected, rel, name=""):
    """max |actual - expected| <= rel * max |expected| (a relative error over the whole tensor), and no NaN."""
    assert not torch.isnan(actual).any(), name
    err = (actual.to(F64) - expected.to(F64)).abs().max().item()
    bound = rel * max(expected.abs().max().item(), 1e-30)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def compare(b=2, h=4, hk=2, q=37, kv=37, d=16, r=2, shared=False, mask=None, tiles=(16, 16), dtype=torch.float32):
    """The kernel in ``dtype`` against the blocked path in float64 (the exact function): output and the gradients of
    query, factors, key, value, alpha and gamma under a random weighting of every output row (fully masked rows
    included), each within the kernel's tolerance (``kernel_tolerances``: docs/design.md 1.5, the one the self-check
    uses). Returns the kernel's output and gradients."""
    exact = make_inputs(b=b, h=h, hk=hk, q=q, kv=kv, d=d, r=r, hf=hk if shared else h, requires_grad=True)
    inputs = [x.detach().to(DEVICE, dtype).requires_grad_(True) for x in exact]
    weight = torch.randn(b, h, q, d, generator=torch.Generator().manual_seed(1), dtype=F64)
    kernel_mask = mask if mask is None or mask.dtype == torch.bool else mask.to(torch.float32)
    out = triton_geodesic_attention(*inputs, 0.35, None if mask is None else kernel_mask.to(DEVICE), tiles=tiles)
    grads = torch.autograd.grad((out.to(F64) * weight.to(DEVICE)).sum(), inputs)
    out_ref = blocked_geodesic_attention(*exact, 0.35, mask, block_size=8)
    grads_ref = torch.autograd.grad((out_ref * weight).sum(), exact)
    tolerances = fused_attention.kernel_tolerances(dtype, d)
    assert out.dtype == dtype and out.shape == out_ref.shape
    assert_near(out.cpu(), out_ref, tolerances["output"], "output")
    for name, grad, ref in zip(fused_attention.GRADIENT_NAMES, grads, grads_ref):
        assert grad.dtype == dtype and grad.shape == ref.shape, name
        assert_near(grad.cpu(), ref, tolerances[name], name)
    return out.cpu(), [g.cpu() for g in grads]


# ---------------------------------------------------------------------------------------------------------------------
# kernel == blocked path, forward and every gradient (float32, tight)
# ---------------------------------------------------------------------------------------------------------------------
CASES = {
    # sequence lengths that are not multiples of the 16-row / 16-key tiles
    "causal": dict(),
    "sliding-window": dict(mask=padding_bool_mask(2, 37, 37, pad=[0, 5], window=7)),
    "float-additive-per-head": dict(q=21, kv=21, mask=additive_mask(2, 21, 21, h=4)),
    "bool-per-head-windows": dict(q=19, kv=19, mask=MASK_CASES["bool-per-head"](2, 19, 19)),
    "float-padding": dict(q=19, kv=19, mask=MASK_CASES["float-padding"](2, 19, 19)),
    "chunk-against-longer-cache": dict(q=7, kv=29, mask=padding_bool_mask(2, 7, 29, pad=[0, 3])),
    "one-token-step": dict(q=1, kv=23),
    "gqa-shared-factors": dict(hk=1, shared=True, q=21, kv=21),
    "gqa-shared-factors-2-groups": dict(hk=2, shared=True, q=21, kv=21, mask=padding_bool_mask(2, 21, 21, pad=[2, 0])),
    "mha": dict(hk=4, q=21, kv=21),
    "rank-1": dict(r=1, q=21, kv=21),
    "rank-3-shared": dict(r=3, hk=1, shared=True, q=21, kv=21),
    "rank-8": dict(r=8, q=21, kv=21),
    "head-dim-64-default-tiles": dict(d=64, q=21, kv=21, tiles=None),
    "head-dim-128-default-tiles": dict(d=128, q=9, kv=9, tiles=None),
    "head-dim-24": dict(d=24, q=21, kv=21),  # not a power of two: padded to 32 inside the kernel
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_blocked_path_forward_and_backward(case):
    compare(**CASES[case])


def test_padded_rows_attend_to_nothing_with_zero_gradients():
    """Left-padded rows (no allowed key) give output 0 and gradient 0 exactly, and nothing is NaN."""
    pad = [0, 6]
    mask = padding_bool_mask(2, 21, 21, pad=pad)  # batch 1: its first 6 rows see no key
    out, grads = compare(q=21, kv=21, mask=mask)
    assert (out[1, :, : pad[1]] == 0).all() and (out[1, :, pad[1]:].abs().sum(-1) > 0).all()
    d_query, d_factors = grads[0], grads[1]
    assert (d_query[1, :, : pad[1]] == 0).all() and (d_factors[1, :, : pad[1]] == 0).all()
    assert (d_query[1, :, pad[1]:] != 0).any()


def test_bfloat16_against_the_float64_function():
    """bf16 inputs, fp32 accumulation: within bf16 rounding of the exact function (and the output stays bf16)."""
    compare(q=21, kv=21, dtype=torch.bfloat16, mask=padding_bool_mask(2, 21, 21, pad=[0, 3]))


@pytest.mark.parametrize("tile", [16, 5])
@pytest.mark.parametrize("along_queries", [True, False])
def test_tile_ranges_are_the_blocked_paths_key_ranges(tile, along_queries):
    """The band each kernel tile loops over (the skip of wholly masked tiles) is exactly the blocked path's
    ``_key_range`` of that tile, per query tile for the forward and per key tile (transposed) for the backward;
    a tile that sees nothing loops over nothing."""
    masks = [padding_bool_mask(2, 37, 37, pad=[0, 20], window=7), padding_bool_mask(2, 7, 29, pad=[0, 3]),
             MASK_CASES["bool-per-head"](2, 19, 19)[:, :, None], padding_bool_mask(1, 21, 21, pad=[21])]
    for mask in masks:
        allowed = mask if mask.dim() == 5 else mask[:, :, None]  # (B, Hk|1, g|1, q, kv), as the kernel reads it
        band = allowed if along_queries else allowed.transpose(-1, -2)
        n, other = band.shape[-2:]
        ranges = fused_attention._tile_ranges(allowed, tile, along_queries).tolist()
        assert len(ranges) == -(-n // tile)
        for t, (lo, hi) in enumerate(ranges):
            i0, i1 = t * tile, min(t * tile + tile, n)
            if band[..., i0:i1, :].any():
                assert (lo, hi) == _key_range(band, i0, i1, n, other), (t, lo, hi)
            else:
                assert (lo, hi) == (0, 0)


def test_a_pipeline_that_does_not_fit_falls_back_to_a_shallower_one(monkeypatch):
    """A launch whose tiles overflow shared memory at a pipeline depth (Triton's OutOfResources) is retried at the
    next depth; the depth that fitted is remembered, so the failing ones are not compiled again."""
    from triton.runtime.errors import OutOfResources

    tried = []

    class Kernel:  # stands for a JIT kernel that fits only without pipelining
        fn = SimpleNamespace(__name__="kernel")

        def __getitem__(self, grid):
            def launch(*args, num_stages, **meta):
                tried.append(num_stages)
                if num_stages > 1:
                    raise OutOfResources(300_000, 232_448, "shared memory")
            return launch

    monkeypatch.setattr(fused_attention, "_stages_found", {})
    fused_attention._run(Kernel(), (1,), BLOCK_M=16)
    assert tried == list(fused_attention.STAGES)
    tried.clear()
    fused_attention._run(Kernel(), (1,), BLOCK_M=16)
    assert tried == [1]


# ---------------------------------------------------------------------------------------------------------------------
# the model on either kernel
# ---------------------------------------------------------------------------------------------------------------------
def test_model_gives_the_same_logits_and_gradients_on_either_kernel():
    """A tiny causal LM with awake geometry (gates off the graft, every geometry parameter perturbed), left-padded
    batch: logits and every parameter gradient equal with fiber_attention_kernel "triton" and "pytorch"."""
    model = set_gates(tiny_model(dtype=torch.float32)).to(DEVICE)
    with torch.no_grad():
        for p in model.geometry_parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = random_ids(2, 20).to(DEVICE)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4] = 0
    results = {}
    for kernel in ("pytorch", "triton"):
        model.config.fiber_attention_kernel = kernel
        model.zero_grad()
        out = model(ids, attention_mask=attention_mask, labels=ids)
        out.loss.backward()
        results[kernel] = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    logits, grads = results["triton"]
    logits_ref, grads_ref = results["pytorch"]
    valid = attention_mask.bool()
    assert_near(logits[valid], logits_ref[valid], 1e-5, "logits")
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert_near(grads[name], grads_ref[name], 2e-5, name)


def test_the_model_runs_the_kernel_when_asked(monkeypatch):
    """The dispatch in geodesic_attention_forward: "triton" runs the kernel (once per layer), "pytorch" never, "auto"
    on CUDA tensors only (on CPU tensors it keeps the blocked PyTorch path); the reference path and output_attentions
    keep their own branches."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].device)
        return triton_geodesic_attention(*args, **kwargs)

    monkeypatch.setattr(modeling, "triton_geodesic_attention", spy)
    model = set_gates(tiny_model(dtype=torch.float32)).to(DEVICE)
    ids = random_ids(1, 6).to(DEVICE)
    layers = model.config.num_hidden_layers
    for kernel, expected in (("auto", layers if DEVICE == "cuda" else 0), ("pytorch", 0), ("triton", layers)):
        model.config.fiber_attention_kernel = kernel
        calls.clear()
        with torch.no_grad():
            model(ids)
        assert len(calls) == expected, kernel
    calls.clear()
    with torch.no_grad():
        model(ids, output_attentions=True)
        model.config.fiber_attention_path = "reference"
        model(ids)
    assert calls == []


# ---------------------------------------------------------------------------------------------------------------------
# dispatch rules and errors
# ---------------------------------------------------------------------------------------------------------------------
def test_auto_picks_triton_only_for_cuda_tensors_without_dropout():
    """The rule of "auto" before its self-check (tests/test_kernel_guard.py: the check itself)."""
    cuda_like = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(8, 32, 100, 64))  # the rule, without a GPU
    assert fused_attention.kernel_applies(cuda_like, 0.0)
    assert not fused_attention.kernel_applies(cuda_like, 0.1)  # attention dropout: the blocked path
    assert not fused_attention.kernel_applies(SimpleNamespace(is_cuda=True, dtype=F64, shape=(1, 4, 5, 8)), 0.0)
    too_many = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(2049, 32, 100, 64))  # 65568 programs
    assert not fused_attention.kernel_applies(too_many, 0.0)  # the launch grid's second axis: the blocked path
    assert not fused_attention.kernel_applies(torch.zeros(1, 4, 5, 8), 0.0)
    assert not use_triton_kernel("auto", torch.zeros(1, 4, 5, 8), 0.0)
    assert not use_triton_kernel("pytorch", cuda_like, 0.0)
    assert use_triton_kernel("triton", torch.zeros(1), 0.0)


def test_inputs_the_kernel_cannot_launch_are_refused_with_the_fix(monkeypatch):
    """"triton" on more (batch x heads) than CUDA's launch grid holds, or on CPU tensors without the interpreter."""
    query = torch.zeros(4097, 16, 1, 16)  # 65552 programs per tile > 65535
    with pytest.raises(ValueError, match="split the batch, or set fiber_attention_kernel='auto'"):
        fused_attention._check_inputs(query, query[:, :4], query[:, :4])
    monkeypatch.setattr(fused_attention, "INTERPRETED", False)
    query, factors, key, value, alpha, gamma = (x.float() for x in make_inputs(q=5, kv=5))
    with pytest.raises(ValueError, match="move the model to a GPU or set fiber_attention_kernel='pytorch'"):
        triton_geodesic_attention(query, factors, key, value, alpha, gamma, 0.3)


def test_triton_with_dropout_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="attention_dropout=0.0"):
        use_triton_kernel("triton", torch.zeros(1), 0.1)
    model = tiny_model(dtype=torch.float32, attention_dropout=0.1, fiber_attention_kernel="triton").train()
    with pytest.raises(ValueError, match="fiber_attention_kernel='auto'"):
        model(random_ids(1, 5))
    query, factors, key, value, alpha, gamma = (x.float() for x in make_inputs(q=5, kv=5))
    with pytest.raises(ValueError, match="no attention dropout"):
        triton_geodesic_attention(query, factors, key, value, alpha, gamma, 0.3, dropout=Dropout(0.1, 0))


def test_triton_without_triton_installed_names_the_install(monkeypatch):
    monkeypatch.setattr(fused_attention, "triton", None)
    assert not fused_attention.kernel_applies(SimpleNamespace(is_cuda=True, dtype=torch.float32, shape=(1, 4)), 0.0)
    with pytest.raises(ImportError, match="pip install triton"):
        use_triton_kernel("triton", torch.zeros(1), 0.0)
    query, factors, key, value, alpha, gamma = (x.float() for x in make_inputs(q=5, kv=5))
    with pytest.raises(ImportError, match="pip install triton"):
        triton_geodesic_attention(query, factors, key, value, alpha, gamma, 0.3)


def test_float64_inputs_are_refused_with_the_fix():
    query, factors, key, value, alpha, gamma = make_inputs(q=5, kv=5)
    with pytest.raises(ValueError, match="fiber_attention_kernel='pytorch'"):
        triton_geodesic_attention(query, factors, key, value, alpha, gamma, 0.3)


def test_config_validates_the_kernel_choice():
    assert FiberBundleConfig().fiber_attention_kernel == "auto"
    assert tiny_config(fiber_attention_kernel="triton").fiber_attention_kernel == "triton"
    with pytest.raises(ValueError, match=r"fiber_attention_kernel must be one of \('auto', 'triton', 'cpp', 'pytorch'\)"):
        tiny_config(fiber_attention_kernel="cuda")


def test_a_hub_folder_does_not_require_triton():
    """transformers' remote-code check lists the imports outside try blocks: triton must not be among them (only
    the standard library's, torch and transformers)."""
    path = fused_attention.__file__
    assert set(get_imports(path)) - set(sys.stdlib_module_names) <= {"torch", "transformers"}
    check_imports(path)


@pytest.mark.heavy
def test_benchmark_smoke_runs_and_checks_the_kernel(tmp_path):
    """benchmarks/bench_kernel.py --smoke: tiny shapes on the CPU interpreter, kernel == reference, a table and JSON."""
    out = tmp_path / "smoke.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel.py"), "--smoke", "--json",
                             str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "| n |" in result.stdout and out.exists()


# ---------------------------------------------------------------------------------------------------------------------
# the kernels as custom operators (a compiled training step keeps them in its graph)
# ---------------------------------------------------------------------------------------------------------------------
def op_inputs(shared=True, mask=None, requires_grad=True):
    """The forward operator's arguments for a small causal (or masked) case, float32, on the kernel's device."""
    from modeling_fiber_bundle.fiber_attention import grouped_kernel_mask, prepare_geodesic_inputs

    query, factors, key, value, alpha, gamma = (x.to(DEVICE, torch.float32) for x in make_inputs(
        b=1, h=4, hk=2, q=20, kv=20, d=16, r=2, hf=2 if shared else 4))
    grouped = prepare_geodesic_inputs(query, factors, key, alpha, gamma, 0.3)
    masks = grouped_kernel_mask(mask, 20, 20, 2, 2, torch.float32)
    tensors = [t.detach().requires_grad_(requires_grad) for t in (*grouped, key, value)]
    return (*tensors, *masks, 0.3, 16, 16)


@pytest.mark.parametrize("masked", [False, True])
def test_kernel_operators_pass_torch_library_opcheck(masked):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of the forward operator, and the
    backward operator's own schema and fake implementation (torch.library.opcheck)."""
    mask = padding_bool_mask(1, 20, 20, pad=[3]).to(DEVICE) if masked else None
    args = op_inputs(mask=mask)
    torch.library.opcheck(fused_attention.geodesic_forward_op, args)
    out, lse = fused_attention.geodesic_forward_op(*args)
    grad = torch.randn_like(out)
    backward_args = (*[a.detach() if isinstance(a, torch.Tensor) else a for a in args[:8]], out.detach(),
                     lse.detach(), grad, *args[8:])
    torch.library.opcheck(fused_attention.geodesic_backward_op, backward_args,
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_step_keeps_the_kernel_in_one_graph_with_the_blocked_paths_values():
    """torch.compile(fullgraph=True) of the kernel's forward and backward: one graph (no break around the kernel), the
    same output and gradients as the blocked path."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.compiler.reset()
    inputs = [x.to(DEVICE, torch.float32).requires_grad_(True) for x in make_inputs(b=1, h=4, hk=2, q=20, kv=20, d=16,
                                                                                       r=2, hf=2)]

    counter = CompileCounterWithBackend("inductor")
    kernel = torch.compile(lambda *t: triton_geodesic_attention(*t, 0.3, None, 8, tiles=(16, 16)), fullgraph=True,
                           backend=counter)
    out = kernel(*inputs)
    grads = torch.autograd.grad(out.pow(2).sum(), inputs)  # through the compiled backward (the backward operator)
    ref = blocked_geodesic_attention(*inputs, 0.3, None, 8)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), inputs)
    assert counter.frame_count == 1
    assert_near(out.cpu(), ref.cpu(), 1e-5, "output")
    for name, grad, expected in zip(["query", "factors", "key", "value", "alpha", "gamma"], grads, ref_grads):
        assert_near(grad.cpu(), expected.cpu(), 1e-4, name)
