"""Do the Riemannian geometries beat tuned AdamW? Each optimiser trains the same converted model on the same corpus with
the same token budget; its learning rate is swept on one seed (a grid, extended by grid steps while the best rate is at
an edge, then the geometric midpoints around the best), and the best rate is re-run on further seeds.

For a Riemannian optimiser the swept rate is that of the factored pairs (``training.riemannian.factored_groups``: the
metric generators in metric-only training, LoRA pairs in LoRA training); every other trainable parameter (gates,
biases) uses AdamW at the best AdamW rate of the same sweep, so the pairs' optimiser is the only difference between
arms.
Every run starts from the same backbone with the metric generators drawn by its seed (gates at the graft value 0).
Results are written after every run (``study.run_study``, one optimiser after the other) and a rerun with the same
settings continues where it stopped; a folder of other settings is refused.

``from_scratch`` is the setting of the optimiser abstract: a small model of ``analyze scratch`` (its arm: ``euclidean``,
metric off, or a Riemannian start) trained from random initialisation in full on the standard library's source, the
geometry on the per-head W_Q / W_K pairs only (``riemannian_pairs="attention"``; a partial isometry starts them
orthonormal), everything else with AdamW at AdamW's best rate. The design points are the five geometries and their block
variants (``stiefel-canonical+block``: each query head its own factor, sharing its KV group's key factor), and for the
three partial-isometry geometries the scale control (``grassmann+scaled``: heads stacked as in the plain variant, the
stack stored at sqrt(query heads per KV head) so each head's query slice starts as large as the block variant's).
"""

import math
import tempfile
import time
from pathlib import Path

import torch

from .compare import corpus
from .measures import paired_interval, summarise
from .models import load_causal_lm
from .study import StepClock, StudyFile, run_study

DEFAULT_GRIDS = {  # AdamW around its known range; the Riemannian steps are plain (no Adam scaling): a decade grid
    "adamw": (1e-2, 3e-2, 1e-1),
    "riemannian-quotient": (1e-2, 1e-1, 1.0),
    "riemannian-embedded": (1e-2, 1e-1, 1.0),
    "stiefel-euclidean": (1e-2, 1e-1, 1.0),
    "stiefel-canonical": (1e-2, 1e-1, 1.0),
    "grassmann": (1e-2, 1e-1, 1.0),
}


def design_points() -> tuple[str, ...]:
    """The optimiser names a comparison takes: AdamW, the five geometries, their block variants (``NAME+block``) and
    the partial-isometry geometries' scale control (``NAME+scaled``)."""
    from fiber_bundle.training.riemannian import FIXED_RANK, GEOMETRIES, OPTIMIZERS

    return (OPTIMIZERS + tuple(f"{geometry}+block" for geometry in GEOMETRIES)
            + tuple(f"{geometry}+scaled" for geometry in GEOMETRIES if geometry not in FIXED_RANK))


def design_point(name: str) -> tuple[str, str | None]:
    """(geometry or "adamw", variant: None, "block" or "scaled") of an optimiser name of ``design_points``."""
    if name not in design_points():
        raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(design_points())}.")
    geometry, _, variant = name.partition("+")
    return geometry, variant or None


def _midpoints(grid, best) -> list[float]:
    """The geometric midpoints between ``best`` and its neighbours in ``grid`` (one side only at an edge)."""
    grid = sorted(grid)
    i = grid.index(best)
    return [math.sqrt(best * grid[j]) for j in (i - 1, i + 1) if 0 <= j < len(grid)]


def run_optimizer_comparison(
    converted: str | Path | None,
    output_dir: str | Path,
    *,
    optimizers=tuple(DEFAULT_GRIDS),
    grids: dict | None = None,
    seeds=(0, 1, 2),
    mode: str | None = None,
    block: bool = False,
    lora_r: int = 8,
    max_steps: int = 16,
    batch_size: int = 4,
    block_size: int = 256,
    max_eval_blocks: int | None = 8,
    adamw_learning_rate: float | None = None,
    max_extensions: int = 3,
    progress: bool = True,
    from_scratch: str | None = None,
    compile: bool = False,
    warmup_steps: int = 10,
    corpus_root: str | Path | None = None,
    gauge: str = "balanced",
) -> dict:
    """Sweep, then re-seed, every optimiser; write ``optimizers.json`` after every run. Returns the results.

    Arguments:
        converted: a converted Fiber Bundle folder (its metric at the graft value); None with ``from_scratch``.
        optimizers: names of ``design_points()``: "adamw", geometries of ``training.riemannian.GEOMETRIES`` and
            their block variants ("grassmann+block"); AdamW runs first (its best rate is the rate of the other arms'
            non-factored parameters).
        grids: optimiser -> learning rates of the sweep (default ``DEFAULT_GRIDS``, a block variant its geometry's).
        seeds: the first seeds the sweep, the best rate runs on all of them.
        mode, block, lora_r: the task ("metric-only" or "lora"; "full" from scratch, the default there) and the
            block variant of every geometry.
        max_steps, batch_size, block_size: the token budget of every run; max_eval_blocks: held-out blocks scored.
        adamw_learning_rate: AdamW's rate when AdamW is not swept here (default: AdamW's best rate already in this
            comparison's results, else 3e-2).
        max_extensions: how many grid steps the sweep may add beyond an edge of the grid where the best rate lies.
        from_scratch: an arm of ``analyze scratch`` ("euclidean", "gates-0", "strong-ALPHA"): a fresh ``small``
            model of that arm per run (drawn by the run's seed), the standard library corpus (``corpus_root``: a
            stand-in folder), ``warmup_steps`` of linear warm-up, the geometry on W_Q / W_K only.
        compile: train through ``torch.compile`` (the time per step is then the median step, compilation left out).
        gauge: the factors riemannian-embedded stores its X as (``training.riemannian.GAUGES``; recorded in the
            settings when not the default "balanced").
    """
    from fiber_bundle.training.riemannian import GAUGES
    from fiber_bundle.training.trainer import evaluation_loss, train_model

    points = design_points()
    unknown = [name for name in optimizers if name not in points]
    if unknown or not optimizers:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {list(points)}.")
    if gauge not in GAUGES:
        raise ValueError(f"gauge {gauge!r} is not one of {', '.join(GAUGES)}.")
    if (converted is None) == (from_scratch is None):
        raise ValueError("give a converted folder (training its factored pairs) or from_scratch (an analyze scratch "
                         "arm, trained from random initialisation), not " + ("both." if converted else "neither."))
    mode = mode or ("full" if from_scratch else "metric-only")
    if mode not in (("full",) if from_scratch else ("metric-only", "lora")):
        raise ValueError(f"mode {mode!r}: the comparison trains " + ("'full' from scratch." if from_scratch else
                                                                    "'metric-only' or 'lora'."))
    grids = {**DEFAULT_GRIDS, **{f"{g}+{variant}": grid for g, grid in DEFAULT_GRIDS.items()
                                 for variant in ("block", "scaled")}, **(grids or {})}
    optimizers = sorted(optimizers, key=lambda name: name != "adamw")  # AdamW first
    if from_scratch:
        from .scratch import DEFAULT_MODEL, arm_config, scratch_corpus
        from fiber_bundle.training.scratch import byte_tokenizer, fresh_model

        tokenizer = byte_tokenizer()
        config = arm_config(from_scratch, tokenizer)
        train_set, eval_set = scratch_corpus(tokenizer, block_size, max_eval_blocks or 64, corpus_root)
        probe_ids = torch.tensor(eval_set[:1]["input_ids"])
        new_model = lambda seed: fresh_model(config, seed)  # noqa: E731
        before = evaluation_loss(new_model(seeds[0]), eval_set, batch_size)
        source = {"from_scratch": from_scratch, "model": DEFAULT_MODEL, "warmup_steps": warmup_steps,
                  "riemannian_pairs": "attention", **({"compile": True} if compile else {}),
                  **({"corpus_root": str(corpus_root)} if corpus_root is not None else {})}
    else:
        model, tokenizer = load_causal_lm(converted)
        train_set, eval_set, probe_ids = corpus(tokenizer, block_size, batch_size, max_eval_blocks)
        before = evaluation_loss(model, eval_set, batch_size)
        del model

        def new_model(seed):
            model, _ = load_causal_lm(converted)
            model.init_geometry(seed)
            return model

        source = {"converted": str(converted)}
    settings = {**source, **({"gauge": gauge} if gauge != "balanced" else {}),  # the default is left out of the file
                "mode": mode, "block": block, "lora_r": lora_r if mode == "lora" else None,
                "budget": {"steps": max_steps, "batch_size": batch_size, "block_size": block_size,
                           "tokens": max_steps * batch_size * block_size},
                "eval_blocks": len(eval_set), "seeds": list(seeds), "threads": torch.get_num_threads()}
    # the optimisers are not settings: a rerun may add some to a finished comparison
    file = StudyFile(output_dir, "optimizers", settings, fresh={"eval_loss_before": before},
                     arm_field="optimizer")
    results = file.results
    results.setdefault("best", {})
    adamw_lr = adamw_learning_rate or results["best"].get("adamw", {}).get("learning_rate", 3e-2)

    def run(name: str, seed: int, setting: dict) -> dict:
        lr = setting["learning_rate"]
        if compile:  # a fresh compilation per run (see analyze scratch)
            torch.compiler.reset()
        model = new_model(seed)
        geometry, variant = design_point(name)
        kwargs = dict(learning_rate=lr) if name == "adamw" else dict(
            learning_rate=adamw_lr, optimizer=geometry, riemannian_learning_rate=lr, block=block or variant == "block",
            **({"equal_scale": True} if variant == "scaled" else {}),
            **({"riemannian_gauge": gauge} if geometry == "riemannian-embedded" else {}))
        if from_scratch:
            kwargs.update(warmup_steps=warmup_steps, torch_compile=compile)
            if name != "adamw":
                kwargs.update(riemannian_pairs="attention", orthonormal_start=True)
        clock = StepClock() if from_scratch else None
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            trainer = train_model(model, train_set, scratch, mode=mode, lora_r=lora_r, max_steps=max_steps,
                                  batch_size=batch_size, seed=seed, probe_ids=probe_ids, quiet=True,
                                  callbacks=(clock,) if clock else (), **kwargs)
            seconds = time.perf_counter() - started
        after = evaluation_loss(trainer.model, eval_set, batch_size)
        return {"optimizer": name, "learning_rate": lr, "seed": seed, "adamw_learning_rate": adamw_lr,
                "eval_loss_after": after if math.isfinite(after) else None,
                "seconds_per_step": seconds / max(1, trainer.state.global_step),
                **({"step_seconds_median": clock.median()} if clock else {}),
                "train_loss": [log["loss"] for log in trainer.state.log_history if "loss" in log]}

    def refine(name: str, best: dict, records: list[dict]) -> list[dict]:  # the geometric midpoints around the best
        tried = [r["learning_rate"] for r in records]
        return [{"learning_rate": lr} for lr in _midpoints(tried, best["learning_rate"])]

    def tuned(name: str, best: dict, records: list[dict]) -> None:
        nonlocal adamw_lr
        if name == "adamw":  # the other arms' non-factored parameters train at AdamW's best rate
            adamw_lr = best["learning_rate"]
        tried = sorted(r["learning_rate"] for r in records)
        results["best"][name] = {"learning_rate": best["learning_rate"],
                                 "at_grid_edge": best["learning_rate"] in (tried[0], tried[-1]),
                                 "swept": {r["learning_rate"]: r["eval_loss_after"] for r in records}}

    run_study(file, optimizers, list(seeds), run, grids={name: grids[name] for name in optimizers},
              max_extensions=max_extensions, refine=refine, tuned=tuned, summarise=summarise_optimizers,
              arm_by_arm=True, desc="optimizers", progress=progress)
    return results


def summarise_optimizers(results: dict) -> dict:
    """Per optimiser at its best rate: eval loss after (mean, std over seeds), the difference to AdamW paired by seed
    (mean, std and ``paired_interval``: 95 % t-interval, bootstrap, detectable difference), a block variant's paired
    difference to its plain geometry, and seconds per step relative to AdamW (the median step where runs recorded it:
    compilation and evaluation left out)."""

    def chosen(name, lr):
        return [r for r in results["runs"] if r["optimizer"] == name and r["learning_rate"] == lr]

    def step_time(runs):
        return summarise([r.get("step_seconds_median") or r["seconds_per_step"] for r in runs])["mean"]

    def paired(mine, reference):
        by_seed = {r["seed"]: r["eval_loss_after"] for r in reference}
        return [r["eval_loss_after"] - by_seed[r["seed"]] for r in mine
                if r["eval_loss_after"] is not None and by_seed.get(r["seed"]) is not None]

    summary = {}
    for name, best in results["best"].items():
        mine = chosen(name, best["learning_rate"])
        loss = summarise([r["eval_loss_after"] for r in mine])
        summary[name] = {"learning_rate": best["learning_rate"], "at_grid_edge": best["at_grid_edge"],
                         "seeds": len(mine), "diverged": sum(r["eval_loss_after"] is None for r in mine),
                         "eval_loss_after_mean": loss["mean"], "eval_loss_after_std": loss["std"],
                         "seconds_per_step_mean": step_time(mine)}
    if "adamw" in summary:
        reference = summary["adamw"]
        adamw = chosen("adamw", reference["learning_rate"])
        for name, row in summary.items():
            differences = paired(chosen(name, row["learning_rate"]), adamw)
            row["loss_vs_adamw"], row["loss_vs_adamw_std"] = summarise(differences)["mean"], summarise(differences)[
                "std"]  # paired by seed
            if name != "adamw":
                row["loss_vs_adamw_interval"] = paired_interval(differences)
            row["time_vs_adamw"] = row["seconds_per_step_mean"] / reference["seconds_per_step_mean"]
    for name, row in summary.items():  # a variant against its plain geometry; a block variant against the scale control
        plain, _, variant = name.partition("+")
        others = {"loss_vs_plain_interval": plain} if variant else {}
        if variant == "block":
            others["loss_vs_scaled_interval"] = f"{plain}+scaled"
        for key, other in others.items():
            if other in summary:
                row[key] = paired_interval(paired(chosen(name, row["learning_rate"]),
                                                  chosen(other, summary[other]["learning_rate"])))
    return summary
