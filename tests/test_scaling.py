"""The scaling study (``analysis/scaling.py``): the from-scratch comparison read across model sizes, its two estimators
(``measures.curve_settling``, ``measures.size_trend``) on constructed inputs with known answers, and ``analyze
scaling`` end to end on constructed studies and on the published small study."""

import json
import math
from pathlib import Path

import pytest

from fiber_bundle.analysis import measures
from fiber_bundle.analysis.scaling import scaling_summary

ROOT = Path(__file__).resolve().parents[1]
RATES = {"euclidean": (1e-3, None), "strong-1": (1e-3, 3e-3)}  # the rates the constructed sweeps choose


# --- the estimators ------------------------------------------------------------------------------------------------

def test_curve_settling_reads_thirds_of_the_steps_between_recorded_points():
    # L(t) = 10 / t from step 10 to 40: thirds end at 20 and 30; drops 1 - 0.5 and 1/3 - 1/4 (exact at recorded points)
    curve = [(t, 10 / t) for t in (10, 20, 30, 40)]
    settling = measures.curve_settling(curve)
    assert settling["first_third_drop"] == pytest.approx(0.5)
    assert settling["last_third_drop"] == pytest.approx(1 / 3 - 1 / 4)
    assert settling["ratio"] == pytest.approx((1 / 12) / 0.5) and settling["settled"] is False
    # between points the loss is interpolated linearly: thirds at 40 and 70 of a line through (10, 4) and (100, 1)
    line = [(10, 4.0), (100, 1.0)]
    assert measures.curve_settling(line)["ratio"] == pytest.approx(1.0)
    flat_late = [(0, 3.0), (30, 1.0), (60, 0.96), (90, 0.95)]
    assert measures.curve_settling(flat_late)["ratio"] == pytest.approx(0.01 / 2.0)
    assert measures.curve_settling(flat_late)["settled"] is True
    rising = measures.curve_settling([(0, 1.0), (3, 2.0)])
    assert rising["ratio"] is None and rising["settled"] is False
    with pytest.raises(ValueError, match="increasing steps"):
        measures.curve_settling([(10, 1.0), (10, 0.5)])


def test_size_trend_recovers_a_known_slope_and_reads_its_sign():
    # mean differences -0.01 - 0.02 log10(N / 1e6): the slope is -0.02 per tenfold parameters; the seeds' spread is
    # symmetric around each mean, so the fitted means are exact
    sizes = [(n, [-0.01 - 0.02 * math.log10(n / 1e6) + e for e in (-0.002, 0.0, 0.002)]) for n in (1e6, 1e7, 1e8)]
    trend = measures.size_trend(sizes)
    assert trend["slope_per_tenfold_parameters"] == pytest.approx(-0.02)
    low, high = trend["bootstrap_interval"]
    assert low < -0.02 < high < 0 and trend["reading"] == "grows" and trend["below_zero"] == 1.0
    assert trend["intercept"] + trend["slope_per_tenfold_parameters"] * 7 == pytest.approx(-0.03)
    shrinking = measures.size_trend([(n, [-d for d in diffs]) for n, diffs in sizes])
    assert shrinking["reading"] == "shrinks"
    # no trend, seeds spread far wider than any slope: the interval spans zero
    noise = [(n, [0.05, -0.05, 0.03, -0.03]) for n in (1e6, 3e6, 1e7)]
    assert measures.size_trend(noise)["reading"] == "cannot be told apart from zero"
    # the bootstrap resamples seeds within a size: a size's spread widens the interval, its count does not move means
    wide = measures.size_trend([(1e6, [-0.03, 0.01]), (1e7, [-0.03, -0.01]), (1e8, [-0.05, -0.03])])
    narrow = measures.size_trend([(1e6, [-0.011, -0.009]), (1e7, [-0.021, -0.019]), (1e8, [-0.041, -0.039])])
    assert wide["slope_per_tenfold_parameters"] == pytest.approx(narrow["slope_per_tenfold_parameters"])
    width = lambda t: t["bootstrap_interval"][1] - t["bootstrap_interval"][0]  # noqa: E731
    assert width(wide) > 5 * width(narrow)


def test_size_trend_refuses_what_gives_no_trend():
    with pytest.raises(ValueError, match="three or more sizes"):
        measures.size_trend([(1e6, [0.1, 0.2]), (1e7, [0.1, 0.2])])
    with pytest.raises(ValueError, match="two or more paired differences"):
        measures.size_trend([(1e6, [0.1, 0.2]), (1e7, [0.1]), (1e8, [0.1, 0.2])])
    with pytest.raises(ValueError, match="same parameter count"):
        measures.size_trend([(1e6, [0.1, 0.2]), (1e6, [0.1, 0.3]), (1e8, [0.1, 0.2])])


# --- constructed studies -------------------------------------------------------------------------------------------

def run(arm: str, seed: int, lr: float, metric_lr, loss: float, steps: int = 100) -> dict:
    """A finished run record as ``scratch.train_arm`` writes it, with a curve that ends at ``loss``."""
    curve = [(step, loss + 2.0 * (1 - step / steps) ** 2) for step in range(25, steps + 1, 25)]
    return {"arm": arm, "seed": seed, "learning_rate": lr, **({"metric_learning_rate": metric_lr} if metric_lr else {}),
            "steps": steps, "eval_loss_after": loss, "eval_curve": curve, "train_loss": curve, "seconds_per_step": 0.1,
            "residual_per_layer": [0.9, 0.8], "score_numerical_rank_per_layer": [8.0], "heads_above_gram_bound": 0,
            "gates": {}, "proxies": {}}


def study(width: int, parameters: int, differences: dict, *, tuning_seed=0, steps: int = 100,
          euclidean_steps=None) -> dict:
    """A scratch study's results for a model of ``width``: rates swept on ``tuning_seed`` (the best is RATES, the others
    worse), then the evaluation seeds (``differences``: seed -> strong-1 minus euclidean)."""
    runs = []
    if tuning_seed is not None:
        runs += [run("euclidean", tuning_seed, lr, None, 2.0 + (lr != 1e-3)) for lr in (1e-3, 3e-3)]
        runs += [run("strong-1", tuning_seed, 1e-3, metric_lr, 2.0 + (metric_lr is not None and metric_lr != 3e-3))
                 for metric_lr in (None, 3e-3, 1e-2)]
    for seed, difference in differences.items():
        runs.append(run("euclidean", seed, 1e-3, None, 2.0 + 0.01 * seed, euclidean_steps or steps))
        runs.append(run("strong-1", seed, 1e-3, 3e-3, 2.0 + 0.01 * seed + difference, steps))
    results = {
        "model": {"num_hidden_layers": 2, "hidden_size": width}, "seeds": sorted(differences),
        "arms": {"euclidean": {"parameters": parameters - 10}, "strong-1": {"parameters": parameters}},
        "budget": {"steps": steps, "tokens": steps * 64, "batch_size": 2, "block_size": 32},
        "runs": runs, "best_learning_rate": {arm: lr for arm, (lr, _) in RATES.items()},
        "best_metric_learning_rate": {arm: metric for arm, (_, metric) in RATES.items()},
    }
    if tuning_seed is not None:
        results["tuning_seed"] = tuning_seed
    if euclidean_steps:
        results["steps_by_arm"] = {"euclidean": euclidean_steps}
    return results


def three_sizes(slope: float = -0.02) -> list[tuple[str, dict]]:
    sizes = []
    for width, parameters in ((64, 10**6), (128, 10**7), (256, 10**8)):
        mean = slope * math.log10(parameters / 10**6)
        sizes.append((f"w{width}", study(width, parameters, {1: mean - 0.004, 2: mean, 3: mean + 0.004})))
    return sizes


def test_each_size_pairs_its_evaluation_seeds_at_the_chosen_rates():
    sizes = three_sizes()
    # a run on the tuning seed at the chosen rates must not enter the pairs: the tuning seed is in no interval
    sizes[0][1]["runs"].append(run("strong-1", 0, 1e-3, 3e-3, 1.0))
    # at the largest size the metric's x10 was not tried: its chosen x3 is then the highest metric rate tried
    sizes[2][1]["runs"] = [r for r in sizes[2][1]["runs"] if r.get("metric_learning_rate") != 1e-2]
    results = scaling_summary(sizes[::-1])  # rows come back by parameters whatever the order given
    rows = results["sizes"]
    assert [row["parameters"] for row in rows] == [10**6, 10**7, 10**8]
    assert rows[0]["seeds"] == [1, 2, 3] and rows[0]["tuning_seed"] == 0
    assert rows[1]["differences"] == pytest.approx({"1": -0.024, "2": -0.02, "3": -0.016})
    assert rows[1]["paired"]["mean"] == pytest.approx(-0.02)
    assert rows[0]["rates"] == {"euclidean": {"learning_rate": 1e-3, "at_sweep_edge": True},  # 1e-3 of 1e-3, 3e-3
                                "strong-1": {"learning_rate": 1e-3, "metric_learning_rate": 3e-3,
                                             "at_sweep_edge": False,  # one backbone rate tried
                                             "metric_at_sweep_edge": False}}  # x3 of x1, x3, x10
    assert rows[2]["rates"]["strong-1"]["metric_at_sweep_edge"] is True
    assert rows[0]["settling"]["euclidean"]["ratio"] == pytest.approx(
        measures.curve_settling(rows[0]["curves"]["euclidean"])["ratio"])
    assert results["trend"]["slope_per_tenfold_parameters"] == pytest.approx(-0.02)
    assert results["trend"]["reading"] == "grows"
    assert scaling_summary(three_sizes(slope=0.0))["trend"]["reading"] == "cannot be told apart from zero"
    assert scaling_summary(three_sizes()[:2])["trend"] is None  # two sizes: rows, no trend


def test_equal_time_studies_are_matched_by_model_and_read_over_the_same_seeds():
    sizes = three_sizes()
    timed = study(128, 10**7, {1: 0.03, 2: 0.05, 3: 0.04, 4: 9.0}, tuning_seed=None, euclidean_steps=125)
    results = scaling_summary(sizes, equal_time=[("w128-time", timed)])
    row = next(r for r in results["sizes"] if r["parameters"] == 10**7)
    assert row["equal_time"]["steps"] == {"euclidean": 125, "strong-1": 100}
    assert row["equal_time"]["seeds"] == [1, 2, 3]  # seed 4 is not an evaluation seed of the size's study
    assert row["equal_time"]["paired"]["mean"] == pytest.approx(0.04)
    assert all("equal_time" not in r for r in results["sizes"] if r is not row)


def test_the_step_ratio_is_read_per_seed_from_the_runs_step_clocks():
    results = study(128, 10**7, {1: 0.0, 2: 0.0, 3: 0.0})
    steps = {("euclidean", 1): 0.50, ("strong-1", 1): 0.55, ("euclidean", 2): 0.40, ("strong-1", 2): 0.42,
             ("euclidean", 3): 0.60, ("strong-1", 3): 0.63}
    for r in results["runs"]:
        r["step_seconds_median"] = steps.get((r["arm"], r["seed"]), 9.0)  # the tuning seed's runs must not count
        r["host"] = {"cpu": "AMD EPYC", "load_average_before": [0.5, 1.0, 1.2], "load_average_after": [2.1, 1.5, 1.3]}
    ratio = scaling_summary([("w128", results)])["sizes"][0]["step_ratio"]
    assert ratio["per_seed"] == pytest.approx({"1": 1.1, "2": 1.05, "3": 1.05})
    assert ratio["median"] == pytest.approx(1.05) and ratio["range"] == pytest.approx([1.05, 1.1])
    assert ratio["reference_steps_at_equal_time"] == 105  # 100 steps x 1.05
    assert ratio["cpus"] == ["AMD EPYC"] and ratio["load_average_max"] == 2.1 and ratio["runs_without_host"] == 0
    del results["runs"][-1]["host"]  # a run reused from before studies recorded their host is counted apart
    assert scaling_summary([("w128", results)])["sizes"][0]["step_ratio"]["runs_without_host"] == 1
    del results["runs"][-1]["step_seconds_median"]  # a run recorded before the step clock: no ratio, no failure
    assert scaling_summary([("w128", results)])["sizes"][0]["step_ratio"] is None


def test_studies_the_protocol_does_not_allow_are_refused_naming_the_fix():
    sizes = three_sizes()
    untuned = study(64, 10**6, {0: -0.01, 1: -0.02}, tuning_seed=None)
    with pytest.raises(ValueError, match="chose its rates on seed 0.*--tuning-seed"):
        scaling_summary([("untuned", untuned), *sizes[1:]])
    one_arm = study(64, 10**6, {1: -0.01, 2: -0.02})
    del one_arm["arms"]["strong-1"]
    with pytest.raises(ValueError, match="no arm 'strong-1'"):
        scaling_summary([("one-arm", one_arm), *sizes[1:]])
    sweeping = study(64, 10**6, {1: -0.01, 2: -0.02})  # stopped inside strong-1's sweep
    del sweeping["best_learning_rate"]["strong-1"]
    with pytest.raises(ValueError, match="not finished sweeping the rates of 'strong-1'.*rerunning the analyze"):
        scaling_summary([("sweeping", sweeping), *sizes[1:]])
    unfinished = study(64, 10**6, {1: -0.01, 2: -0.02})  # stopped during the sweep: no evaluation run yet
    unfinished["runs"] = [r for r in unfinished["runs"] if r["seed"] == 0]
    with pytest.raises(ValueError, match="has 0 evaluation seed.*rerunning the analyze scratch command"):
        scaling_summary([("unfinished", unfinished), *sizes[1:]])
    with pytest.raises(ValueError, match="same size"):
        scaling_summary([sizes[0], ("again", study(96, 10**6, {1: 0.0, 2: 0.01})), sizes[2]])
    with pytest.raises(ValueError, match="equal-time study of no size"):
        scaling_summary(sizes, equal_time=[("other", study(512, 10**9, {1: 0.0, 2: 0.0}, tuning_seed=None))])
    other_rates = study(128, 10**7, {1: 0.0, 2: 0.0}, tuning_seed=None, euclidean_steps=125)
    other_rates["best_learning_rate"]["euclidean"] = 3e-3
    other_rates["runs"] = [dict(r, learning_rate=3e-3) if r["arm"] == "euclidean" else r for r in other_rates["runs"]]
    with pytest.raises(ValueError, match="other rates.*--learning-rates 0.001"):
        scaling_summary(sizes, equal_time=[("w128-time", other_rates)])


# --- the command ---------------------------------------------------------------------------------------------------

def test_analyze_scaling_writes_json_and_figure_and_prints_the_trend(tmp_path, capsys):
    from fiber_bundle.cli import main

    folders = []
    for name, results in three_sizes():
        (tmp_path / name).mkdir()
        (tmp_path / name / "scratch.json").write_text(json.dumps(results))
        folders.append(str(tmp_path / name))
    assert main(["analyze", "scaling", "--studies", *folders, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "1,000,000 parameters, 100 steps (6,400 tokens), 3 seeds: +0.0000, 95 % [" in printed
    assert "trend: -0.0200 per tenfold parameters" in printed and "the edge grows" in printed
    written = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert written["trend"]["reading"] == "grows" and len(written["sizes"]) == 3
    assert (tmp_path / "out" / "scaling.png").stat().st_size > 10_000
    # the figure is drawn from the JSON alone
    from fiber_bundle.analysis.plots import plot_scaling

    assert plot_scaling(written, tmp_path / "again.png").stat().st_size > 10_000
    # a folder without a study is refused in one line, naming it
    assert main(["analyze", "scaling", "--studies", str(tmp_path), "--out", str(tmp_path / "o2")]) != 0
    assert "holds no scratch.json" in capsys.readouterr().err


def test_the_published_small_and_medium_studies_read_as_section_10_prints_them(tmp_path, capsys):
    """The two finished sizes of docs/results.md section 10, each with its equal-time study, read from the committed
    JSON: the rows of its two tables (small −0.0039 [−0.0162, +0.0083], medium +0.0004 [−0.0077, +0.0086]; at equal
    time +0.0394 and +0.0062) and the twin's 1536 steps that medium's own runs allow."""
    from fiber_bundle.cli import main

    results = ROOT / "docs" / "results"
    assert main(["analyze", "scaling", "--studies", str(results / "scratch_size_small"),
                 str(results / "scratch_size_medium"), "--equal-time", str(results / "scratch_power_time"),
                 str(results / "scratch_size_medium_time"), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "1,716,340 parameters, 1000 steps (2,048,000 tokens), 9 seeds: -0.0039, 95 % [-0.0162, +0.0083]" in printed
    assert "equal time (euclidean 1235, strong-1 1000 steps), 9 seeds: +0.0394, 95 % [+0.0255, +0.0533]" in printed
    assert "4,767,334 parameters, 1500 steps (3,072,000 tokens), 5 seeds: +0.0004, 95 % [-0.0077, +0.0086]" in printed
    assert "last-third / first-third drop euclidean 0.049, strong-1 0.049" in printed
    assert "median 1.024 (1.004-1.080); equal time gives euclidean 1536 steps" in printed
    assert "equal time (euclidean 1536, strong-1 1500 steps), 5 seeds: +0.0062, 95 % [-0.0026, +0.0150]" in printed
    assert "trend: needs three or more sizes" in printed
