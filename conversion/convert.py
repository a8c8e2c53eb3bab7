"""Graft per-token metrics onto a pretrained LLaMA / Mistral / Qwen2 / Qwen3 checkpoint (docs/design.md section 2): a causal
LM, or a sequence classifier (reward model), whose head is kept.

Every backbone tensor is copied unchanged (names mapped by ``weight_maps``), the new ``fiber`` parameters are added
at their graft values (gates 0, random bounded factor generators), and the result is a Hub folder (docs/design.md
section 3). The source is read one shard at a time and the output written one shard at a time, so peak memory stays
near the largest shard; everything is written into a temporary folder beside OUTPUT and renamed into place only when
complete (``folders.staged_folder``).
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
from safetensors.torch import save_file
from tqdm.auto import tqdm

from fiber_bundle.model_cards import card_license, framework_versions, public_name, render_card
from modeling_fiber_bundle import FiberBundleConfig, FiberBundlePreTrainedModel
from modeling_fiber_bundle import modeling_fiber_bundle as modeling

from .folders import require_new_or_empty, staged_folder
from .hub import write_config_and_code
from .sources import ConversionError, Source, fiber_class, load_tokenizer, open_source
from .weight_maps import LAYER_PATTERN, weight_map

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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------------------------------
# Config, new parameters, writing (sources are read by ``sources.open_source``)
# ----------------------------------------------------------------------------------------------------------------------
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
            text (``conversion.rank.suggest_metric_rank``) and records the figures in conversion_report.json.
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
    require_new_or_empty(output, overwrite, ConversionError)
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

    with staged_folder(output, "converting") as staging:
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
        # what the card says of the source, by Hub id or file name only: this file is published with the folder
        report = {"source": source_record(src, source, base_model=base_model, license=license), **(report or {}),
                  "versions": framework_versions()}
        report.setdefault("conversion_seconds", time.perf_counter() - started)
        (staging / "conversion_report.json").write_text(json.dumps(report, indent=2) + "\n")
        if "parity" in report and not report["parity"]["passed"]:
            raise ConversionError(f"parity check failed: {report['parity']['summary']}")
        render_card(staging, name=output.name, license=report["source"]["license"])
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
    structure.init_geometry(seed)  # the new parameters at their graft values: the only tensors not on the meta device
    for name, tensor in structure.state_dict().items():
        if ".fiber." in name:
            emit(name, tensor.detach().to(new_dtype))
    missing = sorted(set(shapes) - written)
    if missing:
        raise ConversionError(f"the source lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}.")
    writer.finish()
    write_config_and_code(structure, folder)
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
    if src.location.gguf_file is not None:
        from transformers import GenerationConfig

        load_tokenizer(src.location).save_pretrained(folder)
        GenerationConfig.from_model_config(src.config).save_pretrained(folder)
        return
    for name in TOKENIZER_FILES:
        if (src.location.folder / name).is_file():
            shutil.copyfile(src.location.folder / name, folder / name)


def source_record(src: Source, source: str | Path, *, base_model: str | None = None,
                  license: str | None = None) -> dict:
    """conversion_report.json's "source": the checkpoint by Hub id, or by file / folder name with the Hub repo it came
    from when known (``base_model``, or the id the source names), never by local path; its family and license."""
    hub_id = base_model or _hub_id(src)
    if src.location.gguf_file is not None:
        name = Path(src.location.gguf_file).name
    else:
        name = src.location.hub_id or public_name(source)
    return {"name": name, "hub_id": hub_id,
            "architecture": src.family, "head": src.head,
            "license": license or card_license(src.location.folder)}


def _hub_id(src: Source) -> str | None:
    """The source's Hub id, when it came from the Hub (or names one in its config)."""
    if src.location.hub_id is not None:
        return src.location.hub_id
    named = str(getattr(src.config, "_name_or_path", "") or "")
    if named.count("/") == 1 and not Path(named).exists() and not named.startswith((".", "/")):
        return named
    return None

