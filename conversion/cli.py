"""``fiber-bundle convert``: thin argument parsing over ``convert_checkpoint``; and ``report_failure``, the one-line
error report every ``fiber-bundle`` command uses (conversion being the package the others may import)."""

import argparse
import sys


def convert(argv: list[str]) -> int:
    args = convert_parser().parse_args(argv)

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
        return report_failure("convert", error, traceback=False)
    except KeyboardInterrupt as interrupt:
        return report_failure("convert", interrupt, traceback=False, code=130, prefix="",
                              message="interrupted; nothing was written to OUTPUT.")
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


def report_failure(command: str, error: BaseException, traceback: bool, *, code: int = 1, prefix: str = "error: ",
                   message: str | None = None) -> int:
    """Report a failure of ``fiber-bundle COMMAND`` in one line on stderr (the traceback first when asked for), on its
    own line under any progress bar, and return the exit code."""
    if traceback:
        import traceback as tb

        tb.print_exception(error)
    from tqdm.auto import tqdm

    tqdm.write(f"fiber-bundle {command}: {prefix}{message or error}", file=sys.stderr)  # on its own line, under any bar
    return code


def _rank_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fiber-bundle convert",
        description="Convert SOURCE into a Fiber Bundle Hub folder at OUTPUT that reproduces the source exactly.",
    )
    parser.add_argument("source", help="a checkpoint folder, a Hub model id (OWNER/NAME) or a .gguf file")
    parser.add_argument("output", help="the folder to write (must be absent or empty unless --overwrite)")
    parser.add_argument("--metric-rank", type=_rank_or_auto, default=2,
                        help="rank r of each token's attention metric, or 'auto': the median intrinsic rank of the "
                             "source's attention logits on calibration text (recorded in conversion_report.json)")
    parser.add_argument("--metric-hidden", type=int, default=64, help="width m of the fibre code")
    parser.add_argument("--ffn-metric-rank", type=int, default=None,
                        help="rank of the MLP preconditioner (default: --metric-rank; 0 turns it off)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside SOURCE (a folder or Hub repo)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="dtype of the written weights (default: the source's)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest output shard, e.g. 500MB or 2GB")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="accept pickled .bin weights (loaded with torch.load(weights_only=True))")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new parameters' initialisation")
    parser.add_argument("--no-verify", action="store_true", help="skip the parity check against the source")
    parser.add_argument("--base-model", default=None,
                        help="Hub id of the source for the model card (default: SOURCE when it is a Hub id)")
    parser.add_argument("--license", default=None,
                        help="license for the model card (default: the one the source's model card declares)")
    return parser


def export(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)

    from .export import ExportError, export_model

    try:
        result = export_model(args.model, args.output, format=args.format, max_cache_len=args.max_cache_len,
                              prefill_chunk=args.prefill_chunk, dynamic_length=args.dynamic_length or None,
                              verify=not args.no_verify, prompt_tokens=args.prompt_tokens,
                              new_tokens=args.new_tokens, overwrite=args.overwrite)
    except ExportError as error:
        return report_failure("export", error, traceback=args.traceback)
    except KeyboardInterrupt as interrupt:
        return report_failure("export", interrupt, traceback=False, code=130, prefix="",
                              message="interrupted; nothing was written to OUTPUT.")
    report = result.report
    print(f"exported {args.model} -> {result.output / report['file']} ({args.format}, "
          f"{report['file_bytes'] / 2**20:.1f} MiB) in {report['export_seconds']:.1f} s")
    if "parity" in report:
        print(f"  parity: {report['parity']['summary']} -> passed")
    else:
        print("  parity: not checked (--no-verify)")
    print(f"  not in the program: {'; '.join(report['not_in_the_program'])}")
    print(f"  peak memory: {report['peak_memory_mib']:.0f} MiB; full report: {result.output / 'export_report.json'}")
    return 0


def export_parser() -> argparse.ArgumentParser:
    from .export import FORMATS

    parser = argparse.ArgumentParser(
        prog="fiber-bundle export",
        description="Export MODEL (a Fiber Bundle causal-LM folder) to OUTPUT as a program that runs without Python "
                    "transformers, and check it against eager generate first (docs/deployment.md). Formats: "
                    + "; ".join(f"{name}: {spec.summary}" for name, spec in FORMATS.items()) + ".",
    )
    parser.add_argument("model", help="a Fiber Bundle folder (fiber-bundle convert's or train's output); a LoRA "
                                      "adapter must be merged first (fiber-bundle merge)")
    parser.add_argument("output", help="the folder to write (must be absent or empty unless --overwrite)")
    parser.add_argument("--format", choices=list(FORMATS), default="exported-program",
                        help="the program to write (default: exported-program)")
    parser.add_argument("--max-cache-len", type=int, default=512,
                        help="positions of the static cache (exported-program, executorch): prompt plus generated "
                             "tokens cannot exceed it (default 512)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="onnx: most new tokens per call; longer prompts are fed in chunks (default: the model's "
                             "attention_block_size)")
    parser.add_argument("--dynamic-length", action="store_true",
                        help="require a program that takes any context length (onnx has one; the static-cache "
                             "formats refuse it)")
    parser.add_argument("--prompt-tokens", type=int, default=24,
                        help="tokens of calibration text the parity check prompts with (default 24)")
    parser.add_argument("--new-tokens", type=int, default=16,
                        help="greedy tokens the parity check generates and compares with generate's (default 16)")
    parser.add_argument("--no-verify", action="store_true", help="skip the parity check against the eager model")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")
    parser.add_argument("--traceback", action="store_true",
                        help="print the full Python traceback of an error (for bug reports)")
    return parser
