"""Do the Riemannian geometries beat tuned AdamW? Each optimiser trains the same converted model on the same corpus with
the same token budget; its learning rate is swept on one seed (a grid, extended by grid steps while the best rate is at
an edge, then the geometric midpoints around the best), and the best rate is re-run on further seeds.

For a Riemannian optimiser the swept rate is that of the factored pairs (``training.riemannian.factored_groups``: the
metric generators in metric-only training, LoRA pairs in LoRA training); every other trainable parameter (gates,
biases) uses AdamW at the best AdamW rate of the same sweep, so the pairs' optimiser is the only difference between
arms.
Every run starts from the same backbone with the metric generators drawn by its seed (gates at the graft value 0).
Results are written after every run and a rerun with the same settings continues where it stopped.
"""

import json
import math
import tempfile
import time
from pathlib import Path

import torch

from .compare import corpus
from .measures import summarise
from .models import load_causal_lm
from .output import write_json

DEFAULT_GRIDS = {  # AdamW around its known range; the Riemannian steps are plain (no Adam scaling): a decade grid
    "adamw": (1e-2, 3e-2, 1e-1),
    "riemannian-quotient": (1e-2, 1e-1, 1.0),
    "riemannian-embedded": (1e-2, 1e-1, 1.0),
    "stiefel-euclidean": (1e-2, 1e-1, 1.0),
    "stiefel-canonical": (1e-2, 1e-1, 1.0),
    "grassmann": (1e-2, 1e-1, 1.0),
}


def _midpoints(grid, best) -> list[float]:
    """The geometric midpoints between ``best`` and its neighbours in ``grid`` (one side only at an edge)."""
    grid = sorted(grid)
    i = grid.index(best)
    return [math.sqrt(best * grid[j]) for j in (i - 1, i + 1) if 0 <= j < len(grid)]


def run_optimizer_comparison(
    converted: str | Path,
    output_dir: str | Path,
    *,
    optimizers=tuple(DEFAULT_GRIDS),
    grids: dict | None = None,
    seeds=(0, 1, 2),
    mode: str = "metric-only",
    block: bool = False,
    lora_r: int = 8,
    max_steps: int = 16,
    batch_size: int = 4,
    block_size: int = 256,
    max_eval_blocks: int | None = 8,
    adamw_learning_rate: float | None = None,
    max_extensions: int = 3,
    progress: bool = True,
) -> dict:
    """Sweep, then re-seed, every optimiser; write ``optimizers.json`` after every run. Returns the results.

    Arguments:
        converted: a converted Fiber Bundle folder (its metric at the graft value).
        optimizers: "adamw" and / or geometries of ``training.riemannian.GEOMETRIES``; AdamW runs first (its best
            rate is the rate of the other arms' non-factored parameters).
        grids: optimiser -> learning rates of the sweep (default ``DEFAULT_GRIDS``).
        seeds: the first seeds the sweep, the best rate runs on all of them.
        mode, block, lora_r: the task ("metric-only" or "lora") and the block variant of the geometries.
        max_steps, batch_size, block_size: the token budget of every run; max_eval_blocks: held-out blocks scored.
        adamw_learning_rate: AdamW's rate when AdamW is not swept here (default: AdamW's best rate already in this
            comparison's results, else 3e-2).
        max_extensions: how many grid steps the sweep may add beyond an edge of the grid where the best rate lies.
    """
    from tqdm.auto import tqdm

    from fiber_bundle.training.riemannian import OPTIMIZERS
    from fiber_bundle.training.trainer import evaluation_loss, train_model

    unknown = [name for name in optimizers if name not in OPTIMIZERS]
    if unknown or not optimizers:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {list(OPTIMIZERS)}.")
    if mode not in ("metric-only", "lora"):
        raise ValueError(f"mode {mode!r}: the comparison trains 'metric-only' or 'lora'.")
    grids = {**DEFAULT_GRIDS, **(grids or {})}
    optimizers = sorted(optimizers, key=lambda name: name != "adamw")  # AdamW first
    output_dir = Path(output_dir)
    model, tokenizer = load_causal_lm(converted)
    train_set, eval_set, probe_ids = corpus(tokenizer, block_size, batch_size, max_eval_blocks)
    before = evaluation_loss(model, eval_set, batch_size)
    del model
    settings = {"converted": str(converted), "mode": mode, "block": block, "lora_r": lora_r if mode == "lora" else None,
                "budget": {"steps": max_steps, "batch_size": batch_size, "block_size": block_size,
                           "tokens": max_steps * batch_size * block_size},
                "eval_blocks": len(eval_set), "seeds": list(seeds), "threads": torch.get_num_threads()}
    path = output_dir / "optimizers.json"
    results = {**settings, "eval_loss_before": before, "runs": []}
    if path.is_file():  # continue a stopped comparison (or add optimisers to it) with the same settings
        previous = json.loads(path.read_text())
        if all(previous.get(key) == value for key, value in settings.items()):
            results.update(runs=previous.get("runs", []), best=previous.get("best", {}))

    def run(name: str, lr: float, seed: int, adamw_lr: float) -> dict:
        for done in results["runs"]:
            if (done["optimizer"], done["learning_rate"], done["seed"]) == (name, lr, seed):
                return done
        model, _ = load_causal_lm(converted)
        model.init_geometry(seed)
        kwargs = dict(learning_rate=lr) if name == "adamw" else dict(
            learning_rate=adamw_lr, optimizer=name, riemannian_learning_rate=lr, block=block)
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            trainer = train_model(model, train_set, scratch, mode=mode, lora_r=lora_r, max_steps=max_steps,
                                  batch_size=batch_size, seed=seed, probe_ids=probe_ids, quiet=True, **kwargs)
            seconds = time.perf_counter() - started
        after = evaluation_loss(trainer.model, eval_set, batch_size)
        record = {"optimizer": name, "learning_rate": lr, "seed": seed, "adamw_learning_rate": adamw_lr,
                  "eval_loss_after": after if math.isfinite(after) else None,
                  "seconds_per_step": seconds / max(1, trainer.state.global_step),
                  "train_loss": [log["loss"] for log in trainer.state.log_history if "loss" in log]}
        results["runs"].append(record)
        write_json(path, results)
        return record

    def score(record):  # a diverged run (NaN) ranks last
        return record["eval_loss_after"] if record["eval_loss_after"] is not None else math.inf

    bar = tqdm(total=len(optimizers), desc="optimizers", disable=not progress)
    results.setdefault("best", {})
    adamw_lr = adamw_learning_rate or results["best"].get("adamw", {}).get("learning_rate", 3e-2)
    for name in optimizers:
        bar.set_postfix_str(name)
        grid = sorted(float(lr) for lr in grids[name])
        sweep = [run(name, lr, seeds[0], adamw_lr) for lr in grid]
        step = grid[-1] / grid[-2] if len(grid) > 1 else 10.0
        for _ in range(max_extensions):  # the best rate at an edge of what was tried: go one grid step further
            best, tried = min(sweep, key=score)["learning_rate"], [r["learning_rate"] for r in sweep]
            if best not in (min(tried), max(tried)) or len(tried) < 2:
                break
            sweep.append(run(name, best * step if best == max(tried) else best / step, seeds[0], adamw_lr))
        best = min(sweep, key=score)["learning_rate"]
        sweep += [run(name, lr, seeds[0], adamw_lr) for lr in _midpoints([r["learning_rate"] for r in sweep], best)]
        best = min(sweep, key=score)["learning_rate"]
        tried = sorted(r["learning_rate"] for r in sweep)
        if name == "adamw":
            adamw_lr = best
        for seed in seeds:
            run(name, best, seed, adamw_lr)
        results["best"][name] = {"learning_rate": best, "at_grid_edge": best in (tried[0], tried[-1]),
                                 "swept": {r["learning_rate"]: r["eval_loss_after"] for r in sweep}}
        results["summary"] = summarise_optimizers(results)
        write_json(path, results)
        bar.update()
    bar.close()
    return results


def summarise_optimizers(results: dict) -> dict:
    """Per optimiser at its best rate: eval loss after (mean, std over seeds) and seconds per step relative to AdamW."""
    summary = {}
    for name, best in results["best"].items():
        mine = [r for r in results["runs"] if r["optimizer"] == name and r["learning_rate"] == best["learning_rate"]]
        loss = summarise([r["eval_loss_after"] for r in mine])
        seconds = summarise([r["seconds_per_step"] for r in mine])
        summary[name] = {"learning_rate": best["learning_rate"], "at_grid_edge": best["at_grid_edge"],
                         "seeds": len(mine), "diverged": sum(r["eval_loss_after"] is None for r in mine),
                         "eval_loss_after_mean": loss["mean"], "eval_loss_after_std": loss["std"],
                         "seconds_per_step_mean": seconds["mean"]}
    if "adamw" in summary:
        reference = summary["adamw"]
        adamw = {r["seed"]: r["eval_loss_after"] for r in results["runs"]
                 if r["optimizer"] == "adamw" and r["learning_rate"] == reference["learning_rate"]}
        for name, row in summary.items():
            mine = [r for r in results["runs"] if r["optimizer"] == name and r["learning_rate"] == row["learning_rate"]]
            paired = summarise([r["eval_loss_after"] - adamw[r["seed"]] for r in mine
                                if r["eval_loss_after"] is not None and adamw.get(r["seed"]) is not None])
            row["loss_vs_adamw"], row["loss_vs_adamw_std"] = paired["mean"], paired["std"]  # paired by seed
            row["time_vs_adamw"] = row["seconds_per_step_mean"] / reference["seconds_per_step_mean"]
    return summary
