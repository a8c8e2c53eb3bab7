"""``fiber-bundle serve``: transformers' own OpenAI-compatible server (``transformers serve``) on a Fiber Bundle model.

Why a launcher and not ``transformers serve --trust-remote-code``: transformers' server resolves a model's class as
``getattr(transformers, config.architectures[0])`` (``ModelLoader._load_model`` in
``transformers/cli/serving/model_manager.py``), which no remote-code model passes, and it loads the model in a spawned
process, so a class made resolvable in the launching process does not reach it (docs/deployment.md, "Serving", has the
upstream defect and its reproduction). The route here: ``FiberBundleModelLoader`` (loader.py), a subclass of the
server's ``ModelLoader`` that loads an architecture transformers does not have through ``AutoModelForCausalLM`` and the
folder's ``auto_map``, is put in the server's module before the server is built. It is a class of an importable module,
so the spawned process unpickles it by reference. Where transformers resolves the class itself, the fallback never
runs (``loader.server_resolves_remote_code``), and from the first transformers release whose server loads remote code
itself (``SERVER_LOADS_REMOTE_CODE_FROM``, set once known) the loader is not installed at all.

One answer is changed: a request naming a model the server does not serve gets 404 (OpenAI's ``model_not_found``)
rather than the server's 400, which stays for a request naming no model.
"""

import json
import re
import signal
import sys
from pathlib import Path

# the first transformers release whose server loads a remote-code model through its auto_map (the defect above fixed),
# once known: from it on, the server's own ModelLoader runs. The route here was tested on 5.25.
SERVER_LOADS_REMOTE_CODE_FROM: tuple[int, ...] | None = None


class ServeError(ValueError):
    """A MODEL or an option ``fiber-bundle serve`` refuses, with what to do instead."""


def check_model(model: str) -> None:
    """Refuse what the server could not serve, before it starts: a local path that does not exist or holds no model,
    and a LoRA adapter folder (``fiber-bundle merge`` first). A Hub id is left to the server."""
    path = Path(model).expanduser()
    # a Hub id is "name" or "owner/name": anything else that names a path is a local folder
    if not (path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1):
        return
    if not path.is_dir():
        raise ServeError(f"{model} is not a folder: give a model folder (config.json and weights) or a Hub id.")
    if (path / "adapter_config.json").exists():
        raise ServeError(
            f"{model} is a LoRA adapter, not a model: merge it into its base first, "
            f"`fiber-bundle merge {model} MERGED`, then serve MERGED."
        )
    if not (path / "config.json").exists():
        raise ServeError(f"{model} holds no config.json: give the folder of a saved model (save_pretrained, "
                         "fiber-bundle convert, or fiber-bundle train's OUTPUT).")


def server_loads_remote_code(version: str | None = None) -> bool:
    """Whether transformers' server (the installed one, or ``version``) loads a remote-code model itself: from
    ``SERVER_LOADS_REMOTE_CODE_FROM`` on, never before it is known."""
    if SERVER_LOADS_REMOTE_CODE_FROM is None:
        return False
    if version is None:
        import transformers

        version = transformers.__version__
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3]) >= SERVER_LOADS_REMOTE_CODE_FROM


def install_server_hooks() -> None:
    """Before the server is built: put ``FiberBundleModelLoader`` (loader.py) in transformers' server module, where
    ``Serve`` reads its ``ModelLoader`` (unless that server loads remote code itself), and wrap its app factory so that
    a request naming a model the server does not serve gets 404. Raises ImportError, naming the tested release, where
    the server's module no longer has what the route relies on."""
    import transformers
    import transformers.cli.serving.model_manager as model_manager
    import transformers.cli.serving.server as server_module
    import transformers.cli.serving.utils as serving_utils

    missing = [name for module, name in ((model_manager, "ModelLoader"), (server_module, "build_server"),
                                         (serving_utils, "ModelNotServedError")) if not hasattr(module, name)]
    if missing or not hasattr(getattr(model_manager, "ModelLoader", None), "_load_model"):
        raise ImportError(
            f"fiber-bundle serve was built against transformers 5.25's server, and transformers "
            f"{transformers.__version__}'s has no {', '.join(missing) or 'ModelLoader._load_model'}: install "
            "'transformers>=5.25,<6' as the serving extra pins, or report it to the project."
        )
    if not server_loads_remote_code():
        from .loader import FiberBundleModelLoader

        model_manager.ModelLoader = FiberBundleModelLoader
    build_server = server_module.build_server
    if not getattr(build_server, "answers_404", False):
        server_module.build_server = _with_model_not_found(build_server, serving_utils.ModelNotServedError)


def _with_model_not_found(build_server, not_served: type):
    """``build_server`` whose app answers a request naming a model other than the one served with 404 and OpenAI's
    error body (``model_not_found``); the server's 400 stays for a request that names none."""
    from fastapi.responses import JSONResponse

    async def model_not_found(request, error):
        message = str(error)
        if "requested '" not in message:  # no model named: the request's fault as the server says (400)
            return JSONResponse({"detail": message}, status_code=400)
        body = {"message": message, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        return JSONResponse({"error": body, "detail": message}, status_code=404)

    def build(*args, **kwargs):
        app = build_server(*args, **kwargs)
        app.add_exception_handler(not_served, model_not_found)  # found before the server's ValueError handler (MRO)
        return app

    build.answers_404 = True
    return build


# The paged cache on a CPU where no --cb-* option sizes it. Why: transformers sizes it from the device's free memory,
# which on a CPU is 90 % of the machine's RAM (14 GB for a 2-layer test model on a 24 GB machine), and its masks for
# 8192 batch tokens. Here: 16384 cached tokens (SmolLM2-135M: 0.75 GB in float32), forwards of at most 2048 tokens
# (a longer prompt is prefilled in chunks).
CPU_CACHE_TOKENS = 16384
CPU_MAX_BATCH_TOKENS = 2048
DEFAULT_PAGE_SIZE = 256  # ContinuousBatchingConfig's page_size: the tokens of one block (--cb-block-size)


def serve_arguments(model: str, *, host: str = "127.0.0.1", port: int = 8000, continuous_batching: bool = False,
                    dtype: str = "auto", compile: bool = False, extra: list[str] = (), on_cpu: bool = False
                    ) -> list[str]:
    """The ``transformers serve`` command line this runs: MODEL preloaded, remote code trusted (the model's own code
    is the Fiber Bundle modeling file), every other option passed through, and with continuous batching ``on_cpu``
    the paged cache sized by ``CPU_CACHE_TOKENS`` and ``CPU_MAX_BATCH_TOKENS`` where no --cb-* option sizes it."""
    argv = ["serve", model, "--trust-remote-code", "--host", host, "--port", str(port), "--dtype", dtype]
    if continuous_batching:
        argv.append("--continuous-batching")
        given = {arg.split("=")[0] for arg in extra}
        if on_cpu and not given & {"--cb-num-blocks", "--cb-max-memory-percent", "--cb-max-batch-tokens"}:
            page = int(_option(extra, "--cb-block-size") or DEFAULT_PAGE_SIZE)
            argv += ["--cb-num-blocks", str(max(1, CPU_CACHE_TOKENS // page)),
                     "--cb-max-batch-tokens", str(CPU_MAX_BATCH_TOKENS)]
    if compile:
        argv.append("--compile")
    return [*argv, *extra]


def _option(argv, name: str) -> str | None:
    """The value of option ``name`` in ``argv`` ("--name value" or "--name=value"), or None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def runs_on_cpu(extra) -> bool:
    """Whether the server's model runs on the CPU: --device cpu, or no CUDA device ("auto", the default)."""
    import torch

    device = _option(extra, "--device") or "auto"
    return device.startswith("cpu") or (device == "auto" and not torch.cuda.is_available())


def serve(model: str, **options) -> None:
    """Run transformers' server on MODEL (a folder or a Hub id) until it is stopped (SIGINT / SIGTERM): the options of
    ``serve_arguments``. Raises ``ServeError`` for a MODEL it cannot serve and ImportError where
    ``transformers[serving]`` is not installed (or its server lacks what the route relies on)."""
    check_model(model)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise ImportError("fiber-bundle serve needs transformers' serving extra: "
                          "pip install 'fiber-bundle-transformers[serving]' (or 'transformers[serving]').") from error
    install_server_hooks()
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler it found: make that one
    # an orderly exit (status 0), as for Ctrl-C, rather than death by the signal
    signal.signal(signal.SIGTERM, _exit_cleanly)
    from transformers.cli.transformers import app

    argv = serve_arguments(model, **options, on_cpu=runs_on_cpu(options.get("extra", ())))
    app(args=argv, prog_name="transformers", standalone_mode=True)


def _exit_cleanly(signum, frame) -> None:
    sys.exit(0)


def describe_model(model: str) -> str:
    """One line for the start: what MODEL is (its model type and architecture, read from a local config.json)."""
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return model
    fields = json.loads(config.read_text())
    return f"{model} ({fields.get('model_type')}, {', '.join(fields.get('architectures') or [])})"
