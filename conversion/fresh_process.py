"""Python in a fresh process where this project cannot be imported: how a Hub user meets a published folder.

Used by the tests, by ``fiber-bundle publish``'s folder check and by the main job, so that "it loads with
trust_remote_code without the project" is checked the same way everywhere.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# The child's prologue: every import of this project fails, and a child that could still import it stops at once.
BLOCK_PROJECT = textwrap.dedent(
    """
    import importlib.abc, sys
    class BlockProject(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"modeling_fiber_bundle", "fiber_bundle", "conversion", "training"}:
                raise ImportError(f"{name} must not be importable here")
    sys.meta_path.insert(0, BlockProject())
    try:
        import modeling_fiber_bundle  # noqa: F401
        raise SystemExit("the project is importable: the check would prove nothing")
    except ImportError:
        pass
    """
)


def run_without_project(script: str, *args, cwd: str | Path, hf_home: str | Path | None = None,
                        timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``script`` (its arguments in ``sys.argv[1:]``) in a fresh Python where this project cannot be imported,
    offline, with its own HF cache (``hf_home``, default ``cwd/hf_home``) and no standard input."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home or Path(cwd) / "hf_home"), PYTHONNOUSERSITE="1")
    return subprocess.run([sys.executable, "-c", BLOCK_PROJECT + textwrap.dedent(script), *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
