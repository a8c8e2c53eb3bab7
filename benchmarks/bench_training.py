"""One training step of the Fiber Bundle model against its backbone, eager and compiled, side by side in one run.

    .venv/bin/python benchmarks/bench_training.py --cases small --json benchmarks/bench_training.json
    .venv/bin/python benchmarks/bench_training.py --cases smollm2-512 smollm2-2048 base-512
    .venv/bin/python benchmarks/bench_training.py --quick          # tiny shapes, a smoke run of every path

A step is forward with labels, backward and an AdamW step (``zero_grad(set_to_none=True)`` after it), in float32 on
the CPU with ``--threads`` threads. Cases:

- ``small``: the from-scratch ``small`` preset (4 x 192, byte vocabulary, r = r_f = 2, m = 32) at the ``strong-1``
  start (alpha = gamma = 1) against its equal-parameter Euclidean twin (metric off, MLP widened:
  ``analysis.scratch.equal_parameter_twin``), batch 16 x 128: the comparison of docs/results.md section 7;
- ``medium``: the ``small`` preset widened and deepened to 6 x 256 (8 heads, MLP 768), the larger size of docs/results.md
  section 7's study (``analyze scratch --layers 6 --width 256 --heads 8 --intermediate-size 768``), the same way and
  batch;
- ``base``: the ``base`` preset (8 x 384, m = 64) the same way and batch, the largest size of docs/results.md section 10's
  study (``analyze scratch --layers 8 --width 384 --heads 6 --intermediate-size 1024 --metric-hidden 64``);
- ``base-512``: the ``base`` preset the same way, batch 2 x 512;
- ``smollm2-512`` / ``smollm2-2048``: SmolLM2-135M's shape, the fibre model loaded with the LLaMA backbone's weights
  and its geometry woken (``common.build_fiber``), batch 1, against that ``LlamaForCausalLM`` (sdpa); the fibre model
  trained in full and metric-only (only the ``fiber`` parameters train; the backbone's full step is the reference).

Eager: the models' steps alternate (A B B A ...), ``--repeats`` rounds after a warm-up; medians. Compiled: as
``fiber-bundle train --torch-compile`` compiles, each decoder layer alone (accelerate's ``compile_regions``,
fullgraph, inductor: one compiled code serves every layer) and the embedding, final norm and head apart; ``--whole``
compiles the whole model instead (``torch.compile(model, fullgraph=True)``, one graph). In a fresh inductor cache, so
that the first step's time is the compile time (reported as first step minus one compiled step); then the same
interleaved rounds. The compiled loss of the first step is checked against the eager one, and the number of frames
dynamo compiled is reported. Ratios are fibre / backbone.
"""

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
from accelerate.utils import compile_regions

from common import (
    FULL_SHAPE,
    QUICK_SHAPE,
    add_kernel_argument,
    build_backbone,
    build_fiber,
    cpu_model,
    environment as common_environment,
    finish,
    interleaved_runs,
    print_targets,
)


MEDIUM = dict(num_hidden_layers=6, hidden_size=256, num_attention_heads=8, intermediate_size=768)  # over "small"
SCRATCH_VOCAB = dict(vocab_size=258, bos_token_id=256, eos_token_id=256, pad_token_id=257)
TARGETS = {  # (case, model, mode) -> largest ratio asked for by issue 24 (reported, not asserted)
    ("small", "fibre", "compiled"): 1.15,
    ("small", "fibre", "eager"): 1.50,
    ("smollm2-512", "fibre", "compiled"): 1.10,
    ("smollm2-2048", "fibre", "compiled"): 1.20,
    ("smollm2-512", "fibre", "eager"): 1.20,
    ("smollm2-2048", "fibre", "eager"): 1.30,
}


# ----------------------------------------------------------------------------------------------------------------------
# Cases: name -> (models {label: model}, the reference label, a batch, what trains in each model)
# ----------------------------------------------------------------------------------------------------------------------
def scratch_pair(preset: dict, quick: bool, kernel: str):
    from fiber_bundle.analysis.scratch import equal_parameter_twin
    from modeling_fiber_bundle import FiberBundleConfig, FiberBundleForCausalLM

    fields = dict(preset, **SCRATCH_VOCAB, max_position_embeddings=2048, tie_word_embeddings=True, use_cache=False,
                  metric_gate_init=1.0, flatness_gate_init=1.0, fiber_attention_kernel=kernel)  # the strong-1 start
    if quick:
        fields.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, metric_hidden=16)
    config = FiberBundleConfig(**fields)
    torch.manual_seed(0)
    fibre = FiberBundleForCausalLM(config)
    torch.manual_seed(0)  # the twin as analyze scratch builds it: from the model at its default gates (none exist in it)
    plain = {k: v for k, v in fields.items() if k not in ("metric_gate_init", "flatness_gate_init")}
    twin = FiberBundleForCausalLM(equal_parameter_twin(FiberBundleConfig(**plain)))
    return {"backbone": twin, "fibre": fibre}


def build_case(name: str, quick: bool, kernel: str = "auto"):
    """(models, batch (ids), {label: "full" | "metric-only"}) of a case."""
    from fiber_bundle.training.scratch import PRESETS

    gen = torch.Generator().manual_seed(0)
    if name in ("small", "medium", "base", "base-512"):
        preset = {"small": PRESETS["small"], "medium": {**PRESETS["small"], **MEDIUM}, "base": PRESETS["base"],
                  "base-512": PRESETS["base"]}[name]
        batch, length = ((2, 512) if name == "base-512" else (16, 128)) if not quick else (2, 32)
        models = scratch_pair(preset, quick, kernel)
        ids = torch.randint(0, 256, (batch, length), generator=gen)
        return models, ids, {"backbone": "full", "fibre": "full"}
    if name.startswith("smollm2-"):
        shape = QUICK_SHAPE if quick else FULL_SHAPE
        length = int(name.split("-")[1]) if not quick else 64
        backbone = build_backbone(shape)
        fibre = build_fiber(shape, 2, backbone, kernel)
        models = {"backbone": backbone, "fibre": fibre, "fibre metric-only": copy.deepcopy(fibre)}
        ids = torch.randint(3, shape["vocab_size"], (1, length), generator=gen)
        return models, ids, {"backbone": "full", "fibre": "full", "fibre metric-only": "metric-only"}
    raise SystemExit(f"unknown case {name!r}: choose from small, medium, base, base-512, smollm2-512, smollm2-2048")


def stepper(model, ids, mode: str):
    """A callable running one training step of ``model`` on ``ids`` (labels = ids); returns the loss."""
    model.train()
    if mode == "metric-only":
        for p in model.parameters():
            p.requires_grad_(False)
        for p in model.geometry_parameters():
            p.requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step(forward=model):
        loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


# ----------------------------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------------------------
def run_case(name: str, quick: bool, repeats: int, compile_models: bool, whole: bool = False,
             kernel: str = "auto") -> dict:
    models, ids, modes = build_case(name, quick, kernel)
    labels = list(models)
    # a copy of each model before any step, for the compiled run (same weights, fresh optimiser)
    fresh = {label: copy.deepcopy(model) for label, model in models.items()}
    steps = [stepper(models[label], ids, modes[label]) for label in labels]
    first_losses = [step() for step in steps]
    eager = interleaved_runs(steps, repeats, warmup=True)
    result = {"case": name, "batch": list(ids.shape), "modes": modes,
              "eager_ms": {label: 1000 * statistics.median(t) for label, t in zip(labels, eager)}}
    result["eager_ratio"] = {label: result["eager_ms"][label] / result["eager_ms"]["backbone"] for label in labels}
    if not compile_models:
        return result
    import torch._dynamo.testing
    import torch._inductor.config

    # the previous case's compiled code is not run again: without a reset, the shared code objects (the embedding's
    # region, nn.Module's forward) accumulate guards across cases until dynamo's recompile limit fails a fullgraph run
    torch.compiler.reset()
    compiled_steps, compile_s, graphs, loss_diff = [], {}, {}, {}
    for label, first_loss in zip(labels, first_losses):
        model = fresh[label]
        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
        if whole:
            compiled = torch.compile(model, fullgraph=True, backend=counter)
        else:
            compiled = compile_regions(model, fullgraph=True, backend=counter)
        step = stepper(model, ids, modes[label])
        step_compiled = lambda step=step, compiled=compiled: step(compiled)  # noqa: E731
        start = time.perf_counter()
        loss = step_compiled()
        first = time.perf_counter() - start
        second = min(timed_once(step_compiled) for _ in range(2))
        compile_s[label] = first - second
        graphs[label] = counter.frame_count
        loss_diff[label] = abs(loss - first_loss) / abs(first_loss)
        compiled_steps.append(step_compiled)
        print(f"  {name} / {label}: compiled in {compile_s[label]:.1f} s, {graphs[label]} graph(s), "
              f"loss {loss:.6f} (eager {first_loss:.6f})", flush=True)
    times = interleaved_runs(compiled_steps, repeats, warmup=False)
    result["compiled_ms"] = {label: 1000 * statistics.median(t) for label, t in zip(labels, times)}
    result["compiled_ratio"] = {label: result["compiled_ms"][label] / result["compiled_ms"]["backbone"]
                                for label in labels}
    result["compile_s"] = compile_s
    result["compile_ratio"] = {label: compile_s[label] / compile_s["backbone"] for label in labels}
    result["graphs"] = graphs
    result["compiled_loss_relative_difference"] = loss_diff
    return result


def timed_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def print_report(env: dict, result: dict) -> None:
    print(f"\n{env['date']} · {env['cpu']} · {env['torch_threads']} threads · torch {env['torch']} · "
          f"transformers {env['transformers']}\n")
    print("| case | model | eager ms | eager ratio | compiled ms | compiled ratio | compile s | compile ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for case in result["cases"]:
        for label in case["eager_ms"]:
            row = [case["case"], label, f"{case['eager_ms'][label]:.1f}", f"{case['eager_ratio'][label]:.2f}"]
            if "compiled_ms" in case:
                row += [f"{case['compiled_ms'][label]:.1f}", f"{case['compiled_ratio'][label]:.2f}",
                        f"{case['compile_s'][label]:.1f}", f"{case['compile_ratio'][label]:.2f}"]
            else:
                row += ["-"] * 4
            print("| " + " | ".join(row) + " |")
    targets = []
    for (case_name, label, mode), limit in TARGETS.items():
        values = [case[f"{mode}_ratio"][label] for case in result["cases"]
                  if case["case"] == case_name and f"{mode}_ratio" in case]
        targets.append({"target": f"{case_name} {label} {mode} step <= {limit}x", "values": values,
                        "met": (all(v <= limit for v in values) if values else None)})
    print_targets(targets)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["small"],
                        help="small, medium, base, base-512, smollm2-512, smollm2-2048 (default: small)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per mode (default 6, 2 with --quick)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="time the eager steps only")
    parser.add_argument("--whole", action="store_true",
                        help="compile the whole model as one graph instead of each decoder layer alone (the way "
                             "--torch-compile trains since issue 44)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of every path in seconds")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    add_kernel_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # a fresh inductor cache: the first compiled step then measures the compilation, not a cache hit
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_training_inductor_")
    repeats = args.repeats or (2 if args.quick else 6)
    env = common_environment(args.quick)
    env.update(shape="per case (see cases)", batch="per case", cpu=cpu_model(),
               step="forward with labels, backward, AdamW step, float32",
               compiled="whole model" if args.whole else "each decoder layer alone (accelerate's compile_regions)",
               fiber_attention_kernel=args.kernel)
    cases = []
    for name in args.cases:
        print(f"case {name} ...", flush=True)
        cases.append(run_case(name, args.quick, repeats, args.compile, args.whole, args.kernel))
    finish(env, {"cases": cases}, print_report, args.json)


if __name__ == "__main__":
    main()
