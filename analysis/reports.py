"""The library functions behind ``fiber-bundle analyze collapse | intrinsic-rank | geometry``: load the models, run
the measures of ``stacks`` and ``probes`` with progress bars, write ``<name>.json`` and ``<name>.png`` into a folder."""

import time
from pathlib import Path

import torch

from .models import load_causal_lm, model_label, sample_ids
from fiber_bundle.training.geometry_logging import gate_values

from .output import write_json
from .plots import plot_collapse, plot_geometry, plot_intrinsic_rank
from .probes import decoder, gate_ablation, geometry_report, intrinsic_rank, model_collapse
from .stacks import StackSpec, collapse_experiment, default_variants


def _labels(models, labels) -> list[str]:
    if labels is None:
        names = [Path(str(m)).stem if str(m).endswith(".gguf") else model_label(m) for m in models]
    else:
        names = list(labels)
    if len(names) != len(models):
        raise ValueError(f"{len(names)} labels for {len(models)} models: give one --labels entry per model.")
    if len(set(names)) != len(names):
        raise ValueError(f"labels must be distinct, got {names}: pass --labels.")
    return names


def _held_out_ids(tokenizer, blocks: int, block_size: int = 256) -> torch.Tensor:
    """The first ``blocks`` blocks of the main job's held-out split (pydoc topics, split seed 0), as (blocks, 256) ids."""
    from fiber_bundle.training.data import pack_blocks, pydoc_topics

    packed = pack_blocks(pydoc_topics(seed=0)[1], tokenizer, block_size)
    return torch.tensor(packed[: min(blocks, len(packed))]["input_ids"])


def _finish(results: dict, started: float, output_dir, name: str, plot) -> dict:
    """Record the wall time, write ``name``.json and ``name``.png into ``output_dir``; return the results."""
    results["seconds"] = time.perf_counter() - started
    write_json(Path(output_dir) / f"{name}.json", results)
    plot(results, Path(output_dir) / f"{name}.png")
    return results


def _bar(total, desc, progress):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not progress)


def _each_model(models, labels, dtype, samples, length):
    """(label, model, tokenizer, ids) for every model, loading one at a time (ids from each model's own tokenizer)."""
    for label, source in zip(_labels(models, labels), models):
        model, tokenizer = load_causal_lm(source, dtype=dtype)
        yield label, model, tokenizer, sample_ids(tokenizer, samples, length)
        del model


def run_collapse(output_dir: str | Path, *, models=(), labels=None, samples: int = 4, length: int = 512,
                 seeds=range(20), spec: StackSpec | None = None, alphas=(1.0, 10.0, 100.0), threshold: float = 1e-3,
                 stacks: bool = True, progress: bool = True) -> dict:
    """Rank collapse: (a) pure-attention stacks (``stacks``), bidirectional and causal, without and with skip
    connections, Euclidean versus Riemannian over ``seeds``; (b) each of ``models`` on ``samples`` x ``length`` tokens.
    Writes collapse.json and collapse.png into ``output_dir``."""
    started = time.perf_counter()
    spec = spec or StackSpec()
    results = {"threshold": threshold, "stacks": [], "models": {}}
    if stacks:
        variants = default_variants(alphas)
        configs = [(False, False), (True, False), (False, True), (True, True)]  # (skip, causal)
        bar = _bar(len(configs) * len(variants) * len(list(seeds)), "pure-attention stacks", progress)
        for skip, causal in configs:
            run = collapse_experiment(StackSpec(**{**vars(spec), "skip": skip, "causal": causal}), seeds, variants,
                                      threshold, bar)
            run["title"] = (f"{'causal' if causal else 'bidirectional'}, {'with' if skip else 'no'} skip; D={spec.width}, "
                            f"H={spec.heads}, n={spec.tokens}, r={spec.metric_rank}, {len(run['seeds'])} seeds")
            results["stacks"].append(run)
        bar.close()
    if models:
        bar = _bar(len(models), "models", progress)
        for label, model, _, ids in _each_model(models, labels, torch.float32, samples, length):
            results["models"][label] = {**model_collapse(model, ids), "samples": samples, "tokens": length}
            bar.update(1)
        bar.close()
    return _finish(results, started, output_dir, "collapse", plot_collapse)


def run_intrinsic_rank(output_dir: str | Path, models, *, labels=None, samples: int = 4, length: int = 512,
                       threshold: float = 0.9, rtol: float = 1e-10, progress: bool = True) -> dict:
    """Intrinsic rank per layer and head of each model (float64, so the numerical rank is exact to rtol): writes
    intrinsic_rank.json and intrinsic_rank.png into ``output_dir``."""
    started = time.perf_counter()
    results = {"models": {}}
    for label, model, _, ids in _each_model(models, labels, torch.float64, samples, length):
        bar = _bar(len(decoder(model).layers), f"intrinsic rank: {label}", progress)
        results["models"][label] = intrinsic_rank(model, ids, threshold=threshold, rtol=rtol, progress=bar)
        bar.close()
    return _finish(results, started, output_dir, "intrinsic_rank", plot_intrinsic_rank)


def run_geometry(output_dir: str | Path, models, *, labels=None, samples: int = 4, length: int = 512, eps_values=None,
                 norm_layers=None, ablation_blocks: int = 0, progress: bool = True) -> dict:
    """Connection proxies per layer, RMSNorm Lipschitz constant versus eps with its fitted exponent, attention
    entropy versus context length, the learned gates, and (``ablation_blocks`` > 0) the held-out loss with each part of
    the metric switched off, for each model: writes geometry.json and geometry.png into ``output_dir``."""
    started = time.perf_counter()
    results = {"models": {}}
    bar = _bar(len(models), "geometry", progress)
    for label, model, tokenizer, ids in _each_model(models, labels, torch.float32, samples, length):
        results["models"][label] = geometry_report(model, ids, eps_values=eps_values, norm_layers=norm_layers)
        results["models"][label]["gates"] = gate_values(model)
        if ablation_blocks:
            results["models"][label]["ablation"] = gate_ablation(model, _held_out_ids(tokenizer, ablation_blocks))
        bar.update(1)
    bar.close()
    return _finish(results, started, output_dir, "geometry", plot_geometry)
