"""Training data through ``datasets``: local text / JSON lines / parquet files or a Hub dataset, plain text packed into
fixed-length blocks, chat ``messages`` formatted with the tokenizer's chat template, and two corpora every Python
ships (``CORPORA``: the standard library's ``pydoc_data.topics`` split by topic, and its whole source split by module). Bad data stops with a ``TrainingError`` naming
the file, the line (or record) and what is wrong."""

import contextlib
import json
import random
import sysconfig
from pathlib import Path

from datasets import Dataset, load_dataset
from datasets.utils import logging as datasets_logging

from .errors import TrainingError, describe

FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_source(source: str | Path | list, *, split: str = "train") -> Dataset:
    """Local files (by extension: .txt, .json / .jsonl, .parquet; one kind per call) or a Hub dataset name."""
    paths = [Path(p) for p in (source if isinstance(source, (list, tuple)) else [source])]
    suffixes = {p.suffix.lower() for p in paths}
    if all(p.exists() for p in paths):
        if len(suffixes) != 1 or next(iter(suffixes)) not in FILE_BUILDERS:
            raise TrainingError(f"data files must share one of the extensions {sorted(FILE_BUILDERS)}; got "
                                f"{sorted(suffixes)}.")
        builder = FILE_BUILDERS[suffixes.pop()]
        for path in paths:
            if path.is_file() and path.stat().st_size == 0:
                raise TrainingError(f"data file {path} is empty.")
        try:
            with _datasets_silent():
                return load_dataset(builder, data_files=[str(p) for p in paths], split="train")
        except Exception as error:  # datasets names neither the file nor the line
            raise TrainingError(_unreadable(paths, builder, error)) from error
    missing = [p for p in paths if not p.exists() and (p.suffix.lower() in FILE_BUILDERS or len(paths) > 1)]
    if missing:
        raise TrainingError(f"data file {missing[0]} does not exist.")
    name = str(paths[0])
    try:
        with _datasets_silent():
            return load_dataset(name, split=split)
    except Exception as error:
        raise TrainingError(f"could not load the Hub dataset {name!r} ({describe(error)}); check the name and the "
                            "network (offline, only a cached copy loads), or pass local .txt / .jsonl / .parquet "
                            "files.") from error


@contextlib.contextmanager
def _datasets_silent():
    """datasets logs a reader's failure (with its traceback) before it raises; the error is reported here, in one
    line."""
    level = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL + 1)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(level)


def _unreadable(paths: list[Path], builder: str, error: Exception) -> str:
    """The first file and line that ``datasets`` could not read, and why."""
    locate = {"json": _json_problem, "text": _text_problem}.get(builder)
    for path in paths:
        problem = locate(path) if locate else None
        if problem:
            return f"data file {path}, {problem}."
    while error.__cause__ is not None or error.__context__ is not None:  # the reader's own words, not datasets' wrapper
        error = error.__cause__ or error.__context__
    return f"could not read data file{'s' if len(paths) > 1 else ''} {', '.join(map(str, paths))} ({describe(error)})."


def _lines(path: Path):
    """(number, text) of each line, or (number, None, reason) for the first line that is not UTF-8."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8"), None
            except UnicodeDecodeError as error:
                yield number, None, f"line {number}: not UTF-8 text ({error.reason} at byte {error.start} of the line)"
                return


def _text_problem(path: Path) -> str | None:
    return next((reason for _, _, reason in _lines(path) if reason), None)


def _json_problem(path: Path) -> str | None:
    """JSON Lines: the first line that is not one JSON object; a JSON document (a list of records): where it stops
    parsing, or the first record that is not an object."""
    for number, line, reason in _lines(path):
        if reason:
            return reason
        if not line.strip():
            continue
        try:
            record = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as error:
            if number == 1 and line.lstrip()[:1] in "[{":  # a document over several lines, not JSON Lines
                return _json_document_problem(path)
            return f"line {number}: not valid JSON ({error.msg} at column {error.colno})"
        if not isinstance(record, dict):
            return (f"line {number}: a JSON {type(record).__name__}, where each line must be an object such as "
                    '{"text": "..."}')
    return None


def _json_document_problem(path: Path) -> str | None:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        return f"line {error.lineno}: not valid JSON ({error.msg} at column {error.colno})"
    if not isinstance(document, list):
        return 'one JSON object, where a list of records or one record per line (JSON Lines) is expected'
    bad = next((i for i, record in enumerate(document) if not isinstance(record, dict)), None)
    return None if bad is None else f"record {bad + 1}: a JSON {type(document[bad]).__name__}, not an object"


def chat_to_text(dataset: Dataset, tokenizer, *, column: str = "messages") -> Dataset:
    """Render a ``messages`` column with the tokenizer's chat template into a ``text`` column."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise TrainingError("the data has a 'messages' column but the tokenizer has no chat template; give a 'text' "
                            "column instead, or a tokenizer with a chat template.")

    def render(batch, indices):
        texts = []
        for index, messages in zip(indices, batch[column]):
            try:
                texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
            except Exception as error:
                raise TrainingError(f"record {index + 1}: its {column!r} could not be rendered with the chat template "
                                    f"({describe(error)}).") from error
        return {"text": texts}

    return dataset.map(render, batched=True, with_indices=True, remove_columns=dataset.column_names)


def pack_blocks(dataset: Dataset, tokenizer, block_size: int, *, text_column: str = "text") -> Dataset:
    """Tokenise, join the documents (each followed by EOS) and cut the stream into ``block_size`` blocks with labels;
    the remainder shorter than a block is dropped."""
    if "messages" in dataset.column_names and text_column not in dataset.column_names:
        dataset = chat_to_text(dataset, tokenizer)
    if text_column not in dataset.column_names:
        raise TrainingError(f"no {text_column!r} column (the records have {dataset.column_names}); give each record a "
                            f"{text_column!r} string, or a 'messages' list for chat data.")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize_and_pack(batch, indices):
        for index, text in zip(indices, batch[text_column]):
            if not isinstance(text, str):
                shown = "null" if text is None else f"{str(text)[:40]} (of type {type(text).__name__})"
                raise TrainingError(f"record {index + 1}: {text_column!r} is {shown}, not a string.")
        stream = []
        for ids in tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]:
            stream.extend(ids + eos)
        usable = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return dataset.map(tokenize_and_pack, batched=True, batch_size=1000, with_indices=True,
                       remove_columns=dataset.column_names)


def training_blocks(dataset: Dataset, tokenizer, block_size: int, *, name: str) -> Dataset:
    """``pack_blocks`` for a run: its errors start with ``name`` (e.g. "training data train.jsonl"), and data shorter
    than one block is refused with its token count."""
    try:
        blocks = pack_blocks(dataset, tokenizer, block_size)
    except TrainingError as error:
        raise TrainingError(f"{name}: {error}") from error
    if len(blocks) == 0:
        texts = list((dataset if "text" in dataset.column_names else chat_to_text(dataset, tokenizer))["text"])
        eos = int(tokenizer.eos_token_id is not None)
        tokens = sum(len(ids) + eos for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
        raise TrainingError(f"{name} holds {tokens:,} tokens, fewer than one block of --block-size {block_size}; "
                            "lower --block-size or give more data.")
    return blocks


def pydoc_topics(*, eval_fraction: float = 0.1, seed: int = 0) -> tuple[Dataset, Dataset]:
    """The standard library's pydoc topics (about 465k characters of English documentation), split by topic into
    train and held-out eval sets, so no eval topic is seen in training."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    random.Random(seed).shuffle(names)
    n_eval = max(1, round(eval_fraction * len(names)))
    as_dataset = lambda keys: Dataset.from_dict({"topic": keys, "text": [topics[k] for k in keys]})  # noqa: E731
    return as_dataset(sorted(names[n_eval:])), as_dataset(sorted(names[:n_eval]))


# ----------------------------------------------------------------------------------------------------------------------
# the standard library's source and documentation: a corpus of tens of MB on every machine
# ----------------------------------------------------------------------------------------------------------------------
SKIPPED = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3_tests"}


def stdlib_modules(root: str | Path | None = None, *, include_tests: bool = False) -> dict[str, list[Path]]:
    """The standard library's .py files grouped by top-level module (``asyncio`` holds all of asyncio/*.py; the docs
    are ``pydoc_data``, whose topics.py is the reference documentation). ``root``: the stdlib folder (default: this
    Python's); test suites are skipped unless ``include_tests`` (they double the size)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skipped = SKIPPED - ({"test", "tests", "idle_test", "lib2to3_tests"} if include_tests else set())
    modules: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in skipped for part in parts[:-1]):
            continue
        name = parts[0][:-3] if len(parts) == 1 else parts[0]
        if not name.isidentifier():  # not a module (e.g. config-3.11-x86_64-linux-gnu, the build's own files)
            continue
        modules.setdefault(name, []).append(path)
    if not modules:
        raise TrainingError(f"no Python source under {root}; pass the standard library's folder.")
    return modules


def stdlib_corpus(*, eval_fraction: float = 0.05, seed: int = 0, root: str | Path | None = None,
                  include_tests: bool = False):
    """(train, eval) ``datasets.Dataset``s of the standard library's files (columns ``module``, ``path``, ``text``),
    split by module: a seeded shuffle of the module names puts ``eval_fraction`` of the characters in eval, and no module
    has files in both. Files are read as UTF-8 (Latin-1 where a file is not)."""
    if not 0 < eval_fraction < 1:
        raise TrainingError(f"eval_fraction must lie in (0, 1), got {eval_fraction}.")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    modules = stdlib_modules(root, include_tests=include_tests)
    texts = {name: [(str(p.relative_to(root)), _read(p)) for p in paths] for name, paths in modules.items()}
    sizes = {name: sum(len(text) for _, text in files) for name, files in texts.items()}
    names = sorted(modules)
    random.Random(seed).shuffle(names)
    target, held, held_size = eval_fraction * sum(sizes.values()), [], 0
    for name in names:  # modules in shuffled order until eval holds its share (a huge module is skipped, not split)
        if held_size >= target:
            break
        if held_size + sizes[name] <= 1.5 * target:
            held.append(name)
            held_size += sizes[name]

    def as_dataset(keys):
        rows = [(name, path, text) for name in sorted(keys) for path, text in texts[name] if text.strip()]
        return Dataset.from_dict({"module": [r[0] for r in rows], "path": [r[1] for r in rows],
                                  "text": [r[2] for r in rows]})

    return as_dataset(set(names) - set(held)), as_dataset(held)


def _read(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


# named corpora: --data NAME (when no file of that name exists) gives train and held-out eval splits
CORPORA = {
    "pydoc": "the standard library's pydoc topics (about 465k characters of English reference documentation), split "
             "by topic",
    "python-stdlib": "the standard library's source (about 13 MB of Python and its docstrings, pydoc_data's reference "
                     "documentation included; test suites left out), split by module",
}


def named_corpus(name: str, *, seed: int = 0):
    """(train, eval) datasets of the corpus ``name`` (a key of ``CORPORA``), split with ``seed``."""
    if name == "pydoc":
        return pydoc_topics(seed=seed)
    if name == "python-stdlib":
        return stdlib_corpus(seed=seed)
    raise TrainingError(f"unknown corpus {name!r}; the named corpora are {', '.join(CORPORA)}.")


def is_named_corpus(source) -> str | None:
    """The corpus name when ``source`` (``--data``'s value) is one name of ``CORPORA`` and no file of that name exists."""
    values = source if isinstance(source, (list, tuple)) else [source]
    if len(values) == 1 and str(values[0]) in CORPORA and not Path(str(values[0])).exists():
        return str(values[0])
    return None
