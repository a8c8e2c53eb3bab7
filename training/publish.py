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
from fiber_bundle.model_cards import finish_card

# never uploaded (huggingface_hub's patterns: fnmatch on the path in the folder, "*" crosses "/"): training checkpoints
# (checkpoints/, and a Trainer's checkpoint-N/ at any depth), the Trainer's state, optimiser / scheduler / scaler / RNG
# states and any other pickle (.pt, .pth, .bin: training_args.bin, ...), hidden files and folders
IGNORE_PATTERNS = ["checkpoints/*", "checkpoint-*/*", "*/checkpoint-*/*", "trainer_state.json", "*.pt", "*.pth",
                   "*.bin", ".*", "*/.*"]


class PublishError(RuntimeError):
    """Publishing cannot proceed; the message names the problem and the fix."""


def check_folder(folder: str | Path, *, load: bool = True) -> list[str]:
    """What keeps ``folder`` from being a loadable Hub folder (empty when it is one)."""
    folder = Path(folder)
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
            dry_run: bool = False, token: str | None = None, check_load: bool = True) -> dict:
    """Check ``folder``, finish its card, then (unless ``dry_run``) create ``repo_id`` and upload the folder.

    Arguments:
        folder: a Fiber Bundle folder (from ``fiber-bundle convert`` or ``train``).
        repo_id: OWNER/NAME on the Hub.
        private: create the repo private (refused if it already exists and is public).
        revision: the branch to upload to.
        dry_run: check and render the card only; no HTTP call.
        token: a Hub token; default: huggingface_hub's own (HF_TOKEN or the login token file).
        check_load: load the folder with trust_remote_code in a fresh process as part of the check.
    """
    folder = Path(folder)
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise PublishError(f"--repo-id {repo_id!r} must be OWNER/NAME.")
    problems = check_folder(folder, load=check_load)
    if problems:
        raise PublishError(f"{folder} is not ready to publish: " + "; ".join(problems))
    finish_card(folder, repo_id)
    # what upload_folder sends: the folder's files, relative paths, filtered by the same function and patterns
    files = sorted(filter_repo_objects((p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()),
                                       ignore_patterns=IGNORE_PATTERNS))
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
