"""pytest's fixtures. The helpers the test modules share are in helpers.py (a plain module, imported by name)."""

import pytest

import helpers  # noqa: F401  first: sets the offline environment before any test module imports transformers


@pytest.fixture
def tmp_hub_home(tmp_path, monkeypatch):
    """An empty HF cache so nothing cached elsewhere is picked up."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    return home
