"""Training data through ``datasets``: local text / JSON lines / parquet files or a Hub dataset, plain text packed into
fixed-length blocks, chat ``messages`` formatted with the tokenizer's chat template, and the corpus every Python
ships (the standard library's ``pydoc_data.topics``) split by topic."""

import random
from pathlib import Path

from datasets import Dataset, load_dataset

FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_source(source: str | Path | list, *, split: str = "train") -> Dataset:
    """Local files (by extension: .txt, .json / .jsonl, .parquet; one kind per call) or a Hub dataset name."""
    paths = [Path(p) for p in (source if isinstance(source, (list, tuple)) else [source])]
    suffixes = {p.suffix.lower() for p in paths}
    if all(p.exists() for p in paths):
        if len(suffixes) != 1 or next(iter(suffixes)) not in FILE_BUILDERS:
            raise ValueError(f"data files must share one of the extensions {sorted(FILE_BUILDERS)}; got "
                             f"{sorted(suffixes)}.")
        return load_dataset(FILE_BUILDERS[suffixes.pop()], data_files=[str(p) for p in paths], split="train")
    if len(paths) == 1 and suffixes & set(FILE_BUILDERS):
        raise ValueError(f"data file {paths[0]} does not exist.")
    return load_dataset(str(source), split=split)


def chat_to_text(dataset: Dataset, tokenizer, *, column: str = "messages") -> Dataset:
    """Render a ``messages`` column with the tokenizer's chat template into a ``text`` column."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the dataset has a 'messages' column but the tokenizer has no chat template.")

    def render(batch):
        return {"text": [tokenizer.apply_chat_template(m, tokenize=False) for m in batch[column]]}

    return dataset.map(render, batched=True, remove_columns=dataset.column_names)


def pack_blocks(dataset: Dataset, tokenizer, block_size: int, *, text_column: str = "text") -> Dataset:
    """Tokenise, join the documents (each followed by EOS) and cut the stream into ``block_size`` blocks with labels;
    the remainder shorter than a block is dropped."""
    if "messages" in dataset.column_names and text_column not in dataset.column_names:
        dataset = chat_to_text(dataset, tokenizer)
    if text_column not in dataset.column_names:
        raise ValueError(f"the dataset has no {text_column!r} column (columns: {dataset.column_names}).")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize_and_pack(batch):
        stream = []
        for ids in tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]:
            stream.extend(ids + eos)
        usable = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return dataset.map(tokenize_and_pack, batched=True, batch_size=1000, remove_columns=dataset.column_names)


def pydoc_topics(*, eval_fraction: float = 0.1, seed: int = 0) -> tuple[Dataset, Dataset]:
    """The standard library's pydoc topics (about 465k characters of English documentation), split by topic into
    train and held-out eval sets, so no eval topic is seen in training."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    random.Random(seed).shuffle(names)
    n_eval = max(1, round(eval_fraction * len(names)))
    as_dataset = lambda keys: Dataset.from_dict({"topic": keys, "text": [topics[k] for k in keys]})  # noqa: E731
    return as_dataset(sorted(names[n_eval:])), as_dataset(sorted(names[:n_eval]))
