"""Greedy generation of the Fiber Bundle model against its LLaMA backbone through ``model.generate``: eager (dynamic KV
cache) and compiled (static cache + torch.compile), tokens/s side by side in one run.

Full run (SmolLM2-135M shape, fp32, CPU, 2 threads; an estimated 15-20 min on 2 quiet cores: per rank about 1 min
eager and 2-3 min compiled, most of it the two cold compiles. Other processes on the same cores slow it many times
over and distort the ratios, so the load average is recorded at the start and the end):

    .venv/bin/python benchmarks/bench_generation.py --ranks 0 1 2 4 --repeats 3 --json benchmarks/bench_generation.json

Smoke run (tiny 2-layer shape, 32-token prompt, 8 new tokens, r = 0 and 2; 1-2 min, mostly four cold compiles):

    .venv/bin/python benchmarks/bench_generation.py --quick

What is compared. One ``LlamaForCausalLM`` (attn_implementation="sdpa") of SmolLM2-135M's shape, seeded, and for every
metric rank r (``metric_rank = ffn_metric_rank = r``) a ``FiberBundleForCausalLM`` with the backbone's weights and
its geometry awake: every gate (theta, gamma per head, phi per layer) drawn from U(0.2, 0.6), off the graft, the
fibre model's logits checked to differ from the backbone's (``common.build_fiber``; r = 0 has no geometry and is
checked to equal the backbone). fp32, CPU, ``torch.set_num_threads(--threads)``, batch 1, a seeded random prompt of
--prompt-length tokens (512), greedy (``do_sample=False``) with ``min_new_tokens = max_new_tokens`` (64), so every run
produces exactly that many tokens whatever the end-of-sequence token.

What is timed, every call being one whole ``model.generate`` call, wall clock, nothing excluded:
  a) eager: the default dynamic KV cache. ``generate(max_new_tokens=N)`` gives the whole-call tokens/s, N / t_N
     (prefill included); ``generate(max_new_tokens=1)`` is the prefill alone (the first new token comes from the
     prefill's logits), so the decode-only tokens/s is (N - 1) / (t_N - t_1), the N - 1 single-token steps. t_N - t_1
     is taken within each round (the two calls run back to back), and its median over the rounds is used.
  b) compiled: ``cache_implementation="static"`` and the generation config's ``compile_config``, the mechanism
     transformers 5.24 documents for fast generation (``CompileConfig``, generation/configuration_utils.py):
     ``generate`` then runs the prefill eagerly and every decode step through ``torch.compile(model.__call__)``
     (``get_compiled_call``). Settings: ``CompileConfig(fullgraph=True, mode=--compile-mode)``, backend inductor;
     ``fullgraph=True`` makes any graph break an error; ``_compile_all_devices=True`` because transformers compiles
     on accelerators only unless told (its own tests set it for CPU); mode "default" because "reduce-overhead"
     (CompileConfig's default) only adds CUDA graphs, which do not exist on the CPU. Per rank, torch._dynamo is
     reset and both models compile anew, cold: this script sets TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 (unless the
     environment sets it) so that no on-disk inductor cache from an earlier model or run shortens a compile. The
     first compiled call of each model compiles: its compile time is that first call minus the median steady call
     (same N); the process's first-compile costs (imports, compile workers) are paid beforehand by compiling a trivial
     function, reported apart. Steady calls are then timed like a) (whole call and decode-only). The run checks that
     each model's forward really ran compiled (``model._compiled_call`` exists and dynamo captured a graph in the
     first call), counts graphs captured in the steady calls (recompiles: 0 expected) and graph breaks (0; fullgraph
     would raise), and compares each model's compiled greedy tokens with its eager ones.
Timings alternate between the models and calls (fibre N, backbone N, fibre 1, backbone 1, then the reverse order, ...)
after one untimed warm-up of each, so that machine noise hits both alike; medians of --repeats rounds. Ratios are
fibre / backbone tokens/s: > 1 means the fibre model generates faster. Targets (reported, not asserted): at r = 2 the
eager and the compiled whole-call ratio >= 0.95; at r = 0 both within 3 % of 1.
"""

import os

# before torch is imported: every compile is cold (see the docstring); export the variable to override
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import argparse  # noqa: E402
import warnings  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from common import (  # noqa: E402
    FULL_SHAPE,
    QUICK_SHAPE,
    build_backbone,
    build_fiber,
    environment,
    finish,
    interleaved_runs,
    logit_difference,
    parse_arguments,
    print_targets,
    prompt,
)

# the expected consequence of the cold compiles above, said once per compile
warnings.filterwarnings("ignore", message="dynamo_pgo force disabled by torch.compiler.config.force_disable_caches")

FULL_DEFAULTS = dict(ranks=[0, 1, 2, 4], prompt_length=512, new_tokens=64, repeats=3)
QUICK_DEFAULTS = dict(ranks=[0, 2], prompt_length=32, new_tokens=8, repeats=2)
TARGET_RANK = 2
TARGET_RATIO = 0.95  # fibre / backbone tokens/s, eager and compiled, whole call
R0_TOLERANCE = 0.03
MODELS = ("backbone", "fiber")


# ----------------------------------------------------------------------------------------------------------------------
# The measured calls
# ----------------------------------------------------------------------------------------------------------------------
class Generation:
    """One model's greedy ``generate`` call of a fixed length, eager or compiled; keeps the last call's new tokens."""

    def __init__(self, model, input_ids, new_tokens: int, static: bool):
        self.model, self.input_ids, self.static = model, input_ids, static
        self.kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if static:
            self.kwargs["cache_implementation"] = "static"
        self.tokens = None

    def __call__(self):
        out = self.model.generate(self.input_ids, **self.kwargs)
        self.tokens = out[0, self.input_ids.shape[1]:].tolist()
        if len(self.tokens) != self.kwargs["max_new_tokens"]:
            raise RuntimeError(f"generate gave {len(self.tokens)} new tokens, not {self.kwargs['max_new_tokens']}")


def enable_compilation(model, mode: str) -> None:
    """Make ``generate`` compile the decode steps when the cache is static (transformers' automatic compilation)."""
    config = CompileConfig(fullgraph=True, mode=mode)
    config._compile_all_devices = True  # transformers compiles on CUDA / XPU / ... only unless told
    model.generation_config.compile_config = config


def warm_up_compiler(mode: str) -> float:
    """Compile and run a trivial function once, untimed as a model's compile: the one-time costs of the first inductor
    compile in a process (imports, the compile workers, the C++ toolchain's first start) would otherwise all land on
    the first model compiled. Returns its seconds."""
    start = time.perf_counter()
    torch.compile(lambda x: torch.nn.functional.silu(x) @ x.T + 1, fullgraph=True, mode=mode)(torch.randn(8, 8))
    torch._dynamo.reset()
    return time.perf_counter() - start


def dynamo_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def dynamo_graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def timed_rounds(calls: dict, repeats: int, warmup: bool = True) -> dict:
    """Interleaved timings of {(model, n_new): Generation}: every call's seconds round by round."""
    keys = list(calls)
    times = interleaved_runs([calls[key] for key in keys], repeats, warmup=warmup)
    return dict(zip(keys, times))


def rates(times: dict, model: str, n: int) -> dict:
    """Whole-call and decode-only tokens/s of one model from its rounds of N-token and 1-token calls."""
    whole = statistics.median(times[model, n])
    decode = statistics.median(t_n - t_1 for t_n, t_1 in zip(times[model, n], times[model, 1]))
    return {"whole_s": whole, "whole_tok_s": n / whole,
            "prefill_s": statistics.median(times[model, 1]),
            "decode_s": decode, "decode_tok_s": (n - 1) / decode if decode > 0 else float("nan")}


# ----------------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------------
def bench_rank(rank: int, backbone, shape: dict, args) -> dict:
    n = args.new_tokens
    fiber = build_fiber(shape, rank, backbone, args.kernel)  # geometry awake, checked against the backbone
    models = {"backbone": backbone, "fiber": fiber}
    input_ids = prompt(shape, args.prompt_length)
    row = {"r": rank, "awake_max_logit_difference": logit_difference(fiber, backbone, shape), "eager": {},
           "compiled": {}}

    def calls(static: bool) -> dict:
        return {(name, k): Generation(models[name], input_ids, k, static)
                for k in (n, 1) for name in ("fiber", "backbone")}

    print(f"[r={rank}] eager generate ...", file=sys.stderr, flush=True)
    eager = calls(static=False)
    times = timed_rounds(eager, args.repeats)
    for name in MODELS:
        row["eager"][name] = rates(times, name, n)
    eager_tokens = {name: eager[name, n].tokens for name in MODELS}
    row["r0_tokens_equal_backbone"] = eager_tokens["fiber"] == eager_tokens["backbone"] if rank == 0 else None

    if args.compile:
        torch._dynamo.reset()  # both models compile anew, cold, for this rank
        compiled = calls(static=True)
        compile_info = {}
        for name in MODELS:
            print(f"[r={rank}] compiling {name} (first static-cache generate) ...", file=sys.stderr, flush=True)
            enable_compilation(models[name], args.compile_mode)
            graphs, breaks = dynamo_graphs(), dynamo_graph_breaks()
            first = interleaved_runs([compiled[name, n]], 1, warmup=False)[0][0]
            compile_info[name] = {
                "first_call_s": first,
                "graphs_first_call": dynamo_graphs() - graphs,
                "graph_breaks": dynamo_graph_breaks() - breaks,
                "compiled_call_used": hasattr(models[name], "_compiled_call") and dynamo_graphs() > graphs,
            }
            if not compile_info[name]["compiled_call_used"]:
                raise RuntimeError(f"the {name}'s generate did not run a compiled forward: the benchmark would time "
                                   "eager decoding as compiled")
        print(f"[r={rank}] compiled generate ...", file=sys.stderr, flush=True)
        graphs, breaks = dynamo_graphs(), dynamo_graph_breaks()
        times = timed_rounds(compiled, args.repeats)
        steady_graphs, steady_breaks = dynamo_graphs() - graphs, dynamo_graph_breaks() - breaks
        for name in MODELS:
            r = rates(times, name, n)
            info = compile_info[name]
            r["compile_s"] = info["first_call_s"] - r["whole_s"]
            r["tokens_equal_eager"] = compiled[name, n].tokens == eager_tokens[name]
            row["compiled"][name] = {**r, **info}
        row["compiled"]["steady_recompiles"] = steady_graphs  # graphs captured after the first calls: 0 expected
        row["compiled"]["steady_graph_breaks"] = steady_breaks
        for name in MODELS:  # back to eager generation for the next rank's eager runs
            models[name].generation_config.compile_config = None
            if hasattr(models[name], "_compiled_call"):
                del models[name]._compiled_call

    row["ratio"] = {f"{mode}_{kind}": row[mode]["fiber"][f"{kind}_tok_s"] / row[mode]["backbone"][f"{kind}_tok_s"]
                    for mode in ("eager", "compiled") if row[mode] for kind in ("whole", "decode")}
    del fiber
    gc.collect()
    return row


def check_targets(rows: list[dict]) -> list[dict]:
    results = []
    for mode in ("eager", "compiled"):
        values = [row["ratio"][f"{mode}_whole"] for row in rows if row["r"] == TARGET_RANK and row[mode]]
        results.append({"target": f"r={TARGET_RANK}: {mode} generation >= {TARGET_RATIO}x the backbone's tokens/s",
                        "values": values, "met": all(v >= TARGET_RATIO for v in values) if values else None})
    values = [v for row in rows if row["r"] == 0 for v in row["ratio"].values()]
    results.append({"target": f"r=0: every tokens/s ratio within {R0_TOLERANCE:.0%} of 1", "values": values,
                    "met": all(abs(v - 1) <= R0_TOLERANCE for v in values) if values else None})
    return results


def bench(args) -> dict:
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    backbone = build_backbone(shape)
    if args.compile:
        print("warming up the compiler ...", file=sys.stderr, flush=True)
        args.compiler_warm_up_s = warm_up_compiler(args.compile_mode)
    rows = [bench_rank(rank, backbone, shape, args) for rank in args.ranks]
    return {"rows": rows, "targets": check_targets(rows)}


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------
def _cell(row: dict, mode: str, name: str, key: str, fmt: str) -> str:
    value = row[mode].get(name, {}).get(key) if row[mode] else None
    return "–" if value is None else format(value, fmt)


def _ratio(row: dict, key: str) -> str:
    return f"{row['ratio'][key]:.3f}" if key in row["ratio"] else "–"


def _tokens_equal(row: dict) -> str:
    if not row["compiled"]:
        return "–"
    return "/".join("yes" if row["compiled"][name]["tokens_equal_eager"] else "NO" for name in MODELS)


def print_report(env: dict, result: dict) -> None:
    print("# Fiber Bundle vs. LLaMA backbone (sdpa): greedy generation through `generate`\n")
    for key, value in env.items():
        print(f"- {key}: {value}")
    print(f"\nWhole `generate` calls, prefill included: {env['prompt_length']}-token prompt, {env['new_tokens']} new "
          "tokens, batch 1; medians over repeats; ratio = fibre / backbone tokens/s (> 1: fibre faster). Compile "
          "time = first compiled call minus a steady one. Tokens equal: each model's compiled greedy tokens equal its "
          "eager ones (backbone/fibre).\n")
    print("| r | eager tok/s backbone | fibre | ratio | compiled tok/s backbone | fibre | ratio "
          "| compile s backbone | fibre | tokens equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['r']} | {_cell(row, 'eager', 'backbone', 'whole_tok_s', '.2f')} "
              f"| {_cell(row, 'eager', 'fiber', 'whole_tok_s', '.2f')} | {_ratio(row, 'eager_whole')} "
              f"| {_cell(row, 'compiled', 'backbone', 'whole_tok_s', '.2f')} "
              f"| {_cell(row, 'compiled', 'fiber', 'whole_tok_s', '.2f')} | {_ratio(row, 'compiled_whole')} "
              f"| {_cell(row, 'compiled', 'backbone', 'compile_s', '.1f')} "
              f"| {_cell(row, 'compiled', 'fiber', 'compile_s', '.1f')} | {_tokens_equal(row)} |")
    print(f"\nDecode only: the {env['new_tokens'] - 1} single-token steps, (N - 1) / (t_N - t_1), and the prefill "
          "(t_1, one `generate(max_new_tokens=1)`).\n")
    print("| r | eager decode tok/s backbone | fibre | ratio | compiled decode tok/s backbone | fibre | ratio "
          "| prefill s backbone | fibre | recompiles / graph breaks (steady) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        c = row["compiled"]
        dynamo = f"{c['steady_recompiles']} / {c['steady_graph_breaks']}" if c else "–"
        print(f"| {row['r']} | {_cell(row, 'eager', 'backbone', 'decode_tok_s', '.2f')} "
              f"| {_cell(row, 'eager', 'fiber', 'decode_tok_s', '.2f')} | {_ratio(row, 'eager_decode')} "
              f"| {_cell(row, 'compiled', 'backbone', 'decode_tok_s', '.2f')} "
              f"| {_cell(row, 'compiled', 'fiber', 'decode_tok_s', '.2f')} | {_ratio(row, 'compiled_decode')} "
              f"| {_cell(row, 'eager', 'backbone', 'prefill_s', '.3f')} "
              f"| {_cell(row, 'eager', 'fiber', 'prefill_s', '.3f')} "
              f"| {dynamo} |")
    print_targets(result["targets"])
    for row in result["rows"]:
        if row["r"] == 0 and not row["r0_tokens_equal_backbone"]:
            print("- WARNING: the r = 0 fibre model's eager greedy tokens differ from the backbone's")
        if row["compiled"] and (row["compiled"]["steady_recompiles"] or row["compiled"]["steady_graph_breaks"]):
            print(f"- WARNING: r = {row['r']}: the steady compiled calls recompiled or broke the graph")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=None,
                        help="metric ranks r to compare (metric_rank = ffn_metric_rank = r); default 0 1 2 4 (0 2 with "
                             "--quick)")
    parser.add_argument("--prompt-length", type=int, default=None, help="prompt tokens (default 512, 32 with --quick)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="N, the new tokens of every timed generation, >= 2 (default 64, 8 with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds per call, after one warm-up; the median is reported (default 3, 2 with "
                             "--quick)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the compiled (static cache + torch.compile) measurements")
    parser.add_argument("--compile-mode", default="default",
                        help="torch.compile mode of the CompileConfig (default 'default'; 'reduce-overhead', "
                             "transformers' default, only adds CUDA graphs, which the CPU does not have)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny 2-layer shape, short prompt, r = 0 and 2: a smoke run of 1-2 min, mostly four cold "
                             "compiles (numbers not meaningful)")
    args = parse_arguments(parser, argv, QUICK_DEFAULTS, FULL_DEFAULTS)
    if min(args.ranks) < 0 or args.prompt_length < 1 or args.new_tokens < 2 or args.repeats < 1 or args.threads < 1:
        parser.error("ranks must be >= 0, --new-tokens >= 2 (decode-only needs a step after the prefill's token); "
                     "--prompt-length, --repeats and --threads >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = {**environment(args.quick), "prompt_length": args.prompt_length, "new_tokens": args.new_tokens,
           "repeats": args.repeats, "fiber_attention_kernel": args.kernel,
           "compile": (f"generate's compile_config: CompileConfig(fullgraph=True, mode={args.compile_mode!r}), "
                       "backend inductor, static cache, cold (TORCHINDUCTOR_FORCE_DISABLE_CACHES="
                       f"{os.environ.get('TORCHINDUCTOR_FORCE_DISABLE_CACHES')})") if args.compile else "skipped"}
    result = bench(args)
    if args.compile:
        env["compiler_warm_up_s"] = round(args.compiler_warm_up_s, 1)
    finish(env, result, print_report, args.json)


if __name__ == "__main__":
    main()
