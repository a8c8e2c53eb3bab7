"""The library functions behind ``fiber-bundle analyze``: each runs its measurement or study and writes ``<name>.json``
and ``<name>.png`` into a folder. ``collapse``, ``intrinsic-rank`` and ``geometry`` run the measures of ``stacks`` and
``probes`` with progress bars here; ``scratch``, ``ide`` and ``compare`` are studies (``scratch``, ``ide_study``,
``compare``: their JSON written after every run) whose figure is drawn here from their results."""

import time
from pathlib import Path

import torch

from fiber_bundle.training.geometry_logging import gate_values

from .compare import compare_study
from .ide_study import ide_study
from .models import held_out_ids, load_causal_lm, model_labels, sample_ids
from .output import write_json
from .plots import (plot_collapse, plot_compare, plot_geometry, plot_ide, plot_intrinsic_rank, plot_scaling,
                    plot_scratch)
from .probes import decoder, gate_ablation, geometry_report, intrinsic_rank, model_collapse
from .scaling import scaling_summary
from .scratch import scratch_study
from .stacks import StackSpec, collapse_experiment, default_variants
from .study import progress_bar


def _finish(results: dict, started: float, output_dir, name: str, plot) -> dict:
    """Record the wall time, write ``name``.json and ``name``.png into ``output_dir``; return the results."""
    results["seconds"] = time.perf_counter() - started
    write_json(Path(output_dir) / f"{name}.json", results)
    plot(results, Path(output_dir) / f"{name}.png")
    return results


def _each_model(models, labels, dtype, samples, length):
    """(label, model, tokenizer, ids) for every model, loading one at a time (ids from each model's own tokenizer)."""
    for label, source in zip(model_labels(models, labels), models):
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
        bar = progress_bar(len(configs) * len(variants) * len(list(seeds)), "pure-attention stacks", progress)
        for skip, causal in configs:
            run = collapse_experiment(StackSpec(**{**vars(spec), "skip": skip, "causal": causal}), seeds, variants,
                                      threshold, bar)
            run["title"] = (f"{'causal' if causal else 'bidirectional'}, {'with' if skip else 'no'} skip; D={spec.width}, "
                            f"H={spec.heads}, n={spec.tokens}, r={spec.metric_rank}, {len(run['seeds'])} seeds")
            results["stacks"].append(run)
        bar.close()
    if models:
        bar = progress_bar(len(models), "models", progress)
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
        bar = progress_bar(len(decoder(model).layers), f"intrinsic rank: {label}", progress)
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
    bar = progress_bar(len(models), "geometry", progress)
    for label, model, tokenizer, ids in _each_model(models, labels, torch.float32, samples, length):
        results["models"][label] = geometry_report(model, ids, eps_values=eps_values, norm_layers=norm_layers)
        results["models"][label]["gates"] = gate_values(model)
        if ablation_blocks:
            results["models"][label]["ablation"] = gate_ablation(model, held_out_ids(tokenizer, ablation_blocks))
        bar.update(1)
    bar.close()
    return _finish(results, started, output_dir, "geometry", plot_geometry)


def read_study(path: str | Path) -> dict:
    """A study's results file (scratch.json, optimizers.json, compare.json or ide.json) with its summary computed afresh
    from its runs by the study's own summary function (ide.json holds measurements only: it comes back as it is)."""
    import json

    from .compare import summarise_runs
    from .optimizers import summarise_optimizers
    from .scratch import summarise_scratch

    path = Path(path)
    summaries = {"scratch.json": summarise_scratch, "optimizers.json": summarise_optimizers,
                 "compare.json": lambda results: summarise_runs(results["runs"]), "ide.json": None}
    if path.name not in summaries:
        raise ValueError(f"{path} is not a study's results file: expected one of {', '.join(summaries)}.")
    results = json.loads(path.read_text())
    if summaries[path.name] is not None:
        results["summary"] = summaries[path.name](results)
    return results


def run_scratch_comparison(output_dir: str | Path, **options) -> dict:
    """The from-scratch study (``scratch.scratch_study``, whose ``options`` these are) and its figure, scratch.png."""
    results = scratch_study(output_dir, **options)
    plot_scratch(results, Path(output_dir) / "scratch.png")
    return results


def run_ide(output_dir: str | Path, models, **options) -> dict:
    """The IDE picture's observables (``ide_study.ide_study``, whose ``options`` these are) and their figure, ide.png."""
    results = ide_study(output_dir, models, **options)
    plot_ide(results, Path(output_dir) / "ide.png")
    return results


def run_compare(converted: str | Path, source: str | Path, output_dir: str | Path, **options) -> dict:
    """Metric-only training against equal-parameter LoRA (``compare.compare_study``, whose ``options`` these are) and
    its figure, compare.png."""
    results = compare_study(converted, source, output_dir, **options)
    plot_compare(results, Path(output_dir) / "compare.png")
    return results


def run_scaling(studies, output_dir: str | Path, *, equal_time=(), arm: str = "strong-1",
                reference: str = "euclidean") -> dict:
    """The scaling study (``scaling.scaling_summary``) over scratch study folders, one per size (``studies``), and
    equal-time folders of some sizes (``equal_time``); writes ``scaling.json`` and its figure, ``scaling.png``."""
    def read(folder) -> tuple[str, dict]:
        path = Path(folder)
        path = path / "scratch.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"{folder} holds no scratch.json: give the --out folder of an analyze scratch run.")
        return str(folder), read_study(path)

    results = scaling_summary([read(folder) for folder in studies], equal_time=[read(f) for f in equal_time],
                              arm=arm, reference=reference)
    write_json(Path(output_dir) / "scaling.json", results)
    plot_scaling(results, Path(output_dir) / "scaling.png")
    return results
