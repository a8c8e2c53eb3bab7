"""Does the geometry pay when it is learned from the start? Small models trained from scratch on the standard library's
source (byte-level, split by module), three ways, at equal parameters and equal tokens:

1. ``euclidean``: metric off (``metric_rank = ffn_metric_rank = 0``), the MLP widened by the metric's parameter count;
2. ``gates-0``: the Riemannian model at the graft-style start (alpha = gamma = beta = 0, generators random);
3. ``strong-*``: the Riemannian model with a strong attention metric from the first step (alpha = ``STRONG`` values,
   gamma = 1: the exact squared geodesic distance; beta = 0 as in arm 2, so the attention metric's start is the only
   difference).

Each arm's learning rate is swept on the first seed and its best rate re-run on every seed (``study.run_study``, arms
interleaved); every run of a seed sees the same blocks in the same order (the Trainer's sampler is seeded by the run's
seed, the split is fixed). Each run (``train_arm``) records its held-out loss curve, time per step, and at the end, on
held-out text: the rank-collapse residual per layer, the numerical rank of the attention score matrices (float64), the
learned gates and the connection proxies. Results are written after every run; a rerun with the same settings
continues where a stopped one ended.
"""

import math
import tempfile
import time
from pathlib import Path

import torch

from .measures import energy_effective_rank, numerical_rank, paired_interval, summarise
from .study import StepClock, StudyFile, past_edge, run_study, score

STRONG = (1.0, 10.0)  # alpha at the strong starts (gamma = 1)
DEFAULT_MODEL = dict(num_hidden_layers=4, hidden_size=192, intermediate_size=512, num_attention_heads=6,
                     num_key_value_heads=2, metric_rank=2, ffn_metric_rank=2, metric_hidden=32,
                     max_position_embeddings=1024, tie_word_embeddings=True)
DEFAULT_RATES = (1e-3, 3e-3, 1e-2)


def arm_overrides(strong=STRONG) -> dict[str, dict]:
    """Arm name -> config fields that differ from the Riemannian model (the Euclidean arm's MLP width is added later,
    by ``equal_parameter_twin``)."""
    arms = {"euclidean": {"metric_rank": 0, "ffn_metric_rank": 0}, "gates-0": {}}
    for alpha in strong:
        arms[f"strong-{alpha:g}"] = {"metric_gate_init": alpha, "flatness_gate_init": 1.0}
    return arms


def parameter_count(config) -> int:
    """Parameters of a ``FiberBundleForCausalLM`` of ``config``, counted on the meta device (nothing allocated)."""
    from modeling_fiber_bundle import FiberBundleForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in FiberBundleForCausalLM(config).parameters())


def equal_parameter_twin(config):
    """The Euclidean twin of ``config`` (metric off) with ``intermediate_size`` raised so that its parameter count is
    the closest to the Riemannian model's: the metric's parameters become MLP width. An attention-only model has no
    MLP: its twin is the metric-off model, with fewer parameters (recorded with the arm)."""
    target = parameter_count(config)
    twin = config.to_dict()
    twin.update(metric_rank=0, ffn_metric_rank=0)
    base = type(config)(**_fields(twin))
    if config.attention_only:  # no MLP to widen: the twin is the metric-off model, smaller by the metric's parameters
        return base
    per_unit = parameter_count(type(config)(**_fields({**twin, "intermediate_size": twin["intermediate_size"] + 1})))
    per_unit -= parameter_count(base)  # gate, up and down projections: 3 x hidden (+ biases)
    twin["intermediate_size"] += round((target - parameter_count(base)) / per_unit)
    return type(config)(**_fields(twin))


def _fields(config_dict: dict) -> dict:
    return {k: v for k, v in config_dict.items() if k not in ("model_type", "transformers_version", "architectures")}


def arm_configs(model_fields: dict, tokenizer, strong=STRONG) -> dict:
    """Arm name -> FiberBundleConfig, every arm with the Riemannian model's parameter count."""
    from fiber_bundle.training.scratch import scratch_config

    riemannian = scratch_config(dict(model_fields), tokenizer)
    configs = {}
    for arm, overrides in arm_overrides(strong).items():
        if arm == "euclidean":
            configs[arm] = equal_parameter_twin(riemannian)
        else:
            configs[arm] = scratch_config({**model_fields, **overrides}, tokenizer)
    return configs


def arm_config(arm: str, tokenizer, model_fields: dict | None = None):
    """The FiberBundleConfig of one arm by name ("euclidean", "gates-0", "strong-ALPHA" for any ALPHA) at
    ``model_fields`` (default ``DEFAULT_MODEL``); an unknown name is refused with the arms there are."""
    alpha = arm.removeprefix("strong-")
    try:
        configs = arm_configs(model_fields or DEFAULT_MODEL, tokenizer,
                              strong=(float(alpha),) if alpha != arm else ())
    except ValueError:  # "strong-x": no number
        configs = {}
    if arm not in configs:
        raise ValueError(f"{arm!r} is not an analyze scratch arm: euclidean, gates-0 or strong-ALPHA (e.g. strong-1).")
    return configs[arm]


def scratch_corpus(tokenizer, block_size: int, eval_blocks: int, root: str | Path | None = None):
    """(train blocks, held-out blocks) of the standard library corpus (``root``: its folder, default this Python's)
    split by module with split seed 0, so every run scores on the same held-out blocks; the held-out blocks are spread
    evenly through the split."""
    from fiber_bundle.training.data import pack_blocks, stdlib_corpus

    train_text, eval_text = stdlib_corpus(seed=0, root=root)
    train_set = pack_blocks(train_text, tokenizer, block_size)
    eval_set = pack_blocks(eval_text, tokenizer, block_size)
    if eval_blocks < len(eval_set):
        stride = len(eval_set) // eval_blocks
        eval_set = eval_set.select(range(0, stride * eval_blocks, stride))
    return train_set, eval_set


def measure_trained(model, eval_ids: torch.Tensor) -> dict:
    """What the trained ``model`` does on held-out ``eval_ids`` (a few blocks): the rank-collapse residual of the
    residual stream per layer, the numerical rank of every head's score matrix (float64 copy, rtol 1e-10), the gates
    and the connection proxies."""
    import copy

    from fiber_bundle.training.geometry_logging import gate_values

    from .probes import geometry_proxies, intrinsic_rank, model_collapse, residual_stream

    model.eval()
    collapse = model_collapse(model, eval_ids)
    exact = copy.deepcopy(model).to(torch.float64)
    rank = intrinsic_rank(exact, eval_ids)
    # numerical rank (rtol 1e-10) of each held-out block's hidden states (n x D) entering every layer and leaving the
    # last, mean over blocks: rank collapse drives it to 1
    stream = residual_stream(exact, eval_ids)
    hidden_rank = [numerical_rank(states).double().mean().item() for states in stream]
    # the same states' energy effective rank (singular values holding 90 % of the energy, not centred: X = 1x^T has
    # rank 1): numerical rank stays full unless collapse is exact, the energy rank shows how far towards it X has gone
    hidden_energy = [energy_effective_rank(states, threshold=0.9).double().mean().item() for states in stream]
    del exact, stream
    gates = {}
    for key, value in gate_values(model).items():  # geometry/layer{i}/{alpha,gamma,beta}
        _, layer, gate = key.split("/")
        gates.setdefault(gate, {})[int(layer.removeprefix("layer"))] = value
    return {
        "residual_per_layer": [row["mean"] for row in collapse["per_depth"]],
        "residual_per_layer_without_first_token": [row["mean"] for row in collapse["per_depth_without_first_token"]],
        "hidden_numerical_rank_per_layer": hidden_rank,
        "hidden_energy_rank_per_layer": hidden_energy,
        "score_numerical_rank_per_layer": [sum(layer["score_numerical_rank"]) / len(layer["score_numerical_rank"])
                                           for layer in rank["layers"]],
        "heads_above_gram_bound": rank["summary"]["heads_above_gram_bound"], "heads": rank["summary"]["heads"],
        "head_dim": rank["head_dim"], "score_tokens": rank["tokens"],
        "gates": {gate: [values[i] for i in sorted(values)] for gate, values in gates.items()},
        "proxies": geometry_proxies(model, eval_ids),
    }


def scratch_study(
    output_dir: str | Path,
    *,
    seeds=(0, 1, 2),
    learning_rates=DEFAULT_RATES,
    strong=STRONG,
    arms=None,
    model_fields: dict | None = None,
    max_steps: int = 200,
    batch_size: int = 16,
    block_size: int = 128,
    eval_blocks: int = 64,
    eval_every: int = 25,
    warmup_steps: int = 10,
    probe_blocks: int = 4,
    max_extensions: int = 1,
    corpus_root: str | Path | None = None,
    progress: bool = True,
    compile: bool = False,
    metric_rate_ratios=None,
    metric_rate_extensions: int = 0,
    steps_by_arm: dict | None = None,
    reuse_from=(),
    tuning_seed: int | None = None,
) -> dict:
    """Sweep each arm's learning rate on ``seeds[0]`` (``learning_rates``, extended by up to ``max_extensions`` grid
    steps while the best rate lies at an edge), re-run the best on every seed; with ``tuning_seed`` the sweep runs on
    that seed instead, and the best on every seed of ``seeds``, so that no mean or interval holds the seed that chose
    the rates; write ``scratch.json`` after every
    run (``study.run_study``; ``reports.run_scratch_comparison`` also draws ``scratch.png``). ``compile`` trains through
    ``torch.compile`` (transformers' ``torch_compile``); a run's time per step then leaves out the compilation (its
    first step's excess over the median step, recorded as ``compile_seconds``). ``metric_rate_ratios``: after an arm's
    rate sweep, the metric's parameters get their own rate (``metric_learning_rate`` = best rate x ratio, each ratio
    tried on ``seeds[0]``, the one-rate run counting as ratio 1) and the best pair is re-run on every seed; the
    Euclidean arm has no metric and keeps one rate. ``metric_rate_extensions``: while the best metric rate lies at an
    edge of those tried, one ratio step further, at most that many times (``metric_rate_extension``).
    ``steps_by_arm``: each named arm's own number of steps (an equal-time comparison gives each arm the steps its time
    per step allows in one budget), ``max_steps`` for the others. ``reuse_from``: other studies' folders (or
    ``scratch.json`` files) whose finished runs this study would repeat exactly (``reusable_runs``) are taken over
    instead of trained again, each marked ``reused_from``. Returns the results (``summary``: per arm, the best rate's
    final held-out loss mean ± std, its difference to the Euclidean arm paired by seed, time per step, residual per
    layer, ...)."""
    from fiber_bundle.training.scratch import byte_tokenizer

    model_fields = {**DEFAULT_MODEL, **(model_fields or {})}
    tokenizer = byte_tokenizer()
    configs = arm_configs(model_fields, tokenizer, strong)
    arms = list(configs) if arms is None else list(arms)
    unknown = [arm for arm in arms if arm not in configs]
    if unknown or not arms:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {list(configs)}.")
    if not seeds or not learning_rates:
        raise ValueError("give at least one seed and one learning rate.")
    train_set, eval_set = scratch_corpus(tokenizer, block_size, eval_blocks, corpus_root)
    probe_ids = torch.tensor(eval_set[:probe_blocks]["input_ids"])
    settings = {
        "model": model_fields, "arms": {arm: {"parameters": parameter_count(configs[arm]),
                                              "intermediate_size": configs[arm].intermediate_size,
                                              **arm_overrides(strong)[arm]} for arm in arms},
        "seeds": list(seeds), "learning_rates": sorted(float(lr) for lr in learning_rates),
        "budget": {"steps": max_steps, "batch_size": batch_size, "block_size": block_size,
                   "tokens": max_steps * batch_size * block_size, "warmup_steps": warmup_steps},
        "eval_blocks": len(eval_set), "eval_every": eval_every, "probe_blocks": probe_blocks,
        "max_extensions": max_extensions, "tokenizer": "byte-level (258 tokens)",
        "corpus": {"train_blocks": len(train_set), "eval_blocks_available": eval_blocks, "split_seed": 0,
                   **({"root": str(corpus_root)} if corpus_root is not None else {})},
        "threads": torch.get_num_threads(),
        **({"compile": True} if compile else {}),  # absent when off: earlier comparisons continue unchanged
        **({"metric_rate_ratios": sorted(float(r) for r in metric_rate_ratios)} if metric_rate_ratios else {}),
        **({"metric_rate_extensions": int(metric_rate_extensions)} if metric_rate_extensions else {}),
        **({"steps_by_arm": {arm: int(steps_by_arm[arm]) for arm in sorted(steps_by_arm)}} if steps_by_arm else {}),
        **({"tuning_seed": int(tuning_seed)} if tuning_seed is not None else {}),
    }
    if metric_rate_extensions and not metric_rate_ratios:
        raise ValueError("metric_rate_extensions extends the metric's own rate sweep: give metric_rate_ratios too "
                         "(--metric-rate-ratios 1 3 10).")
    if steps_by_arm and (unknown := sorted(set(steps_by_arm) - set(arms))):
        raise ValueError(f"steps given for arm(s) {unknown} that are not compared; arms: {arms}.")
    file = StudyFile(output_dir, "scratch", settings, setting_fields=("learning_rate", "metric_learning_rate"))
    file.reusable = reusable_runs(settings, reuse_from)
    results = file.results
    results["best_learning_rate"] = {}  # this run's arms only, chosen afresh from the runs
    if metric_rate_ratios:
        results["best_metric_learning_rate"] = {}

    def run(arm: str, seed: int, setting: dict) -> dict:
        return train_arm(configs[arm], arm, seed, setting, train_set=train_set, eval_set=eval_set,
                         probe_ids=probe_ids, steps=(steps_by_arm or {}).get(arm, max_steps), batch_size=batch_size,
                         warmup_steps=warmup_steps, eval_every=eval_every, compile=compile)

    def refine(arm: str, best: dict, records: list[dict]) -> list[dict]:  # the metric's own rate around the best rate
        lr = best["learning_rate"]
        grid = [float(f"{lr * ratio:.3g}") for ratio in (metric_rate_ratios or ()) if ratio != 1]  # 1: the sweep's
        if arm == "euclidean" or not grid:
            return []
        return [{"learning_rate": lr, "metric_learning_rate": rate}
                for rate in grid + metric_rate_extension(lr, grid, records, metric_rate_extensions)]

    def tuned(arm: str, best: dict, records: list[dict]) -> None:
        results["best_learning_rate"][arm] = best["learning_rate"]
        if metric_rate_ratios:
            results["best_metric_learning_rate"][arm] = best.get("metric_learning_rate")

    grid = settings["learning_rates"]
    run_study(file, arms, list(seeds), run, grids={arm: grid for arm in arms}, max_extensions=max_extensions,
              refine=refine, refine_rounds=1 + metric_rate_extensions, tuned=tuned, summarise=summarise_scratch,
              tuning_seed=tuning_seed, desc="scratch runs", progress=progress)
    return results


def metric_rate_extension(lr: float, grid: list[float], records: list[dict], extensions: int) -> list[float]:
    """The metric rates past ``grid``'s (at backbone rate ``lr``) that the tuning ``records`` call for: those already
    tried, and, once the grid is tried, one step further while the best metric rate tried at ``lr`` (the one-rate run
    counting as ``lr`` itself) lies at an edge of them (the ratio of the two rates nearest that edge, kept to 3
    significant figures), up to ``extensions`` rates past the grid in all."""
    tried = {r.get("metric_learning_rate", lr): r for r in records if r["learning_rate"] == lr}
    rates = {lr, *grid}
    if any(rate not in tried for rate in rates):  # the grid first
        return []
    beyond = sorted(rate for rate in tried if rate not in rates)
    ordered = sorted(tried)
    # why the edge's own ratio (past_edge's default): the grid's spacing where it ran out
    further = past_edge(min(ordered, key=lambda rate: score(tried[rate])), ordered)
    return beyond + ([further] if len(beyond) < extensions and further is not None else [])


def train_arm(config, arm: str, seed: int, setting: dict, *, train_set, eval_set, probe_ids: torch.Tensor, steps: int,
              batch_size: int, warmup_steps: int, eval_every: int, compile: bool) -> dict:
    """One run of the scratch study: a fresh model of ``config`` drawn by ``seed``, trained in full for ``steps`` at
    ``setting``'s rates (``learning_rate``, ``metric_learning_rate``) with a held-out evaluation every ``eval_every``
    steps; its record holds the loss curves, the time per step and ``measure_trained`` before and after."""
    from fiber_bundle.training.scratch import fresh_model
    from fiber_bundle.training.trainer import train_model

    lr, metric_lr = setting["learning_rate"], setting.get("metric_learning_rate")
    if compile:  # each run compiles its own model afresh: a model of another shape after the first would be
        # compiled with dynamic shapes (an inductor error in torch 2.13 on the CPU), and after 8 models torch's
        # recompile limit would silently fall back to eager
        torch.compiler.reset()
    model = fresh_model(config, seed)
    at_init = measure_trained(model, probe_ids)  # the same measures before the first step
    clock = StepClock()
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        trainer = train_model(model, train_set, scratch, mode="full", max_steps=steps, batch_size=batch_size,
                              learning_rate=lr, metric_learning_rate=metric_lr, warmup_steps=warmup_steps,
                              seed=seed, eval_dataset=eval_set,
                              eval_strategy="steps", eval_steps=eval_every, logging_steps=eval_every,
                              probe_ids=probe_ids, quiet=True, torch_compile=compile, callbacks=(clock,))
        seconds = time.perf_counter() - started
    history = trainer.state.log_history
    evals = [(log["step"], log["eval_loss"]) for log in history if "eval_loss" in log]
    eval_seconds = sum(log.get("eval_runtime", 0.0) for log in history if "eval_loss" in log)
    if not evals or evals[-1][0] != trainer.state.global_step:  # max_steps not a multiple of eval_every
        evals.append((trainer.state.global_step, trainer.evaluate()["eval_loss"]))
    compile_seconds = clock.first_step_excess() if compile else 0.0
    final = evals[-1][1]
    finite = final is not None and math.isfinite(final)  # Trainer.evaluate gives nan for a diverged model
    return {"arm": arm, "learning_rate": lr, "seed": seed, **({"metric_learning_rate": metric_lr}
                                                               if metric_lr is not None else {}),
            "steps": trainer.state.global_step, "eval_loss_after": final if finite else None,
            "eval_curve": evals, "train_loss": [(log["step"], log["loss"]) for log in history if "loss" in log],
            "seconds_per_step": (seconds - eval_seconds - compile_seconds) / max(1, trainer.state.global_step),
            "step_seconds_median": clock.median(), "seconds": seconds,
            **({"compile_seconds": compile_seconds} if compile else {}),
            **(measure_trained(trainer.model, probe_ids) if finite else {}), "at_init": at_init}


# Settings that choose which runs a study makes, not what one run is: a run of another study that differs only in these
# is the same run (the thread count changes only the order of floating-point sums).
_STUDY_ONLY = ("arms", "seeds", "learning_rates", "max_extensions", "metric_rate_ratios", "metric_rate_extensions",
               "steps_by_arm", "threads", "tuning_seed")


def _steps_of(settings: dict, arm: str) -> int:
    return (settings.get("steps_by_arm") or {}).get(arm, settings["budget"]["steps"])


def reusable_runs(settings: dict, sources) -> list[dict]:
    """The finished runs of other studies (``sources``: folders or ``scratch.json`` paths) that a study of
    ``settings`` would repeat exactly: same model, data, budget and held-out blocks, the arm configured alike and given
    the same number of steps (its rate, metric rate and seed are matched run by run). Each comes back marked
    ``reused_from``. A source that is missing, or whose model, data or budget differ, is refused with the differences
    named (reuse is asked for on purpose; a silent no-op would train everything again)."""
    import json

    found = []
    for source in sources or ():
        path = Path(source)
        path = path / "scratch.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"no study to reuse at {source}: expected a folder holding scratch.json (an "
                                    "'analyze scratch --out' folder) or the scratch.json file itself.")
        other = json.loads(path.read_text())
        budget = lambda s: {k: v for k, v in s.get("budget", {}).items() if k not in ("steps", "tokens")}  # noqa: E731
        differ = sorted(key for key in set(settings) | set(other)
                        if key not in (*_STUDY_ONLY, "budget", "runs", "summary", "best_learning_rate",
                                       "best_metric_learning_rate") and settings.get(key) != other.get(key))
        differ += ["budget"] if budget(settings) != budget(other) else []
        if differ:
            raise ValueError(f"cannot reuse the runs of {path}: these settings differ from this study's: "
                             f"{', '.join(differ)}; reuse only a study of the same model, data and budget.")
        for record in other.get("runs", []):
            arm = record["arm"]
            steps = _steps_of(settings, arm) if arm in settings["arms"] else None
            if other["arms"].get(arm) == settings["arms"].get(arm) and _steps_of(other, arm) == steps == record.get(
                    "steps"):
                found.append({**record, "reused_from": record.get("reused_from", str(path))})
    return found


def chosen_runs(results: dict, arm: str) -> list[dict]:
    """A scratch study's evaluation runs of ``arm``: its seeds (``seeds``, not a separate tuning seed) at the arm's best
    rate and, where the metric's own rate was swept, its best metric rate; diverged runs included."""
    metric_rate, evaluation = results.get("best_metric_learning_rate", {}).get(arm), set(results["seeds"])
    return [r for r in results["runs"] if r["arm"] == arm and r["learning_rate"] == results["best_learning_rate"][arm]
            and r.get("metric_learning_rate") == metric_rate and r["seed"] in evaluation]


def paired_differences(results: dict, arm: str, reference: str = "euclidean") -> dict[int, float]:
    """seed -> ``arm``'s final held-out loss minus ``reference``'s, over the study's evaluation runs (``chosen_runs``)
    where both finished, in the order of ``arm``'s runs."""
    theirs = {r["seed"]: r["eval_loss_after"] for r in chosen_runs(results, reference)}
    return {r["seed"]: r["eval_loss_after"] - theirs[r["seed"]] for r in chosen_runs(results, arm)
            if r["eval_loss_after"] is not None and theirs.get(r["seed"]) is not None}


def summarise_scratch(results: dict) -> dict:
    """Per arm at its best rate: final held-out loss (mean, std over seeds), its difference to the Euclidean arm's
    (paired by seed), time per step (and relative to Euclidean), the per-layer residual, score rank and gates (means over
    seeds), and whether the best rate lies at the sweep's edge. The seeds are the evaluation seeds (``seeds``): a
    separate ``tuning_seed`` chose the rates and enters no mean or interval; without one, ``seeds[0]`` tuned and counts
    too, and each interval is also given without it."""
    tuning = results.get("tuning_seed", results["seeds"][0])
    tried = {arm: sorted({r["learning_rate"] for r in results["runs"] if r["arm"] == arm
                          and r["seed"] == tuning}) for arm in results["best_learning_rate"]}
    metric_rates = results.get("best_metric_learning_rate", {})
    summary = {}
    for arm, lr in results["best_learning_rate"].items():
        mine = chosen_runs(results, arm)
        loss = summarise([r["eval_loss_after"] for r in mine])
        finished = [r for r in mine if r["eval_loss_after"] is not None]
        per_layer = lambda key: [summarise(column)["mean"] for column in zip(*(r[key] for r in finished))]  # noqa: E731
        summary[arm] = {
            "learning_rate": lr, "at_sweep_edge": len(tried[arm]) > 1 and lr in (tried[arm][0], tried[arm][-1]),
            "seeds": len(mine),
            "diverged": len(mine) - len(finished), "parameters": results["arms"][arm]["parameters"],
            "eval_loss_after_mean": loss["mean"], "eval_loss_after_std": loss["std"],
            "seconds_per_step_mean": summarise([r["seconds_per_step"] for r in mine])["mean"],
            "sweep": {r["learning_rate"]: r["eval_loss_after"] for r in results["runs"]
                      if r["arm"] == arm and r["seed"] == tuning and "metric_learning_rate" not in r},
            **({"metric_learning_rate": metric_rates.get(arm),
                "metric_sweep": {r["metric_learning_rate"]: r["eval_loss_after"] for r in results["runs"]
                                 if r["arm"] == arm and r["seed"] == tuning
                                 and r["learning_rate"] == lr and "metric_learning_rate" in r}}
               if "best_metric_learning_rate" in results else {}),
            "steps": summarise([r.get("steps") for r in mine])["mean"],
            "residual_per_layer": per_layer("residual_per_layer"),
            **({"hidden_numerical_rank_per_layer": per_layer("hidden_numerical_rank_per_layer"),
                "at_init": {key: [summarise(column)["mean"] for column in zip(*(r["at_init"][key] for r in finished))]
                            for key in ("residual_per_layer", "hidden_numerical_rank_per_layer",
                                        "hidden_energy_rank_per_layer", "score_numerical_rank_per_layer")
                            if all(key in r["at_init"] for r in finished)}}
               if finished and all("at_init" in r for r in finished) else {}),  # runs recorded before these measures
            **({"hidden_energy_rank_per_layer": per_layer("hidden_energy_rank_per_layer")}
               if finished and all("hidden_energy_rank_per_layer" in r for r in finished) else {}),
            "score_numerical_rank_per_layer": per_layer("score_numerical_rank_per_layer"),
            "heads_above_gram_bound": summarise([r["heads_above_gram_bound"] for r in finished])["mean"],
            "gates": {gate: [summarise(column)["mean"] for column in zip(*(r["gates"][gate] for r in finished))]
                      for gate in (finished[0]["gates"] if finished else {})},
            "proxies": {key: [summarise(column)["mean"] for column in zip(*(r["proxies"][key] for r in finished))]
                        for key in ((finished[0].get("proxies") or {}) if finished else {})},
        }
    if "euclidean" in summary:
        for arm, row in summary.items():
            pairs = paired_differences(results, arm)
            differences = list(pairs.values())
            paired = summarise(differences)
            row["loss_vs_euclidean"], row["loss_vs_euclidean_std"] = paired["mean"], paired["std"]
            if arm != "euclidean":  # t-interval, bootstrap and the smallest detectable difference, paired by seed
                row["loss_vs_euclidean_interval"] = paired_interval(differences)
                if "tuning_seed" not in results:  # seeds[0] chose the rates, which favours the arms on it
                    row["loss_vs_euclidean_interval_without_sweep_seed"] = paired_interval(
                        [difference for seed, difference in pairs.items() if seed != tuning])
            times = row["seconds_per_step_mean"], summary["euclidean"]["seconds_per_step_mean"]
            row["time_vs_euclidean"] = times[0] / times[1] if None not in times else None  # None: no evaluation run yet
    return summary
