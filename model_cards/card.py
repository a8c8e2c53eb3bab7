"""The model card of a Fiber Bundle Hub folder, in one place: ``fiber-bundle convert`` renders it from the template
``fiber_bundle.md`` (``write_card``), ``fiber-bundle publish`` finishes it (``finish_card``: the repo id and the
training metrics). Both go through huggingface_hub's ModelCard; nothing of the project is imported here.
"""

import json
import warnings
from importlib import metadata
from importlib.resources import files
from pathlib import Path

DISTRIBUTION = "fiber-bundle-transformers"
# The card's pipeline tag, by the Auto class that loads the model.
PIPELINE_TAGS = {"AutoModelForCausalLM": "text-generation", "AutoModelForSequenceClassification": "text-classification"}


def template_path(name: str = "fiber_bundle.md") -> str:
    return str(files(__package__) / name)


def transformers_range() -> str:
    """The transformers versions this project supports, as pyproject.toml declares them (read from the installed
    distribution's metadata, e.g. ">=5.24,<6"). Where the distribution is not installed (a source checkout on
    ``sys.path``), the running transformers version, with a warning that the range is unknown."""
    from packaging.requirements import Requirement

    try:
        requirements = [Requirement(line) for line in metadata.requires(DISTRIBUTION) or []]
    except metadata.PackageNotFoundError:
        version = metadata.version("transformers")
        warnings.warn(f"{DISTRIBUTION} is not installed, so the transformers range it supports is unknown; the model "
                      f"card names the running transformers {version} instead. Install the project (pip install -e .) "
                      "to have the range.", stacklevel=2)
        return f"=={version}"
    for requirement in requirements:
        if requirement.name == "transformers" and requirement.marker is None:
            return ",".join(sorted(map(str, requirement.specifier), key=lambda spec: not spec.startswith(">")))
    raise RuntimeError(f"the installed {DISTRIBUTION} declares no transformers requirement; reinstall it.")


def card_license(folder: str | Path) -> str | None:
    """The license that the model card (README.md) in ``folder`` declares, if any (a conversion carries its
    source's)."""
    from huggingface_hub import ModelCard

    card = Path(folder) / "README.md"
    return ModelCard.load(card).data.license if card.is_file() else None


def write_card(folder: str | Path, *, auto_class: str, config, source: str, source_architecture: str,
               report: dict | None, base_model: str | None, license: str | None, model_name: str,
               repo_id: str | None = None):
    """Render README.md in ``folder`` from the template: ``auto_class`` loads the model; ``config`` (a
    FiberBundleConfig) gives the geometry; ``report`` (conversion_report.json, None without verification) gives the
    parity and the parameter counts; ``repo_id`` stays the placeholder OWNER/NAME until ``finish_card``."""
    import torch
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(
        base_model=base_model, library_name="transformers", pipeline_tag=PIPELINE_TAGS[auto_class], license=license,
        tags=["fiber-bundle", "riemannian-attention", "custom_code", source_architecture],
    )
    parity = "not checked (--no-verify)"
    geometry = overhead = "see config.json"
    if report is not None:
        p = report["parity"]
        parity = (f"max abs logit difference {p['max_abs_logit_diff']:.2e} (bound {p['bound']:.2e}) on "
                  f"{p['calibration_tokens']} tokens")
        if p["greedy_agreement"] is not None:  # a classifier does not generate
            parity += f"; greedy agreement {p['greedy_agreement']:.0%} over {p['greedy_tokens']} tokens"
        geometry = f"{report['parameters']['geometry']:,}"
        overhead = f"{report['parameters']['overhead_percent']:.2f}%"
    card = ModelCard.from_template(
        data,
        template_path=template_path(),
        model_name=model_name,
        base_model=base_model or source,
        base_model_url=f"https://huggingface.co/{base_model}" if base_model else "#conversion",
        repo_id=repo_id or "OWNER/NAME",
        auto_class=auto_class,
        metric_rank=config.metric_rank,
        ffn_metric_rank=config.ffn_metric_rank,
        metric_hidden=config.metric_hidden,
        source=source,
        source_architecture=source_architecture,
        geometry_parameters=geometry,
        overhead=overhead,
        parity=parity,
        transformers_range=transformers_range(),
        torch_version=torch.__version__.split("+")[0],
    )
    card.save(Path(folder) / "README.md")
    return card


def finish_card(folder: str | Path, repo_id: str):
    """Fill the repo id into the model card in ``folder`` (a minimal card if there is none) and add the training
    metrics (``training_metrics.json``) if any."""
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    path = folder / "README.md"
    if path.is_file():
        card = ModelCard.load(path)
    else:
        card = ModelCard(f"---\n{ModelCardData().to_yaml()}\n---\n\n# {repo_id.split('/')[-1]}\n\nA Fiber Bundle "
                         "Transformer model.\n")
    card.data.library_name = "transformers"
    card.data.pipeline_tag = card.data.pipeline_tag or "text-generation"  # a converted classifier keeps its own
    card.data.tags = sorted(set(card.data.tags or []) | {"fiber-bundle", "custom_code"})
    card.text = card.text.replace("OWNER/NAME", repo_id)
    metrics_path = folder / "training_metrics.json"
    if metrics_path.is_file() and "## Training" not in card.text:
        metrics = json.loads(metrics_path.read_text())
        rows = "\n".join(f"| {key} | {value} |" for key, value in metrics.items())
        card.text += f"\n## Training\n\n| | |\n|---|---|\n{rows}\n"
    card.save(path)
    return card
