"""Analysis (docs/design.md section 4): every measure on constructed inputs with known answers, the real-model probes
against the models' own attention, and each ``fiber-bundle analyze`` subcommand end to end on tiny models."""

import json
import math
import sys
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from helpers import TINY, random_ids, set_gates, tiny_model
from fiber_bundle.analysis import measures, probes
from fiber_bundle.analysis.stacks import StackSpec, attention_layer, collapse_experiment, stack_residuals
from modeling_fiber_bundle.fiber_attention import bounded_factors

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


# ----------------------------------------------------------------------------------------------------------------------
# measures with known answers
# ----------------------------------------------------------------------------------------------------------------------
def test_relative_residual_of_rank_one_and_orthogonal_matrices():
    row = torch.randn(1, 16, dtype=torch.float64)
    assert measures.relative_residual(row.expand(10, 16)).item() < 1e-15  # every token the same vector: collapsed
    for n in (2, 7, 32):
        q = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64)).Q
        assert measures.relative_residual(q).item() == pytest.approx(math.sqrt((n - 1) / n), rel=1e-12)
    x = torch.randn(3, 9, 5, dtype=torch.float64)
    assert torch.allclose(measures.relative_residual(7.5 * x), measures.relative_residual(x))  # scale-free, batched
    # the mean row is the best constant row: any other constant row leaves a larger residual
    other = x[0] - (x[0].mean(0) + 0.1)
    assert measures.relative_residual(x[0]) < torch.linalg.matrix_norm(other) / torch.linalg.matrix_norm(x[0])


def matrix_with_spectrum(sigma, m=40, n=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, len(sigma), generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, len(sigma), generator=gen, dtype=torch.float64)).Q
    return u @ torch.diag(torch.tensor(sigma, dtype=torch.float64)) @ v.T


def test_energy_effective_rank_of_known_spectra():
    for k in (1, 3, 12):
        equal = matrix_with_spectrum([2.0] * k)
        assert measures.energy_effective_rank(equal, threshold=1.0).item() == k
        assert measures.energy_effective_rank(equal, threshold=0.9).item() == math.ceil(0.9 * k)
    # energies 0.5, 0.3, 0.15, 0.05 of the total
    graded = matrix_with_spectrum([math.sqrt(e) for e in (0.5, 0.3, 0.15, 0.05)])
    assert [measures.energy_effective_rank(graded, threshold=t).item() for t in (0.5, 0.8, 0.9, 0.99)] == [1, 2, 3, 4]
    assert measures.energy_effective_rank(torch.zeros(5, 5)).item() == 0
    batch = torch.stack([matrix_with_spectrum([1.0] * k, seed=k) for k in (2, 5)])
    assert measures.energy_effective_rank(batch, threshold=1.0).tolist() == [2, 5]
    with pytest.raises(ValueError, match="threshold"):
        measures.energy_effective_rank(graded, threshold=0.0)


def test_numerical_rank_of_products():
    gen = torch.Generator().manual_seed(0)
    for k in (1, 4, 9):
        a = torch.randn(50, k, generator=gen, dtype=torch.float64) @ torch.randn(k, 60, generator=gen, dtype=torch.float64)
        assert measures.numerical_rank(a).item() == k
    # float32 rounding fills the spectrum at ~1e-7: why the analysis computes in float64
    low = torch.randn(64, 3, generator=gen) @ torch.randn(3, 64, generator=gen)
    assert measures.numerical_rank(low).item() > 3 and measures.numerical_rank(low, rtol=1e-5).item() == 3


def test_power_law_fit_and_rmsnorm_exponent_on_a_synthetic_sweep():
    eps = torch.logspace(-9, -1, 9, dtype=torch.float64)
    fit = measures.fit_power_law(eps, 3.0 * eps**-0.5)
    assert fit["exponent"] == pytest.approx(-0.5, abs=1e-12) and fit["prefactor"] == pytest.approx(3.0)
    assert fit["r2"] == pytest.approx(1.0)
    noisy = measures.fit_power_law(eps, eps**1.5 * (1 + 0.1 * torch.randn(9, generator=torch.Generator().manual_seed(0))))
    assert noisy["exponent"] == pytest.approx(1.5, abs=0.05) and 0.99 < noisy["r2"] < 1.0
    low, high = noisy["exponent_interval"]
    assert low < 1.5 < high and high - low < 0.1  # the slope's t-interval covers the true exponent
    assert fit["exponent_interval"][1] - fit["exponent_interval"][0] < 1e-9  # an exact power law: no spread
    assert measures.fit_power_law([1.0, 2.0], [1.0, 4.0])["exponent_interval"] is None
    # RMSNorm: the worst-case Lipschitz constant over inputs down to 0 scales as max|w| eps^(-1/2)
    weight = 0.5 + torch.rand(32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    probes_ = measures.lipschitz_probes(32)
    worst = [measures.rmsnorm_lipschitz(weight, e, probes_).max().item() for e in eps.tolist()]
    fit = measures.fit_power_law(eps, worst)
    assert fit["exponent"] == pytest.approx(-0.5, abs=1e-3) and fit["r2"] > 0.9999
    assert worst[0] == pytest.approx(weight.abs().max().item() / math.sqrt(eps[0].item()), rel=1e-9)
    # at inputs of unit RMS the constant barely moves with eps: the exponent is ~0, not -1/2
    unit = torch.randn(8, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    local = [measures.rmsnorm_lipschitz(weight, e, unit).mean().item() for e in eps.tolist()]
    assert abs(measures.fit_power_law(eps, local)["exponent"]) < 0.05


def test_entropy_and_first_depth():
    for c in (1, 2, 10):
        assert measures.attention_entropy(torch.full((c,), 1.0 / c)).item() == pytest.approx(math.log(c))
    assert measures.attention_entropy(torch.tensor([0.0, 1.0, 0.0])).item() == 0.0
    assert measures.first_depth_below([1.0, 0.1, 1e-4, 1e-9], 1e-3) == 2
    assert measures.first_depth_below([1.0, 0.5], 1e-3) is None
    assert measures.summarise([1.0, None, 3.0]) == {"mean": 2.0, "std": math.sqrt(2), "min": 1.0, "max": 3.0, "count": 2}


# ----------------------------------------------------------------------------------------------------------------------
# pure-attention stacks
# ----------------------------------------------------------------------------------------------------------------------
def test_pure_attention_stacks_collapse_and_skip_connections_prevent_it():
    spec = StackSpec(depth=10, tokens=16, width=32, heads=2)
    for kind in ("euclidean", "euclidean-distance", "riemannian"):
        curve = stack_residuals(spec, kind, seed=0)
        assert len(curve) == spec.depth + 1 and curve[0] > 0.9  # random input: far from collapsed
        assert curve[-1] < 1e-10  # Dong et al.: pure attention collapses (doubly exponentially)
    with_skip = stack_residuals(StackSpec(depth=10, tokens=16, width=32, heads=2, skip=True), "euclidean", seed=0)
    assert with_skip[-1] > 1e-2
    # the metric gate acts: alpha > 0 moves the curve before it collapses to round-off
    flat, curved = (stack_residuals(StackSpec(depth=4, tokens=8, width=16, heads=2, alpha=a), "riemannian", 3)
                    for a in (0.0, 5.0))
    assert max(abs(f - c) for f, c in zip(flat, curved)) > 1e-2
    result = collapse_experiment(StackSpec(depth=6, tokens=8, width=16, heads=2), range(3),
                                 {"e": ("euclidean", 0.0), "r": ("riemannian", 5.0)})
    assert result["variants"]["e"]["seeds_reaching_threshold"] == 3
    assert len(result["variants"]["r"]["per_depth"]) == 7
    with pytest.raises(ValueError, match="alpha"):
        StackSpec(alpha=-1.0)
    with pytest.raises(ValueError, match="unknown kind"):
        stack_residuals(spec, "hyperbolic", 0)


def dense_geodesic_layer(x, w, spec, metric_of="query"):
    """The riemannian layer written densely: softmax_j of -(scale/2) (q_i - k_j)^T G (q_i - k_j), G = I + alpha U U^T
    of the query token i (or, to show the test can tell them apart, of the key token j), U from the fibre code."""
    n, h, r = x.shape[0], spec.heads, spec.metric_rank
    d = x.shape[1] // h
    q, k, v = ((x @ w[name]).view(n, h, d).transpose(0, 1) for name in "qkv")  # (H, n, d)
    code = torch.tanh(x * x.pow(2).mean(-1, keepdim=True).rsqrt() @ w["z"])
    u = bounded_factors((code @ w["u"]).view(n, h, r, d)).transpose(0, 1)  # U^T per token: (H, n, r, d)
    metric = torch.eye(d, dtype=x.dtype) + spec.alpha * u.transpose(-2, -1) @ u  # (H, n, d, d)
    diff = q[:, :, None] - k[:, None, :]  # q_i - k_j: (H, n, n, d)
    dist = torch.einsum("hijd,hide,hije->hij" if metric_of == "query" else "hijd,hjde,hije->hij", diff, metric, diff)
    return (torch.softmax(-0.5 * d**-0.5 * dist, dim=-1) @ v).transpose(0, 1).reshape(n, -1) @ w["o"]


def test_riemannian_stack_layer_is_the_geodesic_score_in_the_query_metric():
    """One riemannian layer equals softmax of the dense squared distance in the query token's own metric (docs/design.md 1.2:
    the per-row constant the closed form drops is removed by softmax, so the outputs agree), not the key's."""
    spec = StackSpec(width=16, heads=2, tokens=8, code_width=8, metric_rank=2, alpha=5.0)
    gen = torch.Generator().manual_seed(0)
    draw = lambda fan_in, *shape: torch.randn(*shape, generator=gen, dtype=torch.float64) / fan_in**0.5  # noqa: E731
    w = {name: draw(16, 16, 16) for name in "qkvo"} | {"z": draw(16, 16, 8), "u": draw(8, 8, 2 * 2 * 8)}
    x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    layer = attention_layer(x, w, spec, "riemannian")
    assert torch.allclose(layer, dense_geodesic_layer(x, w, spec), rtol=0, atol=1e-10)
    # here the metric matters, and so does whose it is: both alternatives move the output by far more than rounding
    for other in (dense_geodesic_layer(x, w, replace(spec, alpha=0.0)), dense_geodesic_layer(x, w, spec, "key")):
        assert (layer - other).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------------------------------
# real-model probes against the models' own computations
# ----------------------------------------------------------------------------------------------------------------------
def tiny_transformers_model(config_cls=LlamaConfig, model_cls=LlamaForCausalLM, seed=0):
    """One of transformers' own causal LMs on the tiny shape, eager attention, float64."""
    torch.manual_seed(seed)
    fields = {k: v for k, v in TINY.items() if k not in ("rms_norm_eps",)}
    return model_cls(config_cls(**fields, attn_implementation="eager")).to(torch.float64).eval()


def tiny_llama(seed=0):
    return tiny_transformers_model(seed=seed)


@pytest.mark.parametrize("which", ["fiber", "llama"])
def test_layer_logits_are_the_models_own_attention(which):
    model = set_gates(tiny_model(fiber_attention_path="reference")) if which == "fiber" else tiny_llama()
    ids = random_ids(2, 24)
    with torch.no_grad():
        out = model(ids, output_attentions=True, output_hidden_states=True)
    states = probes.residual_stream(model, ids)
    assert len(states) == model.config.num_hidden_layers + 1
    logits = dict(probes.each_layer_logits(model, ids))
    for i in range(model.config.num_hidden_layers):
        assert torch.allclose(states[i], out.hidden_states[i], atol=1e-12)
        probs = probes._causal_probs(logits[i])
        assert torch.allclose(probs, out.attentions[i].to(probs.dtype), atol=1e-10)


@pytest.mark.parametrize("which", ["fiber-blocked", "fiber-per-head-qk-norm", "llama-sdpa", "qwen3"])
def test_probe_logits_are_the_scores_the_attention_used(which):
    """softmax(probe logits + causal mask) equals the probabilities each layer's attention returned
    (output_attentions): the default blocked path with the metric awake (KV-group and per-head factors, q/k norm), and
    transformers' own classes; the probe leaves the attention implementation and functions as it found them."""
    from fiber_bundle.conversion.rank import attention_calls
    from modeling_fiber_bundle import modeling_fiber_bundle as modeling

    if which.startswith("fiber"):
        extra = {} if which == "fiber-blocked" else dict(metric_factor_sharing="head", qk_norm=True)
        model = set_gates(tiny_model(attention_block_size=5, **extra))
        tolerance = dict(rtol=1e-10, atol=1e-12)
    else:
        model = tiny_transformers_model(Qwen3Config, Qwen3ForCausalLM) if which == "qwen3" else tiny_llama()
        tolerance = dict(rtol=1e-6, atol=1e-8)  # transformers' eager attention takes its softmax in float32
    ids = random_ids(2, 24)
    with torch.no_grad():
        expected = model(ids, output_attentions=True).attentions
    if which == "llama-sdpa":
        model.set_attn_implementation("sdpa")  # returns no probabilities: the probe runs eager meanwhile
    implementation = model.config._attn_implementation
    own_file = sys.modules[type(model.model.layers[0].self_attn).__module__]  # modeling_llama, _qwen3 or ours

    def functions():
        return modeling.geodesic_attention_forward, modeling.eager_attention_forward, own_file.eager_attention_forward

    before = functions()
    calls = attention_calls(model, ids)
    assert len(calls) == model.config.num_hidden_layers
    for call, probs in zip(calls, expected):
        assert (call.factors is not None) == which.startswith("fiber")
        torch.testing.assert_close(probes._causal_probs(call.logits()), probs, **tolerance)
    assert model.config._attn_implementation == implementation
    assert functions() == before


def test_interaction_spectrum_is_that_of_wq_transpose_wk():
    model = tiny_llama()
    attn = model.model.layers[1].self_attn
    d = attn.head_dim
    wq, wk = attn.q_proj.weight.view(-1, d, 64), attn.k_proj.weight.view(-1, d, 64)
    h = 3  # query head 3 reads KV head 1 (two query heads per KV head)
    explicit = torch.linalg.svdvals(wq[h].T @ wk[h // 2])[:d]
    assert torch.allclose(probes.interaction_spectrum(model, 1)[h], explicit, rtol=1e-9, atol=1e-12)


def test_intrinsic_rank_reads_the_gram_bound_and_its_breach():
    ids = random_ids(2, 48)
    d = TINY["head_dim"]
    graft = probes.intrinsic_rank(tiny_model(), ids)  # gates at 0: dot-product scores, a Gram matrix
    assert graft["summary"]["score_numerical_rank"]["max"] <= d and graft["summary"]["heads_above_gram_bound"] == 0
    trained = probes.intrinsic_rank(set_gates(tiny_model()), ids)  # heterogeneous metrics: non-Gram (docs/design.md 1.2)
    assert trained["summary"]["score_numerical_rank"]["min"] > d + 1
    assert trained["summary"]["heads_above_gram_bound"] == trained["summary"]["heads"] == 8
    assert all(1 <= v <= 48 for layer in trained["layers"] for v in layer["text_energy_rank"])
    rank, reason = probes.suggest_metric_rank(tiny_model(), ids)
    assert rank == min(max(1, round(reason["median_text_energy_rank"])), d // 4) and "rule" in reason


def test_geometry_report_matches_the_model_output():
    model, ids = set_gates(tiny_model()), random_ids(2, 40)
    report = probes.geometry_report(model, ids, eps_values=[1e-8, 1e-6, 1e-4, 1e-2], norm_layers=[1])
    with torch.no_grad():
        direct = model(ids[:1], output_geometry=True).geometry
    assert report["proxies"]["torsion"][0] != 0
    assert set(report["rmsnorm_lipschitz"]) == {"layer1", "final"}
    assert report["rmsnorm_lipschitz"]["final"]["worst_case_fit"]["exponent"] == pytest.approx(-0.5, abs=1e-3)
    entropy = report["attention_entropy"]
    assert entropy["bins"][0] == (1, 1) and entropy["per_layer"][0][0] == pytest.approx(0.0, abs=1e-12)
    assert all(e <= u + 1e-9 for e, u in zip(entropy["mean_over_layers"], entropy["uniform"]))
    assert direct["torsion"].shape == (2,)
    assert probes.geometry_proxies(tiny_llama(), ids) is None


# ----------------------------------------------------------------------------------------------------------------------
# the subcommands end to end on tiny models
# ----------------------------------------------------------------------------------------------------------------------
def char_tokenizer():
    """One token per printable ASCII character (ids 3..96), so real text gives varied ids to a 97-token tiny model."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(33 + i): 3 + i for i in range(94)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A tiny LLaMA source, its conversion, and the conversion with moved gates (a 'trained' geometry)."""
    from fiber_bundle.conversion import convert_checkpoint
    from modeling_fiber_bundle import FiberBundleForCausalLM

    root = tmp_path_factory.mktemp("analysis")
    source = tiny_llama().to(torch.float32)
    source.save_pretrained(root / "source")
    char_tokenizer().save_pretrained(root / "source")
    convert_checkpoint(root / "source", root / "converted", show_progress=False)
    trained = set_gates(FiberBundleForCausalLM.from_pretrained(root / "converted", dtype=torch.float64))
    trained.to(torch.float32).save_pretrained(root / "trained")
    char_tokenizer().save_pretrained(root / "trained")
    return root


def read_outputs(folder, name):
    data = json.loads((folder / f"{name}.json").read_text())
    assert (folder / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return data


def test_analyze_collapse_end_to_end(tiny_folders, tmp_path, capsys):
    from fiber_bundle.cli import main

    models = [str(tiny_folders / name) for name in ("source", "converted", "trained")]
    code = main(["analyze", "collapse", *models, "--samples", "2", "--length", "40", "--seeds", "3", "--depth", "6",
                 "--width", "16", "--heads", "2", "--tokens", "8", "--alphas", "1", "50", "--out", str(tmp_path)])
    assert code == 0
    data = read_outputs(tmp_path, "collapse")
    assert len(data["stacks"]) == 4 and set(data["models"]) == {"source", "converted", "trained"}
    variants = data["stacks"][0]["variants"]
    assert set(variants) == {"euclidean (dot product)", "euclidean distance", "riemannian, alpha=1",
                             "riemannian, alpha=50"}
    assert len(variants["euclidean (dot product)"]["curves"]) == 3
    source, converted = data["models"]["source"], data["models"]["converted"]
    assert len(source["per_depth"]) == TINY["num_hidden_layers"] + 1
    for a, b in zip(source["per_depth"], converted["per_depth"]):  # the graft computes the source's function
        assert a["mean"] == pytest.approx(b["mean"], abs=1e-5)
    assert "depth where residual < 0.001" in capsys.readouterr().out


def test_analyze_intrinsic_rank_and_geometry_end_to_end(tiny_folders, tmp_path):
    from fiber_bundle.cli import main

    models = [str(tiny_folders / "converted"), str(tiny_folders / "trained")]
    assert main(["analyze", "intrinsic-rank", *models, "--labels", "graft", "learned", "--samples", "2",
                 "--length", "40", "--out", str(tmp_path)]) == 0
    rank = read_outputs(tmp_path, "intrinsic_rank")["models"]
    assert rank["graft"]["dtype"] == "float64"
    assert rank["graft"]["summary"]["heads_above_gram_bound"] == 0
    assert rank["learned"]["summary"]["heads_above_gram_bound"] == 8
    assert main(["analyze", "geometry", *models, "--samples", "2", "--length", "40", "--eps", "1e-8", "1e-5", "1e-2",
                 "--ablation-blocks", "3", "--out", str(tmp_path)]) == 0
    geometry = read_outputs(tmp_path, "geometry")["models"]
    assert geometry["converted"]["proxies"]["torsion"] == [0.0, 0.0]  # alpha = 0 at the graft: no torsion
    assert geometry["trained"]["proxies"]["torsion"][0] > 0
    graft, learned = geometry["converted"]["ablation"], geometry["trained"]["ablation"]
    assert len({graft[k] for k in ("learned", "attention_metric_off", "mlp_metric_off", "backbone")}) == 1
    assert learned["backbone"] == pytest.approx(graft["backbone"], abs=1e-6)  # all gates off: the same backbone
    assert len({learned[k] for k in ("learned", "attention_metric_off", "mlp_metric_off", "backbone")}) == 4
    assert geometry["trained"]["gates"]["geometry/layer0/alpha"] != 0 == geometry["converted"]["gates"][
        "geometry/layer0/alpha"]
    # bad input: a clear one-line error, exit 1
    assert main(["analyze", "geometry", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 1
    assert main(["analyze", "intrinsic-rank", *models, "--labels", "one", "--out", str(tmp_path)]) == 1


def test_analyze_compare_end_to_end(tiny_folders, tmp_path, capsys):
    from fiber_bundle.analysis.compare import equal_parameter_lora_rank, lora_parameter_count
    from fiber_bundle.cli import main
    from fiber_bundle.training import prepare_for_training

    code = main(["analyze", "compare", str(tiny_folders / "converted"), str(tiny_folders / "source"),
                 "--out", str(tmp_path), "--seeds", "0", "1", "--max-steps", "2", "--batch-size", "2",
                 "--block-size", "32", "--eval-blocks", "4"])
    assert code == 0
    data = read_outputs(tmp_path, "compare")
    assert [(r["arm"], r["seed"]) for r in data["runs"]] == [
        (arm, seed) for seed in (0, 1) for arm in ("metric-only", "lora-source", "lora+metric")]
    summary = data["summary"]
    assert summary["metric-only"]["trainable_parameters"] == data["metric_parameters"]
    # the LoRA rank is the one whose PEFT parameter count is closest to the metric's
    source = tiny_llama().to(torch.float32)
    r = data["lora_r"]
    assert r == equal_parameter_lora_rank(source, data["metric_parameters"])
    assert summary["lora-source"]["trainable_parameters"] == lora_parameter_count(source, r)
    peft_model = prepare_for_training(tiny_llama().to(torch.float32), "lora", lora_r=r)
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == lora_parameter_count(source, r)
    assert summary["lora+metric"]["trainable_parameters"] == data["metric_parameters"] + lora_parameter_count(source, r)
    before = {run["eval_loss_before"] for run in data["runs"]}
    assert max(before) - min(before) < 1e-5  # every arm starts as the source
    assert all(run["eval_loss_after"] != run["eval_loss_before"] for run in data["runs"])
    assert "geometry/torsion" in data["runs"][0]["geometry"] and data["runs"][1]["geometry"] == {}
    assert "lora-source" in capsys.readouterr().out


def test_analyze_optimizers_sweeps_reseeds_and_continues(tiny_folders, tmp_path, capsys, monkeypatch):
    from fiber_bundle.cli import main

    args = ["analyze", "optimizers", str(tiny_folders / "converted"), "--out", str(tmp_path), "--optimizers",
            "grassmann", "adamw", "--learning-rates", "0.01", "0.1", "--seeds", "0", "1", "--max-steps", "2",
            "--batch-size", "2", "--block-size", "32", "--eval-blocks", "4", "--max-extensions", "1"]
    assert main(args) == 0
    data = json.loads((tmp_path / "optimizers.json").read_text())
    names = [r["optimizer"] for r in data["runs"]]
    assert names == sorted(names)  # AdamW first ("adamw" < "grassmann")

    def loss(run):
        return run["eval_loss_after"]

    for name in ("adamw", "grassmann"):
        mine = [r for r in data["runs"] if r["optimizer"] == name]
        sweep = [r for r in mine if r["seed"] == 0]
        rates = [r["learning_rate"] for r in sweep]
        assert rates[:2] == [0.01, 0.1]
        grid_best = min(sweep[:2], key=loss)["learning_rate"]  # a two-point grid: the best is at an edge
        assert rates[2] == pytest.approx(grid_best * 10 if grid_best == 0.1 else grid_best / 10)  # one step beyond
        best3 = min(sweep[:3], key=loss)["learning_rate"]
        tried = sorted(rates[:3])
        i = tried.index(best3)
        assert rates[3:] == pytest.approx([math.sqrt(best3 * tried[j]) for j in (i - 1, i + 1) if 0 <= j < 3])
        best = min(sweep, key=loss)["learning_rate"]
        assert data["best"][name]["learning_rate"] == best
        assert [(r["seed"], r["learning_rate"]) for r in mine if r["seed"] != 0] == [(1, best)]  # re-seeded
        assert all(r["eval_loss_after"] != data["eval_loss_before"] for r in mine)  # every run trained something
    adamw_best = data["best"]["adamw"]["learning_rate"]
    assert {r["adamw_learning_rate"] for r in data["runs"] if r["optimizer"] == "grassmann"} == {adamw_best}
    summary = data["summary"]
    assert summary["adamw"]["time_vs_adamw"] == 1.0 and summary["grassmann"]["seeds"] == 2
    grassmann = [r for r in data["runs"] if r["optimizer"] == "grassmann"
                 and r["learning_rate"] == summary["grassmann"]["learning_rate"]]
    adamw = {r["seed"]: r["eval_loss_after"] for r in data["runs"]
             if r["optimizer"] == "adamw" and r["learning_rate"] == adamw_best}
    differences = [r["eval_loss_after"] - adamw[r["seed"]] for r in grassmann]
    assert summary["grassmann"]["loss_vs_adamw"] == pytest.approx(sum(differences) / 2)  # paired by seed
    assert summary["adamw"]["loss_vs_adamw"] == summary["adamw"]["loss_vs_adamw_std"] == 0
    assert "x AdamW" in capsys.readouterr().out

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    with monkeypatch.context() as patch:
        patch.setattr("fiber_bundle.training.trainer.train_model", no_training)
        assert main(args) == 0  # a rerun with the same settings continues: nothing left to train
    assert json.loads((tmp_path / "optimizers.json").read_text())["runs"] == data["runs"]
    more = args[:6] + ["stiefel-euclidean", "--learning-rates", "0.1"] + args[11:]
    assert main(more) == 0  # another optimiser added to the same comparison, beside AdamW's best rate
    extended = json.loads((tmp_path / "optimizers.json").read_text())
    assert extended["runs"][: len(data["runs"])] == data["runs"]
    assert set(extended["summary"]) == {"adamw", "grassmann", "stiefel-euclidean"}
    assert {r["adamw_learning_rate"] for r in extended["runs"][len(data["runs"]) :]} == {adamw_best}


def test_metric_rank_auto_records_its_reason(tiny_folders, tmp_path):
    from fiber_bundle.cli import main

    assert main(["convert", str(tiny_folders / "source"), str(tmp_path / "auto"), "--metric-rank", "auto"]) == 0
    report = json.loads((tmp_path / "auto" / "conversion_report.json").read_text())
    choice = report["metric_rank_choice"]
    config = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert config["metric_rank"] == choice["metric_rank"] == min(max(1, round(choice["median_text_energy_rank"])), 4)
    assert report["parity"]["passed"]
    with pytest.raises(SystemExit):
        main(["convert", str(tiny_folders / "source"), str(tmp_path / "bad"), "--metric-rank", "two"])
    assert not (tmp_path / "bad").exists()


def test_metric_learning_rate_gets_its_own_group(tmp_path):
    from datasets import Dataset

    from fiber_bundle.training.trainer import train_model

    ids = random_ids(8, 16).tolist()
    trainer = train_model(tiny_model(dtype=torch.float32), Dataset.from_dict({"input_ids": ids, "labels": ids}),
                          tmp_path, mode="lora", max_steps=1, learning_rate=1e-3, metric_learning_rate=2e-2,
                          batch_size=4, lr_scheduler_type="constant")
    groups = trainer.optimizer.param_groups
    assert sorted(g["lr"] for g in groups) == [1e-3, 2e-2]
    metric = next(g for g in groups if g["lr"] == 2e-2)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert metric["params"] and all(".fiber." in names[id(p)] and "lora_" not in names[id(p)] for p in metric["params"])


def test_init_geometry_redraws_a_loaded_model_in_place(tiny_folders):
    from modeling_fiber_bundle import FiberBundleForCausalLM

    loaded = FiberBundleForCausalLM.from_pretrained(tiny_folders / "converted")
    saved = {k: v.clone() for k, v in loaded.state_dict().items()}
    loaded.init_geometry(seed=0)  # the conversion's seed: the same draws as the converted folder
    assert all(torch.equal(saved[k], v) for k, v in loaded.state_dict().items())
    loaded.init_geometry(seed=1)
    changed = [k for k, v in loaded.state_dict().items() if not torch.equal(saved[k], v)]
    assert changed and all(".fiber." in k and k.endswith(("proj.weight",)) for k in changed)
    assert all(torch.isfinite(v).all() for v in loaded.state_dict().values())


@pytest.mark.heavy
def test_analyze_ide_end_to_end_and_resumes(tiny_folders, tmp_path, capsys, monkeypatch):
    """``analyze ide`` on a LLaMA source and a Fiber Bundle model with a trained geometry: the four observables in
    ide.json and ide.png (torsion per layer with its exponent near the predicted 2, each layer's ablation beside the
    adjoint prediction, the rotary recurrence with its fits, SGD and AdamW currents at four lags); a rerun measures
    nothing again."""
    from fiber_bundle.analysis import ide_study
    from fiber_bundle.cli import main

    models = [str(tiny_folders / name) for name in ("source", "trained")]
    args = ["analyze", "ide", *models, "--out", str(tmp_path), "--samples", "1", "--length", "24",
            "--torsion-steps", "1e-4", "1e-3", "1e-2", "--ablation-blocks", "2", "--rope-pairs", "4",
            "--rope-max-offset", "256", "--current-steps", "180", "--current-block-size", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "median exponent over layers" in out and "lag-1 current" in out and "linear in ln m" in out
    assert "quadratics removed" in out
    data = read_outputs(tmp_path, "ide")
    for label in ("source", "trained"):
        model = data["models"][label]
        assert len(model["torsion"]["layers"]) == 2 and abs(model["torsion"]["exponent_median"] - 2) < 0.1
        assert len(model["ablation"]["measured"]) == 2 and model["ablation"]["loss"] > 0
        assert model["rope"]["offsets"][-1] == 256 and len(model["rope"]["mean"]) == len(model["rope"]["offsets"])
        assert model["rope"]["decay"]["mean_log_fit"]["r2"] is not None and "pair_fit" in model["ablation"]
        assert [p["fraction"] for p in model["ablation"]["partial"]] == list(ide_study.ABLATION_FRACTIONS)
        assert model["rope"]["kernel"][0] == pytest.approx(abs(sum(
            complex(math.cos(f), math.sin(f)) for f in model["rope"]["inv_freq"])) / len(model["rope"]["inv_freq"]))
        for name in ("sgd", "adamw"):
            run = model["current"][name]
            assert len(run["losses"]) == 180 and set(run["lags"]) == {"1", "2", "5", "10"}
            assert len(run["trajectory"]) == 180 and len(run["trajectory"][0]) == 8
    monkeypatch.setattr(ide_study, "measure_observable",
                        lambda *a, **k: pytest.fail("a finished measurement ran again"))
    assert main(args) == 0
    assert main([*args[:-2], "--current-block-size", "32"]) == 1  # other settings in the same folder: refused
    assert "holds measurements with other settings" in capsys.readouterr().err
