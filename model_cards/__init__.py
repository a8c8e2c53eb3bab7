"""Model card templates (installed as ``fiber_bundle.model_cards``), rendered with huggingface_hub's ModelCard."""

from importlib.resources import files


def template_path(name: str = "fiber_bundle.md") -> str:
    return str(files(__name__) / name)
