"""A saved folder is a Hub folder: it loads with trust_remote_code in a fresh process where this project is absent."""

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers.dynamic_module_utils import check_imports, get_imports, get_relative_imports

from helpers import random_ids, run_without_project, set_gates, tiny_model, tiny_tokenizer
from modeling_fiber_bundle.modeling_fiber_bundle import AUTO_MAP

# Run in a child where this project cannot be imported (helpers.run_without_project): load as a Hub user does.
CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline
    folder, ids_path, out_path = sys.argv[1:4]
    ids = torch.load(ids_path)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    base = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        logits = model(ids).logits
        hidden = base(ids).last_hidden_state
        geometry = model(ids, output_geometry=True).geometry
    generated = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    text = pipeline("text-generation", model=folder, trust_remote_code=True)("w5 w6 w7", max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(tokenizer("w5 w6 w7")["input_ids"]) == "w5 w6 w7"
    torch.save({"logits": logits, "hidden": hidden, "generated": generated, "geometry": geometry}, out_path)
    print(json.dumps({
        "model_class": type(model).__name__,
        "model_module": type(model).__module__,
        "base_class": type(base).__name__,
        "config_class": type(config).__name__,
        "pipeline_text": text[0]["generated_text"],
    }))
    """
)


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("FBT-tiny.v0.1")  # dots and hyphens, as real repo names have
    model = set_gates(tiny_model(dtype=torch.float32))
    with torch.no_grad():
        for p in model.geometry_parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder, model


def test_folder_holds_config_auto_map_and_only_the_modeling_files(saved_folder):
    folder, _ = saved_folder
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "fiber_bundle"
    assert config["architectures"] == ["FiberBundleForCausalLM"]
    assert config["auto_map"] == AUTO_MAP  # every Auto class, the task heads' included
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_fiber_bundle.FiberBundleForCausalLM"
    py_files = sorted(p.name for p in folder.glob("*.py"))
    assert py_files == [
        "configuration_fiber_bundle.py", "fiber_attention.py", "fused_attention.py", "modeling_fiber_bundle.py"
    ]
    assert (folder / "model.safetensors").exists() and (folder / "generation_config.json").exists()


def test_modeling_files_import_only_torch_transformers_and_siblings(saved_folder):
    folder, _ = saved_folder
    siblings = {p.stem for p in folder.glob("*.py")}
    for path in folder.glob("*.py"):
        check_imports(str(path))  # what transformers runs before loading: raises if an import is not installed
        absolute = set(get_imports(str(path))) - set(sys.stdlib_module_names)  # non-stdlib, outside try/except
        assert absolute <= {"torch", "transformers"}, (path.name, absolute)
        assert set(get_relative_imports(str(path))) <= siblings


def test_fresh_process_loads_with_trust_remote_code(saved_folder, tmp_path):
    folder, model = saved_folder
    ids = random_ids(2, 9, vocab=model.config.vocab_size)
    torch.save(ids, tmp_path / "ids.pt")
    result = run_without_project(CHILD, folder, tmp_path / "ids.pt", tmp_path / "out.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["model_class"] == "FiberBundleForCausalLM"
    assert info["model_module"].startswith("transformers_modules.")  # the folder's code, not this package
    assert info["base_class"] == "FiberBundleModel"
    assert info["config_class"] == "FiberBundleConfig"
    assert info["pipeline_text"].startswith("w5 w6 w7")
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], model(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(out["hidden"], model.model(ids).last_hidden_state, rtol=0, atol=0)
        expected_geometry = model(ids, output_geometry=True).geometry
    for key, value in expected_geometry.items():
        torch.testing.assert_close(out["geometry"][key], value)
    assert torch.equal(out["generated"], model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False))


def test_resaving_a_remote_code_model_keeps_it_loadable(saved_folder, tmp_path):
    """A model loaded through trust_remote_code and saved again still carries its code and full auto_map."""
    folder, _ = saved_folder
    script = textwrap.dedent(
        """
        import sys
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        model.save_pretrained(sys.argv[2])
        """
    )
    resaved = tmp_path / "resaved"
    result = run_without_project(script, folder, resaved, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    config = json.loads((resaved / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert sorted(p.name for p in Path(resaved).glob("*.py")) == [
        "configuration_fiber_bundle.py", "fiber_attention.py", "fused_attention.py", "modeling_fiber_bundle.py"
    ]
