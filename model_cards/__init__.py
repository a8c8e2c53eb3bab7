"""Model cards (installed as ``fiber_bundle.model_cards``): one template, rendered with huggingface_hub's ModelCard
from what a folder's JSON files record (``card``), and the facts those files record in a form a public card may show
(``facts``: sources by Hub id or file name, never a local path)."""

from .card import (EVALUATION_RESULTS, MARKER, PIPELINE_TAGS, card_kind, card_license, evaluation_summary,
                   finish_card, project_url, render_card, significant, template_path, transformers_range)
from .facts import framework_versions, hardware, looks_like_hub_id, public_name

__all__ = ["EVALUATION_RESULTS", "MARKER", "PIPELINE_TAGS", "card_kind", "card_license", "evaluation_summary",
           "finish_card", "framework_versions", "hardware", "looks_like_hub_id", "project_url", "public_name",
           "render_card", "significant", "template_path", "transformers_range"]
