"""Fiber Bundle Transformer vs. its LLaMA backbone: speed and memory ratios measured side by side in one run.

Full run (SmolLM2-135M shape, fp32, CPU, batch 1; takes many minutes on a small machine):

    .venv/bin/python benchmarks/bench_model.py --ranks 0 1 2 4 --lengths 512 2048 --repeats 3 --gen-tokens 16 \
        --json benchmarks/bench_model.json

Smoke run (tiny 2-layer shape; ~25 s, mostly spent starting one process per memory measurement):

    .venv/bin/python benchmarks/bench_model.py --quick

What is compared. For every metric rank r (``metric_rank = ffn_metric_rank = r``) a ``FiberBundleForCausalLM`` is
built and loaded with the weights of one ``LlamaForCausalLM`` (attn_implementation="sdpa") of the same shape: the two
models share parameter names, so the backbone state dict loads into the fibre model with ``strict=False``; only the
``.fiber.`` parameters are its own. The geometry is then woken (``common.wake_geometry``): every gate (theta, gamma per
head, phi per layer) is set to a seeded value drawn from U(0.2, 0.6), off its graft value 0, the factor generators
keep their initialisation, and the fibre model's logits are checked to differ from the backbone's
(``common.check_awake``; for r = 0, which has no geometry, to equal them). A model at its graft computes its
backbone's function; the model timed here computes its own, so the extra cost measured is the price of the geometry
at work. The shared builders are in ``benchmarks/common.py``.

What is measured, for every (r, n), n the prompt / sequence length:
  1. forward: ``model(input_ids, use_cache=False)`` under ``torch.no_grad()``, eval mode, full logits;
  2. forward+backward: ``model(input_ids, use_cache=False).logits.float().mean().backward()``, train mode
     (dropout is 0 in both models);
  3. decode tokens/s with the KV cache: one untimed prefill of n tokens, then K greedy single-token steps
     ``model(next_token, cache=cache, use_cache=True, logits_to_keep=1)``, timed as a loop (see ``Decoder``);
     ``generate`` is also called once per model as a check that the timed loop gives ``generate``'s greedy tokens
     (and, at r = 0, that the fibre model gives the backbone's);
  4. peak memory of one forward and of one forward+backward, each in a fresh process (see ``memory_worker``).
Timings alternate between the two models (A B B A ...) so that machine noise hits both alike; the median of
``--repeats`` runs is reported. Ratios are fibre / backbone: > 1 means the fibre model is slower (times), uses more
memory (peaks) or decodes faster (tokens/s).
"""

import argparse
import ctypes
import gc
import multiprocessing
import re
import resource
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from common import (
    FULL_SHAPE,
    QUICK_SHAPE,
    build_backbone,
    build_fiber,
    environment as common_environment,
    finish,
    interleaved,
    parse_arguments,
    print_targets,
    prompt,
)

FULL_DEFAULTS = dict(ranks=[0, 1, 2, 4], lengths=[512, 2048], repeats=3, gen_tokens=16)
QUICK_DEFAULTS = dict(ranks=[0, 1, 2, 4], lengths=[64, 128], repeats=3, gen_tokens=4)

# Targets are printed next to the results; nothing is asserted.
TARGET_RANK = 2
TARGETS = [
    # (description, rank, length (None: every length), metric key, comparison, bound): issue 13's targets
    ("fwd+bwd at n=512 <= 1.20x", TARGET_RANK, 512, "fwd_bwd", "<=", 1.20),
    ("fwd+bwd at n=2048 <= 1.30x", TARGET_RANK, 2048, "fwd_bwd", "<=", 1.30),
    ("peak memory (fwd) at n=2048 <= 1.15x", TARGET_RANK, 2048, "mem_fwd", "<=", 1.15),
    ("peak memory (fwd+bwd) at n=2048 <= 1.15x", TARGET_RANK, 2048, "mem_fwd_bwd", "<=", 1.15),
    ("decode tokens/s >= 0.95x", TARGET_RANK, None, "gen_tok_s", ">=", 0.95),
]
R0_TOLERANCE = 0.03  # r=0 is the backbone's own attention: every ratio within 3% of 1
METRICS = ["fwd", "fwd_bwd", "gen_tok_s", "mem_fwd", "mem_fwd_bwd"]


# ----------------------------------------------------------------------------------------------------------------------
# The measured operations
# ----------------------------------------------------------------------------------------------------------------------
def run_forward(model, input_ids):
    model.eval()
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)


def run_forward_backward(model, input_ids):
    model.train()
    loss = model(input_ids=input_ids, use_cache=False).logits.float().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)  # frees the gradients (the peak still includes them)
    model.eval()


class Decoder:
    """Greedy decoding with the model's own KV cache, timed as a loop.

    Why not ``generate``: the K decode steps are timed directly, without the prefill (which forward already measures)
    and without generate's per-step bookkeeping, which is the same for both models and would only pull the ratio
    towards 1. One prefill per model and length; each timed run crops the cache back to the prompt and decodes K
    tokens again from the same first token, so every run does identical work.
    """

    def __init__(self, model, input_ids):
        self.model = model.eval()
        self.n = input_ids.shape[1]
        with torch.no_grad():
            out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        self.cache = out.cache
        self.first = out.logits[:, -1].argmax(-1, keepdim=True)

    def decode(self, k: int) -> list[int]:
        extra = self.cache.get_seq_length() - self.n
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5.24: a negative count of tokens to remove
        token, tokens = self.first, []
        with torch.no_grad():
            for _ in range(k):
                out = self.model(input_ids=token, cache=self.cache, use_cache=True, logits_to_keep=1)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(token))
        return tokens

    def greedy_tokens(self, k: int) -> list[int]:
        """The k greedy tokens after the prompt, as ``generate`` returns them: the prefill's token, then k - 1 steps."""
        return [int(self.first)] + self.decode(k - 1)


def generate_tokens(model, input_ids, k: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=k, min_new_tokens=k,
            do_sample=False, pad_token_id=0,
        )
    return out[0, input_ids.shape[1]:].tolist()


# ----------------------------------------------------------------------------------------------------------------------
# Peak memory, one fresh process per measurement
# ----------------------------------------------------------------------------------------------------------------------
def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _return_freed_memory_to_os() -> None:
    """Make glibc serve blocks >= 128 KiB with mmap and unmap them on free (a fixed threshold, not the dynamic one
    that grows after the first large free), so that RSS follows the live tensors rather than the allocator's cache."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: RSS may then include freed memory the allocator kept, for both models alike
        return
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 128 * 1024)


def memory_worker(spec: dict) -> dict:
    """Build one model, then report the peak RSS increase of one forward or forward+backward over the loaded model.

    Runs in a fresh process (see ``measure_memory``) so that nothing allocated or cached by an earlier measurement is
    counted or reused; one 16-token call of the same kind runs before it. The peak is the kernel's VmHWM, reset to the
    current RSS just before the measured call
    (``/proc/self/clear_refs``, Linux >= 4.0); where that reset is not permitted, ``ru_maxrss`` is used instead, which
    also counts any transient peak of the model construction (then the numbers are upper bounds). The model keeps its
    seeded random initialisation, its geometry awake as in the timed runs
    (``build_fiber``): weight values do not change what is allocated.
    """
    _return_freed_memory_to_os()
    torch.set_num_threads(spec["threads"])
    shape = QUICK_SHAPE if spec["quick"] else FULL_SHAPE
    model = (build_backbone(shape) if spec["model"] == "backbone" else
             build_fiber(shape, spec["rank"], kernel=spec["kernel"]))
    input_ids = prompt(shape, spec["n"])
    fn = run_forward if spec["mode"] == "fwd" else run_forward_backward
    # one short call first, both models alike: what happens once per process (the fused operator's loading and its
    # self-check on a 256-token problem, kernel="auto") is not part of the model's peak
    fn(model, input_ids[:, :16])
    gc.collect()
    baseline_kib = _proc_status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method = "VmHWM"
    except OSError:
        method = "ru_maxrss"
    fn(model, input_ids)
    peak_kib = _proc_status_kib("VmHWM") if method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": max(peak_kib - baseline_kib, 0) / 1024, "baseline_mib": baseline_kib / 1024, "method": method}


_FORKSERVER = None


def measure_memory(model: str, rank: int, n: int, mode: str, quick: bool, threads: int, kernel: str = "auto") -> dict:
    """Run ``memory_worker`` in a new process: forked from a forkserver that has only imported torch, transformers and
    this package (no tensors, no threads), which saves the ~4 s of imports per measurement that a plain subprocess
    costs. ``max_tasks_per_child=1``: one process per measurement. A worker's exception is re-raised here."""
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["__main__", "torch", "transformers", "modeling_fiber_bundle"])
    spec = dict(model=model, rank=rank, n=n, mode=mode, quick=quick, threads=threads, kernel=kernel)
    with ProcessPoolExecutor(max_workers=1, mp_context=_FORKSERVER, max_tasks_per_child=1) as pool:
        return pool.submit(memory_worker, spec).result()


# ----------------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------------
def bench(args) -> dict:
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    threads = torch.get_num_threads()
    backbone = build_backbone(shape)
    backbone_memory = {}  # (n, mode) -> dict: the backbone does not depend on r, measure its peaks once per length
    rows = []
    for rank in args.ranks:
        fiber = build_fiber(shape, rank, backbone, args.kernel)  # geometry awake, checked
        for n in args.lengths:
            label = f"r={rank} n={n}"
            input_ids = prompt(shape, n)
            row = {"r": rank, "n": n, "fiber": {}, "backbone": {}}

            print(f"[{label}] forward ...", file=sys.stderr, flush=True)
            f, b = interleaved(lambda: run_forward(fiber, input_ids), lambda: run_forward(backbone, input_ids),
                               args.repeats)
            row["fiber"]["fwd_s"], row["backbone"]["fwd_s"] = f, b

            print(f"[{label}] forward+backward ...", file=sys.stderr, flush=True)
            f, b = interleaved(lambda: run_forward_backward(fiber, input_ids),
                               lambda: run_forward_backward(backbone, input_ids), args.repeats)
            row["fiber"]["fwd_bwd_s"], row["backbone"]["fwd_bwd_s"] = f, b

            print(f"[{label}] decode ...", file=sys.stderr, flush=True)
            fiber_dec, backbone_dec = Decoder(fiber, input_ids), Decoder(backbone, input_ids)
            f, b = interleaved(lambda: fiber_dec.decode(args.gen_tokens), lambda: backbone_dec.decode(args.gen_tokens),
                               args.repeats)
            row["fiber"]["gen_tok_s"], row["backbone"]["gen_tok_s"] = args.gen_tokens / f, args.gen_tokens / b
            # the awake fibre model computes its own function: only r = 0 must give the backbone's greedy tokens
            fiber_gen = generate_tokens(fiber, input_ids, args.gen_tokens)
            backbone_gen = generate_tokens(backbone, input_ids, args.gen_tokens)
            row["generate_matches_backbone"] = fiber_gen == backbone_gen
            row["decode_loop_matches_generate"] = fiber_dec.greedy_tokens(args.gen_tokens) == fiber_gen
            del fiber_dec, backbone_dec

            print(f"[{label}] peak memory (fresh processes) ...", file=sys.stderr, flush=True)
            for mode in ("fwd", "fwd_bwd"):
                if (n, mode) not in backbone_memory:
                    backbone_memory[n, mode] = measure_memory("backbone", 0, n, mode, args.quick, threads)
                fiber_mem = measure_memory("fiber", rank, n, mode, args.quick, threads, args.kernel)
                row["fiber"][f"mem_{mode}_mib"] = fiber_mem["peak_mib"]
                row["backbone"][f"mem_{mode}_mib"] = backbone_memory[n, mode]["peak_mib"]
                row["memory_method"] = fiber_mem["method"]

            f, b = row["fiber"], row["backbone"]
            row["ratio"] = {
                "fwd": f["fwd_s"] / b["fwd_s"],
                "fwd_bwd": f["fwd_bwd_s"] / b["fwd_bwd_s"],
                "gen_tok_s": f["gen_tok_s"] / b["gen_tok_s"],
                "mem_fwd": f["mem_fwd_mib"] / b["mem_fwd_mib"] if b["mem_fwd_mib"] else float("nan"),
                "mem_fwd_bwd": f["mem_fwd_bwd_mib"] / b["mem_fwd_bwd_mib"] if b["mem_fwd_bwd_mib"] else float("nan"),
            }
            rows.append(row)
        del fiber
        gc.collect()
    return {"rows": rows, "targets": check_targets(rows)}


def check_targets(rows: list[dict]) -> list[dict]:
    results = []
    for text, rank, length, key, op, bound in TARGETS:
        values = [row["ratio"][key] for row in rows if row["r"] == rank and length in (None, row["n"])]
        ok = None
        if values:
            ok = all(v <= bound for v in values) if op == "<=" else all(v >= bound for v in values)
        results.append({"target": f"r={rank}: {text}", "values": values, "met": ok})
    values = [row["ratio"][key] for row in rows if row["r"] == 0 for key in METRICS]
    ok = all(abs(v - 1) <= R0_TOLERANCE for v in values) if values else None
    results.append({"target": f"r=0: every ratio within {R0_TOLERANCE:.0%} of 1", "values": values, "met": ok})
    return results


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------
def environment(args) -> dict:
    return {**common_environment(args.quick), "repeats": args.repeats, "gen_tokens": args.gen_tokens,
            "fiber_attention_kernel": args.kernel}


def greedy_check(row: dict) -> str:
    problems = []
    if row["r"] == 0 and not row["generate_matches_backbone"]:
        problems.append("r=0 generate differs from backbone")
    if not row["decode_loop_matches_generate"]:
        problems.append("decode loop differs from generate")
    return "; ".join(problems) or "ok"


def print_report(env: dict, result: dict) -> None:
    print("# Fiber Bundle vs. LLaMA backbone (sdpa): ratios fibre / backbone\n")
    for key, value in env.items():
        print(f"- {key}: {value}")
    print("\nTimes are medians over repeats; gen tok/s is greedy decode with the KV cache (ratio > 1 = fibre faster);")
    print("peak memory is the RSS increase of one call over the loaded model, in a fresh process. Every fibre")
    print("model has its geometry awake (gates off the graft; its logits checked to differ from the backbone's).")
    print("Greedy check: the timed decode loop gives the same tokens as `generate`, and at r = 0 the fibre model's")
    print("`generate` gives the backbone's greedy tokens.\n")
    print("| r | n | fwd ratio | fwd+bwd ratio | gen tok/s ratio | peak mem fwd ratio | peak mem fwd+bwd ratio |")
    print("|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        q = row["ratio"]
        print(f"| {row['r']} | {row['n']} | {q['fwd']:.3f} | {q['fwd_bwd']:.3f} | {q['gen_tok_s']:.3f} "
              f"| {q['mem_fwd']:.3f} | {q['mem_fwd_bwd']:.3f} |")
    print("\nAbsolute numbers (backbone | fibre):\n")
    print("| r | n | fwd s | fwd+bwd s | gen tok/s | peak mem fwd MiB | peak mem fwd+bwd MiB | greedy check |")
    print("|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        b, f = row["backbone"], row["fiber"]
        print(f"| {row['r']} | {row['n']} | {b['fwd_s']:.4f} \\| {f['fwd_s']:.4f} "
              f"| {b['fwd_bwd_s']:.4f} \\| {f['fwd_bwd_s']:.4f} | {b['gen_tok_s']:.1f} \\| {f['gen_tok_s']:.1f} "
              f"| {b['mem_fwd_mib']:.1f} \\| {f['mem_fwd_mib']:.1f} "
              f"| {b['mem_fwd_bwd_mib']:.1f} \\| {f['mem_fwd_bwd_mib']:.1f} "
              f"| {greedy_check(row)} |")
    print_targets(result["targets"])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=None,
                        help="metric ranks r to compare (metric_rank = ffn_metric_rank = r); default 0 1 2 4")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="sequence / prompt lengths n; default 512 2048 (64 128 with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per model and measurement, after one warm-up; the median is reported "
                             "(default 3)")
    parser.add_argument("--gen-tokens", type=int, default=None,
                        help="K, the number of greedy tokens decoded per generation run (default 16, 4 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny 2-layer shape and short lengths: a smoke run in seconds (numbers are not meaningful)")
    args = parse_arguments(parser, argv, QUICK_DEFAULTS, FULL_DEFAULTS)
    if min(args.ranks) < 0 or min(args.lengths) < 1 or args.repeats < 1 or args.gen_tokens < 1:
        parser.error("ranks must be >= 0; lengths, repeats and gen-tokens >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    env = environment(args)
    result = bench(args)
    finish(env, result, print_report, args.json)


if __name__ == "__main__":
    main()
