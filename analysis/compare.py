"""Does the geometry earn its cost? Three ways to spend the same token budget on the same corpus, over several seeds:

1. ``metric-only``: the converted model, backbone frozen, only the metric trains;
2. ``lora-source``: LoRA on the unconverted source, its rank chosen so that it trains as many parameters as (1);
3. ``lora+metric``: LoRA of the same rank on the converted model, with the metric trained alongside.

Every run starts from the same backbone weights (the metric generators drawn with the run's seed, gates at the graft
value 0, so every arm starts as the source), sees the same packed blocks of the main job's corpus (pydoc topics, split by
topic with split seed 0, so the held-out set is the same for every run) and is scored by its held-out eval loss.
Arms are interleaved within each seed so that any drift of the machine's speed touches them alike.
"""

import tempfile
import time
from pathlib import Path

import torch

from .models import load_causal_lm, pydoc_blocks
from .measures import summarise
from .output import write_json
from .study import on_host

ARMS = ("metric-only", "lora-source", "lora+metric")


def lora_parameter_count(model, rank: int) -> int:
    """Parameters LoRA of ``rank`` adds on the standard targets: rank x (in + out) per targeted Linear."""
    from fiber_bundle.training.modes import LORA_TARGET_MODULES

    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGET_MODULES:
            total += rank * (module.in_features + module.out_features)
    return total


def equal_parameter_lora_rank(model, budget: int) -> int:
    """The LoRA rank whose parameter count is closest to ``budget`` (at least 1)."""
    per_rank = lora_parameter_count(model, 1)
    if per_rank == 0:
        raise ValueError("the model has none of the LoRA target modules (q_proj, ..., down_proj).")
    return max(1, round(budget / per_rank))


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def corpus(tokenizer, block_size: int, batch_size: int, max_eval_blocks: int | None = None):
    """The main job's corpus as packed blocks (``models.pydoc_blocks``): (train set, held-out set, a one-block probe
    batch)."""
    train_set, eval_set = pydoc_blocks(tokenizer, block_size)
    if max_eval_blocks is not None:
        eval_set = eval_set.select(range(min(max_eval_blocks, len(eval_set))))
    if len(train_set) < batch_size:
        raise ValueError(f"the corpus holds fewer than batch_size={batch_size} blocks of {block_size} tokens.")
    return train_set, eval_set, torch.tensor(eval_set[:1]["input_ids"])


def compare_study(
    converted: str | Path,
    source: str | Path,
    output_dir: str | Path,
    *,
    gguf_file: str | None = None,
    seeds=(0, 1, 2),
    arms=ARMS,
    max_steps: int = 16,
    batch_size: int = 8,
    block_size: int = 256,
    metric_learning_rate: float = 2e-2,
    lora_learning_rate: float = 1e-3,
    lora_r: int | None = None,
    max_eval_blocks: int | None = None,
    progress: bool = True,
) -> dict:
    """Train every arm with every seed; write ``compare.json`` after every run (``reports.run_compare`` also draws
    ``compare.png``).

    Arguments:
        converted: a Fiber Bundle folder converted from ``source`` (graft: it starts as the source).
        source: the unconverted checkpoint (folder, Hub id or .gguf file; ``gguf_file`` inside a folder).
        seeds, arms: what to run (``ARMS`` by default).
        max_steps, batch_size, block_size: the token budget (max_steps x batch_size x block_size) of every run.
        metric_learning_rate: learning rate of the metric parameters (arms 1 and 3).
        lora_learning_rate: learning rate of the LoRA parameters (arms 2 and 3).
        lora_r: LoRA rank of arms 2 and 3; default: the rank that trains as many parameters as arm 1.
        max_eval_blocks: score on the first this many held-out blocks only (default: all of them).
    Returns the results dict that is written to ``compare.json``.
    """
    from tqdm.auto import tqdm

    from fiber_bundle.training.geometry_logging import probe_geometry
    from fiber_bundle.training.trainer import evaluation_loss, train_model

    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arm(s) {sorted(unknown)}; choose from {list(ARMS)}.")
    output_dir = Path(output_dir)
    base, tokenizer = load_causal_lm(converted)
    train_set, eval_set, probe_ids = corpus(tokenizer, block_size, batch_size, max_eval_blocks)
    metric_budget = sum(p.numel() for p in base.geometry_parameters())
    if lora_r is None:
        lora_r = equal_parameter_lora_rank(base, metric_budget)
    del base

    results = {
        "converted": str(converted), "source": str(source), "seeds": list(seeds), "arms": list(arms),
        "budget": {"steps": max_steps, "batch_size": batch_size, "block_size": block_size,
                   "tokens": max_steps * batch_size * block_size},
        "learning_rates": {"metric": metric_learning_rate, "lora": lora_learning_rate},
        "lora_r": lora_r, "metric_parameters": metric_budget, "eval_blocks": len(eval_set), "runs": [],
    }
    plan = [(seed, arm) for seed in seeds for arm in arms]
    bar = tqdm(plan, desc="compare", disable=not progress)
    before_cache = {}
    def train(seed: int, arm: str) -> dict:  # one run's record
        model_path = source if arm == "lora-source" else converted
        model, _ = load_causal_lm(model_path, gguf_file=gguf_file if arm == "lora-source" else None)
        if arm != "lora-source":  # the metric's random generators drawn with this run's seed (gates stay at 0)
            model.init_geometry(seed)
        if arm not in before_cache:
            before_cache[arm] = evaluation_loss(model, eval_set, batch_size)
        if arm == "metric-only":
            kwargs = dict(mode="metric-only", learning_rate=metric_learning_rate)
        elif arm == "lora-source":
            kwargs = dict(mode="lora", learning_rate=lora_learning_rate, lora_r=lora_r)
        else:
            kwargs = dict(mode="lora", learning_rate=lora_learning_rate, lora_r=lora_r,
                          metric_learning_rate=metric_learning_rate)
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            trainer = train_model(model, train_set, scratch, max_steps=max_steps, batch_size=batch_size, seed=seed,
                                  probe_ids=probe_ids, quiet=True, **kwargs)
            seconds = time.perf_counter() - started
        trained = trainer.model
        return {
            "arm": arm, "seed": seed, "trainable_parameters": _trainable(trained),
            "eval_loss_before": before_cache[arm], "eval_loss_after": evaluation_loss(trained, eval_set, batch_size),
            "train_seconds": seconds, "seconds_per_step": seconds / max(1, trainer.state.global_step),
            "train_loss": [log["loss"] for log in trainer.state.log_history if "loss" in log],
            "geometry": probe_geometry(trained, probe_ids),
        }

    for seed, arm in bar:
        bar.set_postfix_str(f"{arm} seed {seed}")
        results["runs"].append(on_host(lambda: train(seed, arm)))
        results["summary"] = summarise_runs(results["runs"])
        write_json(output_dir / "compare.json", results)
    return results


def summarise_runs(runs: list[dict]) -> dict:
    """Per arm: eval loss after (mean, std over seeds), its change, wall time, trainable parameters, final geometry."""
    summary = {}
    for arm in dict.fromkeys(run["arm"] for run in runs):
        mine = [run for run in runs if run["arm"] == arm]
        after = summarise([r["eval_loss_after"] for r in mine])
        delta = summarise([r["eval_loss_after"] - r["eval_loss_before"] for r in mine])
        seconds = summarise([r["train_seconds"] for r in mine])
        summary[arm] = {
            "seeds": len(mine), "trainable_parameters": mine[0]["trainable_parameters"],
            "eval_loss_before": mine[0]["eval_loss_before"],
            "eval_loss_after_mean": after["mean"], "eval_loss_after_std": after["std"],
            "change_mean": delta["mean"], "change_std": delta["std"],
            "train_seconds_mean": seconds["mean"], "train_seconds_std": seconds["std"],
            "geometry_end": {key.split("/")[-1]: summarise([r["geometry"][key] for r in mine])
                             for key in mine[0]["geometry"]},
        }
    return summary
