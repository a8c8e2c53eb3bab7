"""Conversion cost, measured side by side in one run on the real SmolLM2-135M-Instruct:

    .venv/bin/python benchmarks/bench_conversion.py

1. ``fiber-bundle convert`` of a safetensors folder (verification off: it is a separate, optional step) versus a plain
   ``LlamaForCausalLM.from_pretrained`` + ``save_pretrained`` of the same folder: time and peak memory, and peak
   memory as a multiple of the float32 model size;
2. the same folder saved in 100 MB shards, converted with ``--max-shard-size 100MB``: peak memory versus the largest
   shard.
Each operation runs in a fresh process; peak memory is the rise of the process's peak RSS (VmHWM, reset just before
the operation) over its RSS after imports. Targets (printed, not asserted): time <= 1.5x, peak <= 1.3x the fp32 size.
"""

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import json, sys, time
from pathlib import Path
import torch
from transformers import LlamaForCausalLM
from fiber_bundle.conversion import convert_checkpoint

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

mode, src, out, shard = sys.argv[1:5]
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
except OSError:
    pass
base = rss("VmRSS")
start = time.perf_counter()
if mode == "plain":
    model = LlamaForCausalLM.from_pretrained(src)
    model.save_pretrained(out, max_shard_size=shard)
else:
    convert_checkpoint(src, out, verify=False, max_shard_size=shard, show_progress=False)
print(json.dumps({"seconds": time.perf_counter() - start, "peak_bytes": rss("VmHWM") - base}))
"""


def run(mode, src, out, shard):
    result = subprocess.run([sys.executable, "-c", WORKER, mode, str(src), str(out), shard], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"{mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def prepare(folder: Path, shard: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from fiber_bundle.conversion.assets import smollm2_gguf

    gguf = smollm2_gguf()
    dequantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    fields = {k: v for k, v in dequantised.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig(**fields))
    model.load_state_dict(dequantised.state_dict())
    model.save_pretrained(folder, max_shard_size=shard)
    return sum(p.numel() for p in model.parameters()) * 4


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each operation (median reported)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fp32_bytes = prepare(tmp / "single", "50GB")
        prepare(tmp / "sharded", "100MB")
        largest_shard = max(p.stat().st_size for p in (tmp / "sharded").glob("*.safetensors"))
        results = {"plain": [], "convert": [], "convert_sharded": []}
        for i in range(args.repeats):  # interleaved, so machine noise hits both alike
            results["plain"].append(run("plain", tmp / "single", tmp / f"plain{i}", "50GB"))
            results["convert"].append(run("convert", tmp / "single", tmp / f"conv{i}", "50GB"))
            results["convert_sharded"].append(run("convert", tmp / "sharded", tmp / f"shard{i}", "100MB"))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("seconds", "peak_bytes")} for k, v in results.items()}
    mib = 2**20
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} logical CPUs",
        "fp32_model_mib": fp32_bytes / mib,
        "largest_source_shard_mib": largest_shard / mib,
        "time_ratio_convert_vs_plain": med["convert"]["seconds"] / med["plain"]["seconds"],
        "peak_convert_vs_fp32_size": med["convert"]["peak_bytes"] / fp32_bytes,
        "peak_plain_vs_fp32_size": med["plain"]["peak_bytes"] / fp32_bytes,
        "peak_sharded_convert_vs_largest_shard": med["convert_sharded"]["peak_bytes"] / largest_shard,
        "medians": med,
    }
    print(f"# conversion benchmark, SmolLM2-135M-Instruct, {summary['date']}, {summary['machine']}")
    print(f"fp32 model {summary['fp32_model_mib']:.0f} MiB; largest 100 MB-shard {largest_shard / mib:.0f} MiB")
    print("| operation | time s | peak MiB |")
    print("|---|---|---|")
    for name, label in (("plain", "from_pretrained + save_pretrained"), ("convert", "fiber-bundle convert"),
                        ("convert_sharded", "fiber-bundle convert, 100 MB shards")):
        print(f"| {label} | {med[name]['seconds']:.2f} | {med[name]['peak_bytes'] / mib:.0f} |")
    print(f"time convert / plain: {summary['time_ratio_convert_vs_plain']:.2f}x (target <= 1.5x)")
    print(f"peak convert / fp32 size: {summary['peak_convert_vs_fp32_size']:.2f}x (target <= 1.3x); "
          f"plain: {summary['peak_plain_vs_fp32_size']:.2f}x")
    print(f"peak sharded convert / largest shard: {summary['peak_sharded_convert_vs_largest_shard']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
