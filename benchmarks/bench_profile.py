"""Where the Fiber Bundle model's extra time goes on the CPU: the profile behind the speed targets that are not met.

    .venv/bin/python benchmarks/bench_profile.py [--rank 2] [--threads 1] [--json PATH]     # about 40 s
    .venv/bin/python benchmarks/bench_profile.py --quick                                    # smoke run, seconds

Two measurements, on the SmolLM2-135M shape (``common.FULL_SHAPE``), fp32, geometry awake (``common.build_fiber``):

1. One decode step after a 512-token prompt (dynamic KV cache), both models. Each part of a layer is wrapped with a
   timer for 16 steps: the fibre state (``FiberBundleDecoderLayer.fiber_state``: code, factors, bounded map, gates),
   the factor rotation, the attention function (``geodesic_attention_forward`` against the backbone's SDPA, both
   including nothing but the attention math), the metric-preconditioned step (``precondition``: Woodbury) and the
   rest of the layer. Also the number of aten ops one step dispatches (``torch.profiler``). Times are CPU time of this
   process (``time.process_time``), so with one thread (the default) another process on the machine does not count.
2. One layer's attention (9 query heads, 3 KV heads, head_dim 64, causal) at n = 512 and 2048: the blocked geodesic
   path against ``scaled_dot_product_attention``, forward and forward+backward, with the profiler's split into matrix
   products (bmm / mm: time and achieved GFLOP/s) and everything else (the elementwise combine, softmax, masks).

The figures explain the ratios of ``bench_model.py`` and ``bench_generation.py``; they set no target of their own.
"""

import argparse
import collections
import json
import statistics
import time

import torch
import torch.nn.functional as F
from common import FULL_SHAPE, QUICK_SHAPE, build_backbone, build_fiber, environment, prompt
from transformers import DynamicCache

import modeling_fiber_bundle.modeling_fiber_bundle as modeling
from modeling_fiber_bundle.fiber_attention import blocked_geodesic_attention, bounded_factors

DECODE_STEPS = 16
PROMPT = 512


class PartTimer:
    """CPU time spent inside wrapped callables, by label (wrappers are instance or module attributes)."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)

    def timing(self, fn, label: str):
        """``fn`` with its CPU time added to ``label``'s."""

        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.process_time() - start

        return timed

    def wrap(self, owner, name: str, label: str) -> None:
        setattr(owner, name, self.timing(getattr(owner, name), label))


def decode_profile(model, timer: PartTimer, shape: dict, length: int) -> dict:
    """Per-step CPU ms of each wrapped part and of the whole step, and aten ops per step."""
    ids = prompt(shape, length)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        token = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for _ in range(3):  # warm-up
            model(token, cache=cache, use_cache=True, logits_to_keep=1)
        timer.seconds.clear()
        start = time.process_time()
        for _ in range(DECODE_STEPS):
            model(token, cache=cache, use_cache=True, logits_to_keep=1)
        total = time.process_time() - start
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                model(token, cache=cache, use_cache=True, logits_to_keep=1)
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / 4
    parts = {label: 1e3 * s / DECODE_STEPS for label, s in timer.seconds.items()}
    return {"step_ms": 1e3 * total / DECODE_STEPS, "parts_ms": parts, "aten_ops_per_step": ops}


def decode_section(rank: int, shape: dict, length: int) -> dict:
    backbone = build_backbone(shape).eval()
    fiber = build_fiber(shape, rank, backbone).eval()
    timers = {"backbone": PartTimer(), "fibre": PartTimer()}
    for layer in backbone.model.layers:
        timers["backbone"].wrap(layer.self_attn, "forward", "attention module")
        timers["backbone"].wrap(layer.mlp, "forward", "MLP")
    for layer in fiber.model.layers:
        timers["fibre"].wrap(layer.self_attn, "forward", "attention module")
        timers["fibre"].wrap(layer.mlp, "forward", "MLP")
        timers["fibre"].wrap(layer, "fiber_state", "fibre state")
        timers["fibre"].wrap(layer, "precondition", "Woodbury step")
    timers["fibre"].wrap(modeling, "geodesic_attention_forward", "attention function")
    timers["fibre"].wrap(modeling, "rotate_factors", "factor rotation")
    # the backbone's attention function: SDPA, looked up by LlamaAttention in transformers' attention interface, is
    # overridden for the backbone's run only (a local entry of that shared interface, deleted afterwards)
    interface = modeling.ALL_ATTENTION_FUNCTIONS
    interface["sdpa"] = timers["backbone"].timing(interface["sdpa"], "attention function")
    try:
        result = {"backbone": decode_profile(backbone, timers["backbone"], shape, length)}
    finally:
        del interface["sdpa"]
    result["fibre"] = decode_profile(fiber, timers["fibre"], shape, length)
    return result


def attention_section(rank: int, lengths: list[int], shape: dict, repeats: int = 3) -> list[dict]:
    heads, kv_heads, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    rows = []
    for n in lengths:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, n, d, generator=gen)
        k, v = (torch.randn(1, kv_heads, n, d, generator=gen) for _ in range(2))
        factors = bounded_factors(torch.randn(1, kv_heads, n, rank, d, generator=gen))
        alpha, gamma = torch.rand(heads, generator=gen), torch.rand(heads, generator=gen)
        leaves = [t.requires_grad_() for t in (q, k, v, factors, alpha, gamma)]
        calls = {
            "geodesic": lambda: blocked_geodesic_attention(q, factors, k, v, alpha, gamma, d**-0.5),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        }
        for mode in ("forward", "forward+backward"):
            for name, call in calls.items():
                def run(call=call, mode=mode):
                    if mode == "forward":
                        with torch.no_grad():
                            call()
                    else:
                        call().sum().backward()
                        for t in leaves:
                            t.grad = None

                run()
                times = []
                for _ in range(repeats):
                    start = time.process_time()
                    run()
                    times.append(time.process_time() - start)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            record_shapes=True) as prof:
                    run()
                gemm_s, gemm_flop, total_s = 0.0, 0.0, 0.0
                for event in prof.events():
                    if not event.name.startswith("aten::"):
                        continue
                    total_s += event.self_cpu_time_total / 1e6
                    if event.name in ("aten::bmm", "aten::mm") and len(event.input_shapes) >= 2:
                        a, b = event.input_shapes[0], event.input_shapes[1]
                        batch = a[0] if len(a) == 3 else 1
                        gemm_flop += 2 * batch * a[-2] * a[-1] * b[-1]
                        gemm_s += event.self_cpu_time_total / 1e6
                rows.append({
                    "n": n, "mode": mode, "path": name, "ms": 1e3 * statistics.median(times),
                    "gemm_share": gemm_s / total_s if total_s else 0.0,
                    "gemm_gflop": gemm_flop / 1e9, "gemm_gflop_s": gemm_flop / gemm_s / 1e9 if gemm_s else 0.0,
                })
    return rows


def print_report(decode: dict, attention: list[dict], rank: int, length: int) -> None:
    bb, fb = decode["backbone"], decode["fibre"]
    print(f"\n## One decode step after a {length}-token prompt (r = {rank}), CPU ms per step\n")
    print(f"whole step: backbone {bb['step_ms']:.1f}, fibre {fb['step_ms']:.1f} "
          f"(ratio of tokens/s {bb['step_ms'] / fb['step_ms']:.3f}); aten ops per step: backbone "
          f"{bb['aten_ops_per_step']:.0f}, fibre {fb['aten_ops_per_step']:.0f}\n")
    print("| part (all layers) | backbone | fibre |")
    print("|---|---|---|")
    labels = ["attention module", "attention function", "factor rotation", "fibre state", "Woodbury step", "MLP"]
    for label in labels:
        print(f"| {label} | {bb['parts_ms'].get(label, 0.0):.1f} | {fb['parts_ms'].get(label, 0.0):.1f} |")
    print("\n## One layer's attention (the shape's heads, KV heads and head_dim, causal), CPU ms\n")
    print("| n | mode | geodesic | SDPA | ratio | geodesic: share in matmuls, GFLOP, GFLOP/s | SDPA: share in matmuls |")
    print("|---|---|---|---|---|---|---|")
    for i in range(0, len(attention), 2):
        geo, ref = attention[i], attention[i + 1]
        print(f"| {geo['n']} | {geo['mode']} | {geo['ms']:.1f} | {ref['ms']:.1f} | {geo['ms'] / ref['ms']:.2f} | "
              f"{geo['gemm_share']:.0%}, {geo['gemm_gflop']:.2f}, {geo['gemm_gflop_s']:.0f} | "
              f"{ref['gemm_share']:.0%} (fused kernel) |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=2, help="metric rank r (metric_rank = ffn_metric_rank), default 2")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: CPU time then excludes other processes' load)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048],
                        help="sequence lengths of the attention measurement (default 512 2048)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny 2-layer shape, a 32-token prompt, n = 64: a smoke run of seconds (figures meaningless)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape, length = (QUICK_SHAPE, 32) if args.quick else (FULL_SHAPE, PROMPT)
    lengths = [64] if args.quick else args.lengths
    decode = decode_section(args.rank, shape, length)
    attention = attention_section(args.rank, lengths, shape)
    print_report(decode, attention, args.rank, length)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(args.quick), "threads": args.threads, "rank": args.rank,
                       "decode": decode, "attention": attention}, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
