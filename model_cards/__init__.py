"""Model cards (installed as ``fiber_bundle.model_cards``): the template, rendered and finished with huggingface_hub's
ModelCard by ``card`` (used by ``fiber-bundle convert`` and ``fiber-bundle publish``)."""

from .card import PIPELINE_TAGS, card_license, finish_card, template_path, transformers_range, write_card

__all__ = ["PIPELINE_TAGS", "card_license", "finish_card", "template_path", "transformers_range", "write_card"]
