"""``fiber-bundle publish``: check a Fiber Bundle folder, finish its model card, and upload it to the Hub.

The token comes only from huggingface_hub's own sources (``HF_TOKEN``, the login token file, or the argument); it is
never written anywhere. A dry run makes no HTTP call. A failed upload leaves the local folder as it was.
"""

import json
import tempfile
from pathlib import Path

from huggingface_hub.utils import filter_repo_objects

from fiber_bundle.conversion.fresh_process import run_without_project
from fiber_bundle.conversion.hub import AUTO_MAP, modeling_files
from fiber_bundle.model_cards import EVALUATION_RESULTS, evaluation_summary, finish_card, looks_like_hub_id

# never uploaded (huggingface_hub's patterns: fnmatch on the path in the folder, "*" crosses "/"): training checkpoints
# (checkpoints/, and a Trainer's checkpoint-N/ at any depth), the Trainer's state, optimiser / scheduler / scaler / RNG
# states and any other pickle (.pt, .pth, .bin: training_args.bin, ...), hidden files and folders
IGNORE_PATTERNS = ["checkpoints/*", "checkpoint-*/*", "*/checkpoint-*/*", "trainer_state.json", "*.pt", "*.pth",
                   "*.bin", ".*", "*/.*"]


ADAPTER_CONFIG = "adapter_config.json"
# the files scanned for local paths before anything is uploaded (weights and other binary files hold none)
TEXT_SUFFIXES = {".json", ".md", ".txt", ".jinja", ".py", ".yaml", ".yml", ".cfg", ".csv"}


class PublishError(RuntimeError):
    """Publishing cannot proceed; the message names the problem and the fix."""


def local_paths_in(folder: str | Path, files: list[str]) -> list[str]:
    """Which of ``files`` (relative to ``folder``) hold a local path: the folder's own absolute path, its parent's, or
    the home directory (when it is deeper than one level: "/root" alone is too common a string). One entry per file."""
    folder = Path(folder)
    home = Path.home()
    paths = {str(folder.resolve()), str(folder.resolve().parent), str(folder.absolute().parent)}
    if len(home.parts) > 2:
        paths |= {str(home), str(home.resolve())}
    paths = sorted(p for p in paths if len(Path(p).parts) > 2)  # never "/" or "/tmp" on their own
    found = []
    for name in files:
        if Path(name).suffix.lower() not in TEXT_SUFFIXES:
            continue
        text = (folder / name).read_text(errors="replace")
        hits = [p for p in paths if p in text]
        if hits:
            found.append(f"{name} contains {max(hits, key=len)}")
    return found


def _adapter_problems(folder: Path) -> list[str]:
    problems = []
    if not list(folder.glob("adapter_model.*")):
        problems.append("adapter_config.json but no adapter_model.safetensors")
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not looks_like_hub_id(base):
        problems.append(f"{ADAPTER_CONFIG} names its base model as {base!r}, a local folder that a downloaded adapter "
                        "cannot find: publish the base first, then pass --base-model-id OWNER/NAME (its Hub id)")
    return problems


def _set_adapter_base(folder: Path, base_model_id: str) -> None:
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise PublishError(f"--base-model-id is for an adapter folder, and {folder} holds no {ADAPTER_CONFIG}.")
    if not looks_like_hub_id(base_model_id):
        raise PublishError(f"--base-model-id {base_model_id!r} must be a Hub id OWNER/NAME.")
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_model_id
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _keep_evaluation(folder: Path, evaluation: Path) -> None:
    """Keep what a card shows of ``fiber-bundle evaluate --json``'s output in ``folder`` (evaluation_results.json)."""
    try:
        summary = evaluation_summary(json.loads(evaluation.read_text()))
    except (OSError, ValueError) as error:
        raise PublishError(f"--evaluation {evaluation}: {error}") from error
    (folder / EVALUATION_RESULTS).write_text(json.dumps(summary, indent=2) + "\n")


def check_folder(folder: str | Path, *, load: bool = True) -> list[str]:
    """What keeps ``folder`` from being a loadable Hub folder (empty when it is one). An adapter folder (LoRA / QLoRA)
    needs its adapter files and a base named by Hub id; it is not loaded (its base lives on the Hub)."""
    folder = Path(folder)
    if (folder / ADAPTER_CONFIG).is_file():
        return _adapter_problems(folder)
    if not (folder / "config.json").is_file():
        return [f"{folder} has no config.json"]
    problems = []
    auto_map = json.loads((folder / "config.json").read_text()).get("auto_map") or {}
    missing = [key for key in AUTO_MAP if key not in auto_map]
    if missing:
        problems.append(f"config.json auto_map lacks {missing} (load the model and save_pretrained it again: that "
                        "writes the whole auto_map)")
    problems += [f"modeling file {name} is missing" for name in modeling_files() if not (folder / name).is_file()]
    if not list(folder.glob("*.safetensors")):
        problems.append("no safetensors weights")
    if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
        problems.append("pickled weights (.bin / .pt) present: publish safetensors only")
    if load and not problems:
        with tempfile.TemporaryDirectory() as scratch:
            result = run_without_project(
                "from transformers import AutoModelForCausalLM\n"
                "AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n",
                folder.resolve(), cwd=scratch,
            )
        if result.returncode != 0:
            problems.append(f"does not load with trust_remote_code in a fresh process: {result.stderr[-800:]}")
    return problems


def publish(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
            dry_run: bool = False, token: str | None = None, check_load: bool = True, license: str | None = None,
            evaluation: str | Path | None = None, base_model_id: str | None = None) -> dict:
    """Check ``folder``, render its card for ``repo_id``, then (unless ``dry_run``) create the repo and upload it.

    Arguments:
        folder: a Fiber Bundle folder (from ``fiber-bundle convert``, ``train`` or ``merge``), or a LoRA / QLoRA
            adapter folder (``fiber-bundle train --mode lora``).
        repo_id: OWNER/NAME on the Hub.
        private: create the repo private (refused if it already exists and is public).
        revision: the branch to upload to.
        dry_run: check and render the card only; no HTTP call.
        token: a Hub token; default: huggingface_hub's own (HF_TOKEN or the login token file).
        check_load: load the folder with trust_remote_code in a fresh process as part of the check.
        license: the card's license (default: the one the card declares, or the conversion source's).
        evaluation: the JSON ``fiber-bundle evaluate --json`` wrote: its metrics are kept in the folder as
            evaluation_results.json (without the run's local paths) and reach the card's ``model-index``.
        base_model_id: an adapter's base model on the Hub, written into adapter_config.json (whose
            ``base_model_name_or_path`` is the local base folder after training; a downloaded adapter needs the id).
    Returns the repo id, whether it was a dry run, and the files uploaded (or that would be). Nothing is uploaded when
    any of those files holds a local path (the home directory or the folder's own absolute path).
    """
    folder = Path(folder)
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise PublishError(f"--repo-id {repo_id!r} must be OWNER/NAME.")
    if base_model_id is not None:
        _set_adapter_base(folder, base_model_id)
    problems = check_folder(folder, load=check_load)
    if problems:
        raise PublishError(f"{folder} is not ready to publish: " + "; ".join(problems))
    if evaluation is not None:
        _keep_evaluation(folder, Path(evaluation))
    finish_card(folder, repo_id, license=license)
    # what upload_folder sends: the folder's files, relative paths, filtered by the same function and patterns
    files = sorted(filter_repo_objects((p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()),
                                       ignore_patterns=IGNORE_PATTERNS))
    leaks = local_paths_in(folder, files)
    if leaks:
        raise PublishError(f"{folder} would publish local paths: " + "; ".join(leaks) + ". Remove them from those "
                           "files (or render the card again with fiber-bundle publish --dry-run after fixing the "
                           "source); nothing was uploaded.")
    if dry_run:
        return {"repo_id": repo_id, "dry_run": True, "files": files}

    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    token = token or get_token()
    if token is None:
        raise PublishError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (it is never written to the "
                           "folder or the logs).")
    api = HfApi(token=token)
    try:
        try:
            info = api.repo_info(repo_id)
            if private and not info.private:
                raise PublishError(f"{repo_id} already exists and is public; --private would not make it private. "
                                   "Change its visibility on the Hub, or publish without --private.")
        except RepositoryNotFoundError:
            pass
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision,
                                   ignore_patterns=list(IGNORE_PATTERNS),  # upload_folder extends the list
                                   commit_message="Upload Fiber Bundle model with fiber-bundle publish")
    except PublishError:
        raise
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise PublishError(f"upload of {folder} to {repo_id} failed ({type(error).__name__}: {error}); the local "
                           "folder is unchanged. Check the network, the token's write permission and the repo id.") \
            from error
    return {"repo_id": repo_id, "dry_run": False, "files": files, "url": str(url), "commit": str(commit)}
