"""The geodesic attention alone on the CPU: the fused C++ operator against the blocked PyTorch path and SDPA.

    .venv/bin/python benchmarks/bench_cpu_attention.py [--json benchmarks/results_cpu_attention.json]
    .venv/bin/python benchmarks/bench_cpu_attention.py --quick      # a smoke run in seconds (numbers not meaningful)

What is timed, per case (float32, causal, the threads torch has; shapes below):
  * blocked: ``blocked_geodesic_attention`` (fiber_attention_kernel="pytorch"), the call the model makes;
  * fused: ``cpp_geodesic_attention`` (what "auto" runs on a CPU), the same call on the C++ operator;
  * sdpa: ``scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)``, LLaMA's attention.
Forward under ``torch.no_grad()``; forward+backward with inputs that require gradients, then ``out.backward(grad)``.
The three run interleaved (A B C, C B A, ...) after one untimed call each; medians. Before timing, the fused output and
gradients are compared with the blocked path's on the same float32 inputs (max |difference| / max |blocked|).

GFLOP/s: the flops the function needs (``common.attention_flops``, the count ``bench_kernel.py`` uses, with the r
factor rows shared by each KV group) over the median time.

Cases: ``smollm2-512`` / ``smollm2-2048``: SmolLM2-135M's attention (batch 1, 9 heads over 3 KV heads, head_dim 64,
r = 2 shared by each KV group) at n = 512 / 2048; ``small``: the from-scratch ``small`` preset's (batch 16, 6 heads over
2 KV heads, head_dim 32, r = 2, n = 128), the shape ``bench_training.py --cases small`` trains.
"""

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from common import attention_flops, environment, finish, interleaved_runs

from modeling_fiber_bundle.fiber_attention import blocked_geodesic_attention, bounded_factors
from modeling_fiber_bundle.fused_attention import cpp_geodesic_attention, cpu_operator

CASES = {  # name -> (batch, heads, kv_heads, head_dim, r, n)
    "smollm2-512": (1, 9, 3, 64, 2, 512),
    "smollm2-2048": (1, 9, 3, 64, 2, 2048),
    "small": (16, 6, 2, 32, 2, 128),
}
QUICK_CASES = {"tiny": (2, 4, 2, 16, 2, 64)}
PATHS = ("blocked", "fused", "sdpa")
MODES = ("forward", "forward+backward")


def inputs(batch, heads, kv_heads, head_dim, rank, n, seed=0):
    """query (B, H, n, d), factors (B, Hk, n, r, d) as the model bounds them, key, value (B, Hk, n, d), gates awake."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, n, head_dim, generator=gen)
    key = torch.randn(batch, kv_heads, n, head_dim, generator=gen)
    value = torch.randn(batch, kv_heads, n, head_dim, generator=gen)
    factors = bounded_factors(torch.randn(batch, kv_heads, n, rank, head_dim, generator=gen))
    alpha = torch.empty(heads).uniform_(0.2, 0.6, generator=gen)
    gamma = torch.empty(heads).uniform_(0.2, 0.6, generator=gen)
    return query, factors, key, value, alpha, gamma


def calls(shape):
    """For each path, a callable for each mode (forward, forward+backward) on one set of inputs."""
    query, factors, key, value, alpha, gamma = inputs(*shape)
    scale = shape[3] ** -0.5
    grad = torch.randn(query.shape, generator=torch.Generator().manual_seed(1))
    functions = {
        "blocked": lambda q, f, k, v: blocked_geodesic_attention(q, f, k, v, alpha, gamma, scale),
        "fused": lambda q, f, k, v: cpp_geodesic_attention(q, f, k, v, alpha, gamma, scale),
        "sdpa": lambda q, f, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    leaves = [t.clone().requires_grad_() for t in (query, factors, key, value)]

    def forward(fn):
        def run():
            with torch.no_grad():
                fn(query, factors, key, value)
        return run

    def forward_backward(fn):
        def run():
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(grad)
        return run

    return {(path, mode): (forward if mode == "forward" else forward_backward)(functions[path])
            for path in PATHS for mode in MODES}, functions, leaves, grad


def agreement(functions, leaves, grad) -> float:
    """The largest relative difference of the fused output and gradients from the blocked path's (float32)."""
    results = {}
    for path in ("blocked", "fused"):
        for t in leaves:
            t.grad = None
        out = functions[path](*leaves)
        out.backward(grad)
        results[path] = [out.detach()] + [t.grad.clone() for t in leaves]
    return max(((f - b).abs().max() / b.abs().max()).item() for f, b in zip(results["fused"], results["blocked"]))


def bench(args) -> dict:
    rows = []
    for name, shape in (QUICK_CASES if args.quick else {c: CASES[c] for c in args.cases}).items():
        fns, functions, leaves, grad = calls(shape)
        difference = agreement(functions, leaves, grad)
        for mode in args.modes:
            keys = [(path, mode) for path in PATHS]
            times = interleaved_runs([fns[k] for k in keys], args.repeats)
            medians = {path: statistics.median(t) for (path, _), t in zip(keys, times)}
            row = {"case": name, "shape": dict(zip(("batch", "heads", "kv_heads", "head_dim", "r", "n"), shape)),
                   "mode": mode, "fused_vs_blocked_max_relative_difference": difference}
            for path in PATHS:
                row[f"{path}_ms"] = 1e3 * medians[path]
                batch, heads, kv_heads, head_dim, rank, n = shape
                work = attention_flops("sdpa" if path == "sdpa" else "geodesic", mode, batch, heads, n, head_dim, rank,
                                       factor_heads=kv_heads)
                row[f"{path}_gflops"] = work / medians[path] / 1e9
            row["blocked_over_sdpa"] = medians["blocked"] / medians["sdpa"]
            row["fused_over_sdpa"] = medians["fused"] / medians["sdpa"]
            row["blocked_over_fused"] = medians["blocked"] / medians["fused"]
            rows.append(row)
            print(f"  {name} {mode}: blocked {row['blocked_ms']:.2f} ms, fused {row['fused_ms']:.2f} ms, "
                  f"sdpa {row['sdpa_ms']:.2f} ms", file=sys.stderr)
    return {"rows": rows}


def report(env: dict, result: dict) -> None:
    print(f"\nThe geodesic attention on the CPU: {env['cpu']}, torch {env['torch']}, {env['torch_threads']} threads, "
          f"float32, causal, {env['repeats']} interleaved repeats (medians); load average "
          f"{env['load_average_1_5_15_min_at_start']} -> {env['load_average_1_5_15_min_at_end']}\n")
    print("| case | mode | blocked ms | fused ms | SDPA ms | blocked / fused | fused / SDPA | GFLOP/s blocked / "
          "fused / SDPA | fused vs blocked |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['case']} | {r['mode']} | {r['blocked_ms']:.2f} | {r['fused_ms']:.2f} | {r['sdpa_ms']:.2f} | "
              f"{r['blocked_over_fused']:.2f}x | {r['fused_over_sdpa']:.2f}x | {r['blocked_gflops']:.1f} / "
              f"{r['fused_gflops']:.1f} / {r['sdpa_gflops']:.1f} | "
              f"{r['fused_vs_blocked_max_relative_difference']:.1e} |")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                        help="shapes to time (default: all; see the module docstring)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="forward and/or forward+backward (default: both)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls of each path (default: 10; --quick 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--quick", action="store_true", help="one tiny shape, 2 repeats: a smoke run in seconds")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 10
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_operator() is None:
        sys.exit("The fused C++ operator cannot be built here (a C++ compiler and Linux are needed); see the info "
                 "line above (TRANSFORMERS_VERBOSITY=info).")
    env = {**environment(args.quick), "repeats": args.repeats, "what": "the attention function alone",
           "shape": "quick (tiny)" if args.quick else "per case", "batch": "per case"}
    finish(env, bench(args), report, args.json)


if __name__ == "__main__":
    main()
