"""The harness the studies of ``fiber-bundle analyze`` (``scratch``, ``optimizers``, ``ide``) run on: arms x seeds x
learning rates, each run written to the study's JSON file as soon as it finishes, resumable one way.

A study brings its settings (what its file must match to be continued), its arm function (one run: the record made
from an arm, a seed and a setting such as ``{"learning_rate": 1e-3}``) and its summary; the harness does the rest:

- ``StudyFile``: the results file. A rerun with the same settings continues where a stopped one ended: every finished
  run is kept and none is made twice. A file of other settings is refused, naming the settings that differ.
- ``tune``: the rate sweep on the first seed, extended by grid steps while the best rate lies at an edge of what was
  tried, then whatever further settings the study tries around the best (``refine``).
- ``score``: how runs rank (a diverged run last).
- ``run_study``: every arm tuned on the first seed, its best setting re-run on every seed; arms interleaved seed by
  seed (a drift of the machine's speed touches them alike) or one arm after the other (a later arm needs an earlier
  one's best rate).
"""

import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable

from transformers import TrainerCallback

from fiber_bundle.model_cards.facts import cpu_model, load_average

from .output import jsonable, write_json


def score(record: dict) -> float:
    """A run's rank in a sweep: its final held-out loss, a diverged run (no loss) last."""
    loss = record.get("eval_loss_after")
    return loss if loss is not None else math.inf


def on_host(make: Callable[[], dict]) -> dict:
    """``make()``'s record with where it was made: ``host`` holds the CPU's model name and the load averages before and
    after, so that "same host" and "quiet" can be checked from a study's file."""
    before = load_average()
    record = make()
    record["host"] = {"cpu": cpu_model(), "load_average_before": before, "load_average_after": load_average()}
    return record


def progress_bar(total: int, desc: str, progress: bool = True):
    """A tqdm bar over ``total`` steps (hidden when not ``progress``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not progress)


def differing_settings(previous: dict, settings: dict, prefix: str = "") -> list[str]:
    """The names (dotted inside nested settings, e.g. ``budget.steps``) of the ``settings`` a ``previous`` study file
    records otherwise, compared as JSON holds them (a tuple and the list it was saved as are the same)."""
    differ = []
    for key, value in settings.items():
        mine, theirs = jsonable(value), jsonable(previous.get(key))
        if isinstance(mine, dict) and isinstance(theirs, dict):
            differ += differing_settings(theirs, mine, f"{prefix}{key}.")
        elif json.dumps(mine) != json.dumps(theirs):
            differ.append(f"{prefix}{key}")
    return differ


class StudyFile:
    """``<output_dir>/<name>.json``: a study's settings, its runs and what it derives from them, written after every
    run.

    ``settings`` sit at the file's top level (``nested``: under ``"settings"``); ``fresh`` holds figures measured anew
    on every start (they replace the file's); ``empty`` the containers of a new study (default: an empty ``runs``
    list).
    Runs are told apart by ``arm_field`` (the arm's name), ``seed`` and ``setting_fields`` (the tuned values).
    ``reusable``: finished runs of other studies that this one would repeat exactly, taken over rather than made."""

    def __init__(self, output_dir: str | Path, name: str, settings: dict, *, fresh: dict | None = None,
                 empty: dict | None = None, nested: bool = False, holds: str = "a comparison", arm_field: str = "arm",
                 setting_fields: tuple[str, ...] = ("learning_rate",)):
        self.path = Path(output_dir) / f"{name}.json"
        self.key_fields = (arm_field, "seed", *setting_fields)
        self.arm_field, self.setting_fields = arm_field, setting_fields
        self.reusable: list[dict] = []
        header = {"settings": settings} if nested else dict(settings)
        self.results = {**header, **(fresh or {}), **({"runs": []} if empty is None else empty)}
        if self.path.is_file():  # continue a stopped study, only with the same settings
            previous = json.loads(self.path.read_text())
            differ = differing_settings(previous.get("settings", {}) if nested else previous, settings)
            if differ:
                raise ValueError(f"{self.path} holds {holds} with other settings ({', '.join(differ)} differ); pass "
                                 "another --out, or delete it to start again.")
            self.results = {**previous, **header, **(fresh or {})}

    def save(self) -> None:
        write_json(self.path, self.results)

    def run(self, key: dict, make: Callable[[], dict]) -> dict:
        """The run of ``key`` (arm, seed and setting values): the finished one in this file or in ``reusable``, else
        ``make()``'s record (``on_host``), appended and written at once."""

        def same(record):
            return all(record.get(field) == key.get(field) for field in self.key_fields)

        for done in self.results["runs"]:
            if same(done):
                return done
        record = next((done for done in self.reusable if same(done)), None) or on_host(make)
        self.results["runs"].append(record)
        self.save()
        return record

    def once(self, place: dict, name: str, make: Callable[[], dict]) -> dict:
        """``place[name]`` (``place``: a dict inside the results) if it is there, else ``make()``'s result with the
        seconds it took (and ``on_host``), stored there and written at once."""
        if name not in place:
            started = time.perf_counter()
            place[name] = on_host(make)
            place[name]["seconds"] = time.perf_counter() - started
            self.save()
        return place[name]


def past_edge(best: float, tried: list[float], step: float | None = None) -> float | None:
    """The rate one ``step`` (a ratio; by default that of the two rates nearest the edge) past the edge of the sorted
    rates ``tried`` that ``best`` lies at, kept to 3 significant figures as typed; None while ``best`` lies inside them
    or one rate gives no spacing to step by."""
    if best not in (tried[0], tried[-1]) or (step is None and len(tried) < 2):
        return None
    upper = best == tried[-1]
    step = step or (tried[-1] / tried[-2] if upper else tried[1] / tried[0])
    return float(f"{best * step if upper else best / step:.3g}")


def tune(run_at: Callable[[dict], dict], grid, *, max_extensions: int = 0,
         refine: Callable[[dict, list[dict]], list[dict]] | None = None,
         refine_rounds: int = 1) -> tuple[dict, list[dict]]:
    """Sweep the learning rates of ``grid`` (``run_at({"learning_rate": lr})``); while the best rate lies at an edge of
    what was tried, go one grid step further (at most ``max_extensions`` times; rates kept to 3 significant figures, as
    typed); then try the settings ``refine(best record, records)`` names that were not tried yet, asking again after
    each round while it names new ones (at most ``refine_rounds`` rounds). Returns (the best record, every record)."""
    rates = sorted(float(lr) for lr in grid)
    sweep = [run_at({"learning_rate": lr}) for lr in rates]
    step = rates[-1] / rates[-2] if len(rates) > 1 else None  # the grid's own ratio: a one-rate grid is not swept
    for _ in range(max_extensions if step else 0):
        beyond = past_edge(min(sweep, key=score)["learning_rate"],
                           sorted(record["learning_rate"] for record in sweep), step)
        if beyond is None:
            break
        sweep.append(run_at({"learning_rate": beyond}))
    for _ in range(refine_rounds if refine else 0):
        untried = [setting for setting in refine(min(sweep, key=score), sweep)
                   if not any(all(record.get(k) == v for k, v in setting.items()) for record in sweep)]
        if not untried:
            break
        sweep += [run_at(setting) for setting in untried]
    return min(sweep, key=score), sweep


def run_study(file: StudyFile, arms, seeds, run: Callable[[str, int, dict], dict], *, grids: dict,
              max_extensions: int = 0, refine: Callable[[str, dict, list[dict]], list[dict]] | None = None,
              refine_rounds: int = 1, tuned: Callable[[str, dict, list[dict]], None] | None = None,
              summarise: Callable[[dict], dict] | None = None, arm_by_arm: bool = False,
              tuning_seed: int | None = None, desc: str = "runs", progress: bool = True) -> dict[str, dict]:
    """Tune every arm on ``tuning_seed`` (default ``seeds[0]``; ``tune`` over ``grids[arm]``; ``refine(arm, best,
    records)``: the settings to try after the rate sweep, asked up to ``refine_rounds`` times), then re-run its best
    setting on every seed of ``seeds``. ``run(arm, seed, setting)`` makes one run's record; a finished run is never
    made again. ``tuned(arm, best, records)`` hears each arm's choice before its other seeds run.
    ``summarise(results)`` becomes ``results["summary"]``: after each arm (``arm_by_arm``) or at the end. Returns
    arm -> its best setting."""
    if tuning_seed is not None and tuning_seed in seeds:
        raise ValueError(f"the tuning seed {tuning_seed} is also an evaluation seed: it chose the rates, so it would "
                         "favour the arms in every interval; give a seed that is not in --seeds.")
    tuning = seeds[0] if tuning_seed is None else tuning_seed
    others = seeds[1:] if tuning_seed is None else seeds  # the tuning seed's best run counts only when it is seeds[0]
    bar = progress_bar(sum(len(grids[arm]) + len(others) for arm in arms), desc, progress)

    def attempt(arm: str, seed: int, setting: dict) -> dict:
        bar.set_postfix_str(f"{arm} seed {seed} " + ", ".join(f"{key} {value:g}" for key, value in setting.items()))
        bar.total = max(bar.total, bar.n + 1)  # an extended sweep or a refinement: one run more than planned
        record = file.run({file.arm_field: arm, "seed": seed, **setting}, lambda: run(arm, seed, setting))
        bar.update()
        return record

    def choose(arm: str) -> dict:
        best, records = tune(lambda setting: attempt(arm, tuning, setting), grids[arm],
                             max_extensions=max_extensions, refine_rounds=refine_rounds,
                             refine=(lambda best, records: refine(arm, best, records)) if refine else None)
        if tuned:
            tuned(arm, best, records)
        return {field: best[field] for field in file.setting_fields if best.get(field) is not None}

    def summary() -> None:
        if summarise:
            file.results["summary"] = summarise(file.results)
            file.save()

    chosen = {}
    if arm_by_arm:
        for arm in arms:
            chosen[arm] = choose(arm)
            for seed in others:
                attempt(arm, seed, chosen[arm])
            summary()
    else:
        for arm in arms:
            chosen[arm] = choose(arm)
        for seed in others:
            for arm in arms:
                attempt(arm, seed, chosen[arm])
        summary()
    bar.close()
    return chosen


class StepClock(TrainerCallback):
    """A Trainer callback timing each optimiser step (forward, backward, optimiser), evaluations left out."""

    def __init__(self):
        self.seconds, self._start = [], None

    def on_step_begin(self, *args, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)

    def median(self) -> float | None:
        """The median step after the first (which may compile), or the only one."""
        steps = self.seconds[1:] or self.seconds
        return statistics.median(steps) if steps else None

    def first_step_excess(self) -> float:
        """How much longer the first step took than the median one: the compilation, under torch.compile."""
        return max(0.0, self.seconds[0] - self.median()) if len(self.seconds) > 1 else 0.0
