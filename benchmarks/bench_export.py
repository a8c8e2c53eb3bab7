"""The exported programs (``fiber-bundle export``) against the eager model: export time, file size, parity and greedy
decoding speed of each runtime, side by side in one run.

Full run (SmolLM2-135M shape, fp32, CPU, 2 threads; about 10 min on 2 quiet cores, most of it exporting; ExecuTorch is
measured only where it imports, i.e. under .ci/setup.sh's .venv-executorch, so run the script in both venvs):

    .venv/bin/python benchmarks/bench_export.py --json benchmarks/results_export.json
    .venv-executorch/bin/python benchmarks/bench_export.py --formats executorch --json benchmarks/results_export_et.json

Smoke run (tiny 2-layer shape; under a minute): ``--quick``.

What is compared. A ``FiberBundleForCausalLM`` of the shape (``common.build_fiber``, r = 2, geometry awake: every gate
drawn from U(0.2, 0.6), seeded) saved as a folder and exported by ``export_model`` to each format, which checks the
written program (prompt logits and greedy tokens against eager ``generate``) before writing it. Then each runtime
decodes greedily from the same seeded --prompt-tokens prompt: the eager model with its dynamic cache (what
``generate`` runs), the torch.export program (``torch.export.load(...).module()``, static cache, one token per call),
ONNX Runtime on the ONNX graph (prefill in one call, then one token per call, the cache carried between calls) and
ExecuTorch's runtime on the .pte. Timed, wall clock: the prefill, and the --new-tokens decoding steps after it
(decode tokens/s); rounds interleave the runtimes (order reversed every other round) after one untimed warm-up of
each; medians of --repeats rounds. Ratios are runtime / eager decode tokens/s (> 1: faster than eager).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import common
from fiber_bundle.conversion.export import FORMATS, RUNNERS, export_model


class EagerRunner:
    """The eager model with transformers' dynamic cache: what ``generate`` runs, one token per decoding call."""

    def __init__(self, model):
        self.model = model
        self.reset()

    def reset(self):
        from transformers.cache_utils import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def prefill(self, ids):
        with torch.no_grad():
            return self.model(ids, cache=self.cache, use_cache=True).logits

    def step(self, token, position):
        with torch.no_grad():
            return self.model(token, cache=self.cache, use_cache=True).logits


def available_formats() -> list[str]:
    import importlib.util

    return [name for name, spec in FORMATS.items() if all(importlib.util.find_spec(p) for p in spec.packages)]


def decode_round(runner, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decoding seconds, the tokens) of one greedy run from a fresh cache."""
    if hasattr(runner, "reset"):
        runner.reset()
    start = time.perf_counter()
    logits = runner.prefill(prompt)[:, -1]
    prefilled = time.perf_counter()
    tokens = []
    for position in range(prompt.shape[1], prompt.shape[1] + new_tokens):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token.item())
        logits = runner.step(token, position)[:, -1]
    return prefilled - start, time.perf_counter() - prefilled, tokens


def bench(args) -> dict:
    shape = common.QUICK_SHAPE if args.quick else common.FULL_SHAPE
    model = common.build_fiber(shape, rank=2)
    rows, runners = {"eager": {}}, {"eager": EagerRunner(model)}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        model.save_pretrained(folder)
        for name in args.formats:
            result = export_model(folder, Path(scratch) / name, format=name, max_cache_len=args.max_cache_len,
                                  prompt_tokens=args.prompt_tokens, new_tokens=args.check_tokens)
            report = result.report
            rows[name] = {"export_seconds": report["export_seconds"], "file_mib": report["file_bytes"] / 2**20,
                          "parity": report["parity"], "peak_memory_mib_after_export": report["peak_memory_mib"]}
            runners[name] = RUNNERS[name](Path(scratch) / name / report["file"], model.config,
                                          report["prefill_chunk"])
            print(f"exported {name}: {report['export_seconds']:.1f} s, {rows[name]['file_mib']:.1f} MiB, "
                  f"{report['parity']['summary']}", flush=True)
        prompt = common.prompt(shape, args.prompt_tokens)
        names = list(runners)
        timings = {name: [] for name in names}
        for name in names:  # warm-up
            decode_round(runners[name], prompt, args.new_tokens)
        for i in range(args.repeats):
            for name in names if i % 2 == 0 else names[::-1]:
                timings[name].append(decode_round(runners[name], prompt, args.new_tokens))
    eager_tokens = timings["eager"][0][2]
    for name in names:
        prefill = statistics.median(t[0] for t in timings[name])
        decode = statistics.median(t[1] for t in timings[name])
        rows.setdefault(name, {}).update(prefill_seconds=prefill, decode_tokens_per_s=args.new_tokens / decode,
                                         tokens_equal_eager=timings[name][0][2] == eager_tokens)
    for name in names:
        rows[name]["decode_ratio_to_eager"] = rows[name]["decode_tokens_per_s"] / rows["eager"]["decode_tokens_per_s"]
    return {"settings": vars(args), "rows": rows}


def print_report(env: dict, result: dict) -> None:
    print(f"\n{env['date']}  {env['cpu']}  torch {env['torch']}  transformers {env['transformers']}  "
          f"threads {env['torch_threads']}  load {env['load_average_1_5_15_min_at_start']} -> "
          f"{env['load_average_1_5_15_min_at_end']}\n")
    print("| runtime | export s | file MiB | prompt-logit max abs diff | greedy = generate | prefill s | decode tok/s | "
          "ratio to eager |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in result["rows"].items():
        parity = row.get("parity")
        print(f"| {name} | {row['export_seconds']:.1f} | {row['file_mib']:.1f} | {parity['max_abs_logit_diff']:.2g} | "
              if parity else f"| {name} | - | - | - | ", end="")
        print(f"{row['tokens_equal_eager']} | {row['prefill_seconds']:.3f} | {row['decode_tokens_per_s']:.1f} | "
              f"{row['decode_ratio_to_eager']:.3f} |")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=None,
                        help="formats to export and time (default: every one whose runtime imports here)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens (default 64, 16 with --quick)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="greedy decoding steps timed (default 64, 16 with --quick)")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens of the export's own parity check")
    parser.add_argument("--max-cache-len", type=int, default=256, help="static cache of the static-cache formats")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (medians reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="the tiny 2-layer shape: a smoke run")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    args.formats = args.formats or available_formats()
    args.prompt_tokens = args.prompt_tokens or (16 if args.quick else 64)
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = common.environment(args.quick)
    result = bench(args)
    common.finish(env, result, print_report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
