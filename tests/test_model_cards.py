"""Model cards a user can publish as they are: every kind of folder the project writes (converted, metric-only and full
training, LoRA and QLoRA adapters, merged, from scratch) gets a card with the sections the Hub expects, metadata that
huggingface_hub's own loader parses (model-index where there are results), numbers rounded for people, no dead link,
and no local path in any file ``fiber-bundle publish`` would upload."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results

from helpers import tiny_tokenizer
from test_conversion import save_source

from fiber_bundle.cli import main
from fiber_bundle.model_cards import MARKER, card_kind, public_name, render_card, significant
from fiber_bundle.training.publish import PublishError, local_paths_in, publish

# peft 0.21 itself reads the deprecated `is_gradient_checkpointing` property; nothing of ours does
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
# the folder each command writes -> its kind
KINDS = {"converted": "converted", "metric": "trained", "full": "trained", "lora": "adapter", "qlora": "adapter",
         "merged": "merged", "scratch": "from-scratch"}
SECTIONS = ["## Model details", "## How to use", "## Intended uses and limitations", "## Learned geometry",
            "## Compute and software", "## Citation"]
TRAINING_SECTIONS = ["## Training data", "## Training procedure", "## Evaluation results"]
BASE_ID = "someone/tiny-fbt"  # the Hub id an adapter's base is published under


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Everything the commands write, made as a user would under a home directory of its own: a LLaMA checkpoint and
    data files in HOME, converted, trained in every mode, an adapter merged, a model trained from a config file.
    Returns (HOME, {name: folder})."""
    root = tmp_path_factory.mktemp("cards")
    home = root / "home" / "alice"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        source = home / "checkpoints" / "tiny-llama"
        save_source(source, "llama")
        tiny_tokenizer().save_pretrained(source)
        work = home / "work"
        assert main(["convert", str(source), str(work / "converted"), "--metric-hidden", "16"]) == 0
        words = [f"w{3 + (3 * i) % 90}" for i in range(1500)]
        (home / "data").mkdir()
        (home / "data" / "train.txt").write_text(" ".join(words[:1200]) + "\n")
        (home / "data" / "eval.txt").write_text(" ".join(words[1200:]) + "\n")
        common = ["--data", str(home / "data" / "train.txt"), "--eval-data", str(home / "data" / "eval.txt"),
                  "--block-size", "32", "--batch-size", "4", "--max-steps", "3", "--learning-rate", "1e-2", "--quiet"]
        runs = {"metric": ["--mode", "metric-only"], "full": ["--mode", "full"], "lora": ["--mode", "lora"],
                **({"qlora": ["--mode", "lora", "--load-in-4bit"]} if HAS_BNB else {})}
        for name, extra in runs.items():
            assert main(["train", str(work / "converted"), str(work / name), *extra, "--lora-r", "4", *common]) == 0
        assert main(["merge", str(work / "lora"), str(work / "merged")]) == 0
        (home / "config.json").write_text(json.dumps(dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            metric_hidden=16, metric_gate_init=1.0, flatness_gate_init=1.0)))
        assert main(["train", "--from-config", str(home / "config.json"), str(work / "scratch"), *common]) == 0
    return home, {name: work / name for name in ["converted", *runs, "merged", "scratch"]}


def published(folder: Path, name: str, **kwargs) -> dict:
    """publish --dry-run of ``folder`` as someone/NAME (an adapter with its base's Hub id)."""
    if KINDS[name] == "adapter":
        kwargs.setdefault("base_model_id", BASE_ID)
    return publish(folder, f"someone/{name}-fbt", dry_run=True, check_load=False, **kwargs)


def test_no_local_path_reaches_any_file_publish_would_upload(made):
    """Sources, data files, the config file and the adapter's base were all under HOME: no byte of any file publish
    lists (the card, every JSON, the tokenizer, the weights) holds HOME, and the card names the source by file name."""
    home, folders = made
    assert set(folders) == set(KINDS) - (set() if HAS_BNB else {"qlora"})
    for name, folder in folders.items():
        files = published(folder, name)["files"]
        assert "README.md" in files and not any(f.startswith("checkpoints/") for f in files), name
        for file in files:
            data = (folder / file).read_bytes()
            assert str(home).encode() not in data and str(home.parent).encode() not in data, (name, file)
    card = ModelCard.load(folders["converted"] / "README.md")
    assert "`tiny-llama`" in card.text
    record = json.loads((folders["metric"] / "training_metrics.json").read_text())
    assert (record["data"], record["eval_data"], record["base"]) == ("train.txt", "eval.txt", "converted")
    assert json.loads((folders["scratch"] / "training_metrics.json").read_text())["from_config"] == "config.json"


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_of_card_has_its_sections_and_metadata_the_hub_parses(made, name):
    """Each card: the title from the repo id publish was given, the sections of a Hub card for its kind, metadata that
    huggingface_hub loads strictly, and (where a held-out loss was measured) a model-index with it."""
    if name == "qlora" and not HAS_BNB:
        pytest.skip("bitsandbytes is not installed")
    folder = made[1][name]
    assert card_kind(folder) == KINDS[name]
    published(folder, name)
    card = ModelCard.load(folder / "README.md", ignore_metadata_errors=False)
    text = card.text
    assert text.lstrip().startswith(f"# {name}-fbt\n")
    for section in SECTIONS + (TRAINING_SECTIONS if KINDS[name] != "converted" else ["## Conversion"]):
        assert section in text, (name, section)
    assert f"someone/{name}-fbt" in text and "OWNER/NAME" not in text and MARKER in text
    assert card.data.pipeline_tag == "text-generation" and "fiber-bundle" in card.data.tags
    assert card.data.library_name == ("peft" if KINDS[name] == "adapter" else "transformers")
    if KINDS[name] == "converted":
        assert card.data.eval_results is None and "parity with the source" in text
        return
    metrics = json.loads((folder / "training_metrics.json").read_text())
    model_name, results = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert model_name == f"{name}-fbt"
    assert [(r.metric_type, r.metric_value) for r in results] == [("loss", round(metrics["eval_loss_after"], 4))]
    assert "## Learned geometry" in text and "| 0 | " in text and "| 1 | " in text  # a row per layer
    if KINDS[name] == "adapter":
        assert card.data.base_model == BASE_ID and card.data.base_model_relation == "adapter"
        assert "PeftModel.from_pretrained" in text
        assert ("4-bit NF4" in text) == (name == "qlora")


def test_numbers_are_rounded_for_people_and_kept_raw_in_training_metrics(made):
    folder = made[1]["metric"]
    metrics = json.loads((folder / "training_metrics.json").read_text())
    text = (folder / "README.md").read_text()
    loss = metrics["eval_loss_after"]
    assert f"| {loss:.4g} |" in text and repr(loss) not in text
    assert len(repr(loss)) > 8  # the record keeps every digit
    assert "eval_loss_before" not in text and "eval_loss_after" not in text  # labels for people, not keys
    layer = metrics["geometry"]["layers"][0]
    assert f"| 0 | {significant(layer['alpha'])} | {significant(layer['gamma'])} | {significant(layer['beta'])} |" \
        in text
    assert (significant(2.9264414310455322), significant(1234567), significant(3.2e-07)) == ("2.926", "1,234,567",
                                                                                             "3.2e-07")


def test_every_link_in_every_card_resolves(made):
    """No dead links: a link is a file in the folder (the geometry plot) or a Hub page of an id the card names; with no
    project page declared there is no link to one (the old card linked a package index page that did not exist)."""
    for name, folder in made[1].items():
        text = (folder / "README.md").read_text()
        for target in re.findall(r"\]\(([^)]+)\)", text):
            if target.startswith("https://huggingface.co/"):
                assert target.removeprefix("https://huggingface.co/").count("/") == 1, (name, target)
            else:
                assert (folder / target).is_file(), (name, target)
        assert "pypi.org" not in text
    card = render_card(made[1]["metric"], repo_id="someone/x", url="https://example.org/fbt")
    assert "[Fiber Bundle Transformers](https://example.org/fbt)" in card.text


def test_the_geometry_plot_is_in_the_folder(made):
    pytest.importorskip("matplotlib")
    folder = made[1]["metric"]
    assert (folder / "geometry.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![The learned geometry per layer](geometry.png)" in (folder / "README.md").read_text()


def test_evaluation_results_reach_the_model_index_without_the_runs_paths(made, tmp_path):
    """publish --evaluation: fiber-bundle evaluate's JSON (whose model arguments and commands hold local paths) becomes
    evaluation_results.json and model-index entries the Hub renders."""
    home, folders = made
    folder = tmp_path / "merged"
    import shutil

    shutil.copytree(folders["merged"], folder)
    comparison = {  # the shape compare_on_harness returns (analysis/evaluation.py)
        "runs": {name: {"model_args": {"pretrained": str(home / name)}, "seconds": 1.0,
                        "command": f"lm_eval --model hf --model_args pretrained={home / name}",
                        "metrics": {}, "loglikelihoods": {"pydoc_perplexity": {0: [-1.0], 1: [-2.0]}}}
                 for name in ("converted", "source")},
        "rows": [{"task": "pydoc_perplexity", "metric": "bits_per_byte", "source": 1.2345678, "converted": 1.1234567,
                  "difference": -0.11}],
        "examples": {},
    }
    (tmp_path / "eval.json").write_text(json.dumps(comparison))
    assert main(["publish", str(folder), "--repo-id", "someone/merged-fbt", "--dry-run", "--evaluation",
                 str(tmp_path / "eval.json")]) == 0
    kept = (folder / "evaluation_results.json").read_text()
    assert str(home) not in kept and json.loads(kept)["rows"][0]["documents"] == 2
    card = ModelCard.load(folder / "README.md", ignore_metadata_errors=False)
    results = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert results[("pydoc_perplexity", "bits_per_byte")] == 1.1235 and ("eval.txt", "loss") in results
    assert "| pydoc_perplexity | pydoc_perplexity (2 documents) | bits_per_byte | 1.123 | 1.235 |" in card.text
    assert main(["publish", str(folder), "--repo-id", "someone/x", "--dry-run", "--evaluation",
                 str(tmp_path / "missing.json")]) == 1


def test_publish_refuses_a_local_path_and_an_adapter_whose_base_is_a_local_folder(made, tmp_path):
    import shutil

    home, folders = made
    adapter = tmp_path / "lora"
    shutil.copytree(folders["lora"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())  # as training wrote it (an earlier test here
    config["base_model_name_or_path"] = str(folders["converted"])       # may have published the fixture's copy)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(PublishError, match="base-model-id"):  # training recorded the local base folder
        publish(adapter, "someone/lora-fbt", dry_run=True)
    publish(adapter, "someone/lora-fbt", dry_run=True, base_model_id=BASE_ID)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == BASE_ID
    folder = tmp_path / "metric"
    shutil.copytree(folders["metric"], folder)
    report = json.loads((folder / "conversion_report.json").read_text())
    (folder / "conversion_report.json").write_text(json.dumps({**report, "where": str(folder / "x.gguf")}))
    with pytest.raises(PublishError, match="conversion_report.json contains"):
        publish(folder, "someone/metric-fbt", dry_run=True, check_load=False)
    assert local_paths_in(folder, ["conversion_report.json", "model.safetensors"]) == [
        f"conversion_report.json contains {folder.resolve()}"]


def test_publish_keeps_a_card_the_user_wrote(made, tmp_path):
    """A card without the generated marker is the user's: publish fills the repo id and the metadata, not the text."""
    import shutil

    folder = tmp_path / "metric"
    shutil.copytree(made[1]["metric"], folder)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n\n# My model\n\nLoad OWNER/NAME with care.\n")
    publish(folder, "someone/mine", dry_run=True, check_load=False)
    card = ModelCard.load(folder / "README.md")
    assert card.text.strip() == "# My model\n\nLoad someone/mine with care."
    assert card.data.license == "mit" and "fiber-bundle" in card.data.tags


def test_public_names_keep_hub_ids_and_drop_directories(tmp_path):
    (tmp_path / "model").mkdir()
    assert public_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert public_name(tmp_path / "model") == "model"
    assert public_name(str(tmp_path / "a" / "b.gguf")) == "b.gguf"
    assert public_name(["/x/y/train.txt", "/x/y/more.txt"]) == "train.txt, more.txt"
    assert public_name("C:\\Users\\alice\\data.txt") == "data.txt"
    assert (public_name("small"), public_name("pydoc"), public_name(None)) == ("small", "pydoc", None)
    assert torch.tensor(1.0).item() == 1.0
