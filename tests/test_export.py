"""The model outside Python transformers: ``torch.export`` with a static cache through transformers' own exportable
wrapper, and ``fiber-bundle export`` to a torch.export program, an ONNX graph and an ExecuTorch program, each run by its
own runtime against the eager model (docs/deployment.md)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import random_ids, set_gates, tiny_model


def exportable_model():
    """The tiny model, its geometry awake, with the static cache the exportable wrapper requires."""
    model = set_gates(tiny_model(dtype=torch.float32)).eval()
    model.generation_config.cache_implementation = "static"
    return model


@pytest.mark.parametrize("strict", [True, False])
def test_exported_program_generates_the_eager_tokens(strict):
    """``TorchExportableModuleForDecoderOnlyLM(...).export`` in eval mode (gradients on, as torch.export traces): the
    exported one-token program's logits at every prompt position equal the full forward's, and its greedy tokens equal
    ``generate``'s. (The layer checkpointed its geometry whenever gradients were enabled, which an export trace cannot
    take: ``_checkpoint_context_fn``.)"""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = exportable_model()
    exported = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=32).export(
        input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]), strict=strict)
    prompt = random_ids(1, 6)
    program = exported.module()
    with torch.no_grad():
        full = model(prompt, use_cache=False).logits
        steps = torch.cat([program(input_ids=prompt[:, i:i + 1], cache_position=torch.tensor([i]))
                           for i in range(prompt.shape[1])], dim=1)
        torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
        # greedy decoding, one token per call at its own position (transformers 5.25's
        # TorchExportableModuleWithStaticCache.generate feeds the first new token at position n + 1, not n)
        tokens, logits = prompt, steps[:, -1]
        for position in range(prompt.shape[1], prompt.shape[1] + 12):
            token = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, token], dim=1)
            logits = program(input_ids=token, cache_position=torch.tensor([position]))[:, -1]
        expected = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, expected)


# ----------------------------------------------------------------------------------------------------------------------
# fiber-bundle export: the written file, run by its own runtime, against the eager model
# ----------------------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent


def model_folder(tmp_path) -> Path:
    folder = tmp_path / "model"
    set_gates(tiny_model(dtype=torch.float32)).save_pretrained(folder)
    return folder


def eager_logits(folder, ids):
    from fiber_bundle.conversion import load_model

    with torch.no_grad():
        return load_model(folder)(ids, use_cache=False).logits


def test_exported_program_file_runs_as_the_eager_model(tmp_path):
    """``export_model(..., format="exported-program")`` writes model.pt2 (with the config, generation config and a
    report whose check passed); ``torch.export.load`` of that file, fed the prompt one token per position, gives the
    eager forward's logits. Nothing but OUTPUT is left in its folder."""
    from fiber_bundle.conversion.export import export_model

    folder, out = model_folder(tmp_path), tmp_path / "out"
    result = export_model(folder, out, format="exported-program", max_cache_len=32, prompt_tokens=10, new_tokens=8)
    assert result.report["parity"]["passed"] and result.report["parity"]["greedy_agreement"] == 1.0
    assert {p.name for p in out.iterdir()} >= {"model.pt2", "config.json", "generation_config.json",
                                               "export_report.json"}
    assert json.loads((out / "export_report.json").read_text())["max_cache_len"] == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]  # no staging folder left
    program = torch.export.load(str(out / "model.pt2")).module()
    prompt = random_ids(1, 7)
    with torch.no_grad():
        steps = torch.cat([program(input_ids=prompt[:, i:i + 1], cache_position=torch.tensor([i]))
                           for i in range(prompt.shape[1])], dim=1)
    torch.testing.assert_close(steps, eager_logits(folder, prompt), rtol=1e-5, atol=1e-5)


def test_onnx_graph_prefills_in_chunks_and_decodes_with_its_cache(tmp_path):
    """``--format onnx`` with chunks of 4: onnxruntime, fed a 10-token prompt as chunks of 4, 4 and 2 (each with the
    cache the previous call returned) and then one token, gives the eager logits of all 11 positions; the graph's
    inputs and outputs are the named cache layout."""
    pytest.importorskip("onnxruntime")
    import numpy as np
    import onnxruntime

    from fiber_bundle.conversion.export import export_model

    folder, out = model_folder(tmp_path), tmp_path / "out"
    result = export_model(folder, out, format="onnx", prefill_chunk=4, prompt_tokens=10, new_tokens=8)
    assert result.report["parity"]["passed"] and result.report["max_cache_len"] is None
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"] and names[3:5] == [
        "past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in session.get_outputs()][:2] == ["logits", "present.0.key"]
    ids = random_ids(1, 11)
    past = [np.zeros((1, 2, 0, 16), dtype=np.float32) for _ in names[3:]]
    logits = []
    for start, stop in ((0, 4), (4, 8), (8, 10), (10, 11)):
        feeds = {"input_ids": ids[:, start:stop].numpy(), "attention_mask": np.ones((1, stop), dtype=np.int64),
                 "position_ids": np.arange(start, stop, dtype=np.int64)[None], **dict(zip(names[3:], past))}
        chunk, *past = session.run(None, feeds)
        logits.append(torch.from_numpy(chunk))
    assert past[0].shape == (1, 2, 11, 16)
    torch.testing.assert_close(torch.cat(logits, dim=1), eager_logits(folder, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
def test_executorch_program_generates_the_eager_tokens(tmp_path):
    """``fiber-bundle export --format executorch`` in the venv that has ExecuTorch (.ci/setup.sh's .venv-executorch):
    the .pte, run by ExecuTorch's runtime one token per position, generates ``generate``'s greedy tokens and the eager
    prompt logits. (Before: ``RuntimeError: Missing out variants: {'prims::fma'}`` when lowering, from dynamo
    rewriting the attention's ``addcmul_(..., value=)``.)"""
    python = ROOT / ".venv-executorch" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-executorch: bash .ci/setup.sh creates it")
    folder, out = model_folder(tmp_path), tmp_path / "out"
    result = subprocess.run([str(python), "-m", "fiber_bundle.cli", "export", str(folder), str(out), "--format",
                             "executorch", "--max-cache-len", "32", "--prompt-tokens", "10", "--new-tokens", "12"],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "export_report.json").read_text())
    assert report["format"] == "executorch" and report["parity"]["passed"], report
    assert report["parity"]["greedy_agreement"] == 1.0 and report["parity"]["new_tokens"] == 12
    assert report["parity"]["max_abs_logit_diff"] < 1e-5 and (out / "model.pte").stat().st_size > 0
    assert "executorch" in report["versions"]


def test_export_refuses_what_a_format_cannot_take(tmp_path, monkeypatch, capsys):
    """Each refusal names the problem and the fix, before anything is written."""
    from fiber_bundle.cli import main
    from fiber_bundle.conversion.export import ExportError, export_model

    folder, out = model_folder(tmp_path), tmp_path / "out"
    cases = [(dict(format="tflite"), "not one of exported-program, onnx, executorch"),
             (dict(format="executorch", dynamic_length=True), r"static cache .* \(dynamic length is not available"),
             (dict(format="exported-program", max_cache_len=16), "needs 40 positions .* raise --max-cache-len")]
    for fields, message in cases:
        with pytest.raises(ExportError, match=message):
            export_model(folder, out, **fields)
    with monkeypatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ExportError, match="tensor-parallel .* without torchrun"):
            export_model(folder, out)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ExportError, match=r"LoRA adapter: merge it .* \(fiber-bundle merge"):
        export_model(adapter, out)
    from helpers import SOURCE_FAMILIES, TINY

    config_class, model_class, _ = SOURCE_FAMILIES["llama"]
    model_class(config_class(**TINY)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ExportError, match="not a Fiber Bundle folder .*fiber-bundle convert"):
        export_model(tmp_path / "llama", out)
    from fiber_bundle.conversion import export as export_module

    with monkeypatch.context() as patch:
        patch.setitem(export_module.FORMATS, "onnx",
                      export_module.FORMATS["onnx"].__class__(**{**vars(export_module.FORMATS["onnx"]),
                                                                 "packages": ("no_such_runtime",)}))
        with pytest.raises(ExportError, match=r"no_such_runtime: pip install 'fiber-bundle-transformers\[export\]'"):
            export_model(folder, out, format="onnx")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["export", str(folder), str(tmp_path / "full")]) == 1
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and not out.exists()


def test_a_failed_parity_check_writes_nothing(tmp_path, monkeypatch):
    """A program whose logits miss the bound is not written: OUTPUT keeps its old contents and no staging folder is
    left (the bound is forced below any difference)."""
    from fiber_bundle.conversion import export as export_module

    folder, out = model_folder(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    monkeypatch.setattr(export_module, "parity_bound", lambda reference: -1.0)
    with pytest.raises(export_module.ExportError, match="parity check failed: prompt logits max"):
        export_module.export_model(folder, out, overwrite=True, max_cache_len=48)
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


class EagerRunner:
    """The interface export's check runs a written program through (``StaticCacheRunner``, ``OnnxRunner``), made of
    the eager model itself: each call recomputes the whole sequence so far, so its logits are the model's."""

    def __init__(self, model):
        self.model, self.ids = model, None

    def reset(self) -> None:
        self.ids = None

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids = ids
        with torch.no_grad():
            return self.model(ids, use_cache=False).logits

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        assert position == self.ids.shape[1]  # each new token at its own position
        self.ids = torch.cat([self.ids, token], dim=1)
        with torch.no_grad():
            return self.model(self.ids, use_cache=False).logits[:, -1:]


class WrongSteps:
    """A program whose prompt logits are right and whose decoding steps are wrong: ``runner``'s step logits moved by
    one id, so from the second new token on its greedy choice is never the model's."""

    def __init__(self, runner):
        self.runner = runner

    def reset(self) -> None:
        self.runner.reset()

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.runner.prefill(ids)

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        return self.runner.step(token, position).roll(1, dims=-1)


def test_the_check_compares_the_decoding_steps_not_only_the_prompt():
    """``check_parity`` passes the eager model run as a program and fails one whose prompt logits are exact (difference
    0, within the bound) but whose decoding steps choose other tokens: the prompt logits alone would pass it."""
    from fiber_bundle.conversion.export import check_parity

    model, prompt = set_gates(tiny_model(dtype=torch.float32)).eval(), random_ids(1, 10)
    assert check_parity(model, EagerRunner(model), prompt, 8)["passed"]
    report = check_parity(model, WrongSteps(EagerRunner(model)), prompt, 8)
    assert report["max_abs_logit_diff"] == 0.0 <= report["bound"] and report["greedy_agreement"] < 1.0
    assert not report["passed"]


def test_a_program_with_wrong_decoding_steps_is_not_written(tmp_path, monkeypatch):
    """The written model.pt2 run with its decoding steps' logits moved by one id (its prompt logits untouched): the
    export fails on the greedy tokens, OUTPUT keeps its old contents and no staging folder is left."""
    from fiber_bundle.conversion import export as export_module

    folder, out = model_folder(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real = export_module.RUNNERS["exported-program"]
    monkeypatch.setitem(export_module.RUNNERS, "exported-program",
                        lambda path, config, chunk: WrongSteps(real(path, config, chunk)))
    with pytest.raises(export_module.ExportError, match="parity check failed") as raised:
        export_module.export_model(folder, out, overwrite=True, max_cache_len=48, prompt_tokens=10, new_tokens=8)
    found = re.search(r"prompt logits max \|d\| (\S+) \(bound (\S+)\), greedy tokens (\d+)% equal", str(raised.value))
    diff, bound, agreement = float(found[1]), float(found[2]), int(found[3])
    assert diff <= bound and agreement < 100  # only the decoding steps are wrong
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_export_command_prints_the_check(tmp_path, capsys):
    from fiber_bundle.cli import main

    folder, out = model_folder(tmp_path), tmp_path / "out"
    assert main(["export", str(folder), str(out), "--max-cache-len", "48"]) == 0
    printed = capsys.readouterr().out
    assert f"-> {out / 'model.pt2'} (exported-program," in printed
    assert "parity: prompt logits max |d|" in printed and "greedy tokens 100% equal to generate's over 16" in printed
