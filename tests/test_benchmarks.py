"""The benchmark scripts in benchmarks/: their shared builders time the geometry awake (never a model at its graft), and
their smoke runs (--quick) complete with the checks they report passing."""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load_common():
    spec = importlib.util.spec_from_file_location("benchmarks_common", BENCHMARKS / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarked_fibre_model_has_its_geometry_awake():
    common = load_common()
    shape = common.QUICK_SHAPE
    backbone = common.build_backbone(shape)
    model = common.build_fiber(shape, 2, backbone)  # raises if asleep
    low, high = common.AWAKE_GATE_RANGE
    gates = [getattr(layer.fiber, name) for layer in model.model.layers
             for name in ("attn_gate", "flatness_gate", "ffn_gate")]
    assert len(gates) == 3 * shape["num_hidden_layers"]
    for gate in gates:
        assert ((gate >= low) & (gate <= high)).all()
    assert len({float(gate.detach().flatten()[0]) for gate in gates}) == len(gates)  # a different draw per gate
    assert common.logit_difference(model, backbone, shape) > common.AWAKE_MIN_LOGIT_DIFFERENCE
    # the weights are the backbone's: only the fibre parameters are the model's own
    fibre_free = {k: v for k, v in model.state_dict().items() if ".fiber." not in k}
    assert all(torch.equal(v, backbone.state_dict()[k]) for k, v in fibre_free.items())


def test_a_model_at_its_graft_is_refused_and_rank_0_equals_the_backbone():
    common = load_common()
    shape = common.QUICK_SHAPE
    backbone = common.build_backbone(shape)
    model = common.build_fiber(shape, 1, backbone)
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("attn_gate", "flatness_gate", "ffn_gate"):
                getattr(layer.fiber, name).zero_()  # back at the graft
    with pytest.raises(RuntimeError, match="asleep at the graft.*wake_geometry"):
        common.check_awake(model, backbone, shape)
    assert common.check_awake(common.build_fiber(shape, 0, backbone), backbone, shape) <= 1e-5


@pytest.mark.parametrize("case, fields", [
    ("small", {}),
    ("medium", dict(num_hidden_layers=6, hidden_size=256, num_attention_heads=8, intermediate_size=768)),
    ("base", dict(num_hidden_layers=8, hidden_size=384, num_attention_heads=6, intermediate_size=1024, metric_hidden=64)),
])
def test_training_benchmark_times_the_models_the_from_scratch_study_trains(case, fields, monkeypatch):
    """The equal-time study gives the Euclidean arm the steps that bench_training.py's compiled step ratio allows: the
    pair it times must be the study's strong-1 model and its Euclidean twin (``analyze scratch`` with ``fields``),
    field by field (the context length aside, which only sizes the rotary table)."""
    from fiber_bundle.analysis.scratch import DEFAULT_MODEL, arm_configs
    from fiber_bundle.training.scratch import byte_tokenizer

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_training", BENCHMARKS / "bench_training.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with torch.device("meta"):
        models, ids, _ = bench.build_case(case, quick=False)
    study = arm_configs({**DEFAULT_MODEL, **fields}, byte_tokenizer(), strong=(1.0,))
    assert tuple(ids.shape) == (16, 128)  # the study's batch: 16 blocks of 128 bytes
    for label, arm in (("fibre", "strong-1"), ("backbone", "euclidean")):
        timed, trained = models[label].config.to_dict(), study[arm].to_dict()
        differ = {k for k in set(timed) | set(trained) if timed.get(k) != trained.get(k)}
        assert differ <= {"max_position_embeddings", "use_cache", "transformers_version"}, (label, differ)


def run_script(name, *args, timeout=600):
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BENCHMARKS.parent)


@pytest.mark.heavy
def test_generation_benchmark_quick_run(tmp_path):
    """bench_generation.py --quick: eager and compiled generate for r = 0 and 2, every check it reports passing."""
    out = tmp_path / "gen.json"
    proc = run_script("bench_generation.py", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| r | eager tok/s backbone | fibre | ratio | compiled tok/s backbone" in proc.stdout
    result = json.loads(out.read_text())
    assert [row["r"] for row in result["rows"]] == [0, 2]
    for row in result["rows"]:
        for mode in ("eager", "compiled"):
            for name in ("backbone", "fiber"):
                # decoding alone is a difference of two timings (N tokens less 1), which the tiny smoke model on a
                # busy machine can bring to zero or below: the script then reports nan, never a negative rate
                decode = row[mode][name]["decode_tok_s"]
                assert row[mode][name]["whole_tok_s"] > 0 and (decode > 0 or math.isnan(decode))
        for name in ("backbone", "fiber"):
            compiled = row["compiled"][name]
            assert compiled["compiled_call_used"] and compiled["graphs_first_call"] >= 1
            assert compiled["graph_breaks"] == 0
            assert compiled["tokens_equal_eager"]
            assert compiled["compile_s"] > 0
        assert row["compiled"]["steady_recompiles"] == 0
        assert set(row["ratio"]) == {"eager_whole", "eager_decode", "compiled_whole", "compiled_decode"}
    assert result["rows"][0]["r0_tokens_equal_backbone"]
    assert {"date", "cpu", "torch", "transformers", "torch_threads"} <= set(result["environment"])


@pytest.mark.heavy
def test_model_benchmark_quick_run(tmp_path):
    out = tmp_path / "model.json"
    proc = run_script("bench_model.py", "--quick", "--ranks", "0", "2", "--lengths", "64", "--repeats", "1",
                      "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["r"] for row in result["rows"]] == [0, 2]
    for row in result["rows"]:
        assert row["decode_loop_matches_generate"]
    assert result["rows"][0]["generate_matches_backbone"]


def test_cpu_attention_benchmark_quick_run(tmp_path):
    """bench_cpu_attention.py --quick: the blocked path, the fused operator and SDPA timed in both modes, the fused
    output and gradients equal to the blocked path's, and the flop counts reported."""
    out = tmp_path / "cpu_attention.json"
    proc = run_script("bench_cpu_attention.py", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["forward", "forward+backward"]
    for row in rows:
        assert row["fused_vs_blocked_max_relative_difference"] < 1e-5
        assert all(row[f"{path}_ms"] > 0 and row[f"{path}_gflops"] > 0 for path in ("blocked", "fused", "sdpa"))
    # same shape, more work per pair for the geodesic score, and more again with the backward
    assert rows[0]["fused_gflops"] * rows[0]["fused_ms"] > rows[0]["sdpa_gflops"] * rows[0]["sdpa_ms"]
    assert rows[1]["fused_gflops"] * rows[1]["fused_ms"] > rows[0]["fused_gflops"] * rows[0]["fused_ms"]
    assert "| tiny | forward |" in proc.stdout


def test_profile_benchmark_quick_run(tmp_path):
    """bench_profile.py --quick: both models' decode step split into its parts, and one layer's attention against SDPA."""
    out = tmp_path / "profile.json"
    proc = run_script("bench_profile.py", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    backbone, fibre = result["decode"]["backbone"], result["decode"]["fibre"]
    assert backbone["parts_ms"]["attention function"] > 0  # the backbone's SDPA was found and timed
    for part in ("attention function", "fibre state", "Woodbury step", "factor rotation"):
        assert fibre["parts_ms"][part] > 0, part
    assert "fibre state" not in backbone["parts_ms"]
    assert fibre["aten_ops_per_step"] > backbone["aten_ops_per_step"] > 0
    assert [(row["mode"], row["path"]) for row in result["attention"]] == [
        ("forward", "geodesic"), ("forward", "sdpa"), ("forward+backward", "geodesic"), ("forward+backward", "sdpa")]
    assert all(row["ms"] > 0 for row in result["attention"])
    assert result["attention"][0]["gemm_gflop"] > 0  # the geodesic path's products were counted
    assert "| attention function |" in proc.stdout


def test_quantized_benchmark_quick_run(tmp_path):
    """bench_quantized.py --quick: a tiny model in 4-bit with the repack kept off and (on a CPU with AVX-512 BF16)
    switched back on: both decode the same greedy tokens, the second arm really repacked every 4-bit layer, and the
    mode-change check was timed."""
    bitsandbytes = pytest.importorskip("bitsandbytes")
    out = tmp_path / "quantized.json"
    proc = run_script("bench_quantized.py", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    arms = 2 if bitsandbytes.functional.has_avx512bf16() else 1
    assert len(result["tokens_per_s"]) == arms and all(v > 0 for v in result["tokens_per_s"].values())
    assert result["same_greedy_tokens"]
    if arms == 2:
        repacked, layers = result["layers_repacked_in_the_repacking_arm"].split(" of ")
        assert repacked == layers != "0"
    assert all(us > 0 for us in result["mode_switch_us"].values())


@pytest.mark.heavy
def test_export_benchmark_quick_run(tmp_path):
    """bench_export.py --quick: the tiny model exported to the torch.export program and the ONNX graph, each export's
    check passed, and each runtime decoded the eager model's greedy tokens at a positive rate."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "export.json"
    proc = run_script("bench_export.py", "--quick", "--formats", "exported-program", "onnx", "--repeats", "1",
                      "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["eager", "exported-program", "onnx"]
    for name in ("exported-program", "onnx"):
        assert rows[name]["parity"]["passed"] and rows[name]["file_mib"] > 0
    assert all(row["tokens_equal_eager"] and row["decode_tokens_per_s"] > 0 for row in rows.values())
    assert rows["eager"]["decode_ratio_to_eager"] == 1.0
    assert "| onnx |" in proc.stdout


@pytest.mark.heavy
def test_serving_benchmark_quick_run(tmp_path):
    """bench_serving.py --quick: both models served with continuous batching off and on, every client count answered
    with exactly the asked tokens (the script refuses otherwise), the fibre model awake, every ratio and target
    reported."""
    pytest.importorskip("openai")
    out = tmp_path / "serving.json"
    proc = run_script("bench_serving.py", "--quick", "--clients", "1", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["awake_difference"] > 1e-3
    for cb in ("off", "on"):
        for name in ("backbone", "fibre"):
            rows = result["runs"][cb][name]
            assert list(rows) == ["1", "2"]
            assert all(row["aggregate_tok_s"] > 0 and 0 < row["ttft_median_s"] <= row["ttft_max_s"]
                       for row in rows.values())
        assert result["ratios"][cb]["fibre_scaling"]["1"] == 1.0
    assert [t["met"] in (True, False) for t in result["targets"]] == [True, True]
    assert "| on | 2 |" in proc.stdout


@pytest.mark.heavy
def test_trl_benchmark_quick_run(tmp_path):
    """bench_trl.py --quick: the project's LoRA + metric trainer and TRL's SFTTrainer on the same blocks, each with its
    seconds per step and held-out loss; on the same data and rates they reach the same held-out loss."""
    pytest.importorskip("trl")
    out = tmp_path / "trl.json"
    proc = run_script("bench_trl.py", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == ["fiber-bundle train --mode lora", "TRL SFTTrainer"]
    assert all(row["s_per_step"] > 0 for row in rows.values())
    after = [row["held_out_after"] for row in rows.values()]
    assert after[0] == pytest.approx(after[1], rel=1e-4) and after[0] != result["held_out_before"]
    assert "| TRL SFTTrainer | on |" in proc.stdout


def test_optimizer_benchmark_from_scratch_times_every_design_point(tmp_path):
    """bench_optimizers.py --from-scratch: one row per distinct design point of the optimiser abstract's setting (AdamW,
    the five geometries, the block variants of the three partial-isometry ones), each step timed, appended to the
    record with what it measured."""
    from helpers import fake_stdlib

    root = fake_stdlib(tmp_path / "lib", modules=30)
    record = tmp_path / "record.json"
    proc = run_script("bench_optimizers.py", "--from-scratch", "euclidean", "--corpus-root", str(root), "--rounds",
                      "1", "--batch-size", "2", "--block-size", "16", "--record", str(record))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from scratch (euclidean), full, geometry on W_Q / W_K, (2, 16) tokens" in proc.stdout
    (entry,) = json.loads(record.read_text())
    assert entry["model"] == "from scratch: euclidean" and not entry["compiled"]
    assert (entry["batch_size"], entry["block_size"]) == (2, 16)
    assert list(entry["median_seconds"]) == [
        "adamw", "riemannian-quotient", "riemannian-embedded", "stiefel-euclidean", "stiefel-euclidean (block)",
        "stiefel-canonical", "stiefel-canonical (block)", "grassmann", "grassmann (block)"]
    for row in entry["median_seconds"].values():
        assert row["step"] > 0 and row["forward_backward"] > 0 and row["total_vs_adamw"] > 0
    bad = run_script("bench_optimizers.py", "--from-scratch", "strong", "--corpus-root", str(root), "--rounds", "1")
    assert bad.returncode != 0 and "not an analyze scratch arm" in bad.stderr


def test_gpu_check_dry_run_lists_every_part_and_runs_nothing(tmp_path):
    """benchmarks/gpu_check.py --dry-run: each part, what it runs and its time limit; the limits fit one 10-minute call
    of a lent GPU; nothing is run (no result file appears)."""
    proc = run_script("gpu_check.py", "--dry-run", "--json", str(tmp_path / "gpu.json"), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for part in ("kernel-tests", "guard", "bench-kernel", "compiled-step", "bf16-spd"):
        assert f"  {part} (" in proc.stdout, part
    assert "tests/test_triton_attention.py tests/test_kernel_guard.py" in proc.stdout
    assert "bench_kernel.py --lengths" in proc.stdout and "18 signatures" in proc.stdout
    total = int(proc.stdout.split("limits add up to ")[1].split(" s")[0])
    assert total <= 600
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy
def test_gpu_check_smoke_runs_every_part(tmp_path):
    """benchmarks/gpu_check.py --smoke: every part, each in its own process, at tiny sizes on CPU tensors under Triton's
    interpreter (the GPU command proven end to end without a GPU): each passes, and the table and JSON hold them."""
    out = tmp_path / "gpu.json"
    proc = run_script("gpu_check.py", "--smoke", "--json", str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"kernel-tests", "guard", "bench-kernel", "compiled-step", "bf16-spd"}
    assert all(result["ok"] for result in data["results"].values()), data["results"]
    assert data["results"]["compiled-step"]["graphs"] == 1 and data["results"]["guard"]["signatures"]
    assert "| guard |" in proc.stdout and data["environment"]["smoke"]
