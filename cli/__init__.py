"""The ``fiber-bundle`` command: a table of subcommands, each implemented (and parsed) by its own package, imported
only when it runs, so that ``fiber-bundle convert`` never imports training or analysis. Nothing imports this module."""

import argparse
import importlib
import sys

# subcommand -> (the function that takes its arguments and returns the exit code, one line of help)
SUBCOMMANDS = {
    "convert": ("fiber_bundle.conversion.cli:convert",
                "graft per-token metrics onto a LLaMA / Mistral / Qwen2 / Qwen3 checkpoint"),
    "export": ("fiber_bundle.conversion.cli:export",
               "export a Fiber Bundle causal LM to torch.export, ONNX or ExecuTorch, checked against generate"),
    "train": ("fiber_bundle.training.cli:train",
              "fine-tune a Fiber Bundle folder with transformers' Trainer (full, metric-only or LoRA)"),
    "merge": ("fiber_bundle.training.cli:merge",
              "merge a LoRA (or QLoRA) adapter into its base: a full-precision Fiber Bundle folder"),
    "publish": ("fiber_bundle.training.cli:publish",
                "check a Fiber Bundle folder, finish its model card and upload it to the Hub"),
    "analyze": ("fiber_bundle.analysis.cli:analyze",
                "measure rank collapse, intrinsic rank and the geometry; compare with LoRA"),
    "evaluate": ("fiber_bundle.analysis.cli:evaluate",
                 "run lm-evaluation-harness tasks on a converted model and its source, side by side"),
    "serve": ("fiber_bundle.serving.cli:serve",
              "serve a model with transformers' OpenAI-compatible server (streaming, continuous batching)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="fiber-bundle", description="Fiber Bundle Transformers tools. "
                                     "`fiber-bundle COMMAND --help` describes a command.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in SUBCOMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    command = parser.parse_args(argv[:1]).command  # --help, or an unknown or missing command: argparse's message
    module, function = SUBCOMMANDS[command][0].split(":")
    return getattr(importlib.import_module(module), function)(argv[1:])
