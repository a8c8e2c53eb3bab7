"""``fiber-bundle export``: a Fiber Bundle causal LM as a program that runs without Python transformers, checked
against eager ``generate`` before anything is written (docs/deployment.md).

Three formats, one engine:

- ``exported-program``: ``torch.export`` of transformers' own exportable wrapper
  (``TorchExportableModuleForDecoderOnlyLM``) with a static cache of ``max_cache_len`` positions, saved with
  ``torch.export.save`` (model.pt2). One call takes one token and its position and returns its logits; the cache lives
  in the program's buffers.
- ``executorch``: that same program lowered to ExecuTorch with the XNNPACK partitioner (model.pte).
- ``onnx``: torch's dynamo ONNX exporter on a step that takes its key/value cache as plain tensors and returns the
  grown cache (model.onnx): a chunk of 1 to ``prefill_chunk`` new tokens after a past of any length, the layout
  onnxruntime users know (``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.key``/``.value``
  -> ``logits``, ``present.{i}.key``/``.value``).

Every program returns logits only: sampling, stopping and batching are the caller's loop. The verification runs the
written file (not the in-memory program) through its own runtime on a prompt: its prompt logits against the eager
forward's and its greedy tokens, fed one decoding step at a time at their own positions, against ``generate``'s.
"""

import json
import logging
import os
import resource
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .convert import TOKENIZER_FILES
from .folders import require_new_or_empty, staged_folder
from .sources import ConversionError, is_fiber_bundle_folder, load_model
from .verify import calibration_ids


class ExportError(ConversionError):
    """An export that cannot be made as asked (the message names the problem and the fix)."""


@dataclass(frozen=True)
class Format:
    file: str
    dynamic_length: bool  # whether one program takes any context length (else a static cache of max_cache_len)
    packages: tuple[str, ...]  # the import names the export and its check need
    extra: str  # the pip extra that installs them
    summary: str


FORMATS = {
    "exported-program": Format("model.pt2", False, (), "", "torch.export program with a static cache (one token per "
                               "call); load with torch.export.load"),
    "onnx": Format("model.onnx", True, ("onnxscript", "onnxruntime"), "export", "ONNX graph with the cache as "
                   "inputs/outputs (1..prefill_chunk tokens per call, any past length); run with onnxruntime"),
    "executorch": Format("model.pte", False, ("executorch",), "executorch", "ExecuTorch program (XNNPACK) with a "
                         "static cache (one token per call); run with executorch.runtime or the C++ runtime"),
}


@dataclass
class ExportResult:
    output: Path
    format: str
    seconds: float
    report: dict = field(default_factory=dict)


def export_model(
    model,
    output: str | Path,
    *,
    format: str = "exported-program",
    max_cache_len: int = 512,
    prefill_chunk: int | None = None,
    dynamic_length: bool | None = None,
    verify: bool = True,
    prompt_tokens: int = 24,
    new_tokens: int = 16,
    overwrite: bool = False,
) -> ExportResult:
    """Export MODEL (a Fiber Bundle causal-LM folder, or the model itself) to OUTPUT in ``format`` (``FORMATS``).

    Arguments:
        model: a Fiber Bundle folder (the output of ``fiber-bundle convert`` or ``train``), or a
            ``FiberBundleForCausalLM`` in float32 (exported as it is, in eval mode).
        output: the folder to write (model file, config, generation config, tokenizer, export_report.json); refused if
            it exists and is not empty, unless ``overwrite``. Written whole or not at all.
        max_cache_len: positions of the static cache (exported-program, executorch): prompt plus generated tokens
            cannot exceed it. The ONNX graph has no such limit.
        prefill_chunk: most new tokens one ONNX call takes (default: the model's ``attention_block_size``); longer
            prompts are fed in chunks. Decoding feeds one.
        dynamic_length: ask for a program that takes any context length; only ``onnx`` has one (its default), the
            static-cache formats refuse it.
        verify: run the written program on ``prompt_tokens`` of calibration text and generate ``new_tokens`` greedily:
            its tokens must equal eager ``generate``'s and its prompt logits the eager forward's (``parity_bound``);
            on failure nothing is written.
    """
    started = time.perf_counter()
    if format not in FORMATS:
        raise ExportError(f"--format {format!r} is not one of {', '.join(FORMATS)}.")
    spec = FORMATS[format]
    if dynamic_length is None:
        dynamic_length = spec.dynamic_length
    if dynamic_length and not spec.dynamic_length:
        raise ExportError(f"{format} programs hold a static cache of --max-cache-len positions (dynamic length is not "
                          "available in this format): drop --dynamic-length and set --max-cache-len to the longest "
                          "context you need, or export --format onnx.")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ExportError("export runs in one process: a tensor-parallel (or otherwise distributed) model cannot be "
                          "exported. Run fiber-bundle export without torchrun; the program holds the whole model.")
    output = Path(output)
    require_new_or_empty(output, overwrite, ExportError)
    if verify and prompt_tokens + new_tokens > max_cache_len and not spec.dynamic_length:
        raise ExportError(f"the check needs {prompt_tokens + new_tokens} positions but --max-cache-len is "
                          f"{max_cache_len}: raise --max-cache-len.")
    _require(format, spec)
    folder, model = _load(model)
    chunk = model.config.attention_block_size if prefill_chunk is None else prefill_chunk
    if chunk < 1:
        raise ExportError(f"--prefill-chunk must be at least 1, got {chunk}.")

    with staged_folder(output, "exporting") as staging:
        path = staging / spec.file
        exporting = time.perf_counter()
        if format == "onnx":
            io = export_onnx(model, path, prefill_chunk=chunk)
        else:
            program = static_cache_program(model, max_cache_len)
            io = {"inputs": {"input_ids": "(1, 1) int64", "cache_position": "(1,) int64"},
                  "outputs": {"logits": f"(1, 1, {model.config.vocab_size}) float32"}}
            if format == "executorch":
                write_executorch(program, path)
            else:
                torch.export.save(program, path)
        export_seconds = time.perf_counter() - exporting
        report = {"format": format, "file": spec.file, "summary": spec.summary, **io,
                  "max_cache_len": None if spec.dynamic_length else max_cache_len,
                  "prefill_chunk": chunk if format == "onnx" else 1,
                  "export_seconds": export_seconds, "file_bytes": _size(path),
                  "not_in_the_program": ["sampling (the program returns logits: sample in your loop)",
                                         "batching (batch size 1)", "tensor parallelism (one process)"]}
        if verify:
            ids = calibration_ids(folder, model.config.vocab_size, prompt_tokens)
            report["parity"] = check_parity(model, RUNNERS[format](path, model.config, chunk), ids, new_tokens)
        report["peak_memory_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
            1024 if sys.platform != "darwin" else 1024**2)
        report["seconds"] = time.perf_counter() - started
        report["versions"] = _versions(spec)
        (staging / "export_report.json").write_text(json.dumps(report, indent=2) + "\n")
        if verify and not report["parity"]["passed"]:
            raise ExportError(f"parity check failed: {report['parity']['summary']}")
        _copy_assets(folder, model, staging)
    return ExportResult(output, format, time.perf_counter() - started, report)


# ----------------------------------------------------------------------------------------------------------------------
# The programs
# ----------------------------------------------------------------------------------------------------------------------
def static_cache_program(model, max_cache_len: int) -> torch.export.ExportedProgram:
    """transformers' exportable wrapper around ``model`` with a static cache, exported strictly: one token per call
    (``input_ids`` (1, 1), ``cache_position`` (1,)) -> logits (1, 1, V)."""
    import torch._dynamo
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    saved = model.generation_config.cache_implementation
    model.generation_config.cache_implementation = "static"  # the wrapper's requirement
    try:
        # why strict: the non-strict program fails ExecuTorch's run_decompositions in torch 2.13 ("expected
        # compiled_fn to be GraphModule"), LLaMA's too; why no dynamo decompositions: dynamo rewrites
        # addcmul_(..., value=) into inductor's prims.fma, which ExecuTorch has no kernel for
        with torch._dynamo.config.patch(enable_dynamo_decompositions=False):
            return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len).export(
                input_ids=torch.tensor([[0]]), cache_position=torch.tensor([0]), strict=True)
    finally:
        model.generation_config.cache_implementation = saved


def write_executorch(program: torch.export.ExportedProgram, path: Path) -> None:
    """Lower ``program`` to ExecuTorch, XNNPACK taking what it supports, and write the .pte."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    path.write_bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)


class CachedStep(torch.nn.Module):
    """One call of the causal LM with its key/value cache as plain tensors in and out (the ONNX graph's signature).

    input_ids, position_ids (1, n); attention_mask (1, past + n); past: per layer key, value (1, Hk, past, d)
    -> logits (1, n, V), then per layer the grown key, value (1, Hk, past + n, d)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, past):
        from transformers.cache_utils import DynamicCache

        layers = len(past) // 2
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(layers)],
                             config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         use_cache=True)
        grown = [tensor for layer in out.cache.layers for tensor in (layer.keys, layer.values)]
        return (out.logits, *grown)


def onnx_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def export_onnx(model, path: Path, *, prefill_chunk: int) -> dict:
    """Export ``CachedStep(model)`` with torch's dynamo exporter: the chunk length (1..prefill_chunk) and the past
    length are dynamic. Returns the graph's inputs and outputs for the report."""
    config = model.config
    saved = config.attention_block_size
    # why: the blocked attention loops over query blocks; a chunk that fits one block is one graph for every length
    config.attention_block_size = max(saved, prefill_chunk)
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)  # "torchvision is not installed. Skipping torchvision::nms", ...
    try:
        hk, d, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
        n, past = min(2, prefill_chunk), 3  # example shapes only: both dimensions are exported dynamic
        chunk = torch.export.Dim("chunk", min=1, max=prefill_chunk)
        past_len, total = torch.export.Dim("past", min=0), torch.export.Dim("total", min=1)
        example = (torch.zeros(1, n, dtype=torch.long), torch.ones(1, past + n, dtype=torch.long),
                   torch.arange(past, past + n)[None],
                   tuple(torch.zeros(1, hk, past, d) for _ in range(2 * layers)))
        shapes = ({1: chunk}, {1: total}, {1: chunk}, tuple({2: past_len} for _ in range(2 * layers)))
        inputs, outputs = onnx_names(layers)
        with warnings.catch_warnings():  # torch 2.13's exporter uses its own deprecated pytree API
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message="# The axis name", category=UserWarning)  # chunk, past reused
            program = torch.onnx.export(CachedStep(model).eval(), example, dynamic_shapes=shapes, dynamo=True,
                                        input_names=inputs, output_names=outputs, verbose=False)
            program.save(str(path))
    finally:
        config.attention_block_size = saved
        registration.setLevel(level)
    return {"inputs": {"input_ids": "(1, chunk) int64", "attention_mask": "(1, past + chunk) int64",
                       "position_ids": "(1, chunk) int64",
                       "past_key_values.{i}.key/value": f"(1, {hk}, past, {d}) float32, i < {layers}"},
            "outputs": {"logits": f"(1, chunk, {config.vocab_size}) float32",
                        "present.{i}.key/value": f"(1, {hk}, past + chunk, {d}) float32"}}


# ----------------------------------------------------------------------------------------------------------------------
# Running a written program, and the parity check
# ----------------------------------------------------------------------------------------------------------------------
class StaticCacheRunner:
    """A static-cache program (exported-program or executorch), one token per call at its own position."""

    def __init__(self, call):
        self.call = call

    def reset(self) -> None:
        """Nothing to clear: a call at position p attends to positions <= p only, so a new sequence from position 0
        overwrites what it reads."""

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.call(ids[:, i:i + 1], i) for i in range(ids.shape[1])], dim=1)

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        return self.call(token, position)


def exported_program_runner(path: Path, config, chunk: int) -> StaticCacheRunner:
    module = torch.export.load(str(path)).module()
    return StaticCacheRunner(lambda ids, i: module(input_ids=ids, cache_position=torch.tensor([i])).detach())


def executorch_runner(path: Path, config, chunk: int) -> StaticCacheRunner:
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(path)).load_method("forward")
    return StaticCacheRunner(lambda ids, i: method.execute([ids, torch.tensor([i])])[0])


class OnnxRunner:
    """The ONNX graph under onnxruntime: prefill in chunks of at most ``chunk`` tokens, then one token per call, the
    cache carried from each call's ``present`` outputs to the next call's ``past`` inputs."""

    def __init__(self, path: Path, config, chunk: int):
        import numpy as np
        import onnxruntime

        self.np, self.chunk = np, chunk
        self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.shape = (1, config.num_key_value_heads, 0, config.head_dim)
        self.names = onnx_names(config.num_hidden_layers)[0][3:]
        self.reset()

    def reset(self) -> None:
        """An empty cache: the next call starts a new sequence."""
        self.past = [self.np.zeros(self.shape, dtype=self.np.float32) for _ in self.names]

    def _run(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        n, np = ids.shape[1], self.np
        feeds = {"input_ids": ids.numpy().astype(np.int64),
                 "attention_mask": np.ones((1, position + n), dtype=np.int64),
                 "position_ids": np.arange(position, position + n, dtype=np.int64)[None],
                 **dict(zip(self.names, self.past))}
        logits, *self.past = self.session.run(None, feeds)
        return torch.from_numpy(logits)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._run(ids[:, i:i + self.chunk], i) for i in range(0, ids.shape[1], self.chunk)], dim=1)

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        return self._run(token, position)


RUNNERS = {"exported-program": exported_program_runner, "executorch": executorch_runner, "onnx": OnnxRunner}


def greedy_tokens(runner, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's logits from ``runner`` and ``new_tokens`` greedy tokens after it, each fed at its own position
    (prompt length + i): (prompt logits (1, n, V), tokens (1, n + new_tokens))."""
    prompt_logits = runner.prefill(prompt)
    tokens, logits = prompt, prompt_logits[:, -1]
    for position in range(prompt.shape[1], prompt.shape[1] + new_tokens):
        token = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, token], dim=1)
        if position + 1 < prompt.shape[1] + new_tokens:  # the last token's logits are never used
            logits = runner.step(token, position)[:, -1]
    return prompt_logits, tokens


def parity_bound(reference: torch.Tensor) -> float:
    """The largest prompt-logit difference a float32 program may show: 1e-4 of the logits' scale (at least 1e-4), the
    round-off of a reordered float32 reduction over the hidden size, far below any change of weights or of a term."""
    return 1e-4 * max(1.0, reference.abs().max().item())


def check_parity(model, runner, prompt: torch.Tensor, new_tokens: int) -> dict:
    """The written program against the eager model: prompt logits within ``parity_bound`` and greedy tokens equal to
    ``generate``'s (do_sample=False, exactly ``new_tokens``)."""
    with torch.no_grad():
        reference = model(prompt, use_cache=False).logits
        expected = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  attention_mask=torch.ones_like(prompt))
    timed = time.perf_counter()
    prompt_logits, tokens = greedy_tokens(runner, prompt, new_tokens)
    seconds = time.perf_counter() - timed
    diff = (prompt_logits - reference).abs().max().item()
    bound = parity_bound(reference)
    agree = (tokens[0, prompt.shape[1]:] == expected[0, prompt.shape[1]:]).float().mean().item()
    passed = diff <= bound and torch.equal(tokens, expected)
    return {"passed": passed, "prompt_tokens": prompt.shape[1], "new_tokens": new_tokens,
            "max_abs_logit_diff": diff, "bound": bound, "greedy_agreement": agree,
            "program_seconds": seconds,
            "summary": f"prompt logits max |d| {diff:.3g} (bound {bound:.3g}), greedy tokens {agree:.0%} equal to "
                       f"generate's over {new_tokens}"}


# ----------------------------------------------------------------------------------------------------------------------
# Inputs and outputs
# ----------------------------------------------------------------------------------------------------------------------
def _require(format: str, spec: Format) -> None:
    import importlib.util

    missing = [name for name in spec.packages if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"--format {format} needs {', '.join(missing)}: pip install "
                          f"'fiber-bundle-transformers[{spec.extra}]' (or pip install {' '.join(missing)}).")


def _load(model) -> tuple[Path | None, torch.nn.Module]:
    """(the folder or None, the causal LM in float32 eval mode), refusing what an export cannot take."""
    if isinstance(model, (str, Path)):
        folder = Path(model)
        if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
            raise ExportError(f"{folder} is a LoRA adapter: merge it into its base first (fiber-bundle merge ADAPTER "
                              "OUT), then export OUT.")
        if not is_fiber_bundle_folder(folder):
            raise ExportError(f"MODEL {folder} is not a Fiber Bundle folder (no config.json with model_type "
                              "fiber_bundle): convert a checkpoint first (fiber-bundle convert SOURCE OUT).")
        model = load_model(folder)
    else:
        folder = None
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None):
        raise ExportError("the model is quantized (bitsandbytes): export a full-precision folder (fiber-bundle merge "
                          "writes one from a QLoRA adapter).")
    if not hasattr(model, "lm_head"):
        raise ExportError(f"only causal LMs export (got {type(model).__name__}): the programs return next-token "
                          "logits.")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ExportError("the model is split by tensor parallelism: load it in one process (no tp_plan) to export.")
    if model.dtype != torch.float32:
        raise ExportError(f"the model is in {model.dtype}: exports are float32 (the parity check's tolerance); "
                          "load it with dtype=torch.float32.")
    # the fused operators (Triton, C++: opaque custom operators) do not export; the blocked path gives the same numbers
    model.config.fiber_attention_kernel = "pytorch"
    return folder, model.eval()


def _copy_assets(folder: Path | None, model, staging: Path) -> None:
    """The model's config and generation config, and the tokenizer files of its folder, beside the program."""
    model.config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    if folder is not None:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, staging / name)


def _size(path: Path) -> int:
    """Bytes of ``path`` and of any external-data file beside it."""
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.name.startswith(path.name))


def _versions(spec: Format) -> dict:
    from importlib import metadata

    from fiber_bundle.model_cards import framework_versions

    found = framework_versions()
    for name in spec.packages:
        try:
            found[name] = metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            pass
    return found
