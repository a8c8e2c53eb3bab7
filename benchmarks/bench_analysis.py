"""Cost of the two heaviest analyses on the real SmolLM2-135M-Instruct, against the issue's budget of 5 minutes on
2 CPU cores for both together:

    .venv/bin/python benchmarks/bench_analysis.py [--converted out/smollm2-fbt-metric]

1. ``fiber-bundle analyze collapse``: the pure-attention stacks (4 configurations x 5 variants x 20 seeds, depth 32)
   and SmolLM2 on 4 x 512 tokens of pydoc topics;
2. ``fiber-bundle analyze intrinsic-rank``: SmolLM2 in float64, 4 x 512 tokens, every layer and head.
The model measured is the source (from its GGUF), or with ``--converted`` a Fiber Bundle folder (geodesic scores,
the dearer path). Each step's wall time and the total are printed with their fraction of the 300 s budget; results
are appended to benchmarks/results_analysis.json.
"""

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

BUDGET_SECONDS = 300.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--converted", default=None,
                        help="a Fiber Bundle folder to measure instead of the source GGUF (e.g. out/smollm2-fbt-metric)")
    parser.add_argument("--samples", type=int, default=4, help="windows of sample text")
    parser.add_argument("--length", type=int, default=512, help="tokens per window")
    parser.add_argument("--record", default=str(Path(__file__).with_name("results_analysis.json")),
                        help="JSON file the results are appended to")
    args = parser.parse_args()

    from fiber_bundle.analysis.reports import run_collapse, run_intrinsic_rank
    from fiber_bundle.conversion.assets import smollm2_gguf

    model = args.converted or str(smollm2_gguf())
    timings = {}
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        collapse = run_collapse(out, models=[model], samples=args.samples, length=args.length, progress=False)
        timings["collapse"] = time.perf_counter() - started
        started = time.perf_counter()
        rank = run_intrinsic_rank(out, [model], samples=args.samples, length=args.length, progress=False)
        timings["intrinsic-rank"] = time.perf_counter() - started
    total = sum(timings.values())
    print(f"model: {model}; {args.samples} x {args.length} tokens; {os.cpu_count()} CPU cores; "
          f"torch threads {__import__('torch').get_num_threads()}")
    for name, seconds in timings.items():
        print(f"  {name:15s} {seconds:7.1f} s  ({seconds / BUDGET_SECONDS:.2f} of the 300 s budget)")
    print(f"  {'total':15s} {total:7.1f} s  ({total / BUDGET_SECONDS:.2f} of the budget: "
          f"{'met' if total <= BUDGET_SECONDS else 'NOT met'})")
    summary = next(iter(rank["models"].values()))["summary"]
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": model, "samples": args.samples, "length": args.length, "seconds": timings, "total_seconds": total,
        "budget_seconds": BUDGET_SECONDS, "stack_runs": sum(len(s["variants"]) * len(s["seeds"])
                                                           for s in collapse["stacks"]),
        "text_energy_rank_mean": summary["text_energy_rank"]["mean"],
    }
    path = Path(args.record)
    history = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(history + [record], indent=2) + "\n")


if __name__ == "__main__":
    main()
