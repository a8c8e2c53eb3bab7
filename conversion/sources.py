"""Where models come from, in one place: a source (a checkpoint folder, a Hub model id, a .gguf file, or a folder or Hub
repo plus the name of a GGUF file in it) is resolved once (``locate``), then loaded as a transformers model
(``load_model``: a Fiber Bundle folder as its Fiber Bundle class, anything else with transformers' own class, a GGUF
dequantised into a plain model), as its tokenizer (``load_tokenizer``), or, for conversion, as the tensors it streams
shard by shard (``open_source``). Conversion, its verification and the analyses all load through here.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from modeling_fiber_bundle import FiberBundlePreTrainedModel
from modeling_fiber_bundle import modeling_fiber_bundle as modeling

from .weight_maps import SUPPORTED_ARCHITECTURES, WEIGHT_MAPS

# What a Hub id's download fetches (a checkpoint and its tokenizer, never code).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


class ConversionError(RuntimeError):
    """A conversion that cannot proceed; the message names the problem and the fix."""


class SourceNotFoundError(ConversionError, FileNotFoundError):
    """No checkpoint where SOURCE points (also a FileNotFoundError, as callers outside conversion expect)."""


@dataclass(frozen=True)
class Location:
    """A resolved source: the local folder holding it (a Hub id's is its snapshot in the huggingface_hub cache), the
    GGUF file in that folder when the checkpoint is one, and the Hub id it was fetched by, if any."""

    folder: Path
    gguf_file: str | None = None
    hub_id: str | None = None


def locate(source: str | Path | Location, *, gguf_file: str | None = None, allow_pickle: bool = False) -> Location:
    """Resolve SOURCE: a local folder, a .gguf file (or folder + ``gguf_file``), or a Hub model id OWNER/NAME
    (downloaded through huggingface_hub's cache, which also serves it offline once cached; with ``allow_pickle`` its
    pickled .bin weights too). Raises ``SourceNotFoundError`` naming what SOURCE should be."""
    if isinstance(source, Location):
        return source
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SourceNotFoundError(f"GGUF file {path} does not exist.")
        return Location(path.parent, path.name)
    if path.is_dir():
        if gguf_file is None and not (path / "config.json").is_file():
            raise SourceNotFoundError(f"{path} has no config.json: SOURCE must be a transformers checkpoint folder, a "
                                      "Hub model id or a .gguf file.")
        return Location(path, gguf_file)
    if path.exists():
        raise SourceNotFoundError(f"{path} is a file but not a .gguf file; pass a checkpoint folder instead.")
    if str(source).startswith((".", "/")) or str(source).count("/") != 1:
        raise SourceNotFoundError(f"{source} is neither an existing folder nor a Hub model id of the form OWNER/NAME.")
    from huggingface_hub import snapshot_download

    patterns = [gguf_file] if gguf_file else HUB_PATTERNS + (["*.bin"] if allow_pickle else [])
    try:
        folder = Path(snapshot_download(str(source), allow_patterns=patterns))
    except Exception as error:  # network, permission, missing repo, offline without a cached copy
        raise SourceNotFoundError(f"could not fetch {source} from the Hub ({type(error).__name__}: {error}). Check the "
                                  "id and your network or HF_TOKEN, or pass a local folder.") from error
    return Location(folder, gguf_file, hub_id=str(source))


def is_fiber_bundle_folder(folder: str | Path) -> bool:
    config = Path(folder) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "fiber_bundle"


def fiber_class(head: str) -> type[FiberBundlePreTrainedModel]:
    """The Fiber Bundle class that takes a source's head (``weight_maps.HEADS``): "FiberBundle" + the head's suffix."""
    return getattr(modeling, f"FiberBundle{head}")


# ----------------------------------------------------------------------------------------------------------------------
# Whole models and tokenizers
# ----------------------------------------------------------------------------------------------------------------------
def load_model(source: str | Path | Location, *, gguf_file: str | None = None, head: str = "ForCausalLM",
               dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """The model at SOURCE (see ``locate``) with the ``head`` ("ForCausalLM", "ForSequenceClassification", ...), in
    eval mode: a Fiber Bundle folder loads as its Fiber Bundle class, any other checkpoint with transformers' own
    ``AutoModel{head}``, so a source is measured exactly as its users run it. A GGUF is dequantised into a plain model
    (transformers flags a GGUF-loaded model as quantized, and then refuses to save or fully train it)."""
    where = locate(source, gguf_file=gguf_file)
    kwargs = dict(dtype=dtype)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if where.gguf_file is not None:
        auto_class = getattr(transformers, f"AutoModel{head}")
        return _plain_copy(auto_class.from_pretrained(where.folder, gguf_file=where.gguf_file, **kwargs)).eval()
    if is_fiber_bundle_folder(where.folder):
        return fiber_class(head).from_pretrained(where.folder, **kwargs).eval()
    return getattr(transformers, f"AutoModel{head}").from_pretrained(where.folder, **kwargs).eval()


def _plain_copy(model):
    """The GGUF-loaded ``model``'s (already dequantised) weights in a plain instance of the same class."""
    fields = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    plain = type(model)(type(model.config)(**fields)).to(model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.set_attn_implementation(model.config._attn_implementation)
    return plain


def load_tokenizer(source: str | Path | Location, *, gguf_file: str | None = None):
    """The tokenizer at SOURCE (see ``locate``): a GGUF's own, or the folder's (a Fiber Bundle folder's with
    ``trust_remote_code``, as a Hub user loads it)."""
    where = locate(source, gguf_file=gguf_file)
    if where.gguf_file is not None:
        return AutoTokenizer.from_pretrained(where.folder, gguf_file=where.gguf_file)
    if is_fiber_bundle_folder(where.folder):
        return AutoTokenizer.from_pretrained(where.folder, trust_remote_code=True)
    return AutoTokenizer.from_pretrained(where.folder)


def calibration_text() -> str:
    """Real English text that every Python ships: the standard library's pydoc topics."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


# ----------------------------------------------------------------------------------------------------------------------
# A conversion's source: its config and its tensors, read one shard at a time
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class Source:
    """A checkpoint to convert: its transformers config, its family and head (``weight_maps.SUPPORTED_ARCHITECTURES``),
    where it lives, and its tensors as a list of shard readers."""

    config: object
    family: str
    head: str
    location: Location
    shards: list  # callables, each returning an iterator of (name, tensor) for one shard
    shard_bytes: list[int]


def _architecture(config) -> tuple[str, str]:
    """(family, head) of the source class the config declares; a config that declares none is a causal LM."""
    architectures = list(getattr(config, "architectures", None) or [])
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    if not architectures and config.model_type in WEIGHT_MAPS:
        return config.model_type, "ForCausalLM"
    found = ", ".join(architectures) or f"model_type {config.model_type!r}"
    raise ConversionError(f"unsupported architecture: {found}. Supported: {supported}.")


def _safetensors_reader(path: Path):
    def read():
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    return read


def _pickle_reader(path: Path):
    def read():
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()

    return read


def _folder_source(where: Location, allow_pickle: bool) -> Source:
    folder = where.folder
    config = AutoConfig.from_pretrained(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / name for name in files]
        readers = [_safetensors_reader(p) for p in paths]
    elif (folder / "model.safetensors").is_file():
        paths = [folder / "model.safetensors"]
        readers = [_safetensors_reader(paths[0])]
    else:
        paths = sorted(folder.glob("pytorch_model*.bin"))
        if not paths:
            raise ConversionError(f"{folder} holds no weights (model.safetensors, its index, or pytorch_model*.bin).")
        if not allow_pickle:
            raise ConversionError(f"{folder} holds only pickled .bin weights; pass --allow-pickle to load them "
                                  "(with torch.load(weights_only=True)) or convert the source to safetensors first.")
        readers = [_pickle_reader(p) for p in paths]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConversionError(f"the checkpoint index lists shards that are not there: {', '.join(missing)}.")
    return Source(config, *_architecture(config), where, readers, [p.stat().st_size for p in paths])


def _gguf_source(where: Location) -> Source:
    """A GGUF's tensors, dequantised by transformers (the whole file at once: one shard)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(where.folder, gguf_file=where.gguf_file,
                                                              dtype=torch.float32)
    state = model.state_dict()
    config = model.config
    del model
    size = sum(t.numel() * t.element_size() for t in state.values())
    return Source(config, *_architecture(config), where, [lambda: iter(state.items())], [size])


def open_source(source: str | Path | Location, *, gguf_file: str | None = None, allow_pickle: bool = False) -> Source:
    """SOURCE (see ``locate``) as conversion reads it: its config, family and head, and one reader per shard."""
    where = locate(source, gguf_file=gguf_file, allow_pickle=allow_pickle)
    return _gguf_source(where) if where.gguf_file is not None else _folder_source(where, allow_pickle)
