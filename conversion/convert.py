"""Graft per-token metrics onto a pretrained LLaMA / Mistral / Qwen2 / Qwen3 checkpoint (DESIGN.md section 2): a causal
LM, or a sequence classifier (reward model), whose head is kept.

Every backbone tensor is copied unchanged (names mapped by ``weight_maps``), the new ``fiber`` parameters are added
at their graft values (gates 0, random bounded factor generators), and the result is a Hub folder (DESIGN.md
section 3). The source is read one shard at a time and the output written one shard at a time, so peak memory stays
near the largest shard; everything is written into a temporary folder beside OUTPUT and renamed into place only when
complete.
"""

import gc
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig
from tqdm.auto import tqdm
from transformers.dynamic_module_utils import get_relative_import_files

from modeling_fiber_bundle import FiberBundleConfig, FiberBundlePreTrainedModel
from modeling_fiber_bundle import modeling_fiber_bundle as modeling

from .weight_maps import LAYER_PATTERN, SUPPORTED_ARCHITECTURES, WEIGHT_MAPS, weight_map

# Configuration fields copied from the source config as they are (same names in every supported family).
SOURCE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "rope_parameters", "attention_bias", "mlp_bias", "attention_dropout", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id", "sliding_window", "layer_types",
    "id2label", "label2id", "problem_type",  # a classifier's labels (num_labels is len(id2label))
)
# What each family's attention has that the field names above do not say.
FAMILY_FIELDS = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True, "attention_out_bias": False},  # q/k/v bias, no o bias
    "qwen3": {"qk_norm": True},
}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
# The model card's pipeline tag, by the Auto class that loads the converted model.
PIPELINE_TAGS = {"AutoModelForCausalLM": "text-generation", "AutoModelForSequenceClassification": "text-classification"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConversionError(RuntimeError):
    """A conversion that cannot proceed; the message names the problem and the fix."""


@dataclass
class Source:
    """A checkpoint to convert: its transformers config, its family and head (``weight_maps.SUPPORTED_ARCHITECTURES``),
    and its tensors as a list of shard readers."""

    config: object
    family: str
    head: str
    folder: Path | None  # where tokenizer files live (None for an in-memory source)
    shards: list  # callables, each returning an iterator of (name, tensor) for one shard
    shard_bytes: list[int]
    gguf: tuple[Path, str] | None = None


# ----------------------------------------------------------------------------------------------------------------------
# Reading sources
# ----------------------------------------------------------------------------------------------------------------------
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


def _folder_source(folder: Path, allow_pickle: bool) -> Source:
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder} has no config.json: SOURCE must be a transformers checkpoint folder, a Hub "
                              "model id or a .gguf file.")
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
    return Source(config, *_architecture(config), folder, readers, [p.stat().st_size for p in paths])


def _gguf_source(folder: Path, filename: str) -> Source:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    state = model.state_dict()
    config = model.config
    del model
    size = sum(t.numel() * t.element_size() for t in state.values())
    return Source(config, *_architecture(config), folder, [lambda: iter(state.items())], [size],
                  gguf=(folder, filename))


def open_source(source: str | Path, *, gguf_file: str | None = None, allow_pickle: bool = False) -> Source:
    """Resolve SOURCE: a local folder, a .gguf file (or folder + ``gguf_file``), or a Hub model id (downloaded
    through huggingface_hub's cache, which also serves it offline once cached)."""
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConversionError(f"GGUF file {path} does not exist.")
        return _gguf_source(path.parent, path.name)
    if path.is_dir():
        return _gguf_source(path, gguf_file) if gguf_file else _folder_source(path, allow_pickle)
    if path.exists():
        raise ConversionError(f"{path} is a file but not a .gguf file; pass a checkpoint folder instead.")
    if str(source).startswith((".", "/")) or str(source).count("/") != 1:
        raise ConversionError(f"{source} is neither an existing folder nor a Hub model id of the form OWNER/NAME.")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"] + (["*.bin"] if allow_pickle else [])
    try:
        folder = Path(snapshot_download(str(source), allow_patterns=[gguf_file] if gguf_file else patterns))
    except Exception as error:  # network, permission, missing repo, offline without a cached copy
        raise ConversionError(f"could not fetch {source} from the Hub ({type(error).__name__}: {error}). Check the "
                              "id and your network or HF_TOKEN, or pass a local folder.") from error
    return _gguf_source(folder, gguf_file) if gguf_file else _folder_source(folder, allow_pickle)


# ----------------------------------------------------------------------------------------------------------------------
# Config, new parameters, writing
# ----------------------------------------------------------------------------------------------------------------------
def fiber_class(head: str) -> type[FiberBundlePreTrainedModel]:
    """The Fiber Bundle class that takes a source's head (``weight_maps.HEADS``): "FiberBundle" + the head's suffix."""
    return getattr(modeling, f"FiberBundle{head}")


def configured_class(config: FiberBundleConfig) -> type[FiberBundlePreTrainedModel]:
    """The Fiber Bundle class a converted config names in ``architectures``."""
    return getattr(modeling, config.architectures[0])


def fiber_config_from_source(source_config, family: str, head: str = "ForCausalLM", **geometry) -> FiberBundleConfig:
    """A fresh FiberBundleConfig holding the source's backbone (and label) values and the requested geometry."""
    fields = {name: getattr(source_config, name) for name in SOURCE_FIELDS if getattr(source_config, name, None)
              is not None}
    fields.update(FAMILY_FIELDS[family])
    if family == "mistral" and fields.get("sliding_window") is not None:
        fields["layer_types"] = ["sliding_attention"] * fields["num_hidden_layers"]
    if fields.get("layer_types") and "sliding_attention" not in fields["layer_types"]:
        fields.pop("sliding_window", None)
    dtype = getattr(source_config, "dtype", None)
    return FiberBundleConfig(**fields, **geometry, dtype=dtype, architectures=[fiber_class(head).__name__])


def meta_model(config: FiberBundleConfig) -> FiberBundlePreTrainedModel:
    """The converted model's structure (the class its config names), without memory: names and shapes of every
    tensor."""
    with torch.device("meta"):
        return configured_class(config)(config)


def init_geometry(model: FiberBundlePreTrainedModel, seed: int) -> None:
    """(Re)initialise every layer's ``fiber`` module in place at its graft values (gates 0, generators random), with
    the model's own _init_weights: the model then computes its backbone's function again."""
    torch.manual_seed(seed)
    for layer in model.model.layers:
        fiber = getattr(layer, "fiber", None)
        if fiber is not None:
            if fiber.code_proj.weight.is_meta:
                fiber.to_empty(device="cpu")
            for param in fiber.parameters():  # why: transformers' init functions skip tensors flagged as loaded
                param._is_hf_initialized = False
            model._init_weights(fiber)


def new_parameters(model: FiberBundlePreTrainedModel, seed: int) -> dict[str, torch.Tensor]:
    """The ``fiber`` parameters of every layer at their graft values, initialised by the model's own _init_weights."""
    init_geometry(model, seed)
    tensors = {}
    for i, layer in enumerate(model.model.layers):
        fiber = getattr(layer, "fiber", None)
        if fiber is not None:
            for name, value in fiber.state_dict().items():
                tensors[f"model.layers.{i}.fiber.{name}"] = value.detach().clone()
    return tensors


def expected_shapes(model: FiberBundlePreTrainedModel) -> dict[str, torch.Size]:
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    return shapes


def parse_size(size: str | int) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", str(size).upper())
    if not match:
        raise ConversionError(f"--max-shard-size {size!r} is not a size; write e.g. 500MB or 2GB.")
    unit = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, None: 1}[match.group(2)]
    return int(float(match.group(1)) * unit)


class ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_bytes`` (a larger single tensor gets its own shard)."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.pending, self.pending_bytes, self.files, self.weight_map, self.total = {}, 0, [], {}, 0

    def add(self, name: str, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def flush(self):
        if not self.pending:
            return
        path = self.folder / f"shard-{len(self.files):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self):
        self.flush()
        count = len(self.files)
        for number, (path, names) in enumerate(self.files, start=1):
            final = "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"
            path.rename(self.folder / final)
            os.chmod(self.folder / final, 0o644)  # safetensors writes owner-only files; a Hub folder is for sharing
            self.weight_map.update({name: final for name in names})
        if count > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _map_name(name: str, table: dict) -> tuple[bool, str | None]:
    template = re.sub(LAYER_PATTERN, ".{}.", name, count=1)
    if template not in table:
        return False, None
    target = table[template]
    if target is None:
        return True, None
    index = re.search(LAYER_PATTERN, name)
    return True, target.format(index.group(1)) if index else target


def _write_modeling_files(folder: Path):
    modeling_file = Path(modeling.__file__)
    for path in [modeling_file, *get_relative_import_files(str(modeling_file))]:
        shutil.copyfile(path, folder / Path(path).name)


# ----------------------------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class ConversionResult:
    output: Path
    config: FiberBundleConfig
    source_family: str
    seconds: float
    report: dict | None = None


def convert_checkpoint(
    source: str | Path,
    output: str | Path,
    *,
    metric_rank: int | str = 2,
    metric_hidden: int = 64,
    ffn_metric_rank: int | None = None,
    gguf_file: str | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "2GB",
    overwrite: bool = False,
    allow_pickle: bool = False,
    seed: int = 0,
    verify: bool = True,
    show_progress: bool = True,
    base_model: str | None = None,
    license: str | None = None,
) -> ConversionResult:
    """Convert SOURCE into a Fiber Bundle Hub folder at OUTPUT.

    Arguments:
        source: a local checkpoint folder (single or sharded safetensors), a Hub model id, or a .gguf file.
        output: the folder to write; refused if it exists and is not empty, unless ``overwrite``.
        metric_rank, metric_hidden, ffn_metric_rank: the geometry (``ffn_metric_rank`` defaults to ``metric_rank``).
            ``metric_rank="auto"`` picks r from the intrinsic rank of the source's attention logits on calibration
            text (``analysis.probes.suggest_metric_rank``) and records the figures in conversion_report.json.
        gguf_file: the GGUF file name inside the ``source`` folder (or Hub repo).
        dtype: "float32", "bfloat16" or "float16"; default: keep the source's dtype.
        max_shard_size: largest output shard, e.g. "500MB".
        allow_pickle: accept pickled .bin weights (loaded with ``weights_only=True``).
        seed: seed of the new parameters' initialisation.
        verify: compare the result with the source (``conversion.verify``) and fail on a parity error; skipped
            (with a message) when source and result would not fit in memory together.
        show_progress: a progress bar over source shards (with the tensor being converted).
        base_model, license: the model card's ``base_model`` and ``license``; by default the source's Hub id and the
            license its model card declares.
    """
    started = time.perf_counter()
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise ConversionError(f"OUTPUT {output} exists and is not empty; pass --overwrite to replace it, or choose "
                              "another folder.")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}.")
    max_bytes = parse_size(max_shard_size)
    src = open_source(source, gguf_file=gguf_file, allow_pickle=allow_pickle)
    rank_choice = None
    if metric_rank == "auto":
        metric_rank, rank_choice = _auto_metric_rank(src)
    elif not isinstance(metric_rank, int):
        raise ConversionError(f"--metric-rank must be an integer >= 0 or 'auto', got {metric_rank!r}.")
    geometry = dict(metric_rank=metric_rank, metric_hidden=metric_hidden,
                    ffn_metric_rank=metric_rank if ffn_metric_rank is None else ffn_metric_rank)
    try:
        config = fiber_config_from_source(src.config, src.family, src.head, **geometry)
    except ValueError as error:
        raise ConversionError(f"this checkpoint cannot be a Fiber Bundle model: {error}") from error
    target_dtype = DTYPES[dtype] if dtype else None
    if target_dtype is not None:
        config.dtype = target_dtype

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.converting-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _write_folder(src, config, staging, max_bytes, target_dtype, seed, show_progress)
        report = None
        fp32_bytes = 4 * sum(src.shard_bytes) // _bytes_per_value(src)  # the backbone in float32
        if verify and 3 * fp32_bytes > _available_memory():  # source (eager + sdpa, in turn) and result together
            print(f"skipping verification: source and result need about {3 * fp32_bytes / 2**30:.1f} GiB in float32, "
                  "more than this machine has available", file=sys.stderr)
            verify = False
        if verify:
            from .verify import verify_conversion

            report = verify_conversion(src, staging, seconds=time.perf_counter() - started)
        if rank_choice is not None:  # why r was chosen travels with the model
            report = {**(report or {}), "metric_rank_choice": rank_choice}
        if report is not None:
            (staging / "conversion_report.json").write_text(json.dumps(report, indent=2) + "\n")
            if "parity" in report and not report["parity"]["passed"]:
                raise ConversionError(f"parity check failed: {report['parity']['summary']}")
        write_model_card(staging, config=config, source=str(source), family=src.family, report=report,
                         base_model=base_model or _hub_id(source, src), license=license or _source_license(src),
                         model_name=output.name)
        replace_folder(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written is left behind, whatever happened
        raise
    return ConversionResult(output, config, src.family, time.perf_counter() - started, report)


def _auto_metric_rank(src: Source) -> tuple[int, dict]:
    """Load the source once and pick r from its attention logits (``verify.auto_metric_rank``)."""
    from .verify import auto_metric_rank

    fp32_bytes = 4 * sum(src.shard_bytes) // _bytes_per_value(src)
    if fp32_bytes > _available_memory():
        raise ConversionError(f"--metric-rank auto runs the source (about {fp32_bytes / 2**30:.1f} GiB in float32), "
                              "more than this machine has available; pass an integer --metric-rank instead.")
    rank, choice = auto_metric_rank(src)
    print(f"--metric-rank auto: r = {rank} ({choice['rule']}: median {choice['median_text_energy_rank']:.1f})",
          file=sys.stderr)
    return rank, choice


def _write_folder(src: Source, config: FiberBundleConfig, folder: Path, max_bytes: int, dtype, seed: int,
                  show_progress: bool = True):
    structure = meta_model(config)
    table, shapes = weight_map(src.family, src.head), expected_shapes(structure)
    writer, written = ShardWriter(folder, max_bytes), set()

    def emit(name, tensor):
        if name not in shapes:
            raise ConversionError(f"tensor {name} has no place in a Fiber Bundle model of this config "
                                  "(a config / weights mismatch in the source).")
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ConversionError(f"shape mismatch for {name}: the source has {tuple(tensor.shape)}, the config "
                                  f"implies {tuple(shapes[name])}.")
        if name in written:
            raise ConversionError(f"tensor {name} appears twice in the source.")
        writer.add(name, tensor.to(dtype) if dtype is not None else tensor)
        written.add(name)

    progress = tqdm(total=len(src.shards), unit="shard", desc="converting", disable=not show_progress)
    for read in src.shards:
        try:
            for name, tensor in read():
                progress.set_postfix_str(name, refresh=False)
                known, target = _map_name(name, table)
                if not known:
                    raise ConversionError(f"unmapped tensor {name!r} in a {src.family} checkpoint: the weight map "
                                          "does not know it, so the conversion stops rather than drop it.")
                if target == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied to the embedding: stored once
                if target is not None:
                    emit(target, tensor)
        except ConversionError:
            raise
        except Exception as error:  # truncated or corrupt shard
            raise ConversionError(f"could not read a source shard ({type(error).__name__}: {error}); the file is "
                                  "corrupt or truncated, download it again.") from error
        gc.collect()
        progress.update(1)
    progress.close()
    new_dtype = dtype or _source_dtype(config)
    for name, tensor in new_parameters(structure, seed).items():
        emit(name, tensor.to(new_dtype))
    missing = sorted(set(shapes) - written)
    if missing:
        raise ConversionError(f"the source lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}.")
    writer.finish()
    config.auto_map = dict(modeling.AUTO_MAP)
    config.save_pretrained(folder)
    _write_modeling_files(folder)
    _copy_tokenizer(src, folder)


def _bytes_per_value(src: Source) -> int:
    dtype = getattr(src.config, "dtype", None)
    return torch.finfo(dtype).bits // 8 if isinstance(dtype, torch.dtype) and dtype.is_floating_point else 4


def _available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: do not block verification
        return 1 << 62


def _source_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _copy_tokenizer(src: Source, folder: Path):
    if src.gguf is not None:
        from transformers import AutoTokenizer, GenerationConfig

        gguf_folder, filename = src.gguf
        AutoTokenizer.from_pretrained(gguf_folder, gguf_file=filename).save_pretrained(folder)
        GenerationConfig.from_model_config(src.config).save_pretrained(folder)
        return
    for name in TOKENIZER_FILES:
        if src.folder is not None and (src.folder / name).is_file():
            shutil.copyfile(src.folder / name, folder / name)


def _hub_id(source, src: Source) -> str | None:
    """The source's Hub id, when it came from the Hub (or names one in its config)."""
    for candidate in (str(source), str(getattr(src.config, "_name_or_path", "") or "")):
        if candidate.count("/") == 1 and not Path(candidate).exists() and not candidate.startswith((".", "/")):
            return candidate
    return None


def _source_license(src: Source) -> str | None:
    card = src.folder / "README.md" if src.folder is not None else None
    if card is None or not card.is_file():
        return None
    from huggingface_hub import ModelCard

    return ModelCard.load(card).data.license


def write_model_card(folder: Path, *, config, source: str, family: str, report: dict | None,
                     base_model: str | None, license: str | None, model_name: str, repo_id: str | None = None):
    """Render README.md from the template in ``model_cards/`` with huggingface_hub's ModelCard."""
    from huggingface_hub import ModelCard, ModelCardData

    from fiber_bundle.model_cards import template_path

    auto_class = configured_class(config)._auto_class
    data = ModelCardData(
        base_model=base_model, library_name="transformers", pipeline_tag=PIPELINE_TAGS[auto_class], license=license,
        tags=["fiber-bundle", "riemannian-attention", "custom_code", family],
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
        source_architecture=family,
        geometry_parameters=geometry,
        overhead=overhead,
        parity=parity,
        transformers_range=">=5.24,<6",
        torch_version=torch.__version__.split("+")[0],
    )
    card.save(folder / "README.md")


def replace_folder(staging: Path, output: Path):
    """Move the finished folder ``staging`` into place at ``output`` (same file system); an existing ``output`` is
    renamed aside to ``.{name}.replaced-{pid}`` first and removed only after that (training's write of its final model
    uses this too)."""
    backup = None
    if output.exists():
        backup = output.parent / f".{output.name}.replaced-{os.getpid()}"
        output.rename(backup)
    staging.rename(output)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
