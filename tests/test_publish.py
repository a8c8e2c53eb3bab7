"""fiber-bundle publish: folder checks, the model card, dry run without HTTP, and the upload at the huggingface_hub
boundary (HfApi mocked; the suite runs with HF_HUB_OFFLINE=1, so any real HTTP call would fail)."""

import json

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

from helpers import tiny_model, tiny_tokenizer
from fiber_bundle.cli import main as cli_main
from fiber_bundle.training.publish import IGNORE_PATTERNS, PublishError, check_folder, publish


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "model"
    tiny_model(dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    (path / "training_metrics.json").write_text(json.dumps({"eval_loss_before": 4.6, "eval_loss_after": 4.1}))
    return path


def http_error(cls, status, message):
    """A huggingface_hub HTTP error as the library raises it (it needs the failed response)."""
    import httpx2

    response = httpx2.Response(status, request=httpx2.Request("POST", "https://huggingface.co/api/repos"))
    return cls(message, response=response)


class RecordingApi:
    """Stands in for HfApi: records the calls, fails where told to."""

    calls = []

    def __init__(self, token=None, fail_upload=False, existing=None):
        self.token = token

    def repo_info(self, repo_id):
        RecordingApi.calls.append(("repo_info", repo_id))
        if RecordingApi.existing is None:
            raise http_error(huggingface_hub.errors.RepositoryNotFoundError, 404, "no such repo")
        return RecordingApi.existing

    def create_repo(self, repo_id, **kwargs):
        RecordingApi.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        kwargs["ignore_patterns"] += DEFAULT_IGNORE_PATTERNS  # as HfApi.upload_folder does, to the list it is given
        RecordingApi.calls.append(("upload_folder", kwargs))
        if RecordingApi.fail_upload:
            raise http_error(huggingface_hub.errors.HfHubHTTPError, 403, "403 Forbidden: no write access")
        return "commit-url"


@pytest.fixture
def api(monkeypatch):
    RecordingApi.calls, RecordingApi.fail_upload, RecordingApi.existing = [], False, None
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_never_written")
    return RecordingApi


def test_dry_run_checks_renders_the_card_and_makes_no_call(folder, api):
    result = publish(folder, "someone/fbt-tiny", dry_run=True)
    assert result["dry_run"] and "model.safetensors" in result["files"]
    assert api.calls == []  # no HTTP at all
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "custom_code" in card.data.tags and "## Training" in card.text and "4.1" in card.text


def test_upload_goes_through_hfapi_with_the_right_arguments(folder, api):
    patterns = list(IGNORE_PATTERNS)
    result = publish(folder, "someone/fbt-tiny", private=True, revision="dev", check_load=False)
    names = [call[0] for call in api.calls]
    assert names == ["repo_info", "create_repo", "upload_folder"]
    assert api.calls[1][1] == "someone/fbt-tiny" and api.calls[1][2]["private"] is True
    upload = api.calls[2][1]
    assert upload["repo_id"] == "someone/fbt-tiny" and upload["revision"] == "dev"
    assert upload["folder_path"] == str(folder) and upload["ignore_patterns"] == patterns + DEFAULT_IGNORE_PATTERNS
    assert IGNORE_PATTERNS == patterns  # upload_folder extends the list it is given: publish passes a copy
    assert not result["dry_run"]
    assert {"config.json", "model.safetensors", "README.md", "modeling_fiber_bundle.py", "fiber_attention.py",
            "configuration_fiber_bundle.py", "tokenizer.json"} <= set(result["files"])
    for path in folder.rglob("*"):  # the token is never written anywhere
        if path.is_file():
            assert b"hf_test_token_never_written" not in path.read_bytes(), path


CHECKPOINT = ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth",
              "trainer_state.json", "training_args.bin")  # what the Trainer writes into a checkpoint-N folder
RUN_ARTEFACTS = [*(f"checkpoints/checkpoint-{n}/{name}" for n in (2, 4) for name in CHECKPOINT),  # fiber-bundle train
                 "checkpoints/runs/May01_12-00-00_host/events.out.tfevents.1.host",  # ... with --report_to tensorboard
                 *(f"checkpoint-6/{name}" for name in CHECKPOINT),  # a Trainer run with the folder as output_dir
                 *(f"run/checkpoint-8/{name}" for name in CHECKPOINT),  # ... or a folder inside it
                 "trainer_state.json", "rng_state_0.pth", "run/scaler.pt", ".env", ".ipynb_checkpoints/x.ipynb",
                 "tokenizer/.DS_Store"]
TOP_LEVEL_PICKLES = ["optimizer.pt", "scheduler.pt", "training_args.bin"]  # refused by the check before any upload


def test_upload_leaves_out_checkpoints_optimiser_states_and_other_run_artefacts(folder, api):
    """The recorded ignore_patterns, applied by huggingface_hub's own filter (the one upload_folder uses) to the
    folder's real files, keep exactly the model's files; the dry run lists the same files."""
    model_files = sorted({p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} | {"README.md"})
    for name in RUN_ARTEFACTS:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"run artefact")
    assert publish(folder, "someone/fbt-tiny", dry_run=True)["files"] == model_files
    publish(folder, "someone/fbt-tiny", check_load=False)
    patterns = api.calls[-1][1]["ignore_patterns"]
    for name in TOP_LEVEL_PICKLES:
        (folder / name).write_bytes(b"run artefact")
    with pytest.raises(PublishError, match="pickled weights"):
        publish(folder, "someone/fbt-tiny", check_load=False)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert sorted(filter_repo_objects(files, ignore_patterns=patterns)) == model_files


def test_private_onto_an_existing_public_repo_is_refused(folder, api):
    api.existing = type("Info", (), {"private": False})()
    with pytest.raises(PublishError, match="already exists and is public"):
        publish(folder, "someone/fbt-tiny", private=True, check_load=False)
    assert [c[0] for c in api.calls] == ["repo_info"]


def test_missing_token_and_failed_upload_give_clear_errors(folder, api, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(PublishError, match="no Hugging Face token"):
        publish(folder, "someone/fbt-tiny", check_load=False)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_x")
    api.fail_upload = True
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    with pytest.raises(PublishError, match="failed.*local folder is unchanged"):
        publish(folder, "someone/fbt-tiny", check_load=False)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before


def test_checks_find_what_breaks_a_hub_folder(folder):
    assert check_folder(folder) == []  # includes a trust_remote_code load in a fresh process
    (folder / "fiber_attention.py").unlink()
    torch.save({}, folder / "pytorch_model.bin")
    problems = " ".join(check_folder(folder))
    assert "fiber_attention.py is missing" in problems and "pickled weights" in problems
    with pytest.raises(PublishError, match="not ready to publish"):
        publish(folder, "someone/x", dry_run=True)
    with pytest.raises(PublishError, match="OWNER/NAME"):
        publish(folder, "no-owner", dry_run=True)


def test_publish_command_dry_run(folder, api, capsys):
    assert cli_main(["publish", str(folder), "--repo-id", "someone/fbt-tiny", "--dry-run"]) == 0
    assert "would upload (dry run)" in capsys.readouterr().out and api.calls == []


def test_check_refuses_a_folder_missing_any_modeling_file(folder):
    """The check reads the one list of modeling files (what save_pretrained writes): each missing one is named."""
    from fiber_bundle.conversion.hub import modeling_files

    assert sorted(p.name for p in folder.glob("*.py")) == list(modeling_files())
    for name in modeling_files():
        (folder / name).rename(folder / f"{name}.aside")
        assert check_folder(folder, load=False) == [f"modeling file {name} is missing"]
        (folder / f"{name}.aside").rename(folder / name)
    assert check_folder(folder, load=False) == []
