"""Serving through transformers' own server (``fiber-bundle serve``): aggregate tokens/s and time to first token for
1, 4 and 8 concurrent streaming clients, SmolLM2-135M-Instruct's Fiber Bundle conversion with its geometry awake
against its LLaMA source served the same way, continuous batching off and on, side by side in one run.

Full run (the real checkpoint, float32, CPU; about 10 minutes on 2 quiet cores, most of it the 8-client runs without
continuous batching):

    .venv/bin/python benchmarks/bench_serving.py --json benchmarks/results_serving.json

Smoke run (SmolLM2's tokenizer over tiny 2-layer models of its vocabulary, 16-token prompts, 8 new tokens; 1-2 min,
mostly the four server starts):

    .venv/bin/python benchmarks/bench_serving.py --quick

What is served. The source: SmolLM2-135M-Instruct's GGUF dequantised (``conversion.sources.load_model``) and saved as a
plain LLaMA folder. The fibre model: the same GGUF through ``fiber-bundle convert`` (``convert_checkpoint``, metric rank
2), its gates woken (``common.wake_geometry``, checked to compute other logits than the source:
``common.check_awake``) and saved. Both float32, each served by ``fiber-bundle serve FOLDER --dtype float32``
(``--continuous-batching`` for "CB on"; on a CPU that route gets its paged cache of ``CPU_CACHE_TOKENS``), one server at
a time, on 127.0.0.1. ``--threads`` caps the server's torch threads (OMP_NUM_THREADS; default: every core).

What is timed. Per server: one untimed warm-up request, then for each client count C (--clients), --repeats rounds of
C concurrent streamed ``/v1/completions`` requests through the ``openai`` client, each a different --prompt-tokens-token
prompt (pydoc text, SmolLM2's tokenizer) and exactly --new-tokens new tokens (max_tokens, and the request's
generation_config turns end-of-sequence off), greedy. Per round: aggregate tokens/s = every client's
completion tokens (the usage the server reports, checked to be --new-tokens each) / (last answer's end - first
request's start); time to first token (TTFT) per client = first streamed text - its request's start. Reported: the
median over rounds of the aggregate tokens/s, and of the per-client TTFTs the median and the largest.
Ratios: fibre / backbone aggregate tokens/s (> 1: the fibre model serves faster); continuous batching at C clients /
the same server's 1 client. Targets (reported, not asserted): fibre / backbone >= 0.85 at 8 clients with continuous
batching; the fibre model with continuous batching at 8 clients >= 3x its 1-client aggregate tokens/s.
"""

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from common import FULL_SHAPE, QUICK_SHAPE, build_backbone, build_fiber, check_awake, environment, finish, \
    print_targets, wake_geometry

ROOT = Path(__file__).resolve().parent.parent
FIBRE_RANK = 2


# ----------------------------------------------------------------------------------------------------------------------
# The two folders
# ----------------------------------------------------------------------------------------------------------------------
def build_folders(work: Path, quick: bool) -> tuple[Path, Path, float, object]:
    """The source (plain LLaMA) and fibre folders under ``work``, float32, with SmolLM2's tokenizer; the fibre model's
    max |logit difference| from the source (its geometry awake), and the tokenizer."""
    from fiber_bundle.conversion import convert_checkpoint
    from fiber_bundle.conversion.assets import SMOLLM2_HUB_ID, smollm2_gguf
    from fiber_bundle.conversion.sources import load_model, load_tokenizer
    from modeling_fiber_bundle import FiberBundleForCausalLM

    gguf = smollm2_gguf()
    tokenizer = load_tokenizer(gguf)
    source, fibre = work / "backbone", work / "fibre"
    if quick:
        shape = dict(QUICK_SHAPE, vocab_size=FULL_SHAPE["vocab_size"])
        backbone = build_backbone(shape)
        model = build_fiber(shape, FIBRE_RANK, backbone)
    else:
        shape = FULL_SHAPE
        backbone = load_model(gguf)
        convert_checkpoint(gguf, work / "converted", metric_rank=FIBRE_RANK, base_model=SMOLLM2_HUB_ID,
                           license="apache-2.0")
        model = wake_geometry(FiberBundleForCausalLM.from_pretrained(work / "converted", dtype=torch.float32).eval(),
                              seed=100 + FIBRE_RANK)
    difference = check_awake(model, backbone, shape)
    for folder, weights in ((source, backbone), (fibre, model)):
        weights.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return source, fibre, difference, tokenizer


def prompts(tokenizer, count: int, length: int) -> list[str]:
    """``count`` different texts of exactly ``length`` tokens each: consecutive windows of pydoc's topics."""
    from pydoc_data.topics import topics

    ids = tokenizer(" ".join(topics[name] for name in sorted(topics)), add_special_tokens=False)["input_ids"]
    texts, start = [], 0
    while len(texts) < count:
        window = ids[start:start + length]
        text = tokenizer.decode(window)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) == length:  # decodes back to `length` tokens
            texts.append(text)
        start += length
    return texts


# ----------------------------------------------------------------------------------------------------------------------
# One server, its clients
# ----------------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``fiber-bundle serve FOLDER`` in a subprocess on a free localhost port, stopped (SIGTERM) on exit."""

    def __init__(self, folder: Path, continuous_batching: bool, threads: int | None):
        self.folder, self.port = folder, free_port()
        command = [sys.executable, "-m", "fiber_bundle.cli", "serve", str(folder), "--port", str(self.port),
                   "--dtype", "float32", "--log-level", "warning"]
        if continuous_batching:
            command.append("--continuous-batching")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env,
                                        cwd=ROOT)

    def __enter__(self):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log.read()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("the server did not answer /health within 600 s")

    def __exit__(self, *exc):
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                             timeout=1800)


def one_request(client, model: str, text: str, new_tokens: int) -> dict:
    """One streamed greedy completion of exactly ``new_tokens`` tokens: its start, first text and end times
    (perf_counter) and the completion tokens the server reports."""
    start = time.perf_counter()
    first, tokens = None, None
    stream = client.completions.create(
        model=model, prompt=text, max_tokens=new_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"generation_config": json.dumps({"eos_token_id": None})},  # no early end: exactly new_tokens
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"start": start, "first": first, "end": time.perf_counter(), "tokens": tokens}


def one_round(server: Server, texts: list[str], new_tokens: int) -> dict:
    """len(texts) concurrent clients, one request each."""
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda text: one_request(client, str(server.folder), text, new_tokens), texts))
    if any(a["tokens"] != new_tokens for a in answers):
        raise RuntimeError(f"a request did not generate {new_tokens} tokens: {[a['tokens'] for a in answers]}")
    wall = max(a["end"] for a in answers) - min(a["start"] for a in answers)
    return {"aggregate_tok_s": sum(a["tokens"] for a in answers) / wall,
            "ttft_s": [a["first"] - a["start"] for a in answers], "wall_s": wall}


def measure_server(folder: Path, continuous_batching: bool, texts: list[str], args) -> dict:
    """Every client count on one server, after one untimed warm-up request."""
    rows = {}
    with Server(folder, continuous_batching, args.threads) as server:
        one_round(server, texts[:1], args.new_tokens)
        for clients in args.clients:
            rounds = [one_round(server, texts[:clients], args.new_tokens) for _ in range(args.repeats)]
            ttfts = [t for r in rounds for t in r["ttft_s"]]
            rows[clients] = {
                "aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in rounds),
                "ttft_median_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
                "rounds": rounds,
            }
            print(f"  {folder.name:6s} CB {'on ' if continuous_batching else 'off'} {clients} clients: "
                  f"{rows[clients]['aggregate_tok_s']:.1f} tok/s, TTFT median {rows[clients]['ttft_median_s']:.2f} s",
                  flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------
def print_report(env: dict, result: dict) -> None:
    print(f"\n# serving benchmark, {env['shape']}, {env['date']}, {env['cpu']}, {env['logical_cpus']} logical CPUs")
    print(f"prompts of {result['prompt_tokens']} tokens, {result['new_tokens']} new tokens each, greedy, "
          f"{result['repeats']} round(s); fibre model's max |logit - source logit| {result['awake_difference']:.3g}\n")
    print("| CB | clients | backbone tok/s | fibre tok/s | fibre / backbone | backbone TTFT median (max) s "
          "| fibre TTFT median (max) s | fibre vs its 1 client |")
    print("|---|---|---|---|---|---|---|---|")
    for cb in ("off", "on"):
        for clients, row in result["runs"][cb]["fibre"].items():
            back = result["runs"][cb]["backbone"][clients]
            print(f"| {cb} | {clients} | {back['aggregate_tok_s']:.1f} | {row['aggregate_tok_s']:.1f} "
                  f"| {result['ratios'][cb]['fibre_over_backbone'][clients]:.3f} "
                  f"| {back['ttft_median_s']:.2f} ({back['ttft_max_s']:.2f}) "
                  f"| {row['ttft_median_s']:.2f} ({row['ttft_max_s']:.2f}) "
                  f"| {result['ratios'][cb]['fibre_scaling'][clients]:.2f}x |")
    print_targets(result["targets"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny 2-layer models, 16-token prompts, 8 new tokens")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8], help="concurrent clients (default 1 4 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="tokens of each prompt (default 64)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens of each answer (default 64)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per client count (median; default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="the server's torch threads (OMP_NUM_THREADS; default: torch's, every core)")
    parser.add_argument("--work", default=None, help="folder for the two model folders (default: a temporary one)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.prompt_tokens = args.prompt_tokens or (16 if args.quick else 64)
    args.new_tokens = args.new_tokens or (8 if args.quick else 64)
    if 1 not in args.clients:
        parser.error("--clients must include 1 (the ratios are against one client)")

    env = environment(args.quick)
    env.update(batch="concurrent clients", served_by="fiber-bundle serve (transformers serve)",
               torch_threads=args.threads or torch.get_num_threads())
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        print("building the source and fibre folders ...", flush=True)
        source, fibre, difference, tokenizer = build_folders(work, args.quick)
        texts = prompts(tokenizer, max(args.clients), args.prompt_tokens)
        runs = {}
        for cb in ("off", "on"):
            runs[cb] = {name: measure_server(folder, cb == "on", texts, args)
                        for name, folder in (("backbone", source), ("fibre", fibre))}
    ratios = {cb: {"fibre_over_backbone": {c: runs[cb]["fibre"][c]["aggregate_tok_s"]
                                           / runs[cb]["backbone"][c]["aggregate_tok_s"] for c in args.clients},
                   "fibre_scaling": {c: runs[cb]["fibre"][c]["aggregate_tok_s"]
                                     / runs[cb]["fibre"][1]["aggregate_tok_s"] for c in args.clients}}
              for cb in runs}
    top = max(args.clients)
    targets = [
        {"target": f"fibre / backbone aggregate tok/s at {top} clients, continuous batching, >= 0.85",
         "values": [ratios["on"]["fibre_over_backbone"][top]],
         "met": ratios["on"]["fibre_over_backbone"][top] >= 0.85},
        {"target": f"fibre model, continuous batching, {top} clients / 1 client aggregate tok/s >= 3",
         "values": [ratios["on"]["fibre_scaling"][top]], "met": ratios["on"]["fibre_scaling"][top] >= 3},
    ]
    result = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "clients": args.clients, "awake_difference": difference, "runs": runs, "ratios": ratios,
              "targets": targets}
    finish(env, result, print_report, args.json)


if __name__ == "__main__":
    main()
