"""The code half of a Fiber Bundle Hub folder: the one list of its modeling files, and the one way they are written.

Every writer goes through transformers' ``custom_object_save`` (``FiberBundlePreTrainedModel.save_code``): a model's
``save_pretrained`` calls it, and conversion, which streams the weights itself, calls ``write_config_and_code``.
"""

from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files

from modeling_fiber_bundle import FiberBundlePreTrainedModel
from modeling_fiber_bundle import modeling_fiber_bundle as modeling
from modeling_fiber_bundle.modeling_fiber_bundle import AUTO_MAP

__all__ = ["AUTO_MAP", "modeling_files", "write_config_and_code"]


def modeling_files() -> tuple[str, ...]:
    """The names of the code files every Hub folder holds, sorted: the modeling file and its relative imports, which
    is what ``custom_object_save`` copies."""
    return tuple(sorted(Path(path).name for path in [modeling.__file__,
                                                     *get_relative_import_files(modeling.__file__)]))


def write_config_and_code(model: FiberBundlePreTrainedModel, folder: str | Path) -> None:
    """Write ``model``'s config (with the full auto_map) and the modeling files into ``folder``, exactly as its
    ``save_pretrained`` does, without the weights: ``model`` may live on the meta device."""
    model.save_code(folder)
    model.config.save_pretrained(folder)
