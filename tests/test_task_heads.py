"""Task heads (sequence / token classification, question answering): LLaMA's own heads over the Fiber Bundle backbone,
their Auto registration and remote-code loading, and the conversion of sequence classifiers (reward models)."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

import modeling_fiber_bundle
from helpers import TINY, random_ids, run_without_project, set_gates, tiny_config, tiny_model
from fiber_bundle.conversion import ConversionError, convert_checkpoint
from fiber_bundle.conversion import convert as engine
from modeling_fiber_bundle import (
    FiberBundleForQuestionAnswering,
    FiberBundleForSequenceClassification,
    FiberBundleForTokenClassification,
)

F64 = torch.float64
# kind: (LLaMA's head, ours, the Auto class, the head's output fields)
HEADS = {
    "sequence": (LlamaForSequenceClassification, FiberBundleForSequenceClassification,
                 AutoModelForSequenceClassification, ("logits",)),
    "token": (LlamaForTokenClassification, FiberBundleForTokenClassification, AutoModelForTokenClassification,
              ("logits",)),
    "qa": (LlamaForQuestionAnswering, FiberBundleForQuestionAnswering, AutoModelForQuestionAnswering,
           ("start_logits", "end_logits")),
}


def head_pair(kind, seed=0, **overrides):
    """LLaMA's head and ours holding the same backbone and head weights (our gates at their graft values)."""
    source_cls, fiber_cls, _, _ = HEADS[kind]
    torch.manual_seed(seed)
    source = source_cls(LlamaConfig(**TINY, **overrides)).to(F64).eval()
    torch.manual_seed(seed + 1)
    fiber = fiber_cls(tiny_config(**overrides)).to(F64).eval()
    prefix = f"{source.base_model_prefix}."  # LLaMA's QA head keeps its old "transformer" prefix; ours is "model"
    state = {f"model.{k.removeprefix(prefix)}" if k.startswith(prefix) else k: v
             for k, v in source.state_dict().items()}
    missing, unexpected = fiber.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert missing and all(".fiber." in k for k in missing), missing  # only the new geometry is not in LLaMA's
    return source, fiber


def padded_batch():
    """An unpadded, a left-padded and a right-padded row (pad id 0 only where the mask is 0)."""
    ids = random_ids(3, 10, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, 7:] = 0
    return ids.masked_fill(mask == 0, TINY["pad_token_id"]), mask


def targets(kind, mask, num_labels=3, problem_type=None):
    """Labels for each head's loss; none on padding."""
    gen = torch.Generator().manual_seed(5)
    rows = mask.shape[0]
    if kind == "token":
        return {"labels": torch.randint(0, num_labels, mask.shape, generator=gen).masked_fill(mask == 0, -100)}
    if kind == "qa":
        positions = torch.arange(mask.shape[1]).expand_as(mask)
        return {"start_positions": positions.masked_fill(mask == 0, 99).min(-1).values,  # first real token
                "end_positions": positions.masked_fill(mask == 0, -1).max(-1).values}  # last real token
    if num_labels == 1:  # regression
        return {"labels": torch.randn(rows, generator=gen, dtype=F64)}
    if problem_type == "multi_label_classification":
        return {"labels": torch.randint(0, 2, (rows, num_labels), generator=gen).to(F64)}
    return {"labels": torch.randint(0, num_labels, (rows,), generator=gen)}


LOSS_CASES = [  # (kind, config overrides)
    ("sequence", dict(num_labels=1)),
    ("sequence", dict(num_labels=3)),
    ("sequence", dict(num_labels=3, problem_type="multi_label_classification")),
    ("token", dict(num_labels=3)),
    ("qa", dict()),
]


@pytest.mark.parametrize("kind, overrides", LOSS_CASES, ids=["regression", "single_label", "multi_label", "token",
                                                             "qa"])
def test_graft_outputs_and_loss_equal_llama_heads(kind, overrides):
    source, fiber = head_pair(kind, **overrides)
    ids, mask = padded_batch()
    labels = targets(kind, mask, overrides.get("num_labels", 3), overrides.get("problem_type"))
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, **labels)
        got = fiber(ids, attention_mask=mask, **labels)
    real = mask.bool()
    for field in HEADS[kind][3]:
        want, have = getattr(expected, field), getattr(got, field)
        if kind != "sequence":  # per-token outputs: padding positions are nobody's answer
            want, have = want[real], have[real]
        torch.testing.assert_close(have, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-12, atol=1e-12)
    if kind == "sequence":
        assert got.logits.shape == (3, overrides["num_labels"])
        assert fiber.config.problem_type == source.config.problem_type  # the generic loss chose the same way


def test_sequence_classification_pools_the_last_non_pad_token():
    """Each row's score is the score head at its last real token, for left and right padding alike."""
    _, fiber = head_pair("sequence", num_labels=3)
    set_gates(fiber)
    ids, mask = padded_batch()
    with torch.no_grad():
        hidden = fiber.model(ids, attention_mask=mask).last_hidden_state
        logits = fiber(ids, attention_mask=mask).logits
        every_position = fiber.score(hidden)  # the head as the model applies it: one matmul of this shape, one kernel
    last = torch.tensor([9, 9, 6])
    # exact: the same kernel on the same shape (score applied to the 3 gathered rows alone is another matmul shape,
    # which MKL's AVX-512 path rounds differently, by up to 5.6e-17 in float64)
    torch.testing.assert_close(logits, every_position[torch.arange(3), last], rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(HEADS))
def test_gradients_reach_the_fiber_parameters_off_the_graft(kind):
    _, fiber = head_pair(kind, num_labels=3)
    set_gates(fiber)
    ids, mask = padded_batch()
    fiber(ids, attention_mask=mask, **targets(kind, mask)).loss.backward()
    geometry = {name: p for name, p in fiber.named_parameters() if ".fiber." in name}
    assert geometry
    for name, param in geometry.items():
        assert param.grad is not None and param.grad.abs().max() > 0, name


@pytest.mark.parametrize("kind", list(HEADS))
def test_save_load_round_trip_keeps_llama_names(kind, tmp_path):
    _, fiber_cls, auto_cls, fields = HEADS[kind]
    _, fiber = head_pair(kind)
    set_gates(fiber)
    fiber.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [fiber_cls.__name__]
    assert config["auto_map"][auto_cls.__name__] == f"modeling_fiber_bundle.{fiber_cls.__name__}"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    head = {"qa": "qa_outputs.weight"}.get(kind, "score.weight")
    assert head in names and "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert all(n.startswith("model.") or n.split(".")[0] in ("score", "qa_outputs") for n in names), names
    loaded = auto_cls.from_pretrained(tmp_path, dtype=F64).eval()
    assert type(loaded) is fiber_cls
    ids, mask = padded_batch()
    with torch.no_grad():
        for field in fields:
            torch.testing.assert_close(getattr(loaded(ids, attention_mask=mask), field),
                                       getattr(fiber(ids, attention_mask=mask), field), rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(HEADS))
def test_auto_classes_build_the_heads(kind):
    _, fiber_cls, auto_cls, _ = HEADS[kind]
    model = auto_cls.from_config(tiny_config(num_labels=5))
    assert type(model) is fiber_cls and model.base_model_prefix == "model"
    assert type(model.model).__name__ == "FiberBundleModel"
    assert fiber_cls.__name__ in modeling_fiber_bundle.__all__ and fiber_cls._auto_class == auto_cls.__name__


# Loads every head from a causal LM folder where this project cannot be imported (helpers.run_without_project).
CHILD = """
    import torch
    from transformers import (AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)
    folder, batch_path, out_path = sys.argv[1:4]
    ids, mask = torch.load(batch_path)
    out = {}
    for auto_cls in (AutoModelForSequenceClassification, AutoModelForTokenClassification,
                     AutoModelForQuestionAnswering):
        model = auto_cls.from_pretrained(folder, trust_remote_code=True, num_labels=3, dtype=torch.float64).eval()
        with torch.no_grad():
            result = model(ids, attention_mask=mask)
            hidden = model.model(ids, attention_mask=mask).last_hidden_state
        head = getattr(model, "score", None) or model.qa_outputs
        out[auto_cls.__name__] = {"class": type(model).__name__, "module": type(model).__module__, "hidden": hidden,
                                  "head": head.weight, "first": result[0]}
    torch.save(out, out_path)
"""


def test_heads_load_from_a_causal_lm_folder_without_the_project(tmp_path):
    model = set_gates(tiny_model())
    with torch.no_grad():
        for p in model.geometry_parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "folder")
    ids, mask = padded_batch()
    torch.save((ids, mask), tmp_path / "batch.pt")
    result = run_without_project(CHILD, tmp_path / "folder", tmp_path / "batch.pt", tmp_path / "out.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        hidden = model.model(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    for kind, (_, fiber_cls, auto_cls, _) in HEADS.items():
        got = out[auto_cls.__name__]
        assert got["class"] == fiber_cls.__name__ and got["module"].startswith("transformers_modules.")
        torch.testing.assert_close(got["hidden"][real], hidden[real], rtol=0, atol=0)  # the causal LM's backbone
        assert got["head"].shape == ((2, 64) if kind == "qa" else (3, 64))  # a fresh head
    # the remote sequence classifier pools its fresh score head at each row's last real token
    pooled = hidden[torch.arange(3), torch.tensor([9, 9, 6])] @ out["AutoModelForSequenceClassification"]["head"].T
    torch.testing.assert_close(out["AutoModelForSequenceClassification"]["first"], pooled, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# conversion of sequence classifiers (reward models)
# ---------------------------------------------------------------------------------------------------------------------
CLASSIFIERS = {  # family: (config class, model class, label config)
    "llama": (LlamaConfig, LlamaForSequenceClassification, dict(id2label={0: "bad", 1: "neutral", 2: "good"})),
    "qwen2": (Qwen2Config, Qwen2ForSequenceClassification, dict(num_labels=1)),  # a reward model: one score
}


def save_classifier(folder, family, seed=0):
    config_cls, model_cls, labels = CLASSIFIERS[family]
    torch.manual_seed(seed)
    source = model_cls(config_cls(**TINY, **labels)).to(F64).eval()
    source.save_pretrained(folder)
    return source


REMOTE_SCORES = """
    import torch
    from transformers import AutoModelForSequenceClassification
    folder, batch_path, out_path = sys.argv[1:4]
    ids, mask = torch.load(batch_path)
    model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True, dtype=torch.float64)
    with torch.no_grad():
        torch.save((type(model).__module__, model(ids, attention_mask=mask).logits), out_path)
"""


@pytest.mark.parametrize("family", list(CLASSIFIERS))
def test_sequence_classifier_conversion_keeps_the_score_head(tmp_path, family):
    source = save_classifier(tmp_path / "src", family)
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out")
    out = tmp_path / "out"
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["parity"]["passed"] and report["parity"]["greedy_agreement"] is None  # a classifier: no generation
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["FiberBundleForSequenceClassification"]
    assert config["auto_map"]["AutoModelForSequenceClassification"] == \
        "modeling_fiber_bundle.FiberBundleForSequenceClassification"
    assert result.config.num_labels == source.config.num_labels
    assert {int(k): v for k, v in config["id2label"].items()} == source.config.id2label
    assert config["label2id"] == source.config.label2id and config["pad_token_id"] == source.config.pad_token_id
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert torch.equal(f.get_tensor("score.weight"), source.score.weight)
    assert "lm_head.weight" not in names
    assert "pipeline_tag: text-classification" in (out / "README.md").read_text()

    ids, mask = padded_batch()
    torch.save((ids, mask), tmp_path / "batch.pt")
    child = run_without_project(REMOTE_SCORES, out, tmp_path / "batch.pt", tmp_path / "scores.pt", cwd=tmp_path)
    assert child.returncode == 0, child.stderr[-4000:]
    module, logits = torch.load(tmp_path / "scores.pt")
    assert module.startswith("transformers_modules.")
    with torch.no_grad():
        torch.testing.assert_close(logits, source(ids, attention_mask=mask).logits, rtol=1e-12, atol=1e-12)


def test_verification_compares_the_classification_scores(tmp_path, monkeypatch):
    """A wrong score head is caught by the parity check, and nothing is written."""
    save_classifier(tmp_path / "src", "llama")
    add = engine.ShardWriter.add

    def corrupt_score(self, name, tensor):
        add(self, name, tensor + 0.1 if name == "score.weight" else tensor)

    monkeypatch.setattr(engine.ShardWriter, "add", corrupt_score)
    with pytest.raises(ConversionError, match=r"parity check failed: max \|dlogits\|"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_head_is_refused(tmp_path):
    torch.manual_seed(0)
    LlamaForTokenClassification(LlamaConfig(**TINY)).save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError, match=r"unsupported architecture: LlamaForTokenClassification\. Supported: "
                                              r".*LlamaForSequenceClassification"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()
