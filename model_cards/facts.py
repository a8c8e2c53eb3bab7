"""What a folder's JSON files record about how it was made, in the form a public card may show: sources by Hub id or
file name (never a local path), the software and the hardware. ``fiber-bundle convert``, ``train`` and ``merge`` record
these; ``card.render_card`` reads them back. Nothing of the project is imported here."""

import os
import platform
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "fiber-bundle-transformers"
# the packages whose versions a card lists, in this order (absent ones are left out)
FRAMEWORKS = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "huggingface-hub",
              DISTRIBUTION)


def looks_like_hub_id(value) -> bool:
    """``owner/name`` with no local file or folder of that name: a Hub repository id (a dataset's or a model's)."""
    text = str(value)
    parts = text.split("/")
    return (len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and "\\" not in text
            and not Path(text).exists())


def public_name(value) -> str | None:
    """How a source may be named in public: a Hub id as it is, a local file or folder by its name only (the part
    after the last separator, so no directory layout or user name leaks), anything else (a preset or corpus name,
    "byte") as it is. None stays None."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return ", ".join(public_name(v) for v in value)
    text = str(value)
    if looks_like_hub_id(text):
        return text
    if os.sep in text or "/" in text or "\\" in text or Path(text).exists():
        return Path(text.replace("\\", "/").rstrip("/")).name or text
    return text


def framework_versions() -> dict[str, str]:
    """The installed versions of ``FRAMEWORKS`` (local build tags such as ``+cpu`` dropped)."""
    found = {}
    for name in FRAMEWORKS:
        try:
            found[name] = metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    return found


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` shows it (read from /proc/cpuinfo on Linux; elsewhere what ``platform``
    knows): which host a timing or a run came from."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 min load averages (None where unknown): whether anything else ran on the cores while
    a run was timed."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def hardware() -> str:
    """The device a run used, as a card may show it: the GPU's name and count, else the CPU's model name
    (``cpu_model``) and the threads torch used."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return f"{count} x {torch.cuda.get_device_name(0)}"
    return f"{cpu_model()} (CPU, {torch.get_num_threads()} threads)"
