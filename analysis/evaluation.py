"""A converted model and its source side by side on EleutherAI's lm-evaluation-harness (``lm_eval``), loaded the way
the harness loads any checkpoint: ``lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True``.

Two tasks ship with the package and run offline, written at run time as harness task folders (a YAML file beside a
JSON Lines file, read by the ``datasets`` "json" builder):

- ``pydoc_perplexity`` (``loglikelihood_rolling``): the held-out pydoc topics of ``fiber-bundle train``'s default data
  (``training.data.pydoc_topics``, split seed 0), cut into documents of at most 2,000 characters at paragraph breaks;
  word perplexity, byte perplexity and bits per byte.
- ``arithmetic_choice`` (``multiple_choice``): 40 sums of two numbers below 50, each with the right answer and three
  near misses; accuracy and length-normalised accuracy.

Any other harness task (built in, or a YAML folder passed as ``include_path``) runs beside them. At the graft a
converted model's per-example loglikelihoods equal its source's (docs/design.md section 2), so the comparison reports,
besides each metric, the largest per-example loglikelihood difference of each task.

In this process (which imports the project, whose classes are registered with transformers' Auto classes) a Fiber
Bundle folder runs on the project's own modeling code; the printed ``lm_eval`` commands, run from a shell, run the
folder's copy of it (the same files: tests/test_evaluation.py checks both).
"""

import contextlib
import json
import random
import tempfile
import time
from pathlib import Path

from fiber_bundle.conversion.sources import is_fiber_bundle_folder, locate

PERPLEXITY_TASK = "pydoc_perplexity"
CHOICE_TASK = "arithmetic_choice"
DOCUMENT_CHARACTERS = 2000  # the longest pydoc_perplexity document (about 500 tokens of a 49k-token BPE vocabulary)
CHOICE_ITEMS = 40

_DATA_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""  # a packaged task reads its documents from one JSON file written beside its YAML

_PERPLEXITY_YAML = _DATA_YAML + """\
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
"""

_CHOICE_YAML = _DATA_YAML + """\
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def pydoc_documents(max_characters: int = DOCUMENT_CHARACTERS) -> list[str]:
    """The held-out pydoc topics (the eval split of ``fiber-bundle train``'s default data), each cut at paragraph
    breaks into documents of at most ``max_characters`` (a longer paragraph is cut at a line break, then anywhere)."""
    from fiber_bundle.training.data import pydoc_topics

    documents = []
    for topic in pydoc_topics(seed=0)[1]["text"]:
        current = ""
        for paragraph in topic.strip().split("\n\n"):
            pieces = [paragraph]
            while len(pieces[-1]) > max_characters:  # one paragraph longer than a document
                head, tail = pieces[-1][:max_characters], pieces[-1][max_characters:]
                cut = head.rfind("\n") + 1 or max_characters
                pieces[-1:] = [head[:cut].rstrip("\n"), head[cut:] + tail]
            for piece in pieces:
                joined = f"{current}\n\n{piece}" if current else piece
                if len(joined) <= max_characters:
                    current = joined
                else:
                    documents.append(current)
                    current = piece
        if current.strip():
            documents.append(current)
    return [d for d in documents if d.strip()]


def arithmetic_items(count: int = CHOICE_ITEMS, seed: int = 0) -> list[dict]:
    """``count`` questions "What is A plus B?" (A, B from 2 to 49), each with the sum and three near misses (the sum
    plus or minus one and the sum plus ten) in a seeded order; ``label`` is the index of the right answer."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        total = a + b
        choices = [total, total + 1, total - 1, total + 10]
        rng.shuffle(choices)
        items.append({"question": f"Question: What is {a} plus {b}?\nAnswer:", "choices": [f" {c}" for c in choices],
                      "label": choices.index(total)})
    return items


# task name -> (its YAML template, a function returning its documents as JSON-serialisable dicts)
PACKAGED_TASKS = {
    PERPLEXITY_TASK: (_PERPLEXITY_YAML, lambda: [{"text": text} for text in pydoc_documents()]),
    CHOICE_TASK: (_CHOICE_YAML, arithmetic_items),
}


def write_packaged_tasks(folder: str | Path, names: list[str] | None = None) -> Path:
    """Write the packaged tasks ``names`` (default: all of ``PACKAGED_TASKS``) into ``folder`` as harness task files
    (``NAME.yaml`` reading ``NAME.jsonl`` by absolute path) and return the folder, ready for the harness's
    ``--include_path`` (or ``TaskManager(include_path=...)``)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for name in PACKAGED_TASKS if names is None else names:
        if name not in PACKAGED_TASKS:
            raise ValueError(f"{name} is not a packaged task; packaged: {', '.join(PACKAGED_TASKS)}.")
        template, documents = PACKAGED_TASKS[name]
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in documents()))
        (folder / f"{name}.yaml").write_text(template.format(task=name, data=json.dumps(str(data))))
    return folder


def harness_model_args(model: str | Path, *, gguf_file: str | None = None, dtype: str = "auto") -> dict:
    """The harness's ``hf`` model arguments that load MODEL as its users load it: a Fiber Bundle folder with
    ``trust_remote_code``, a GGUF (a .gguf path, or a folder plus ``gguf_file``) through transformers' GGUF loader, any
    other checkpoint folder or Hub id as it is. Raises ``FileNotFoundError`` when MODEL is none of these."""
    where = locate(model, gguf_file=gguf_file)
    args = {"pretrained": str(where.folder)}
    if where.gguf_file is not None:
        args["gguf_file"] = where.gguf_file
    if is_fiber_bundle_folder(where.folder):
        args["trust_remote_code"] = True
    args["dtype"] = dtype
    return args


def command_line(model_args: dict, tasks: list[str], include_paths: list[str | Path]) -> str:
    """The ``lm_eval`` command that runs the same evaluation."""
    args = ",".join(f"{key}={value}" for key, value in model_args.items())
    line = f"lm_eval --model hf --model_args {args} --tasks {','.join(tasks)}"
    return line + "".join(f" --include_path {path}" for path in include_paths)


@contextlib.contextmanager
def harness_tasks(tasks: list[str], *, include_paths: list[str | Path] = (), tasks_dir: str | Path | None = None):
    """A harness ``TaskManager`` that knows every one of ``tasks``, for the duration of the ``with`` block: the
    packaged tasks among them written into ``tasks_dir`` (kept; default: a temporary folder, removed afterwards),
    the folders of ``include_paths`` added, and the harness's built-in tasks indexed only when some task is in none of
    those (indexing its thousands of tasks takes half a minute). Raises ``ValueError`` naming an unknown task and
    ``FileNotFoundError`` for an include path that is not a folder."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise ImportError("lm-evaluation-harness is not installed: pip install 'fiber-bundle-transformers[evaluation]' "
                          "(or pip install lm-eval).") from error
    tasks = list(tasks)
    if not tasks:
        raise ValueError(f"no tasks given; name at least one (e.g. {','.join(PACKAGED_TASKS)}).")
    extra = [Path(p).resolve() for p in include_paths]
    for path in extra:
        if not path.is_dir():
            raise FileNotFoundError(f"include path {path} is not a folder; pass the folder holding the task YAMLs.")
    packaged = [task for task in tasks if task in PACKAGED_TASKS]
    written = contextlib.nullcontext(tasks_dir) if tasks_dir is not None else \
        tempfile.TemporaryDirectory(prefix="fiber_bundle_tasks_")
    with written as folder:
        paths = ([write_packaged_tasks(folder, packaged)] if packaged else []) + extra
        manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=False) if paths else None
        if manager is None or any(not manager.match_tasks([task]) for task in tasks):
            manager = TaskManager(include_path=[str(p) for p in paths] or None)
        missing = [task for task in tasks if not manager.match_tasks([task])]
        if missing:
            raise ValueError(f"unknown harness task(s): {', '.join(missing)}. Use a packaged task "
                             f"({', '.join(PACKAGED_TASKS)}), a task `lm_eval ls tasks` lists, or pass the folder of "
                             "its YAML file with --include-path.")
        yield manager


def _loglikelihoods(response) -> list[float]:
    """The loglikelihoods in one harness sample's ``filtered_resps``: a float per rolling document, a (loglikelihood,
    is_greedy) pair per choice or continuation; generated text has none."""
    flat = []
    for item in response:
        if isinstance(item, (list, tuple)) and item and isinstance(item[0], (int, float)):
            flat.append(float(item[0]))
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            flat.append(float(item))
    return flat


def run_harness(model_args: dict, tasks: list[str], task_manager, *, limit: int | None = None,
                batch_size: int | str = 1, device: str | None = None) -> dict:
    """One ``lm_eval.simple_evaluate`` of the harness's ``hf`` model with ``model_args`` (``harness_model_args``, plus
    any other ``HFLM`` argument, e.g. ``attn_implementation``) over ``tasks`` (known to ``task_manager``, see
    ``harness_tasks``); ``limit``: the first N documents of each task; ``device``: default the GPU when there is one,
    else the CPU. Returns {"model_args", "seconds", "metrics":
    {task: {metric: value}}, "loglikelihoods": {task: {doc_id: [float, ...]}}}."""
    import lm_eval
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    output = lm_eval.simple_evaluate(model="hf", model_args=dict(model_args), tasks=list(tasks),
                                     task_manager=task_manager, limit=limit, batch_size=batch_size, device=device,
                                     log_samples=True)
    seconds = time.perf_counter() - started
    metrics = {}
    for task, values in output["results"].items():
        metrics[task] = {key.removesuffix(",none"): value for key, value in values.items()
                         if "," in key and "_stderr," not in key and isinstance(value, (int, float))}
    loglikelihoods = {task: {int(s["doc_id"]): _loglikelihoods(s["filtered_resps"]) for s in samples}
                      for task, samples in output.get("samples", {}).items()}
    return {"model_args": dict(model_args), "seconds": seconds, "metrics": metrics, "loglikelihoods": loglikelihoods}


def loglikelihood_gaps(run: dict, reference: dict) -> dict:
    """Per task of ``run``: the number of documents ``reference`` also scored and the largest absolute difference of
    their per-example loglikelihoods (None when they share none)."""
    gaps = {}
    for task, per_doc in run["loglikelihoods"].items():
        theirs = reference["loglikelihoods"].get(task, {})
        shared = [doc for doc in per_doc if doc in theirs]
        diffs = [abs(a - b) for doc in shared for a, b in zip(per_doc[doc], theirs[doc], strict=True)]
        gaps[task] = {"examples": len(shared), "max_abs_loglikelihood_diff": max(diffs, default=None)}
    return gaps


def compare_on_harness(model: str | Path, source: str | Path | None, tasks: list[str], *,
                       gguf_file: str | None = None, source_gguf_file: str | None = None, limit: int | None = None,
                       batch_size: int | str = 1, include_paths: list[str | Path] = (), dtype: str = "auto",
                       device: str | None = None, tasks_dir: str | Path | None = None) -> dict:
    """MODEL (a converted folder) and, when given, its SOURCE on the same harness tasks (``harness_tasks``,
    ``run_harness``); both are checked before either runs.

    Returns {"runs": {"converted": run, "source": run} (each run with its ``lm_eval`` "command"), "rows": [{"task",
    "metric", "source", "converted", "difference"}], "examples": ``loglikelihood_gaps`` of MODEL against SOURCE}: one
    row per task and metric (``difference``: converted minus source; at the graft every per-example loglikelihood
    difference is zero up to rounding)."""
    tasks = list(tasks)
    targets = {"converted": harness_model_args(model, gguf_file=gguf_file, dtype=dtype)}
    if source is not None:
        targets["source"] = harness_model_args(source, gguf_file=source_gguf_file, dtype=dtype)
    shown = ([tasks_dir if tasks_dir is not None else "TASKS_DIR"] if set(tasks) & set(PACKAGED_TASKS) else []) + \
        list(include_paths)
    runs = {}
    with harness_tasks(tasks, include_paths=include_paths, tasks_dir=tasks_dir) as manager:
        for name, args in targets.items():
            runs[name] = run_harness(args, tasks, manager, limit=limit, batch_size=batch_size, device=device)
            runs[name]["command"] = command_line(args, tasks, shown) + ("" if limit is None else f" --limit {limit}")
    converted, base = runs["converted"], runs.get("source")
    rows = []
    for task, values in converted["metrics"].items():
        for metric, value in values.items():
            other = None if base is None else base["metrics"].get(task, {}).get(metric)
            rows.append({"task": task, "metric": metric, "source": other, "converted": value,
                         "difference": None if other is None else value - other})
    return {"runs": runs, "rows": rows, "examples": {} if base is None else loglikelihood_gaps(converted, base)}


def comparison_table(comparison: dict) -> str:
    """The rows of ``compare_on_harness`` as an aligned text table, then each task's per-example loglikelihood gap."""
    number = lambda v: "-" if v is None else f"{v:.6g}"  # noqa: E731
    signed = lambda v: "-" if v is None else f"{v:+.3g}"  # noqa: E731
    header = ("task", "metric", "source", "converted", "difference")
    cells = [header] + [(r["task"], r["metric"], number(r["source"]), number(r["converted"]), signed(r["difference"]))
                        for r in comparison["rows"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for task, gap in comparison["examples"].items():
        lines.append(f"{task}: {gap['examples']} examples, max |per-example loglikelihood difference| "
                     f"{number(gap['max_abs_loglikelihood_diff'])}")
    return "\n".join(lines)
