"""The harness of the analysis studies (``analysis/study.py``): one resume rule, one sweep, one ranking, and the
published studies' results re-summarised through it to the tables their commands printed."""

import json
import math
from pathlib import Path

import pytest

from fiber_bundle.analysis import study

ROOT = Path(__file__).resolve().parents[1]
TABLES = json.loads((ROOT / "tests" / "fixtures" / "study_tables.json").read_text())


def numbers_close(a, b) -> bool:
    """``a`` and ``b`` equal, floats to 1e-12 relative (a recomputed mean may differ from the stored one in its last
    bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(numbers_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(numbers_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
    return a == b


# runs added to a published study after its table was printed into the fixture: (study, suffix of their optimiser)
ADDED_SINCE = {"optimizers_scratch_strong-1/optimizers.json": "+scaled"}  # section 8.1's scale control, 2026-12-07


@pytest.mark.parametrize("name", sorted(TABLES))
def test_a_published_study_re_summarises_to_the_table_its_command_printed(name, tmp_path):
    """One study of each kind from docs/results/: its summary recomputed from its runs equals the stored one, and the
    command's table of it is, line for line, the one the command printed before the harness existed (the fixture)."""
    from fiber_bundle.analysis import cli
    from fiber_bundle.analysis.reports import read_study
    from fiber_bundle.analysis.output import jsonable

    path = ROOT / "docs" / "results" / name
    results = read_study(path)
    stored = json.loads(path.read_text())
    assert numbers_close(json.loads(json.dumps(jsonable(results.get("summary")))), stored.get("summary"))
    if name in ADDED_SINCE:  # the fixture is the table of the study as it was then, without the runs added since
        later = ADDED_SINCE[name]
        then = {**stored, "runs": [r for r in stored["runs"] if not r["optimizer"].endswith(later)],
                "best": {k: v for k, v in stored["best"].items() if not k.endswith(later)}}
        (tmp_path / path.name).write_text(json.dumps(then))
        results = read_study(tmp_path / path.name)
    table = {"scratch.json": cli.scratch_table, "optimizers.json": cli.optimizers_table, "ide.json": cli.ide_table,
             "compare.json": cli.compare_table}[path.name]
    assert table(results) == TABLES[name]


def fake_run(calls, losses):
    """An arm function whose held-out loss is ``losses(arm, seed, learning_rate)``; ``calls`` records each run made."""

    def run(arm, seed, setting):
        calls.append((arm, seed, setting["learning_rate"]))
        return {"arm": arm, "seed": seed, **setting, "eval_loss_after": losses(arm, seed, setting["learning_rate"])}

    return run


def test_tune_extends_the_sweep_past_an_edge_and_ranks_diverged_runs_last():
    """The best rate at the grid's top edge: one grid step further (3 significant figures), then stop where the best
    is inside; a diverged run (no loss) never wins; a one-rate grid is not extended; ``past_edge``'s own cases."""
    calls = []
    # best near 0.0316; no loss (diverged) above 0.05
    loss = lambda lr: None if lr > 0.05 else (math.log10(lr) + 1.5) ** 2  # noqa: E731
    best, records = study.tune(lambda s: calls.append(s["learning_rate"]) or {**s, "eval_loss_after": loss(
        s["learning_rate"])}, [1e-3, 3e-3, 1e-2], max_extensions=3)
    assert calls == [1e-3, 3e-3, 1e-2, 0.0333, 0.111]  # 0.111 diverged: the best, 0.0333, is inside what was tried
    assert best["learning_rate"] == 0.0333 and study.score(records[-1]) == math.inf
    single = study.tune(lambda s: {**s, "eval_loss_after": 1.0}, [1e-3], max_extensions=3)[1]
    assert len(single) == 1
    refined = study.tune(lambda s: {**s, "eval_loss_after": loss(s["learning_rate"])}, [1e-2, 1e-1], max_extensions=0,
                         refine=lambda best, records: [{"learning_rate": 0.02}])
    assert [r["learning_rate"] for r in refined[1]] == [1e-2, 1e-1, 0.02] and refined[0]["learning_rate"] == 0.02
    # past_edge, the rule shared with the metric's extension: by default each edge's own spacing; none inside or alone
    tried = [0.01, 0.03, 0.1]
    assert study.past_edge(0.1, tried) == 0.333 and study.past_edge(0.01, tried) == 0.00333
    assert study.past_edge(0.03, tried) is None and study.past_edge(0.01, [0.01]) is None
    assert study.past_edge(0.1, tried, step=10.0) == 1.0 and study.past_edge(0.01, tried, step=10.0) == 0.001


def test_study_runs_interleaved_or_arm_by_arm_and_a_rerun_makes_nothing_again(tmp_path):
    """Interleaved: every arm swept on the first seed, then the seeds in turn across arms; arm by arm: each arm swept
    and re-seeded before the next, its choice heard first. A rerun of the same study finds every run on disk."""
    losses = lambda arm, seed, lr: abs(math.log10(lr) + (2 if arm == "a" else 3)) + seed  # noqa: E731
    calls, heard = [], []
    file = study.StudyFile(tmp_path / "x", "demo", {"grid": [1e-3, 1e-2]})
    grids = {"a": [1e-3, 1e-2], "b": [1e-3, 1e-2]}
    chosen = study.run_study(file, ["a", "b"], [0, 1], fake_run(calls, losses), grids=grids,
                             summarise=lambda results: {"runs": len(results["runs"])}, progress=False)
    assert chosen == {"a": {"learning_rate": 1e-2}, "b": {"learning_rate": 1e-3}}
    assert calls == [("a", 0, 1e-3), ("a", 0, 1e-2), ("b", 0, 1e-3), ("b", 0, 1e-2), ("a", 1, 1e-2), ("b", 1, 1e-3)]
    on_disk = json.loads((tmp_path / "x" / "demo.json").read_text())
    assert on_disk["grid"] == [1e-3, 1e-2] and len(on_disk["runs"]) == 6 and on_disk["summary"] == {"runs": 6}
    calls.clear()
    again = study.StudyFile(tmp_path / "x", "demo", {"grid": (1e-3, 1e-2)})  # a tuple is saved as this list
    study.run_study(again, ["a", "b"], [0, 1], fake_run(calls, losses), grids=grids, progress=False)
    assert calls == []
    by_arm = study.StudyFile(tmp_path / "y", "demo", {})
    study.run_study(by_arm, ["a", "b"], [0, 1], fake_run(calls, losses), grids={"a": [1e-2], "b": [1e-2]},
                    tuned=lambda arm, best, records: heard.append((arm, len(calls))), arm_by_arm=True, progress=False)
    assert calls == [("a", 0, 1e-2), ("a", 1, 1e-2), ("b", 0, 1e-2), ("b", 1, 1e-2)]
    assert heard == [("a", 1), ("b", 3)]  # each choice heard before that arm's other seeds run


def test_a_study_file_of_other_settings_is_refused_naming_what_differs(tmp_path):
    file = study.StudyFile(tmp_path, "demo", {"budget": {"steps": 4, "batch_size": 2}, "seeds": [0]})
    file.save()
    with pytest.raises(ValueError, match=r"holds a comparison with other settings \(budget\.steps differ\); pass "
                                         "another --out, or delete it"):
        study.StudyFile(tmp_path, "demo", {"budget": {"steps": 5, "batch_size": 2}, "seeds": [0]})
    nested = study.StudyFile(tmp_path, "nested", {"length": 8}, nested=True, empty={"models": {}}, holds="measurements")
    nested.once(nested.results["models"].setdefault("m", {}), "rope", lambda: {"value": 1})
    assert json.loads((tmp_path / "nested.json").read_text())["models"]["m"]["rope"]["value"] == 1
    with pytest.raises(ValueError, match=r"holds measurements with other settings \(length differ\)"):
        study.StudyFile(tmp_path, "nested", {"length": 9}, nested=True, empty={"models": {}}, holds="measurements")


def test_a_tuning_seed_chooses_the_rates_and_enters_no_interval(tmp_path):
    """``tuning_seed``: the sweep runs on it, the best setting on every evaluation seed, and a tuning seed among the
    evaluation seeds is refused. Re-summarising the published 10-seed study with seed 0 (which chose its rates) as the
    tuning seed gives as its interval the one it published without that seed."""
    calls = []
    losses = lambda arm, seed, lr: abs(math.log10(lr) + 2) + seed  # noqa: E731
    file = study.StudyFile(tmp_path, "demo", {})
    chosen = study.run_study(file, ["a"], [0, 1], fake_run(calls, losses), grids={"a": [1e-3, 1e-2]}, tuning_seed=7,
                             progress=False)
    assert calls == [("a", 7, 1e-3), ("a", 7, 1e-2), ("a", 0, 1e-2), ("a", 1, 1e-2)] and chosen == {
        "a": {"learning_rate": 1e-2}}
    with pytest.raises(ValueError, match="the tuning seed 1 is also an evaluation seed"):
        study.run_study(file, ["a"], [0, 1], fake_run(calls, losses), grids={"a": [1e-2]}, tuning_seed=1,
                        progress=False)
    from fiber_bundle.analysis.scratch import summarise_scratch

    published = json.loads((ROOT / "docs" / "results" / "scratch_power" / "scratch.json").read_text())
    strong = summarise_scratch({**published, "seeds": published["seeds"][1:], "tuning_seed": 0})["strong-1"]
    assert strong["seeds"] == 9 and "loss_vs_euclidean_interval_without_sweep_seed" not in strong
    assert numbers_close(strong["loss_vs_euclidean_interval"],
                         published["summary"]["strong-1"]["loss_vs_euclidean_interval_without_sweep_seed"])


def test_every_run_made_records_its_host_and_the_load_around_it(tmp_path):
    """``host``: the CPU's model name (lscpu's) and the 1, 5 and 15 min load averages before and after the run, on each
    run a study makes (a run found on disk keeps the record it was made with)."""
    from fiber_bundle.model_cards.facts import cpu_model

    file = study.StudyFile(tmp_path, "demo", {})
    record = file.run({"arm": "a", "seed": 0, "learning_rate": 1e-3}, lambda: {"arm": "a", "seed": 0,
                                                                            "learning_rate": 1e-3})
    host = json.loads((tmp_path / "demo.json").read_text())["runs"][0]["host"]
    assert host == record["host"] and host["cpu"] == cpu_model() and host["cpu"]
    assert len(host["load_average_before"]) == len(host["load_average_after"]) == 3
    placed = file.once(file.results.setdefault("models", {}), "m", lambda: {"value": 1})
    assert placed["host"]["cpu"] == cpu_model()
