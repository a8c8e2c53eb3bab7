"""Writing results: JSON written atomically (a killed run never leaves half a file) and PNG figures (matplotlib,
without a display)."""

import json
import math
import os
from pathlib import Path


def jsonable(value):
    """``value`` as JSON can hold it: tensors and arrays as lists, dict keys as strings, NaN and inf as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / inf; a missing figure is null
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # tensors and numpy arrays
        return jsonable(value.tolist())
    return value


def write_json(path: str | Path, data: dict) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(jsonable(data), indent=2) + "\n")
    temporary.replace(path)
    return path


def figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.6):
    """A matplotlib figure and its axes (always a flat list), on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, list(axes.flat)


def label_axes(ax, xlabel: str, ylabel: str, *, title: str | None = None, legend: int | None = None) -> None:
    """Name a panel's axes; ``title`` in the small type of a multi-panel figure, ``legend`` at that font size."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title, fontsize=9)
    if legend is not None:
        ax.legend(fontsize=legend)


def save_figure(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    fig.tight_layout()
    fig.savefig(temporary, dpi=110)
    plt.close(fig)
    temporary.replace(path)
    return path
