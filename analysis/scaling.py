"""Does the geometry's edge grow with size? The from-scratch comparison (``scratch``) read across model sizes.

Each size is one scratch study (``analyze scratch``) of the same protocol: an arm (``strong-1``) against its
equal-parameter Euclidean twin, rates swept on a tuning seed that is in no interval (``--tuning-seed``), the chosen
rates re-run on the evaluation seeds. Per size: the paired difference (arm minus twin, by seed) with its intervals,
whether the loss curves had flattened (``measures.curve_settling``), and, where an equal-time study of that size is
given (the twin trained for the steps its faster step allows in the arm's time, ``--steps-by-arm``), the paired
difference at equal wall time. Across sizes: the slope of the difference against log10(parameters) with a bootstrap
over the seeds within each size (``measures.size_trend``).
"""

import statistics

from .measures import curve_settling, paired_interval, size_trend, summarise
from .scratch import chosen_runs, paired_differences, summarise_scratch


def _mean_curve(runs: list[dict]) -> list[tuple[int, float]]:
    """The held-out loss curve averaged over finished runs of the same steps: (step, mean loss) pairs."""
    finished = [r["eval_curve"] for r in runs if r["eval_loss_after"] is not None]
    return [(points[0][0], summarise([loss for _, loss in points])["mean"]) for points in zip(*finished)]


def _check_study(results: dict, name: str, arm: str, reference: str, *, tuned_apart: bool = True) -> None:
    """Refuse a study that does not compare both arms, or (``tuned_apart``) chose its rates on an evaluation seed."""
    missing = [a for a in (arm, reference) if a not in results.get("arms", {})]
    if missing:
        raise ValueError(f"{name} compares no arm {missing[0]!r} (its arms: {sorted(results.get('arms', {}))}); "
                         f"give studies that ran both {arm!r} and {reference!r}.")
    untuned = [a for a in (arm, reference) if a not in results.get("best_learning_rate", {})]
    if untuned:
        raise ValueError(f"{name} has not finished sweeping the rates of {untuned[0]!r}: finish the study by "
                         "rerunning the analyze scratch command that started it.")
    if tuned_apart and "tuning_seed" not in results:
        raise ValueError(f"{name} chose its rates on seed {results['seeds'][0]}, which is in its intervals; rerun it "
                         "with --tuning-seed SEED and its evaluation seeds in --seeds (--reuse-runs FOLDER takes over "
                         "the runs it already made).")


def _metric_edge(row: dict) -> dict:
    """``metric_at_sweep_edge`` for an arm whose metric rate was swept (``summarise_scratch``'s row): whether the chosen
    metric rate is the lowest or highest tried at the chosen backbone rate (the one-rate run counting as that rate)."""
    if not row.get("metric_sweep"):
        return {}
    lr = row["learning_rate"]
    tried = sorted({lr, *(float(rate) for rate in row["metric_sweep"])})
    return {"metric_at_sweep_edge": (row.get("metric_learning_rate") or lr) in (tried[0], tried[-1])}


def step_ratio(results: dict, arm: str = "strong-1", reference: str = "euclidean") -> dict | None:
    """``arm``'s training step over ``reference``'s as the runs took it: per evaluation seed, the ratio of the two runs'
    median steps (``StepClock``: the compiled step with evaluations and compilation left out; a study runs each seed's
    arms back to back), the median and range over seeds, the reference's steps that the median ratio allows in the
    arm's time (``--steps-by-arm``), and the hosts and largest load average the runs recorded (runs made before studies
    recorded their host are counted apart). None where a run has no step clock."""
    clock = {a: {r["seed"]: r for r in chosen_runs(results, a)} for a in (arm, reference)}
    seeds = sorted(set(clock[arm]) & set(clock[reference]))
    runs = [clock[a][seed] for seed in seeds for a in (arm, reference)]
    if not seeds or any(r.get("step_seconds_median") is None for r in runs):
        return None
    ratios = {seed: clock[arm][seed]["step_seconds_median"] / clock[reference][seed]["step_seconds_median"]
              for seed in seeds}
    median = statistics.median(ratios.values())
    hosts = [r["host"] for r in runs if r.get("host")]
    loads = [value for host in hosts for key in ("load_average_before", "load_average_after")
             for value in host.get(key) or ()]
    return {"per_seed": {str(seed): value for seed, value in ratios.items()}, "median": median,
            "range": [min(ratios.values()), max(ratios.values())],
            "reference_steps_at_equal_time": round(results["budget"]["steps"] * median),
            "cpus": sorted({host["cpu"] for host in hosts}), "runs_without_host": len(runs) - len(hosts),
            "load_average_max": max(loads) if loads else None}


def size_row(results: dict, name: str, *, arm: str = "strong-1", reference: str = "euclidean",
             equal_time: tuple[str, dict] | None = None) -> dict:
    """One size of the scaling study from its scratch study's ``results`` (``name``: where it came from, for messages):
    parameters, budget, chosen rates, the paired difference and its intervals, each arm's curve settling, and at equal
    time (``equal_time``: (name, results) of the equal-time study of the same model) its paired difference over the
    same evaluation seeds."""
    _check_study(results, name, arm, reference)
    summary = summarise_scratch(results)
    differences = paired_differences(results, arm, reference)
    curves = {a: _mean_curve(chosen_runs(results, a)) for a in (reference, arm)}
    if len(differences) < 2:
        raise ValueError(f"{name} has {len(differences)} evaluation seed(s) with both arms finished; a size needs two "
                         "or more: finish the study by rerunning the analyze scratch command that started it.")
    row = {
        "study": name, "model": results["model"], "parameters": results["arms"][arm]["parameters"],
        "reference_parameters": results["arms"][reference]["parameters"], "steps": results["budget"]["steps"],
        "tokens": results["budget"]["tokens"], "tuning_seed": results["tuning_seed"], "seeds": sorted(differences),
        "rates": {a: {"learning_rate": summary[a]["learning_rate"], "at_sweep_edge": summary[a]["at_sweep_edge"],
                      **({"metric_learning_rate": summary[a]["metric_learning_rate"]}
                         if summary[a].get("metric_learning_rate") is not None else {}),
                      **_metric_edge(summary[a])} for a in (reference, arm)},
        "loss": {a: {"mean": summary[a]["eval_loss_after_mean"], "std": summary[a]["eval_loss_after_std"]}
                 for a in (reference, arm)},
        "differences": {str(seed): value for seed, value in sorted(differences.items())},
        "paired": paired_interval(list(differences.values())),
        "settling": {a: curve_settling(curve) for a, curve in curves.items()},
        "curves": curves,
        "seconds_per_step_in_runs": {a: summary[a]["seconds_per_step_mean"] for a in (reference, arm)},
        "step_ratio": step_ratio(results, arm, reference),
    }
    if equal_time is not None:
        timed_name, timed = equal_time
        _check_study(timed, timed_name, arm, reference, tuned_apart=False)  # it re-runs rates chosen here
        if timed["model"] != results["model"]:
            raise ValueError(f"{timed_name} trains another model than {name}; give each size's equal-time study.")
        timed_summary = summarise_scratch(timed)
        for a in (reference, arm):
            ours, theirs = row["rates"][a], timed_summary[a]
            if (theirs["learning_rate"], theirs.get("metric_learning_rate")) != (
                    ours["learning_rate"], ours.get("metric_learning_rate")):
                raise ValueError(f"{timed_name} trains {a} at other rates than {name} chose; rerun it at the chosen "
                                 f"rates (--learning-rates {ours['learning_rate']:g}).")
        timed_differences = {seed: value for seed, value in paired_differences(timed, arm, reference).items()
                             if seed in differences}  # the size's evaluation seeds only
        steps = {a: (timed.get("steps_by_arm") or {}).get(a, timed["budget"]["steps"]) for a in (reference, arm)}
        row["equal_time"] = {"study": timed_name, "steps": steps, "seeds": sorted(timed_differences),
                             "differences": {str(s): v for s, v in sorted(timed_differences.items())},
                             "paired": paired_interval(list(timed_differences.values()))}
    return row


def scaling_summary(studies: list[tuple[str, dict]], *, equal_time: list[tuple[str, dict]] = (),
                    arm: str = "strong-1", reference: str = "euclidean") -> dict:
    """The scaling study from named scratch studies, one per size (``studies``: (name, results)), and optionally an
    equal-time study for some of the sizes (``equal_time``, matched to a size by its model). Rows by parameters, and
    with three or more sizes the trend of the paired difference in log10(parameters) (``measures.size_trend``)."""
    if not studies:
        raise ValueError("give one scratch study per model size.")
    by_model = {}
    for name, results in equal_time:
        matches = [n for n, r in studies if r.get("model") == results.get("model")]
        if not matches:
            raise ValueError(f"{name} is an equal-time study of no size given; its model: {results.get('model')}.")
        by_model[matches[0]] = (name, results)
    rows = sorted((size_row(results, name, arm=arm, reference=reference, equal_time=by_model.get(name))
                   for name, results in studies), key=lambda row: row["parameters"])
    for smaller, larger in zip(rows, rows[1:]):
        if smaller["parameters"] == larger["parameters"]:
            raise ValueError(f"{smaller['study']} and {larger['study']} are the same size "
                             f"({larger['parameters']:,} parameters): give one study per size.")
    sizes = [(row["parameters"], list(row["differences"].values())) for row in rows]
    return {"arm": arm, "reference": reference, "sizes": rows,
            "trend": size_trend(sizes) if len(rows) >= 3 else None}
