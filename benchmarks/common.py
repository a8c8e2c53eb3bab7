"""What the model benchmarks share: the shapes, the LLaMA backbone, the Fiber Bundle model loaded with the backbone's
weights and its geometry woken off the graft, the prompt, interleaved timing and the machine's description.

Imported by ``bench_model.py`` and ``bench_generation.py`` as ``common`` (each script's folder is first on
``sys.path`` when it is run as ``python benchmarks/<script>.py``).
"""

import datetime
import json
import os
import platform
import statistics
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_fiber_bundle
from fiber_bundle.model_cards.facts import cpu_model, load_average
from modeling_fiber_bundle import FiberBundleConfig, FiberBundleForCausalLM

SEED = 0

# SmolLM2-135M
FULL_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_id=2,
)
# --quick: the same architecture, tiny, for a smoke run in seconds
QUICK_SHAPE = dict(
    FULL_SHAPE,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)

# The woken gates: every head's theta (alpha = exp(theta) - 1) and gamma, and every layer's phi (beta = exp(phi) - 1),
# drawn uniformly from this range. Moderate values, as a trained geometry might hold; never 0 (the graft).
AWAKE_GATE_RANGE = (0.2, 0.6)
# The fibre model's logits must differ from the backbone's by more than this (max |difference|) once awake
AWAKE_MIN_LOGIT_DIFFERENCE = 1e-3
AWAKE_CHECK_LENGTH = 16  # tokens of the prompt used by that check


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------
def build_backbone(shape: dict) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(**shape, attn_implementation="sdpa")
    return LlamaForCausalLM(config).float().eval()


def wake_geometry(model: FiberBundleForCausalLM, seed: int) -> FiberBundleForCausalLM:
    """Move every gate off its graft value 0: each layer's ``fiber.attn_gate`` (theta) and ``fiber.flatness_gate``
    (gamma) per head, and ``fiber.ffn_gate`` (phi), to seeded values drawn uniformly from ``AWAKE_GATE_RANGE``. The
    factor generators keep their initialisation. A model at its graft computes its backbone's function, and a
    benchmark must time the geometry at work, not a model that could skip it."""
    low, high = AWAKE_GATE_RANGE
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            fiber = getattr(layer, "fiber", None)
            if fiber is None:  # rank 0 in both parts: the backbone's own layer
                continue
            for name in ("attn_gate", "flatness_gate", "ffn_gate"):
                gate = getattr(fiber, name, None)
                if gate is not None:
                    values = low + (high - low) * torch.rand(gate.shape, generator=generator, dtype=torch.float64)
                    gate.copy_(values.to(gate.dtype))
    return model


KERNELS = ("auto", "pytorch", "cpp")


def add_kernel_argument(parser) -> None:
    """--kernel: the fibre model's ``fiber_attention_kernel``; "pytorch" times the blocked path that every CPU run took
    before the fused C++ operator, so one host measures before and after."""
    parser.add_argument("--kernel", choices=KERNELS, default="auto",
                        help="the fibre model's config.fiber_attention_kernel: auto (default: the fused C++ operator "
                             "on the CPU where it builds), pytorch (the blocked PyTorch path) or cpp")


def parse_arguments(parser, argv, quick_defaults: dict, full_defaults: dict):
    """Add --json and --kernel to a model benchmark's ``parser``, parse ``argv`` and fill every option left unset with
    its --quick or full-size default (the two sizes' defaults differ, so argparse's own cannot hold them)."""
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    add_kernel_argument(parser)
    args = parser.parse_args(argv)
    for key, value in (quick_defaults if args.quick else full_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build_fiber(shape: dict, rank: int, backbone: LlamaForCausalLM | None = None,
                kernel: str = "auto") -> FiberBundleForCausalLM:
    """A ``FiberBundleForCausalLM`` of ``shape`` with ``metric_rank = ffn_metric_rank = rank`` and
    ``fiber_attention_kernel = kernel``, its geometry awake (``wake_geometry``). With ``backbone`` it carries the backbone's weights (the two models share parameter names;
    only the ``.fiber.`` parameters are its own) and, for rank > 0, is checked to compute a different function
    (``check_awake``); rank 0 is the backbone's own model and is checked to compute the same logits."""
    torch.manual_seed(SEED + 1 + rank)
    config = FiberBundleConfig(**shape, metric_rank=rank, ffn_metric_rank=rank, attn_implementation="sdpa",
                               fiber_attention_kernel=kernel)
    model = FiberBundleForCausalLM(config).float().eval()
    if backbone is not None:
        result = model.load_state_dict(backbone.state_dict(), strict=False)
        stray = [key for key in result.missing_keys if ".fiber." not in key]
        if stray or result.unexpected_keys:
            raise RuntimeError(f"backbone weights did not map onto the fibre model: missing {stray}, "
                               f"unexpected {result.unexpected_keys}")
    wake_geometry(model, seed=SEED + 100 + rank)
    if backbone is not None:
        check_awake(model, backbone, shape)
    return model


def logit_difference(model, backbone, shape: dict) -> float:
    """max |fibre logits - backbone logits| on the first ``AWAKE_CHECK_LENGTH`` tokens of the benchmark prompt."""
    input_ids = prompt(shape, AWAKE_CHECK_LENGTH)
    with torch.no_grad():
        ours = model(input_ids=input_ids, use_cache=False).logits
        theirs = backbone(input_ids=input_ids, use_cache=False).logits
    return (ours - theirs).abs().max().item()


def check_awake(model, backbone, shape: dict) -> float:
    """Raise unless a rank > 0 model computes a function other than its backbone's (its geometry is awake) and a rank 0
    model computes the backbone's (it has no geometry). Returns the max |logit difference|."""
    difference = logit_difference(model, backbone, shape)
    rank = model.config.metric_rank + model.config.ffn_metric_rank
    if rank > 0 and not difference > AWAKE_MIN_LOGIT_DIFFERENCE:
        raise RuntimeError(f"the fibre model (metric_rank={model.config.metric_rank}) computes its backbone's logits "
                           f"(max |difference| {difference:.2e} <= {AWAKE_MIN_LOGIT_DIFFERENCE:g}): its geometry is "
                           "asleep at the graft, which is not what may be timed; wake it with wake_geometry()")
    if rank == 0 and not difference <= AWAKE_MIN_LOGIT_DIFFERENCE:
        raise RuntimeError(f"the rank-0 fibre model should compute its backbone's logits, but differs by "
                           f"{difference:.2e}: the backbone's weights did not load")
    return difference


def prompt(shape: dict, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(3, shape["vocab_size"], (1, n), generator=generator)  # avoid bos / eos ids


# ----------------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------------
def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def interleaved_runs(fns: list, repeats: int, warmup: bool = True) -> list[list[float]]:
    """Seconds of each callable in ``fns`` over ``repeats`` rounds, the order reversed every other round
    (A B C, C B A, A B C ...) so that machine noise hits every callable alike; one untimed call of each first when
    ``warmup``. Returns one list of times per callable, round by round."""
    if warmup:
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    order = list(range(len(fns)))
    for i in range(repeats):
        for j in order if i % 2 == 0 else order[::-1]:
            times[j].append(timed(fns[j]))
    return times


def interleaved(fiber_fn, backbone_fn, repeats: int) -> tuple[float, float]:
    """Median seconds of each callable, run alternately F B B F F B ... after one untimed warm-up each."""
    fiber_times, backbone_times = interleaved_runs([fiber_fn, backbone_fn], repeats)
    return statistics.median(fiber_times), statistics.median(backbone_times)


def attention_flops(kind: str, mode: str, b: int, h: int, n: int, d: int, r: int, factor_heads: int | None = None,
                    causal: bool = True) -> float:
    """The flops one attention call needs (a multiply-add counts 2; one "product" is an n x n x d matmul per head, halved
    under causal): SDPA ("flash", "sdpa") 2 products forward, 7 with the backward (recomputed scores, dV, dP, dQ, dK);
    the geodesic attention ("geodesic") h + r * factor_heads query-key products (the stacked pseudo-queries [G_i q_i,
    u_i1 .. u_ir], the factor rows shared by a KV group when factor_heads = KV heads; default per head) and h value
    products forward, and with the backward 3 (h + r factor_heads) + 2 h more (the recomputed score products, dV, dP,
    and for each score product its two gradients). The work the function needs, not what a kernel executes."""
    hf = h if factor_heads is None else factor_heads
    if kind in ("flash", "sdpa"):
        products = (2 if mode == "forward" else 7) * h
    else:
        products = 2 * h + r * hf if mode == "forward" else 7 * h + 4 * r * hf
    return products * 2.0 * b * n * n * d * (0.5 if causal else 1.0)


# ----------------------------------------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------------------------------------
def print_targets(targets: list[dict]) -> None:
    """Each target of a run with its measured values and whether it is met (reported, never asserted)."""
    print("\nTargets (reported, not asserted):\n")
    for target in targets:
        status = {True: "met", False: "NOT met", None: "n/a (not measured in this run)"}[target["met"]]
        values = ", ".join(f"{v:.3f}" for v in target["values"])
        print(f"- {target['target']}: {status}" + (f" ({values})" if values else ""))


def finish(env: dict, result: dict, print_report, json_path: str | None) -> None:
    """The end of a benchmark run: the load average after it, the printed report, and the JSON file if asked for."""
    env["load_average_1_5_15_min_at_end"] = load_average()
    print_report(env, result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": env, **result}, f, indent=2)
        print(f"\nwrote {json_path}")


def environment(quick: bool) -> dict:
    """Date, versions and machine: the header of every benchmark's report and JSON."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "modeling_fiber_bundle": modeling_fiber_bundle.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "load_average_1_5_15_min_at_start": load_average(),
        "torch_threads": torch.get_num_threads(),
        "shape": "quick (tiny, 2 layers)" if quick else "SmolLM2-135M",
        "dtype": "float32",
        "device": "cpu",
        "batch": 1,
        "geometry": f"awake: every gate (theta, gamma, phi) ~ U{AWAKE_GATE_RANGE}, seeded; factor generators as "
                    "initialised",
    }
