"""The ``fiber-bundle`` command line (convert, train, publish): thin argument parsing over the library functions."""

import argparse
import sys


def _convert(args) -> int:
    from .convert import ConversionError, convert_checkpoint

    try:
        result = convert_checkpoint(
            args.source,
            args.output,
            metric_rank=args.metric_rank,
            metric_hidden=args.metric_hidden,
            ffn_metric_rank=args.ffn_metric_rank,
            gguf_file=args.gguf_file,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
            seed=args.seed,
            verify=not args.no_verify,
            base_model=args.base_model,
            license=args.license,
        )
    except ConversionError as error:
        print(f"fiber-bundle convert: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fiber-bundle convert: interrupted; nothing was written to OUTPUT.", file=sys.stderr)
        return 130
    print(f"converted {args.source} ({result.source_family}) -> {result.output} in {result.seconds:.1f} s")
    report = result.report or {}
    if "metric_rank_choice" in report:
        choice = report["metric_rank_choice"]
        print(f"  metric rank {choice['metric_rank']} chosen automatically: {choice['rule']} "
              f"(median {choice['median_text_energy_rank']:.1f})")
    if "parity" not in report:
        print("  parity: not checked (--no-verify)")
        return 0
    parity, params = report["parity"], report["parameters"]
    print(f"  parity: {parity['summary']} -> {'passed' if parity['passed'] else 'FAILED'}")
    print(f"  new parameters: {params['geometry']:,} ({params['overhead_percent']:.2f}% of {params['backbone']:,})")
    print(f"  peak memory: {report['peak_memory_mib']:.0f} MiB; full report: {result.output / 'conversion_report.json'}")
    return 0


def _train(args) -> int:
    from fiber_bundle.training.errors import TrainingStopped, describe
    from fiber_bundle.training.trainer import run_training

    try:
        result = run_training(
            args.model, args.output, data=args.data, eval_data=args.eval_data, mode=args.mode,
            block_size=args.block_size, max_steps=args.max_steps, learning_rate=args.learning_rate,
            batch_size=args.batch_size, seed=args.seed, lora_r=args.lora_r,
            metric_learning_rate=args.metric_learning_rate, optimizer=args.optimizer,
            riemannian_learning_rate=args.riemannian_learning_rate, block=args.block, retraction=args.retraction,
            curvature_weight=args.curvature_weight,
            torsion_weight=args.torsion_weight, report_to=args.report_to,
            **({"save_strategy": "steps", "save_steps": args.save_steps} if args.save_steps else {}),
            resume_from_checkpoint=True if args.resume else None, base_model_id=args.base_model_id,
            overwrite=args.overwrite,
        )
    except TrainingStopped as stop:  # SIGTERM: a checkpoint was saved; 128 + 15, as a process killed by SIGTERM
        return _failed("train", stop, args.traceback, code=143, prefix="")
    except KeyboardInterrupt as interrupt:
        return _failed("train", interrupt, args.traceback, code=130, prefix="", message=(
            "interrupted; OUTPUT holds no new model. Run the same command with --resume to continue from the newest "
            "checkpoint in OUTPUT/checkpoints (if --save-steps kept one)."))
    except Exception as error:  # one line, never a traceback unless --traceback
        expected = isinstance(error, (ValueError, OSError))
        return _failed("train", error, args.traceback, message=None if expected else (
            f"{describe(error)} (run again with --traceback for the details)"))
    print(f"trained {result['steps']} steps ({result['mode']}) -> {result['output']}")
    if result["eval_loss_before"] is not None:
        print(f"  eval loss: {result['eval_loss_before']:.4f} -> {result['eval_loss_after']:.4f}")
    return 0


def _failed(command: str, error: BaseException, traceback: bool, *, code: int = 1, prefix: str = "error: ",
            message: str | None = None) -> int:
    """Report a failure in one line on stderr (the traceback first when asked for) and return the exit code."""
    if traceback:
        import traceback as tb

        tb.print_exception(error)
    from tqdm.auto import tqdm

    tqdm.write(f"fiber-bundle {command}: {prefix}{message or error}", file=sys.stderr)  # on its own line, under any bar
    return code


def _publish(args) -> int:
    from fiber_bundle.training.publish import PublishError, publish

    try:
        result = publish(args.folder, args.repo_id, private=args.private, revision=args.revision,
                         dry_run=args.dry_run)
    except PublishError as error:
        print(f"fiber-bundle publish: error: {error}", file=sys.stderr)
        return 1
    action = "would upload (dry run)" if result["dry_run"] else "uploaded"
    print(f"{action} {len(result['files'])} files to {result['repo_id']}: {', '.join(result['files'])}")
    return 0


def _rank_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from fiber_bundle.training.riemannian import OPTIMIZERS

    parser = argparse.ArgumentParser(prog="fiber-bundle", description="Fiber Bundle Transformers tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert", help="graft per-token metrics onto a LLaMA / Mistral / Qwen2 / Qwen3 checkpoint",
        description="Convert SOURCE into a Fiber Bundle Hub folder at OUTPUT that reproduces the source exactly.",
    )
    convert.add_argument("source", help="a checkpoint folder, a Hub model id (OWNER/NAME) or a .gguf file")
    convert.add_argument("output", help="the folder to write (must be absent or empty unless --overwrite)")
    convert.add_argument("--metric-rank", type=_rank_or_auto, default=2,
                         help="rank r of each token's attention metric, or 'auto': the median intrinsic rank of the "
                              "source's attention logits on calibration text (recorded in conversion_report.json)")
    convert.add_argument("--metric-hidden", type=int, default=64, help="width m of the fibre code")
    convert.add_argument("--ffn-metric-rank", type=int, default=None,
                         help="rank of the MLP preconditioner (default: --metric-rank; 0 turns it off)")
    convert.add_argument("--gguf-file", default=None, help="GGUF file name inside SOURCE (a folder or Hub repo)")
    convert.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                         help="dtype of the written weights (default: the source's)")
    convert.add_argument("--max-shard-size", default="2GB", help="largest output shard, e.g. 500MB or 2GB")
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")
    convert.add_argument("--allow-pickle", action="store_true",
                         help="accept pickled .bin weights (loaded with torch.load(weights_only=True))")
    convert.add_argument("--seed", type=int, default=0, help="seed of the new parameters' initialisation")
    convert.add_argument("--no-verify", action="store_true", help="skip the parity check against the source")
    convert.add_argument("--base-model", default=None,
                         help="Hub id of the source for the model card (default: SOURCE when it is a Hub id)")
    convert.add_argument("--license", default=None,
                         help="license for the model card (default: the one the source's model card declares)")
    convert.set_defaults(handler=_convert)

    train = commands.add_parser(
        "train", help="fine-tune a Fiber Bundle folder with transformers' Trainer (full, metric-only or LoRA)",
        description="Train MODEL (a Fiber Bundle folder) and save the result to OUTPUT.",
    )
    train.add_argument("model", help="a Fiber Bundle folder, e.g. the output of fiber-bundle convert")
    train.add_argument("output", help="folder for the trained model (or LoRA adapter), tokenizer and checkpoints")
    train.add_argument("--data", nargs="+", default=None,
                       help="training text: .txt / .json(l) / .parquet files or a Hub dataset name "
                            "(default: Python's pydoc topics, split by topic)")
    train.add_argument("--eval-data", nargs="+", default=None, help="held-out data in the same forms as --data")
    train.add_argument("--mode", choices=["full", "metric-only", "lora"], default="metric-only",
                       help="what trains: everything, only the metric (backbone frozen), or LoRA plus the metric")
    train.add_argument("--block-size", type=int, default=256, help="tokens per packed training block")
    train.add_argument("--max-steps", type=int, default=100, help="optimiser steps")
    train.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate")
    train.add_argument("--batch-size", type=int, default=8, help="blocks per device and step")
    train.add_argument("--seed", type=int, default=0, help="random seed")
    train.add_argument("--lora-r", type=int, default=8, help="LoRA rank (--mode lora)")
    train.add_argument("--metric-learning-rate", type=float, default=None,
                       help="learning rate of the metric (fiber) parameters, when it should differ from "
                            "--learning-rate (e.g. --mode lora --learning-rate 1e-3 --metric-learning-rate 2e-2)")
    train.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                       help="adamw, or a Riemannian geometry for the factored pairs (LoRA pairs, metric generators, "
                            "per-head W_Q / W_K in --mode full); the other parameters stay with AdamW")
    train.add_argument("--riemannian-learning-rate", type=float, default=None,
                       help="learning rate of the factored pairs under a Riemannian --optimizer (default: "
                            "--learning-rate); the steps are plain Riemannian gradient steps, so rates differ from "
                            "AdamW's")
    train.add_argument("--block", action="store_true",
                       help="the block variant of the geometry: each attention head's slice of a factor is its own "
                            "factor (heads share the other one)")
    train.add_argument("--retraction", choices=["qr", "polar"], default="qr",
                       help="retraction of the partial-isometry optimizers (stiefel-*, grassmann): QR or polar factor")
    train.add_argument("--curvature-weight", type=float, default=None, help="weight of the curvature regulariser")
    train.add_argument("--torsion-weight", type=float, default=None, help="weight of the torsion regulariser")
    train.add_argument("--report-to", nargs="*", default=[], help="Trainer integrations to log to (e.g. tensorboard)")
    train.add_argument("--save-steps", type=int, default=0,
                       help="write a checkpoint to OUTPUT/checkpoints every N steps (0: none; SIGTERM still saves one)")
    train.add_argument("--base-model-id", default=None,
                       help="--mode lora: Hub id of the base model, recorded in adapter_config.json")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in OUTPUT/checkpoints (a killed or preempted "
                            "run continues exactly; with none yet, training starts from the beginning)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace an OUTPUT that already holds a model or other files (once the new model is "
                            "complete); without --resume, also start again over an earlier run's checkpoints")
    train.add_argument("--traceback", action="store_true",
                       help="print the full Python traceback of an error (for bug reports)")
    train.set_defaults(handler=_train)

    publish = commands.add_parser(
        "publish", help="check a Fiber Bundle folder, finish its model card and upload it to the Hub",
        description="Check FOLDER (loads with trust_remote_code in a fresh process, auto_map, modeling files, "
                    "safetensors), render its model card, then create the repo and upload. The token comes from "
                    "HF_TOKEN or `hf auth login` and is never written anywhere.",
    )
    publish.add_argument("folder", help="the folder to publish")
    publish.add_argument("--repo-id", required=True, help="OWNER/NAME of the Hub repository")
    publish.add_argument("--private", action="store_true", help="create the repository private")
    publish.add_argument("--revision", default=None, help="branch to upload to (default: main)")
    publish.add_argument("--dry-run", action="store_true", help="check and render the card only; no network access")
    publish.set_defaults(handler=_publish)

    from fiber_bundle.analysis.cli import add_analyze_parser

    add_analyze_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
