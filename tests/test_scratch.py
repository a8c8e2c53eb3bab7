"""Training from scratch: ``fiber-bundle train --from-config`` (a fresh model, a byte-level tokenizer, full training,
a Hub folder that loads with trust_remote_code), the standard-library corpus split by module, and the resumable
from-scratch comparison (``fiber-bundle analyze scratch``) on a tiny model and a tiny stand-in standard library."""

import json
import math

import pytest
import torch

from helpers import fake_stdlib, run_without_project
from fiber_bundle.analysis import reports
from fiber_bundle.cli import main
from fiber_bundle.training.data import is_named_corpus, named_corpus, stdlib_corpus, stdlib_modules
from fiber_bundle.training.errors import TrainingError
from fiber_bundle.training.scratch import PRESETS, byte_tokenizer, fresh_model, scratch_config

TINY_SCRATCH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, metric_hidden=8, max_position_embeddings=256, tie_word_embeddings=True)


def write_config(path, **overrides):
    path.write_text(json.dumps({**TINY_SCRATCH, **overrides}))
    return path


# ----------------------------------------------------------------------------------------------------------------------
# the tokenizer and the configuration
# ----------------------------------------------------------------------------------------------------------------------
def test_byte_tokenizer_is_one_token_per_byte_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = byte_tokenizer()
    text = "def f(x):\n\treturn x  # héllo ∑ \x00\x7f"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 258 and tokenizer.eos_token_id == tokenizer.bos_token_id == 256
    assert tokenizer.pad_token_id == 257
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids and loaded.decode(ids) == text


def test_scratch_config_from_a_preset_a_file_and_a_saved_config(tmp_path):
    tokenizer = byte_tokenizer()
    small = scratch_config("small", tokenizer)
    assert (small.hidden_size, small.num_hidden_layers) == (PRESETS["small"]["hidden_size"], 4)
    assert small.vocab_size == 258 and small.eos_token_id == 256 and small.pad_token_id == 257
    config = scratch_config(write_config(tmp_path / "c.json", metric_gate_init=1.0, flatness_gate_init=1.0,
                                         ffn_gate_init=0.5), tokenizer)
    assert (config.metric_gate_init, config.flatness_gate_init, config.ffn_gate_init) == (1.0, 1.0, 0.5)
    config.save_pretrained(tmp_path / "saved")  # a saved config.json is a valid spec
    again = scratch_config(tmp_path / "saved" / "config.json", tokenizer)
    drop = lambda d: {k: v for k, v in d.items() if k != "auto_map"}  # noqa: E731  (written by save_pretrained)
    assert drop(again.to_dict()) == drop(config.to_dict())


@pytest.mark.parametrize("fields, message", [
    (dict(metric_gate_int=1.0), "unknown FiberBundleConfig field(s) metric_gate_int"),
    (dict(vocab_size=100), "vocab_size 100 is smaller than the tokenizer's 258 tokens"),
    (dict(model_type="llama"), "model_type 'llama'; a from-scratch model is a 'fiber_bundle' model"),
    (dict(metric_gate_init=-2.0), "metric_gate_init must be a finite number > -1"),
])
def test_scratch_config_refuses_bad_input_with_the_fix(tmp_path, fields, message):
    with pytest.raises(TrainingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scratch_config(write_config(tmp_path / "c.json", **fields), byte_tokenizer())


def test_scratch_config_refuses_a_missing_file_and_bad_json(tmp_path):
    with pytest.raises(TrainingError, match="no such file and not a preset"):
        scratch_config(tmp_path / "missing.json", byte_tokenizer())
    (tmp_path / "bad.json").write_text("{\"hidden_size\": 32,")
    with pytest.raises(TrainingError, match="not valid JSON"):
        scratch_config(tmp_path / "bad.json", byte_tokenizer())


def test_fresh_model_starts_at_the_configured_gates_and_is_seeded():
    tokenizer = byte_tokenizer()
    config = scratch_config({**TINY_SCRATCH, "metric_gate_init": 10.0, "flatness_gate_init": 1.0,
                             "ffn_gate_init": 0.5}, tokenizer)
    model = fresh_model(config, seed=3)
    fiber = model.model.layers[1].fiber
    torch.testing.assert_close(torch.expm1(fiber.attn_gate.detach()), torch.full((4,), 10.0))
    torch.testing.assert_close(fiber.flatness_gate.detach(), torch.ones(4))
    torch.testing.assert_close(torch.expm1(fiber.ffn_gate.detach()), torch.tensor([0.5]))
    same, other = fresh_model(config, seed=3), fresh_model(config, seed=4)
    for (name, a), b in zip(model.state_dict().items(), same.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    euclidean = fresh_model(scratch_config({**TINY_SCRATCH, "metric_rank": 0, "ffn_metric_rank": 0}, tokenizer), 0)
    assert not any("fiber" in name for name, _ in euclidean.named_parameters())


# ----------------------------------------------------------------------------------------------------------------------
# fiber-bundle train --from-config
# ----------------------------------------------------------------------------------------------------------------------
def test_train_from_config_builds_trains_and_writes_a_folder_that_loads_with_remote_code(tmp_path, capsys):
    config = write_config(tmp_path / "config.json", metric_gate_init=1.0, flatness_gate_init=1.0)
    out = tmp_path / "out"
    assert main(["train", "--from-config", str(config), str(out), "--max-steps", "4", "--batch-size", "4",
                 "--block-size", "64", "--learning-rate", "3e-3", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "trained 4 steps (full)" in printed
    before, after = (float(x) for x in printed.split("eval loss: ")[1].split()[0::2])
    assert math.isclose(before, math.log(258), rel_tol=0.05) and after < before  # starts near uniform, learns
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert metrics["mode"] == "full" and metrics["from_config"] == config.name and metrics["tokenizer"] == "byte"
    assert metrics["data"] == "pydoc"
    saved = json.loads((out / "config.json").read_text())
    assert saved["metric_gate_init"] == 1.0 and saved["vocab_size"] == 258 and "auto_map" in saved
    assert (out / "modeling_fiber_bundle.py").is_file() and (out / "tokenizer.json").is_file()

    from modeling_fiber_bundle import FiberBundleForCausalLM

    trained = FiberBundleForCausalLM.from_pretrained(out)
    alpha = torch.expm1(trained.model.layers[0].fiber.attn_gate.detach())
    assert not torch.allclose(alpha, torch.ones_like(alpha)) and alpha.min() > 0.5  # trained, from 1
    ids = torch.tensor([list(b"def main():\n    return 0\n")])
    torch.save(ids, tmp_path / "ids.pt")
    script = """
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        assert tokenizer("def main", add_special_tokens=False)["input_ids"] == list(b"def main")
        with torch.no_grad():
            torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
    """
    result = run_without_project(script, out, tmp_path / "ids.pt", tmp_path / "logits.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), trained(ids).logits, rtol=0, atol=1e-6)


def test_train_from_config_trains_the_euclidean_twin_and_a_preset(tmp_path, capsys):
    config = write_config(tmp_path / "euclid.json", metric_rank=0, ffn_metric_rank=0)
    text = (tmp_path / "train.txt", tmp_path / "eval.txt")
    text[0].write_text("def add(a, b):\n    return a + b\n" * 40)
    text[1].write_text("class Point:\n    x: int = 0\n" * 10)
    data = ["--data", str(text[0]), "--eval-data", str(text[1])]
    assert main(["train", "--from-config", str(config), str(tmp_path / "euclid"), "--max-steps", "2",
                 "--batch-size", "2", "--block-size", "32", "--quiet", *data]) == 0
    saved = json.loads((tmp_path / "euclid" / "config.json").read_text())
    assert saved["metric_rank"] == 0 and saved["ffn_metric_rank"] == 0
    assert main(["train", str(tmp_path / "preset"), "--from-config", "tiny", "--max-steps", "1", "--batch-size", "1",
                 "--block-size", "16", "--quiet", *data]) == 0
    metrics = json.loads((tmp_path / "preset" / "training_metrics.json").read_text())
    assert metrics["data"] == text[0].name and metrics["from_config"] == "tiny"
    assert json.loads((tmp_path / "preset" / "config.json").read_text())["hidden_size"] == PRESETS["tiny"]["hidden_size"]


def test_train_from_config_refuses_what_does_not_apply(tmp_path, capsys):
    config = write_config(tmp_path / "config.json")
    out = tmp_path / "out"
    for argv, message in [
        (["--mode", "lora"], "drop --mode lora (from-config training is --mode full)"),
        (["--load-in-4bit"], "drop --load-in-4bit / --load-in-8bit"),
        (["--data", "pydoc", "--eval-data", str(config)], "--data pydoc is a named corpus with its own held-out split"),
    ]:
        assert main(["train", "--from-config", str(config), str(out), *argv]) == 1
        assert message in capsys.readouterr().err
    assert main(["train", str(tmp_path / "model"), str(out), "--tokenizer", "byte"]) == 1
    assert "--tokenizer applies with --from-config" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:  # MODEL and --from-config: one too many paths
        main(["train", str(tmp_path / "model"), "--from-config", str(config), str(out)])
    assert exit.value.code == 2 and "with --from-config only OUTPUT is given" in capsys.readouterr().err
    assert main(["train", "--from-config", str(tmp_path / "nope.json"), str(out)]) == 1
    assert "no such file and not a preset" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------------------------
# the corpus
# ----------------------------------------------------------------------------------------------------------------------
def test_stdlib_corpus_splits_by_module_with_no_module_in_both(tmp_path):
    root = fake_stdlib(tmp_path)
    modules = stdlib_modules(root)
    assert set(modules) == {f"mod{i:02d}" for i in range(12)} | {"pkga", "pkgb"}
    assert [p.name for p in modules["pkga"]] == ["__init__.py", "inner.py"]  # tests and site-packages left out
    train, held = stdlib_corpus(root=root, eval_fraction=0.2, seed=1)
    assert set(train["module"]).isdisjoint(held["module"]) and set(train["module"]) | set(held["module"]) == set(modules)
    share = sum(map(len, held["text"])) / (sum(map(len, held["text"])) + sum(map(len, train["text"])))
    assert 0.1 < share < 0.35
    again = stdlib_corpus(root=root, eval_fraction=0.2, seed=1)
    assert list(again[1]["path"]) == list(held["path"]) and list(again[0]["text"]) == list(train["text"])
    assert list(stdlib_corpus(root=root, eval_fraction=0.2, seed=2)[1]["module"]) != list(held["module"])
    assert "pkga/sub/inner.py" in list(train["path"]) + list(held["path"])
    with pytest.raises(TrainingError, match="no Python source under"):
        stdlib_modules(tmp_path / "pkga" / "tests" / "none")


def test_the_real_stdlib_corpus_is_tens_of_megabytes_split_by_module():
    train, held = named_corpus("python-stdlib")
    train_size, held_size = sum(map(len, train["text"])), sum(map(len, held["text"]))
    assert train_size + held_size > 5_000_000 and 0.02 < held_size / (train_size + held_size) < 0.1
    assert set(train["module"]).isdisjoint(held["module"])
    assert "pydoc_data" in set(train["module"]) | set(held["module"])  # the reference documentation is in
    assert is_named_corpus(["python-stdlib"]) == "python-stdlib" and is_named_corpus(["a.txt"]) is None
    with pytest.raises(TrainingError, match="the named corpora are pydoc, python-stdlib"):
        named_corpus("wikipedia")


# ----------------------------------------------------------------------------------------------------------------------
# the comparison
# ----------------------------------------------------------------------------------------------------------------------
def test_equal_parameter_twin_spends_the_metric_on_mlp_width():
    from fiber_bundle.analysis.scratch import equal_parameter_twin, parameter_count

    config = scratch_config("small", byte_tokenizer())
    twin = equal_parameter_twin(config)
    assert twin.metric_rank == 0 and twin.ffn_metric_rank == 0
    per_unit = 3 * config.hidden_size * config.num_hidden_layers
    assert twin.intermediate_size > config.intermediate_size
    assert abs(parameter_count(twin) - parameter_count(config)) <= per_unit / 2


def test_scratch_comparison_runs_resumes_and_refuses_other_settings(tmp_path, monkeypatch):
    from fiber_bundle.analysis import scratch

    root = fake_stdlib(tmp_path / "lib", modules=30)
    settings = dict(seeds=(0, 1), learning_rates=(1e-3, 1e-2), arms=("euclidean", "strong-10"), strong=(10.0,),
                    model_fields=dict(TINY_SCRATCH), max_steps=3, batch_size=2, block_size=32, eval_blocks=4,
                    eval_every=2, warmup_steps=0, probe_blocks=2, corpus_root=root, progress=False)
    results = reports.run_scratch_comparison(tmp_path / "out", **settings)
    runs = results["runs"]
    assert {(r["arm"], r["seed"]) for r in runs} >= {("euclidean", 0), ("euclidean", 1), ("strong-10", 1)}
    assert sum(r["seed"] == 0 and r["arm"] == "euclidean" for r in runs) >= 2  # the sweep
    first = runs[0]
    assert [step for step, _ in first["eval_curve"]] == [2, 3]  # every 2 steps and at the end
    assert first["eval_loss_after"] == first["eval_curve"][-1][1]
    assert first["step_seconds_median"] > 0 and "compile_seconds" not in first and "compile" not in results
    assert len(first["residual_per_layer"]) == 3 and first["heads"] == 8
    euclid = [r for r in runs if r["arm"] == "euclidean"]
    strong = [r for r in runs if r["arm"] == "strong-10"]
    assert all(r["score_numerical_rank_per_layer"] == [8.0, 8.0] for r in euclid)  # dot product: rank <= head_dim 8
    assert all(r["heads_above_gram_bound"] == 8 for r in strong)  # the metric breaks the Gram bound in every head
    # started at 10; Adam moves theta = log(1 + alpha) by about lr per step
    assert all(abs(a - 10.0) < 1.5 for r in strong for a in r["gates"]["alpha"]) and not euclid[0]["gates"]
    summary = results["summary"]
    assert summary["euclidean"]["loss_vs_euclidean"] == 0.0
    assert summary["strong-10"]["parameters"] - summary["euclidean"]["parameters"] < 3 * 32 * 2
    paired = [s["eval_loss_after"] - e["eval_loss_after"] for s in strong for e in euclid
              if s["seed"] == e["seed"] and s["learning_rate"] == summary["strong-10"]["learning_rate"]
              and e["learning_rate"] == summary["euclidean"]["learning_rate"]]
    assert summary["strong-10"]["loss_vs_euclidean"] == pytest.approx(sum(paired) / len(paired))
    assert (tmp_path / "out" / "scratch.png").stat().st_size > 10_000

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr("fiber_bundle.training.trainer.train_model", no_training)
    again = reports.run_scratch_comparison(tmp_path / "out", **settings)  # everything is on disk: nothing reruns
    assert json.loads(json.dumps(again["summary"])) == json.loads(json.dumps(summary))
    partial = json.loads((tmp_path / "out" / "scratch.json").read_text())
    partial["runs"] = partial["runs"][:-1]  # as if stopped before the last run: only that one runs
    (tmp_path / "out" / "scratch.json").write_text(json.dumps(partial))
    monkeypatch.undo()
    calls = []

    from fiber_bundle.training import trainer

    original = trainer.train_model
    monkeypatch.setattr(trainer, "train_model", lambda *a, **k: calls.append(1) or original(*a, **k))
    reports.run_scratch_comparison(tmp_path / "out", **settings)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="holds a comparison with other settings"):
        reports.run_scratch_comparison(tmp_path / "out", **{**settings, "max_steps": 4})


@pytest.mark.heavy
def test_scratch_comparison_compiled_leaves_the_compilation_out_of_the_time_per_step(tmp_path, monkeypatch):
    """`analyze scratch --compile`: each arm (two shapes: the twin's MLP is wider) trains through torch.compile, the
    first step's compilation is recorded apart, and the time per step is a compiled step's."""
    from fiber_bundle.analysis import scratch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile, whatever ran before

    root = fake_stdlib(tmp_path / "lib", modules=30)
    results = reports.run_scratch_comparison(
        tmp_path / "out", seeds=(0,), learning_rates=(1e-2,), arms=("euclidean", "strong-1"), strong=(1.0,),
        model_fields=dict(TINY_SCRATCH), max_steps=4, batch_size=2, block_size=32, eval_blocks=4, eval_every=4,
        warmup_steps=0, probe_blocks=2, corpus_root=root, progress=False, max_extensions=0, compile=True)
    assert results["compile"] is True
    for run in results["runs"]:
        assert run["compile_seconds"] > 5 * run["step_seconds_median"]  # compiling takes far longer than a step
        assert run["seconds_per_step"] < run["compile_seconds"] and math.isfinite(run["eval_loss_after"])


def test_paired_interval_on_known_differences():
    """Differences 1..5: mean 3, s = sqrt(2.5); t_{0.975,4} = 2.7764 and t_{0.8,4} = 0.9410 (Student's t table), so the
    t-interval is 3 -/+ 1.963 and the detectable difference 2.628; the bootstrap interval lies within the data's range;
    symmetric differences around 0 give an interval that spans it; one difference gives no interval."""
    from fiber_bundle.analysis.measures import paired_interval

    result = paired_interval([1, 2, 3, 4, 5])
    half = 2.7764 * math.sqrt(2.5) / math.sqrt(5)
    assert result["mean"] == 3 and result["count"] == 5 and result["std"] == pytest.approx(math.sqrt(2.5))
    assert result["t_interval"] == pytest.approx([3 - half, 3 + half], abs=1e-3)
    assert result["detectable_difference"] == pytest.approx((2.7764 + 0.9410) * math.sqrt(2.5) / math.sqrt(5), abs=1e-3)
    low, high = result["bootstrap_interval"]
    assert 1 <= low < 3 < high <= 5 and not result["spans_zero"]
    assert paired_interval([-1.0, 1.0, -0.5, 0.5, None])["spans_zero"]
    single = paired_interval([0.2])
    assert single["mean"] == 0.2 and single["t_interval"] is None and single["spans_zero"] is None


def test_attention_only_study_measures_collapse_before_and_after(tmp_path, capsys):
    """``analyze scratch`` over attention-only models (``attention_only=True``): the Euclidean twin is the metric-off
    model (no MLP to widen, fewer parameters), every run records the residual, the hidden states' numerical and energy
    ranks at every depth and the score ranks both at initialisation and after training, and the summary carries them with the
    paired interval; an MLP metric asked for without an MLP is refused by the command with the fix."""
    from fiber_bundle.analysis import scratch

    config = scratch_config({**TINY_SCRATCH, "attention_only": True, "ffn_metric_rank": 0}, byte_tokenizer())
    twin = scratch.equal_parameter_twin(config)
    assert twin.attention_only and twin.metric_rank == 0
    assert scratch.parameter_count(twin) < scratch.parameter_count(config)
    root = fake_stdlib(tmp_path / "lib", modules=30)
    results = reports.run_scratch_comparison(
        tmp_path / "out", seeds=(0, 1), learning_rates=(1e-2,), arms=("euclidean", "strong-10"), strong=(10.0,),
        model_fields={**TINY_SCRATCH, "num_hidden_layers": 3, "attention_only": True, "ffn_metric_rank": 0},
        max_steps=2, batch_size=2, block_size=32, eval_blocks=4, eval_every=2, warmup_steps=0, probe_blocks=2,
        corpus_root=root, progress=False)
    for run in results["runs"]:
        for record in (run, run["at_init"]):
            assert len(record["residual_per_layer"]) == len(record["hidden_numerical_rank_per_layer"]) == 4
            assert all(1 <= rank <= 32 for rank in record["hidden_numerical_rank_per_layer"])  # n = 32 tokens, D = 32
            # 90 % of the energy never needs more directions than the numerical rank holds
            assert all(1 <= energy <= rank for energy, rank in zip(record["hidden_energy_rank_per_layer"],
                                                                   record["hidden_numerical_rank_per_layer"]))
        assert run["at_init"]["residual_per_layer"] != run["residual_per_layer"]  # trained in between
    strong = results["summary"]["strong-10"]
    assert len(strong["at_init"]["hidden_numerical_rank_per_layer"]) == 4
    assert len(strong["at_init"]["hidden_energy_rank_per_layer"]) == len(strong["hidden_energy_rank_per_layer"]) == 4
    assert (tmp_path / "out" / "scratch.png").stat().st_size > 10_000
    assert strong["loss_vs_euclidean_interval"]["count"] == 2 and len(strong["loss_vs_euclidean_interval"]["t_interval"]) == 2
    assert "loss_vs_euclidean_interval" not in results["summary"]["euclidean"]
    seed_1 = {r["arm"]: r["eval_loss_after"] for r in results["runs"] if r["seed"] == 1}
    without = strong["loss_vs_euclidean_interval_without_sweep_seed"]  # seed 0 chose the rates: left out
    assert without["count"] == 1 and without["mean"] == pytest.approx(seed_1["strong-10"] - seed_1["euclidean"])
    assert main(["analyze", "scratch", "--out", str(tmp_path / "refused"), "--attention-only",
                 "--ffn-metric-rank", "2"]) == 1
    assert "attention_only=True removes the MLP" in capsys.readouterr().err


def test_scratch_study_sweeps_the_metric_rate_and_gives_arms_their_own_steps(tmp_path, monkeypatch):
    """``metric_rate_ratios``: after the rate sweep the metric's own rate (best rate x ratio) is tried on the first seed
    and the best pair re-run on the other, reaching the Trainer as ``metric_learning_rate``; the Euclidean arm keeps one
    rate. ``steps_by_arm``: each arm trains its own number of steps (equal wall time); an arm not compared is refused.
    A rerun trains nothing."""
    from fiber_bundle.analysis import scratch
    from fiber_bundle.training import trainer

    calls = []
    original = trainer.train_model
    monkeypatch.setattr(trainer, "train_model", lambda *a, **k: calls.append(k) or original(*a, **k))
    root = fake_stdlib(tmp_path / "lib", modules=30)
    settings = dict(seeds=(0, 1), learning_rates=(1e-2,), arms=("euclidean", "strong-10"), strong=(10.0,),
                    model_fields=dict(TINY_SCRATCH), max_steps=3, batch_size=2, block_size=32, eval_blocks=4,
                    eval_every=2, warmup_steps=0, probe_blocks=2, corpus_root=root, progress=False,
                    metric_rate_ratios=(1.0, 3.0), steps_by_arm={"euclidean": 4})
    results = reports.run_scratch_comparison(tmp_path / "out", **settings)
    strong = [r for r in results["runs"] if r["arm"] == "strong-10"]
    assert sorted((r["seed"], r.get("metric_learning_rate") or 0.0) for r in strong)[:2] == [(0, 0.0), (0, 0.03)]
    assert {k.get("metric_learning_rate") for k in calls} == {None, 0.03}
    assert all(r["steps"] == 4 for r in results["runs"] if r["arm"] == "euclidean")
    assert all(r["steps"] == 3 for r in strong) and len(calls) == 2 + 3
    best = results["best_metric_learning_rate"]["strong-10"]
    assert best in (None, 0.03) and results["best_metric_learning_rate"]["euclidean"] is None
    row = results["summary"]["strong-10"]
    assert row["metric_learning_rate"] == best and set(row["metric_sweep"]) == {0.03}
    assert row["seeds"] == 2 and all(r.get("metric_learning_rate") == best for r in strong if r["seed"] == 1)
    assert results["summary"]["euclidean"]["steps"] == 4 and row["steps"] == 3
    reports.run_scratch_comparison(tmp_path / "out", **settings)
    assert len(calls) == 5  # everything was on disk
    with pytest.raises(ValueError, match=r"steps given for arm\(s\) \['gates-0'\] that are not compared"):
        reports.run_scratch_comparison(tmp_path / "other", **{**settings, "steps_by_arm": {"gates-0": 2}})


@pytest.mark.parametrize("better, tried", [("higher", [0.01, 0.03, 0.09]), ("lower", [0.00333, 0.01, 0.03])])
def test_scratch_study_extends_the_metric_rate_past_the_edge_it_is_best_at(tmp_path, monkeypatch, better, tried):
    """``metric_rate_extensions``: once the metric's grid (x1, x3) is tried, a best metric rate at an edge of those
    tried is followed one ratio step further (x9 above, x1/3 below), then no more than asked; the extension reaches
    the other seeds as the chosen rate and the summary's metric sweep, a rerun trains nothing, and the
    option without --metric-rate-ratios is refused with the fix."""
    from fiber_bundle.analysis import scratch

    original = scratch.train_arm

    def ranked(config, arm, seed, setting, **kwargs):  # the real run, its loss ranked by the metric's rate alone
        record = original(config, arm, seed, setting, **kwargs)
        rate = setting.get("metric_learning_rate", setting["learning_rate"])
        calls.append((arm, seed, setting.get("metric_learning_rate")))
        return {**record, "eval_loss_after": 5.0 - rate if better == "higher" else 5.0 + rate}

    calls = []
    monkeypatch.setattr(scratch, "train_arm", ranked)
    root = fake_stdlib(tmp_path / "lib", modules=30)
    settings = dict(seeds=(1,), tuning_seed=0, learning_rates=(1e-2,), arms=("euclidean", "strong-10"),
                    strong=(10.0,), model_fields=dict(TINY_SCRATCH), max_steps=2, batch_size=2, block_size=32,
                    eval_blocks=4, eval_every=2, warmup_steps=0, probe_blocks=2, corpus_root=root, progress=False,
                    metric_rate_ratios=(1.0, 3.0), metric_rate_extensions=1)
    results = reports.run_scratch_comparison(tmp_path / "out", **settings)
    tuning = sorted(rate or 0.01 for arm, seed, rate in calls if arm == "strong-10" and seed == 0)
    assert tuning == tried  # the grid, then one step past its best edge, and no second step
    best = tried[-1] if better == "higher" else tried[0]
    assert results["best_metric_learning_rate"]["strong-10"] == best and results["metric_rate_extensions"] == 1
    assert ("strong-10", 1, best) in calls and ("euclidean", 1, None) in calls and len(calls) == 6
    row = results["summary"]["strong-10"]  # the summary carries the extension, chosen (analyze scaling marks the edge)
    assert row["metric_learning_rate"] == best and sorted(row["metric_sweep"]) == [r for r in tried if r != 1e-2]
    reports.run_scratch_comparison(tmp_path / "out", **settings)
    assert len(calls) == 6  # everything was on disk
    with pytest.raises(ValueError, match=r"give metric_rate_ratios too \(--metric-rate-ratios 1 3 10\)"):
        reports.run_scratch_comparison(tmp_path / "other", **{**settings, "metric_rate_ratios": None})


def test_scratch_study_reuses_the_runs_another_study_already_made(tmp_path, monkeypatch):
    """``reuse_from``: an equal-time study that changes only the Euclidean arm's steps takes the other arm's finished
    runs from the equal-token study (marked ``reused_from``) and trains only the Euclidean runs; a study of other data or
    budget, or a missing folder, is refused with the reason."""
    from fiber_bundle.analysis import scratch
    from fiber_bundle.training import trainer

    calls = []
    original = trainer.train_model
    monkeypatch.setattr(trainer, "train_model", lambda *a, **k: calls.append(k["max_steps"]) or original(*a, **k))
    root = fake_stdlib(tmp_path / "lib", modules=30)
    settings = dict(seeds=(0, 1), learning_rates=(1e-2,), arms=("euclidean", "strong-10"), strong=(10.0,),
                    model_fields=dict(TINY_SCRATCH), max_steps=3, batch_size=2, block_size=32, eval_blocks=4,
                    eval_every=2, warmup_steps=0, probe_blocks=2, corpus_root=root, progress=False)
    tokens = reports.run_scratch_comparison(tmp_path / "tokens", **settings)
    assert calls == [3, 3, 3, 3]
    timed = reports.run_scratch_comparison(tmp_path / "time", **settings, steps_by_arm={"euclidean": 5},
                                           reuse_from=[tmp_path / "tokens"])
    assert calls[4:] == [5, 5]  # only the Euclidean arm, at its own steps, trained again
    strong = [r for r in timed["runs"] if r["arm"] == "strong-10"]
    assert len(strong) == 2 and all(r["reused_from"] == str(tmp_path / "tokens" / "scratch.json") for r in strong)
    assert [r["eval_loss_after"] for r in strong] == [r["eval_loss_after"] for r in tokens["runs"]
                                                     if r["arm"] == "strong-10"]
    assert all("reused_from" not in r and r["steps"] == 5 for r in timed["runs"] if r["arm"] == "euclidean")
    assert timed["summary"]["strong-10"]["seeds"] == 2 and timed["summary"]["euclidean"]["steps"] == 5
    again = reports.run_scratch_comparison(tmp_path / "again", **settings,
                                           reuse_from=[tmp_path / "time" / "scratch.json", tmp_path / "tokens"])
    assert len(calls) == 6  # every run of the equal-token design is in the first two studies
    assert {r["reused_from"] for r in again["runs"]} == {str(tmp_path / "tokens" / "scratch.json")}
    with pytest.raises(ValueError, match="cannot reuse the runs of .*: these settings differ from this study's: budget"):
        reports.run_scratch_comparison(tmp_path / "other", **{**settings, "batch_size": 4},
                                       reuse_from=[tmp_path / "tokens"])
    with pytest.raises(FileNotFoundError, match="no study to reuse at .*missing"):
        reports.run_scratch_comparison(tmp_path / "other", **settings, reuse_from=[tmp_path / "missing"])


def test_analyze_scratch_command_prints_the_paired_intervals_and_reuses_runs(tmp_path, monkeypatch, capsys):
    """The command over a stand-in library: each arm's line carries the paired 95 % interval with and without the
    seed that chose the rates; ``--steps-by-arm`` with ``--reuse-runs`` trains only the lengthened arm."""
    from fiber_bundle.training import data, trainer

    root_ = fake_stdlib(tmp_path / "lib", modules=30)  # the command reads this Python's library: a stand-in instead
    original_corpus = data.stdlib_corpus
    monkeypatch.setattr(data, "stdlib_corpus", lambda seed=0, root=None: original_corpus(seed=seed, root=root_))
    calls = []
    original = trainer.train_model
    monkeypatch.setattr(trainer, "train_model", lambda *a, **k: calls.append(k["max_steps"]) or original(*a, **k))
    shape = ["--layers", "2", "--width", "32", "--intermediate-size", "64", "--heads", "4", "--kv-heads", "2",
             "--metric-hidden", "8"]
    study = ["analyze", "scratch", *shape, "--arms", "euclidean", "strong-10", "--strong-alphas", "10", "--seeds", "0",
             "1", "2", "--learning-rates", "1e-2", "--max-steps", "2", "--batch-size", "2", "--block-size", "32",
             "--eval-blocks", "4", "--eval-every", "2", "--warmup-steps", "0"]
    assert main([*study, "--out", str(tmp_path / "tokens")]) == 0
    out = capsys.readouterr().out
    strong = next(line for line in out.splitlines() if line.strip().startswith("strong-10"))
    assert "vs euclidean" in strong and "95 % [" in strong and "95 % without the sweep seed [" in strong
    assert calls == [2] * 6
    assert main([*study, "--out", str(tmp_path / "time"), "--steps-by-arm", "euclidean=3",
                 "--reuse-runs", str(tmp_path / "tokens")]) == 0
    assert calls[6:] == [3, 3, 3]  # the strong arm's runs came from the first study
    results = json.loads((tmp_path / "time" / "scratch.json").read_text())
    assert sum("reused_from" in r for r in results["runs"]) == 3
    # the metric's extended sweep reaches the study from the command line (refused without the ratios it extends)
    assert main([*study, "--out", str(tmp_path / "extended"), "--metric-rate-extensions", "1"]) == 1
    assert "give metric_rate_ratios too (--metric-rate-ratios 1 3 10)" in capsys.readouterr().err
    assert len(calls) == 9 and not (tmp_path / "extended" / "scratch.json").exists()


def test_optimizer_comparison_from_scratch_puts_the_geometry_on_attention_pairs_only(tmp_path, monkeypatch):
    """``analyze optimizers --from-scratch ARM`` (the optimiser abstract's setting): each run trains a fresh model of
    the scratch arm in full, the design point's geometry on the per-head W_Q / W_K pairs only (the metric generators
    of a Riemannian arm stay with AdamW), a partial isometry from orthonormal W_Q / W_K and still on its manifold after
    training; the scale control stores the stacked query factor at sqrt(heads per KV head) and stays there; the summary
    pairs every point with AdamW, a variant with its plain geometry and the block variant with the scale control, with
    intervals."""
    from fiber_bundle.analysis.optimizers import run_optimizer_comparison
    from fiber_bundle.training import manifolds as mf
    from fiber_bundle.training import trainer as trainer_module
    from fiber_bundle.training.riemannian import _read, attention_groups

    trainers = []
    original = trainer_module.train_model

    def keep(*args, **kwargs):
        trainers.append((kwargs, original(*args, **kwargs)))
        return trainers[-1][1]

    monkeypatch.setattr(trainer_module, "train_model", keep)
    root = fake_stdlib(tmp_path / "lib", modules=30)
    common = dict(seeds=(0, 1), max_steps=2, batch_size=2, block_size=32, max_eval_blocks=4, max_extensions=0,
                  corpus_root=root, progress=False)
    grids = {"adamw": (1e-3,), "stiefel-canonical": (0.1,), "stiefel-canonical+block": (0.1,),
             "stiefel-canonical+scaled": (0.1,)}
    results = run_optimizer_comparison(None, tmp_path / "euclidean", from_scratch="euclidean", grids=grids,
                                       optimizers=["stiefel-canonical+block", "adamw", "stiefel-canonical",
                                                   "stiefel-canonical+scaled"], **common)
    assert [r["optimizer"] for r in results["runs"]] == ["adamw"] * 2 + ["stiefel-canonical+block"] * 2 + [
        "stiefel-canonical"] * 2 + ["stiefel-canonical+scaled"] * 2
    assert results["from_scratch"] == "euclidean" and results["mode"] == "full" and results["eval_blocks"] == 4
    for kwargs, trainer in trainers:
        if kwargs.get("optimizer") is None:
            continue
        assert kwargs["riemannian_pairs"] == "attention" and kwargs["orthonormal_start"] is True
        assert kwargs["block"] == (trainer is trainers[2][1] or trainer is trainers[3][1])
        scaled = kwargs.get("equal_scale", False)
        assert scaled == (trainer is trainers[6][1] or trainer is trainers[7][1])
        groups = attention_groups(trainer.model, block=kwargs["block"])
        config = trainer.model.config
        scale = (config.num_attention_heads // config.num_key_value_heads) ** 0.5 if scaled else 1.0
        for group in groups:  # after training: every factor still orthonormal, the scaled stack at sqrt(heads per KV)
            for lefts, rights in group["pairs"]:
                assert all(mf.orthonormality_error(_read(group["params"], f) / scale) < 1e-5 for f in lefts)
                assert mf.orthonormality_error(_read(group["params"], rights[0])) < 1e-5
    summary = results["summary"]
    assert summary["stiefel-canonical+block"]["loss_vs_adamw_interval"]["count"] == 2
    assert summary["stiefel-canonical+block"]["loss_vs_plain_interval"]["count"] == 2
    assert summary["stiefel-canonical+block"]["loss_vs_scaled_interval"]["count"] == 2
    assert summary["stiefel-canonical+scaled"]["loss_vs_plain_interval"]["count"] == 2
    assert "loss_vs_scaled_interval" not in summary["stiefel-canonical+scaled"]
    assert "loss_vs_plain_interval" not in summary["stiefel-canonical"]
    assert all(r["step_seconds_median"] > 0 for r in results["runs"])
    trainers.clear()
    strong = run_optimizer_comparison(None, tmp_path / "strong", from_scratch="strong-1", optimizers=["grassmann"],
                                      grids={"grassmann": (0.1,)}, adamw_learning_rate=1e-3, **common)
    assert strong["summary"]["grassmann"]["seeds"] == 2
    kinds = [group.get("kind", group["geometry"]) for group in trainers[0][1].optimizer.param_groups]
    assert kinds == ["attention"] * 4 + ["adamw"]  # 4 layers' W_Q / W_K; generators, gates and the rest: AdamW
    assert "gauge" not in results and "gauge" not in strong  # the default: folders of earlier studies still continue
    trainers.clear()
    continuous = run_optimizer_comparison(None, tmp_path / "gauge", from_scratch="euclidean", gauge="continuous",
                                          optimizers=["riemannian-embedded"], grids={"riemannian-embedded": (0.1,)},
                                          adamw_learning_rate=1e-3, **common)
    assert continuous["gauge"] == "continuous"
    assert {g.get("gauge") for g in trainers[0][1].optimizer.param_groups if "pairs" in g} == {"continuous"}
    with pytest.raises(ValueError, match="gauge 'svd' is not one of balanced, continuous"):
        run_optimizer_comparison(None, tmp_path / "bad", from_scratch="euclidean", gauge="svd", **common)
    with pytest.raises(ValueError, match="not an analyze scratch arm"):
        run_optimizer_comparison(None, tmp_path / "bad", from_scratch="strong-x", **common)
    with pytest.raises(ValueError, match="not both"):
        run_optimizer_comparison(tmp_path, tmp_path / "bad", from_scratch="euclidean", **common)
    with pytest.raises(ValueError, match="trains 'full' from scratch"):
        run_optimizer_comparison(None, tmp_path / "bad", from_scratch="euclidean", mode="lora", **common)
