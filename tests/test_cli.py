"""The ``fiber-bundle`` command line: one dispatcher that imports only the package a subcommand needs, and ``train``
parsed by transformers' HfArgumentParser into ``FiberBundleTrainingArguments``, so every TrainingArguments field is a
flag that reaches the Trainer, beside the project's fields and the spellings the command has always accepted."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_model, tiny_tokenizer
from fiber_bundle.cli import SUBCOMMANDS, main
from fiber_bundle.training.arguments import FiberBundleTrainingArguments
from fiber_bundle.training.cli import parse_train
from fiber_bundle.training.errors import TrainingError

ROOT = Path(__file__).resolve().parent.parent


def help_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_subcommand_and_an_unknown_one_is_refused(capsys):
    text = " ".join(help_of(["--help"], capsys).split())
    for name, (_, summary) in SUBCOMMANDS.items():
        assert f"{name} {summary}" in text
    with pytest.raises(SystemExit) as exit:
        main(["bogus"])
    assert exit.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_train_help_lists_the_training_arguments_and_the_projects(capsys):
    text = help_of(["train", "--help"], capsys)
    for flag in ("--gradient_accumulation_steps", "--warmup_steps", "--lr_scheduler_type", "--bf16", "--logging_steps",
                 "--eval_strategy", "--mode", "--metric_learning_rate", "--optimizer", "--batch-size", "--traceback"):
        assert flag in text, flag


# the command line as it has always been spelled, and the same run in HfArgumentParser's own spellings
OLD = ["--data", "a.txt", "b.txt", "--eval-data", "e.txt", "--mode", "lora", "--block-size", "32", "--max-steps", "7",
       "--learning-rate", "0.01", "--batch-size", "4", "--seed", "3", "--lora-r", "2", "--metric-learning-rate", "0.02",
       "--curvature-weight", "0.1", "--torsion-weight", "0.2", "--report-to", "tensorboard", "--save-steps", "5",
       "--base-model-id", "x/y", "--resume", "--overwrite", "--traceback"]
NEW = ["--data", "a.txt", "b.txt", "--eval_data", "e.txt", "--mode", "lora", "--block_size", "32", "--max_steps", "7",
       "--learning_rate", "0.01", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--seed",
       "3", "--lora_r", "2", "--metric_learning_rate", "0.02", "--curvature_weight", "0.1", "--torsion_weight", "0.2",
       "--report_to", "tensorboard", "--save_strategy", "steps", "--save_steps", "5", "--base_model_id", "x/y",
       "--resume", "true", "--overwrite", "true"]
RIEMANNIAN = ["--optimizer", "grassmann", "--riemannian-learning-rate", "0.1", "--block", "--retraction", "polar"]


def test_old_spellings_parse_to_the_same_arguments():
    old, command = parse_train(["MODEL", "OUT", *OLD])
    new, _ = parse_train(["MODEL", "OUT", *NEW])
    assert (command.model, command.output, command.traceback) == ("MODEL", "OUT", True)
    assert {**old.to_dict(), "batch_size": None} == new.to_dict()
    assert (old.per_device_eval_batch_size, old.save_strategy, old.report_to, old.checkpoint_to_resume) == (
        4, "steps", ["tensorboard"], True)
    riemannian, _ = parse_train(["MODEL", "OUT", *RIEMANNIAN])
    assert (riemannian.optimizer, riemannian.riemannian_learning_rate, riemannian.block, riemannian.retraction) == (
        "grassmann", 0.1, True, "polar")
    default, _ = parse_train(["MODEL", "OUT"])  # the defaults the command has always had
    assert default.to_dict() == FiberBundleTrainingArguments().to_dict()
    assert (default.learning_rate, default.max_steps, default.per_device_train_batch_size, default.seed,
            default.logging_steps, default.save_strategy, default.report_to, default.dataloader_pin_memory,
            default.mode, default.optimizer) == (1e-3, 100, 8, 0, 1, "no", [], torch.cuda.is_available(),
                                                 "metric-only", "adamw")


def test_bad_options_are_refused_with_the_fix(tmp_path, capsys):
    cases = [(dict(mode="partial"), "mode 'partial' is not one of full, metric-only, lora"),
             (dict(block=True), "apply to a Riemannian optimizer, not to adamw"),
             (dict(optimizer="grassmann", metric_learning_rate=0.1), "metric_learning_rate applies to the AdamW"),
             (dict(metric_learning_rate=0.1, optim="sgd"), "drop --optim"),
             (dict(save_strategy="steps"), "pass --save_steps N")]
    for fields, message in cases:
        with pytest.raises(TrainingError, match=message):
            FiberBundleTrainingArguments(**fields)
    out = tmp_path / "out"
    assert main(["train", str(tmp_path / "model"), str(out), "--output_dir", str(tmp_path / "elsewhere")]) == 1
    assert capsys.readouterr().err == (
        f"fiber-bundle train: error: output_dir is set to {tmp_path / 'elsewhere'}, but the checkpoints of a run "
        f"always go to OUTPUT/checkpoints ({out / 'checkpoints'}): drop --output_dir (output_dir).\n")
    assert main(["train", "MODEL", str(out), "--optimizer", "grassmann", "--metric-learning-rate", "0.1"]) == 1
    assert "metric_learning_rate applies to the AdamW" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["train", "MODEL", str(out), "--no-such-flag", "1"])
    assert exit.value.code == 2 and "unrecognized arguments: --no-such-flag 1" in capsys.readouterr().err
    assert not out.exists()


def test_a_training_arguments_flag_reaches_the_trainer(tmp_path):
    """--gradient_accumulation_steps and --lr_scheduler_type, which the command never had, are in the Trainer's own
    record of the run (training_args.bin) and act: a constant rate, two micro-batches per step."""
    folder = tmp_path / "model"
    tiny_model(dtype=torch.float32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (tmp_path / "train.txt").write_text(" ".join(f"w{3 + (7 * i) % 90}" for i in range(800)) + "\n")
    out = tmp_path / "out"
    assert main(["train", str(folder), str(out), "--data", str(tmp_path / "train.txt"), "--block-size", "32",
                 "--batch-size", "2", "--max-steps", "2", "--save-steps", "2", "--gradient_accumulation_steps", "2",
                 "--lr_scheduler_type", "constant", "--use_cpu"]) == 0
    checkpoint = out / "checkpoints" / "checkpoint-2"
    used = torch.load(checkpoint / "training_args.bin", weights_only=False)
    assert isinstance(used, FiberBundleTrainingArguments) and used.output_dir == str(out / "checkpoints")
    assert (used.gradient_accumulation_steps, used.lr_scheduler_type, used.per_device_train_batch_size) == (
        2, "constant", 2)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert [entry["learning_rate"] for entry in state["log_history"] if "loss" in entry] == [1e-3, 1e-3]
    assert state["train_batch_size"] == 2 and state["global_step"] == 2


def test_training_shows_a_progress_bar_without_log_lines_when_asked(tmp_path, capsys):
    """print_logs=False (the main job): transformers' progress bar, and none of the log entries it prints under it."""
    from fiber_bundle.training.trainer import train_model
    from test_training import pattern_dataset

    common = dict(mode="metric-only", max_steps=2, batch_size=4, use_cpu=True, disable_tqdm=False)
    trainer = train_model(tiny_model(dtype=torch.float32), pattern_dataset(n=8), tmp_path / "a", print_logs=False,
                          **common)
    printed = capsys.readouterr()
    assert "2/2" in printed.err and "geometry/" not in printed.out + printed.err
    assert any("geometry/torsion" in entry for entry in trainer.state.log_history)  # still logged
    train_model(tiny_model(dtype=torch.float32), pattern_dataset(n=8), tmp_path / "b", **common)
    assert "geometry/" in capsys.readouterr().out  # the default: each entry under the bar


def test_the_dispatcher_imports_only_the_package_a_command_needs():
    script = """
import sys
from fiber_bundle.cli import main
try:
    main(["convert", "--help"])
except SystemExit:
    pass
print(sorted(m for m in sys.modules if m.startswith(("fiber_bundle.training", "fiber_bundle.analysis"))))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Convert SOURCE into a Fiber Bundle" in result.stdout and result.stdout.strip().endswith("[]")


def project_imports(folder: Path) -> set[str]:
    """The project packages a folder's modules import, at any depth (an import inside a function counts)."""
    found = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found.update(name.split(".")[1] for name in names if name.startswith("fiber_bundle."))
    return found


def test_conversion_imports_neither_training_nor_analysis():
    assert not project_imports(ROOT / "conversion") & {"training", "analysis", "cli"}
    assert not project_imports(ROOT / "training") & {"analysis", "cli"}


# analysis/ in layers, each importing only from its own layer or the ones below: estimators and loading, then the probes
# that read models, then the studies, then their reports and figures, then the command line
ANALYSIS_LAYERS = [{"measures", "output", "models", "evaluation"}, {"probes", "stacks", "ide"},
                   {"study", "scratch", "optimizers", "compare", "ide_study", "scaling"}, {"reports", "plots"},
                   {"cli", "__init__"}]


def test_analysis_layers_point_one_way():
    """Every module of analysis/ is in one layer of ``ANALYSIS_LAYERS`` and imports (at any depth) no module of a layer
    above its own."""
    layer = {name: depth for depth, names in enumerate(ANALYSIS_LAYERS) for name in names}
    upward = []
    for path in sorted((ROOT / "analysis").glob("*.py")):
        assert path.stem in layer, f"analysis/{path.name} is in no layer of ANALYSIS_LAYERS"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith(
                    "fiber_bundle.analysis.")):
                imported = (node.module or "").rpartition(".")[2]
                if layer[imported] > layer[path.stem]:
                    upward.append(f"{path.name} -> {imported}")
    assert not upward, upward


def test_no_private_name_is_imported_across_modules():
    """A helper another module needs has a public name: no ``from module import _name`` in the project's packages (an
    import inside a function counts)."""
    found = set()
    for package in ("modeling_fiber_bundle", "conversion", "training", "analysis", "serving", "cli", "model_cards"):
        for path in (ROOT / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith(
                        ("fiber_bundle", "modeling_fiber_bundle"))):
                    found.update((f"{package}/{path.name}", alias.name) for alias in node.names
                                 if alias.name.startswith("_") and not alias.name.startswith("__"))
    assert not found, sorted(found)

