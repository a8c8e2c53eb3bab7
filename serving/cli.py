"""``fiber-bundle serve``: thin argument parsing over ``serving.server.serve``."""

import argparse

from .server import CPU_CACHE_TOKENS, CPU_MAX_BATCH_TOKENS


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fiber-bundle serve",
        description="Serve a Fiber Bundle model (a folder or a Hub id) with transformers' own OpenAI-compatible server "
                    "(`transformers serve`: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, "
                    "/health, streaming), its remote code trusted and loaded in the server's model process. Options "
                    "not listed here are passed to `transformers serve` as they are (see `transformers serve --help`: "
                    "--device, --max-model-len, --cb-block-size, --cb-num-blocks, --cb-max-batch-tokens, "
                    "--default-seed, --log-level, --enable-cors, ...). Stop it with Ctrl-C or SIGTERM.",
    )
    parser.add_argument("model", help="the model folder (fiber-bundle convert / train / merge OUTPUT) or a Hub id; a "
                                      "LoRA adapter folder is refused (fiber-bundle merge it first)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every "
                             "interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--continuous-batching", action="store_true",
                        help="share one forward between concurrent requests over a paged KV cache (transformers' "
                             "ContinuousBatchingManager; tune with --cb-* options). On a CPU, unless a "
                             "--cb-num-blocks, --cb-max-memory-percent or --cb-max-batch-tokens option is given, the "
                             f"cache holds {CPU_CACHE_TOKENS} tokens and a forward at most {CPU_MAX_BATCH_TOKENS} "
                             "(transformers would reserve 90%% of the RAM)")
    parser.add_argument("--dtype", default="auto",
                        help="the weights' dtype: auto (as saved), float32, bfloat16 or float16 (default: auto)")
    parser.add_argument("--compile", action="store_true", help="compile the model's forward with torch.compile")
    parser.add_argument("--traceback", action="store_true",
                        help="print the full Python traceback of an error (for bug reports)")
    return parser


def serve(argv: list[str]) -> int:
    args, extra = serve_parser().parse_known_args(argv)

    from fiber_bundle.conversion.cli import report_failure

    from .server import ServeError, describe_model, serve

    print(f"serving {describe_model(args.model)} on http://{args.host}:{args.port}/v1 (transformers serve)", flush=True)
    try:
        serve(args.model, host=args.host, port=args.port, continuous_batching=args.continuous_batching,
              dtype=args.dtype, compile=args.compile, extra=extra)
    except (ServeError, ImportError) as error:
        return report_failure("serve", error, args.traceback)
    except SystemExit as exit_:  # typer's own exit (its code: 0 after a clean stop, 2 for an option it rejects)
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0
