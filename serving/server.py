"""``fiber-bundle serve``: transformers' own OpenAI-compatible server (``transformers serve``) on a Fiber Bundle model.

Why a launcher and not ``transformers serve --trust-remote-code``: transformers' server resolves a model's class as
``getattr(transformers, config.architectures[0])`` (``ModelLoader._load_model`` in
``transformers/cli/serving/model_manager.py``), which no remote-code model passes, and it loads the model in a spawned
process, so a class made resolvable in the launching process does not reach it (docs/deployment.md, "Serving", has the
upstream defect and its reproduction). The route here: ``FiberBundleModelLoader`` (loader.py), a subclass of the
server's ``ModelLoader`` that loads an architecture transformers does not have through ``AutoModelForCausalLM`` and the
folder's ``auto_map``, is put in the server's module before the server is built. It is a class of an importable module,
so the spawned process unpickles it by reference. Where transformers resolves the class itself, the fallback never
runs (``loader.server_resolves_remote_code``).
"""

import json
import signal
import sys
from pathlib import Path



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


def install_model_loader() -> None:
    """Put ``FiberBundleModelLoader`` (loader.py) in transformers' server module, where ``Serve`` reads its
    ``ModelLoader``."""
    import transformers.cli.serving.model_manager as model_manager

    from .loader import FiberBundleModelLoader

    model_manager.ModelLoader = FiberBundleModelLoader


def serve_arguments(model: str, *, host: str = "127.0.0.1", port: int = 8000, continuous_batching: bool = False,
                    dtype: str = "auto", compile: bool = False, extra: list[str] = ()) -> list[str]:
    """The ``transformers serve`` command line this runs: MODEL preloaded, remote code trusted (the model's own code
    is the Fiber Bundle modeling file), and every other option passed through."""
    argv = ["serve", model, "--trust-remote-code", "--host", host, "--port", str(port), "--dtype", dtype]
    if continuous_batching:
        argv.append("--continuous-batching")
    if compile:
        argv.append("--compile")
    return [*argv, *extra]


def serve(model: str, **options) -> None:
    """Run transformers' server on MODEL (a folder or a Hub id) until it is stopped (SIGINT / SIGTERM): the options of
    ``serve_arguments``. Raises ``ServeError`` for a MODEL it cannot serve and ImportError where ``transformers[serving]``
    is not installed."""
    check_model(model)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise ImportError("fiber-bundle serve needs transformers' serving extra: "
                          "pip install 'fiber-bundle-transformers[serving]' (or 'transformers[serving]').") from error
    install_model_loader()
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler it found: make that one
    # an orderly exit (status 0), as for Ctrl-C, rather than death by the signal
    signal.signal(signal.SIGTERM, _exit_cleanly)
    from transformers.cli.transformers import app

    app(args=serve_arguments(model, **options), prog_name="transformers", standalone_mode=True)


def _exit_cleanly(signum, frame) -> None:
    sys.exit(0)


def describe_model(model: str) -> str:
    """One line for the start: what MODEL is (its model type and architecture, read from a local config.json)."""
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return model
    fields = json.loads(config.read_text())
    return f"{model} ({fields.get('model_type')}, {', '.join(fields.get('architectures') or [])})"
