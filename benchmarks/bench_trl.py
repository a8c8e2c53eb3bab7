"""LoRA with the metric alongside, trained by TRL's SFTTrainer and by the project's own trainer (``fiber-bundle train
--mode lora``) on the same blocks with the same budget, side by side in one run: held-out loss before and after, and
seconds per step.

Full run (the main job's output, 10 steps of 8 x 256 tokens each way; about 10 minutes on 2 cores):

    .venv/bin/python docs/quickstart.py --out out/smollm2-fbt          # once: writes out/smollm2-fbt-metric
    .venv/bin/python benchmarks/bench_trl.py out/smollm2-fbt-metric --json benchmarks/results_trl.json

Smoke run (a tiny model converted from a random LLaMA, 3 steps of 2 x 64 tokens):

    .venv/bin/python benchmarks/bench_trl.py --quick

What is compared. The training text: Python's pydoc topics split by topic into training and held-out parts
(``training.data.pydoc_topics``), each cut into blocks of --block-size tokens (``training_blocks``: documents joined,
each ended by EOS). Both trainers get the same training blocks in the same order (seed 0; TRL's SFTTrainer takes them
as an already tokenised dataset, without packing), --batch-size blocks per step, --steps steps, AdamW at
--learning-rate with the metric (``fiber``) parameters at --metric-learning-rate, LoRA r = 8 on the projections
(``trl_recipes.lora_config``, the same as ``--mode lora``), float32, no bf16 autocast. Each starts from the folder as
saved. TRL runs with its defaults otherwise: gradient checkpointing on (the project's trainer has it off) and its
fused LM-head loss; ``--no-checkpointing`` turns TRL's off too. Held-out loss: the mean token loss over every held-out
block (``trainer.evaluation_loss``), of the folder before training and of each trained model. Seconds per step:
``train_runtime`` / steps as each Trainer reports it (the first step's set-up included, in both).
"""

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from common import environment, finish

# TRL 1.16 on transformers 5.25: its configs' default gradient_checkpointing=True is a deprecated name (still applies)
warnings.filterwarnings("ignore", message="`[a-z_]*gradient_checkpointing[a-z_]*` is deprecated",
                        category=FutureWarning)


def quick_folder(work: Path) -> Path:
    """A tiny random LLaMA of SmolLM2's vocabulary, with its tokenizer, converted to a Fiber Bundle folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fiber_bundle.conversion import convert_checkpoint
    from fiber_bundle.conversion.assets import smollm2_gguf
    from fiber_bundle.conversion.sources import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True)
    source = work / "llama"
    LlamaForCausalLM(config).save_pretrained(source)
    load_tokenizer(smollm2_gguf()).save_pretrained(source)
    convert_checkpoint(source, work / "fbt", verify=False)
    return work / "fbt"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a Fiber Bundle folder (e.g. the main job's out/smollm2-fbt-metric)")
    parser.add_argument("--quick", action="store_true", help="a tiny converted model, 3 steps of 2 x 64 tokens")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps each way (default 10; quick 3)")
    parser.add_argument("--batch-size", type=int, default=None, help="blocks per step (default 8; quick 2)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per block (default 256; quick 64)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="LoRA's (and every non-metric) rate")
    parser.add_argument("--metric-learning-rate", type=float, default=2e-2, help="the fiber parameters' rate")
    parser.add_argument("--no-checkpointing", action="store_true", help="turn TRL's gradient checkpointing off")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not args.quick and not args.model:
        parser.error("give MODEL (a Fiber Bundle folder) or --quick")
    args.steps = args.steps or (3 if args.quick else 10)
    args.batch_size = args.batch_size or (2 if args.quick else 8)
    args.block_size = args.block_size or (64 if args.quick else 256)

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from fiber_bundle.training.data import pydoc_topics, training_blocks
    from fiber_bundle.training.trainer import evaluation_loss, train_model
    from fiber_bundle.training.trl_recipes import lora_config, with_metric_learning_rate
    from modeling_fiber_bundle import FiberBundleForCausalLM

    env = environment(args.quick)
    env.update(batch=args.batch_size, block_size=args.block_size, steps=args.steps)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        folder = quick_folder(work) if args.quick else Path(args.model)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        train_text, eval_text = pydoc_topics()
        train = training_blocks(train_text, tokenizer, args.block_size, name="pydoc training topics")
        held_out = training_blocks(eval_text, tokenizer, args.block_size, name="pydoc held-out topics")
        load = lambda: FiberBundleForCausalLM.from_pretrained(folder, dtype=torch.float32)  # noqa: E731
        before = evaluation_loss(load(), held_out)
        print(f"held-out loss before: {before:.4f} ({len(held_out)} blocks of {args.block_size})", flush=True)

        rows = {}
        start = time.perf_counter()
        trainer = train_model(load(), train, work / "project", mode="lora", max_steps=args.steps,
                              batch_size=args.batch_size, learning_rate=args.learning_rate,
                              metric_learning_rate=args.metric_learning_rate, seed=0, use_cpu=True, quiet=True,
                              save_strategy="no", report_to=[], lr_scheduler_type="constant")
        rows["fiber-bundle train --mode lora"] = {
            "s_per_step": trainer.state.log_history[-1]["train_runtime"] / args.steps,
            "wall_s": time.perf_counter() - start, "gradient_checkpointing": False,
            "held_out_after": evaluation_loss(trainer.model, held_out)}

        config = SFTConfig(output_dir=str(work / "trl"), max_steps=args.steps,
                           per_device_train_batch_size=args.batch_size,
                           learning_rate=args.learning_rate, seed=0, use_cpu=True, bf16=False, report_to=[],
                           save_strategy="no", lr_scheduler_type="constant", logging_steps=args.steps,
                           max_length=args.block_size, packing=False, disable_tqdm=True,
                           gradient_checkpointing=not args.no_checkpointing)
        start = time.perf_counter()
        sft = SFTTrainer(model=load(), args=config, processing_class=tokenizer, peft_config=lora_config(),
                         train_dataset=Dataset.from_dict({"input_ids": train["input_ids"]}))
        with_metric_learning_rate(sft, args.metric_learning_rate)
        output = sft.train()
        rows["TRL SFTTrainer"] = {
            "s_per_step": output.metrics["train_runtime"] / args.steps, "wall_s": time.perf_counter() - start,
            "gradient_checkpointing": bool(config.gradient_checkpointing),
            "held_out_after": evaluation_loss(sft.model, held_out)}

    result = {"model": "quick" if args.quick else Path(args.model).name, "held_out_before": before, "rows": rows}

    def report(env, result):
        print(f"\n# LoRA + metric, TRL vs fiber-bundle train, {env['date']}, {env['cpu']}, "
              f"{env['logical_cpus']} logical CPUs; {args.steps} steps of {args.batch_size} x {args.block_size} "
              f"tokens\n")
        print(f"held-out loss before: {result['held_out_before']:.4f}\n")
        print("| trainer | gradient checkpointing | s / step | held-out loss after |")
        print("|---|---|---|---|")
        for name, row in result["rows"].items():
            print(f"| {name} | {'on' if row['gradient_checkpointing'] else 'off'} | {row['s_per_step']:.2f} "
                  f"| {row['held_out_after']:.4f} |")

    finish(env, result, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
