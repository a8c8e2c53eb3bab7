"""``fiber-bundle train``, ``merge`` and ``publish``: thin command lines over ``run_training``, ``merge_adapter`` and
``publish``.

``train`` is parsed by transformers' ``HfArgumentParser`` into ``FiberBundleTrainingArguments``, so every
``TrainingArguments`` field is a flag (``--gradient_accumulation_steps``, ``--warmup_steps``, ``--bf16``, ...) beside
the project's (``--mode``, ``--metric_learning_rate``, ...), each also spelled with hyphens; the dataclass goes to
``run_training`` as parsed.
"""

import argparse

from fiber_bundle.conversion.cli import report_failure


def train_parser(*, from_config: bool = False):
    """The parser of ``fiber-bundle train``: MODEL OUTPUT, or only OUTPUT when ``from_config`` (--from-config given)."""
    from transformers import HfArgumentParser

    from .arguments import FiberBundleTrainingArguments

    parser = HfArgumentParser(FiberBundleTrainingArguments, prog="fiber-bundle train",
                              description="Train MODEL (a Fiber Bundle folder), or a fresh model built from "
                                          "--from-config CONFIG (a JSON file of FiberBundleConfig fields or a size "
                                          "preset; then only OUTPUT is given), and save the result to OUTPUT. Every "
                                          "transformers TrainingArguments field is a flag; output_dir is "
                                          "OUTPUT/checkpoints.")
    if not from_config:
        parser.add_argument("model", help="a Fiber Bundle folder, e.g. the output of fiber-bundle convert (omit it "
                                          "with --from-config)")
    parser.add_argument("output", help="folder for the trained model (or LoRA adapter), tokenizer and checkpoints")
    parser.add_argument("--traceback", action="store_true",
                        help="print the full Python traceback of an error (for bug reports)")
    return parser


def parse_train(argv: list[str]):
    """``argv`` (after ``train``) as ``(FiberBundleTrainingArguments, namespace of MODEL (None with --from-config),
    OUTPUT and --traceback)``; an unknown flag or a malformed value exits with argparse's usage error, as any command
    line does."""
    from_config = any(arg.split("=")[0] in ("--from-config", "--from_config") for arg in argv)
    parser = train_parser(from_config=from_config)
    args, command, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True,
                                                                look_for_args_file=False)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" + (
            " (with --from-config only OUTPUT is given: a fresh model is built, not loaded from MODEL)"
            if from_config else ""))
    if from_config:
        command.model = None
    return args, command


def train(argv: list[str]) -> int:
    from .errors import TrainingStopped, describe
    from .trainer import run_training

    traceback = "--traceback" in argv  # known before the options are checked, which may already fail
    try:
        args, command = parse_train(argv)
        result = run_training(command.model, command.output, args)
    except TrainingStopped as stop:  # SIGTERM: a checkpoint was saved; 128 + 15, as a process killed by SIGTERM
        return report_failure("train", stop, traceback, code=143, prefix="")
    except KeyboardInterrupt as interrupt:
        return report_failure("train", interrupt, traceback, code=130, prefix="", message=(
            "interrupted; OUTPUT holds no new model. Run the same command with --resume to continue from the newest "
            "checkpoint in OUTPUT/checkpoints (if --save-steps kept one)."))
    except Exception as error:  # one line, never a traceback unless --traceback
        expected = isinstance(error, (ValueError, OSError))
        return report_failure("train", error, traceback, message=None if expected else (
            f"{describe(error)} (run again with --traceback for the details)"))
    print(f"trained {result['steps']} steps ({result['mode']}) -> {result['output']}")
    if result["eval_loss_before"] is not None:
        print(f"  eval loss: {result['eval_loss_before']:.4f} -> {result['eval_loss_after']:.4f}")
    return 0


def publish(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fiber-bundle publish",
        description="Check FOLDER (loads with trust_remote_code in a fresh process, auto_map, modeling files, "
                    "safetensors), render its model card, then create the repo and upload. The token comes from "
                    "HF_TOKEN or `hf auth login` and is never written anywhere.",
    )
    parser.add_argument("folder", help="the folder to publish")
    parser.add_argument("--repo-id", required=True, help="OWNER/NAME of the Hub repository")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", default=None, help="branch to upload to (default: main)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check, render the card and list the files that would be uploaded; no network access")
    parser.add_argument("--license", default=None,
                        help="the card's license, a Hub license id such as apache-2.0 (default: the one the card "
                             "declares, or the conversion source's)")
    parser.add_argument("--evaluation", default=None, metavar="JSON",
                        help="the file `fiber-bundle evaluate ... --json JSON` wrote: its metrics go into the card and "
                             "its model-index (kept in FOLDER as evaluation_results.json, without local paths)")
    parser.add_argument("--base-model-id", default=None, metavar="OWNER/NAME",
                        help="for an adapter folder: the Hub id of the base model it was trained on, written into "
                             "adapter_config.json (training records the local base folder there)")
    args = parser.parse_args(argv)

    from .publish import PublishError, publish as publish_folder

    try:
        result = publish_folder(args.folder, args.repo_id, private=args.private, revision=args.revision,
                                dry_run=args.dry_run, license=args.license, evaluation=args.evaluation,
                                base_model_id=args.base_model_id)
    except PublishError as error:
        return report_failure("publish", error, traceback=False)
    action = "would upload (dry run)" if result["dry_run"] else "uploaded"
    print(f"{action} {len(result['files'])} files to {result['repo_id']}:")
    for name in result["files"]:
        print(f"  {name}")
    return 0


def merge(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fiber-bundle merge",
        description="Merge a LoRA adapter (the OUTPUT of fiber-bundle train --mode lora, QLoRA included) into its base "
                    "in full precision and save a Fiber Bundle folder (weights, tokenizer, card, remote code) that "
                    "loads with trust_remote_code and no PEFT.",
    )
    parser.add_argument("adapter", help="the adapter folder (adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("output", help="folder for the merged model")
    parser.add_argument("--base", default=None, help="the full-precision Fiber Bundle folder the adapter was trained "
                                                     "on (default: base_model_name_or_path in adapter_config.json)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an OUTPUT that already holds a model or other files (once the merged model is "
                             "complete)")
    parser.add_argument("--traceback", action="store_true",
                        help="print the full Python traceback of an error (for bug reports)")
    args = parser.parse_args(argv)

    from .merge import merge_adapter

    try:
        result = merge_adapter(args.adapter, args.output, base=args.base, overwrite=args.overwrite)
    except (ValueError, OSError) as error:
        return report_failure("merge", error, args.traceback)
    print(f"merged {result['adapter']} into {result['base']} -> {result['output']}")
    return 0
