"""fiber-bundle convert: parity with the source, Hub-folder contents, streaming, and every failure leaving no OUTPUT."""

import json
import weakref

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from helpers import SOURCE_FAMILIES as SOURCES
from helpers import geometry_step_change, random_ids, run_without_project, tiny_tokenizer
from fiber_bundle.conversion import ConversionError, convert_checkpoint
from fiber_bundle.conversion import convert as engine
from fiber_bundle.cli import main as cli_main
from fiber_bundle.conversion import sources
from modeling_fiber_bundle import FiberBundleForCausalLM

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def save_source(folder, family, tie=False, dtype=torch.float32, shard="30KB", seed=0):
    config_cls, model_cls, extra = SOURCES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**TINY, tie_word_embeddings=tie, **extra)).to(dtype).eval()
    model.save_pretrained(folder, max_shard_size=shard)
    return model


def padded_batch():
    ids = random_ids(2, 12, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", list(SOURCES))
def test_sharded_conversion_reproduces_the_source(tmp_path, family, tie):
    source = save_source(tmp_path / "src", family, tie=tie)
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 1  # the source really is sharded
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out", max_shard_size="40KB")
    out = tmp_path / "out"
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["parity"]["passed"] and report["parity"]["greedy_agreement"] == 1.0
    assert report["parity"]["max_abs_logit_diff"] <= report["parity"]["bound"]
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1

    converted = FiberBundleForCausalLM.from_pretrained(out).eval()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "fiber_bundle" and config["architectures"] == ["FiberBundleForCausalLM"]
    for field in ("tie_word_embeddings", "rope_parameters", "head_dim", "rms_norm_eps", "vocab_size"):
        assert getattr(converted.config, field) == getattr(source.config, field), field
    if family == "mistral":
        assert converted.config.layer_types == ["sliding_attention"] * 2 and converted.config.sliding_window == 6
    ids, mask = padded_batch()
    with torch.no_grad():
        expected, got = source(ids, attention_mask=mask).logits, converted(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)
    args = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(converted.generate(ids[:1], **args), source.generate(ids[:1], **args))
    assert result.source_family == family


def test_converted_folder_loads_without_the_project_and_learns(tmp_path):
    source = save_source(tmp_path / "src", "qwen3")
    convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    ids = random_ids(1, 10)
    torch.save(ids, tmp_path / "ids.pt")
    script = """
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
    """
    result = run_without_project(script, tmp_path / "out", tmp_path / "ids.pt", tmp_path / "logits.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), source(ids).logits, rtol=0, atol=1e-5)

    model = FiberBundleForCausalLM.from_pretrained(tmp_path / "out")  # the graft is trainable
    assert geometry_step_change(model, ids) > 1e-5


def test_dtype_is_kept_unless_asked(tmp_path):
    save_source(tmp_path / "src", "llama", dtype=torch.bfloat16)
    convert_checkpoint(tmp_path / "src", tmp_path / "bf16", verify=False)
    loaded = FiberBundleForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16 and loaded.model.layers[0].fiber.attn_gate.dtype == torch.bfloat16
    convert_checkpoint(tmp_path / "src", tmp_path / "fp32", dtype="float32", verify=False)
    assert FiberBundleForCausalLM.from_pretrained(tmp_path / "fp32").dtype == torch.float32


def test_tokenizer_and_generation_config_are_copied(tmp_path):
    save_source(tmp_path / "src", "llama")
    (tmp_path / "src" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    for name in ("generation_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()


def test_sharded_conversion_holds_one_shard_at_a_time(tmp_path, monkeypatch):
    """The source tensors alive at once stay near one output shard: shards are streamed, never all loaded."""
    save_source(tmp_path / "src", "qwen2", shard="20KB")
    shards = sorted((tmp_path / "src").glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    alive, peak = {}, [0]
    reader = sources._safetensors_reader

    def tracking_reader(path):
        read = reader(path)

        def wrapped():
            for name, tensor in read():
                key = id(tensor)
                alive[key] = tensor.numel() * tensor.element_size()
                weakref.finalize(tensor, alive.pop, key, None)
                peak[0] = max(peak[0], sum(alive.values()))
                yield name, tensor

        return wrapped

    monkeypatch.setattr(sources, "_safetensors_reader", tracking_reader)
    convert_checkpoint(tmp_path / "src", tmp_path / "out", max_shard_size="20KB", verify=False)
    assert len(shards) >= 4
    # one output shard being filled, the tensor that closes it and the one in hand: never the whole checkpoint
    assert peak[0] <= 20_000 + 2 * max(p.stat().st_size for p in shards)
    assert peak[0] < total / 2


# ---------------------------------------------------------------------------------------------------------------------
# failures: a clear message and no OUTPUT (nor a staging folder) left behind
# ---------------------------------------------------------------------------------------------------------------------
def assert_nothing_written(tmp_path, output="out"):
    assert not (tmp_path / output).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{output}.")]


def test_unsupported_architecture_is_refused(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError, match=r"GPT2LMHeadModel.*Supported: LlamaForCausalLM"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert_nothing_written(tmp_path)


def test_existing_output_is_refused_without_overwrite(tmp_path):
    save_source(tmp_path / "src", "llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="--overwrite"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False, overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").exists()


def test_truncated_shard_fails_cleanly(tmp_path):
    save_source(tmp_path / "src", "llama")
    shard = sorted((tmp_path / "src").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ConversionError, match="corrupt or truncated"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    assert_nothing_written(tmp_path)


def test_shape_mismatch_fails_cleanly(tmp_path):
    save_source(tmp_path / "src", "llama")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["intermediate_size"] = 128  # the weights say 96
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"shape mismatch for model.layers.0.mlp.\w+_proj.weight: the source has"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    assert_nothing_written(tmp_path)


def edit_single_shard(tmp_path, edit):
    """Save a one-file LLaMA source and rewrite its tensors with ``edit(dict)``."""
    from safetensors.torch import load_file, save_file

    save_source(tmp_path / "src", "llama", shard="10GB")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_fails_cleanly(tmp_path):
    edit_single_shard(tmp_path, lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConversionError, match="lacks 1 tensor.*model.layers.1.mlp.up_proj.weight"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    assert_nothing_written(tmp_path)


def test_unmapped_tensor_fails_cleanly(tmp_path):
    edit_single_shard(tmp_path, lambda tensors: tensors.update({"model.layers.0.self_attn.mystery.weight": torch.zeros(3)}))
    with pytest.raises(ConversionError, match="unmapped tensor 'model.layers.0.self_attn.mystery.weight'"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    assert_nothing_written(tmp_path)


def test_interrupt_leaves_nothing(tmp_path, monkeypatch):
    save_source(tmp_path / "src", "llama")
    calls = []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of writing shards

    original = engine.ShardWriter.flush
    monkeypatch.setattr(engine.ShardWriter, "flush", lambda self: (interrupted(self), original(self)))
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", max_shard_size="20KB", verify=False)
    assert_nothing_written(tmp_path)


def test_disk_full_leaves_nothing(tmp_path, monkeypatch):
    save_source(tmp_path / "src", "llama")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine, "save_file", full)
    with pytest.raises(OSError, match="No space left"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    assert_nothing_written(tmp_path)


def test_pickled_weights_need_allow_pickle(tmp_path):
    source = save_source(tmp_path / "src", "llama", shard="10GB")
    (tmp_path / "src" / "model.safetensors").unlink()
    torch.save(source.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="--allow-pickle"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    assert_nothing_written(tmp_path)
    convert_checkpoint(tmp_path / "src", tmp_path / "out", allow_pickle=True)
    assert json.loads((tmp_path / "out" / "conversion_report.json").read_text())["parity"]["passed"]


def test_cli_reports_errors_and_exit_codes(tmp_path, capsys):
    save_source(tmp_path / "src", "llama")
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--metric-rank", "1"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["metric_rank"] == 1
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "out")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "o2")]) == 1
    assert "neither an existing folder nor a Hub model id" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "o3"), "--metric-rank", "99"]) == 1
    assert "metric_rank" in capsys.readouterr().err
    assert_nothing_written(tmp_path, "o3")


def test_hub_id_source_goes_through_the_hub_cache(tmp_path, monkeypatch):
    """A Hub id is fetched with huggingface_hub.snapshot_download (which serves a cached copy offline)."""
    import huggingface_hub

    save_source(tmp_path / "cache" / "snapshot", "qwen3")
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path / "cache" / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    convert_checkpoint("someone/tiny-qwen3", tmp_path / "out")
    assert calls and calls[0][0] == "someone/tiny-qwen3" and "*.safetensors" in calls[0][1]
    from huggingface_hub import ModelCard

    assert ModelCard.load(tmp_path / "out" / "README.md").data.base_model == "someone/tiny-qwen3"

    def offline(repo_id, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConversionError, match="could not fetch someone/other.*HF_TOKEN"):
        convert_checkpoint("someone/other", tmp_path / "out2")
    assert_nothing_written(tmp_path, "out2")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_full_size_key_lists_map_on_the_meta_device(family):
    """An 8B-class checkpoint's every tensor name and shape maps onto the converted model (no memory needed)."""
    from fiber_bundle.conversion.weight_maps import weight_map

    config_cls, model_cls, _ = SOURCES[family]
    config = config_cls(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)
    config.architectures = [model_cls.__name__]
    with torch.device("meta"):
        source = model_cls(config)
    fiber_config = engine.fiber_config_from_source(config, family, metric_rank=2, metric_hidden=64, ffn_metric_rank=2)
    shapes = engine.expected_shapes(engine.meta_model(fiber_config))
    targets = set()
    for name, tensor in source.state_dict().items():
        known, target = engine._map_name(name, weight_map(family, "ForCausalLM"))
        assert known and target is not None, name
        assert shapes[target] == tensor.shape, name
        targets.add(target)
    assert set(shapes) - targets == {n for n in shapes if ".fiber." in n}  # only the new geometry is added


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "proportional"])
def test_rope_types_llama_supports_convert_and_others_are_refused(tmp_path, rope_type):
    """Every RoPE type transformers supports for LLaMA converts (with parity); any other stops with the list."""
    save_source(tmp_path / "src", "llama")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    extra = {"factor": 2.0} if rope_type != "longrope" else {
        "original_max_position_embeddings": 64, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    config["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 10000.0, **extra}
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    if rope_type == "proportional":
        with pytest.raises(ConversionError, match=r"rope_type.*'default', 'linear', 'dynamic', 'yarn', 'longrope'"):
            convert_checkpoint(tmp_path / "src", tmp_path / "out")
        assert_nothing_written(tmp_path)
    else:
        report = convert_checkpoint(tmp_path / "src", tmp_path / "out").report
        assert report["parity"]["passed"] and report["parity"]["greedy_agreement"] == 1.0
        saved = json.loads((tmp_path / "out" / "config.json").read_text())
        assert saved["rope_parameters"]["rope_type"] == rope_type


# ---------------------------------------------------------------------------------------------------------------------
# one Hub-folder writer, one card, one loader, one init_geometry
# ---------------------------------------------------------------------------------------------------------------------
def test_convert_and_save_pretrained_write_the_same_code_and_auto_map(tmp_path):
    """Conversion (weights streamed, code through the model's save_code) and a model's save_pretrained write the same
    code files, byte for byte, and the same auto_map: every Auto class."""
    from fiber_bundle.conversion.hub import AUTO_MAP, modeling_files

    save_source(tmp_path / "src", "llama")
    convert_checkpoint(tmp_path / "src", tmp_path / "converted", verify=False)
    FiberBundleForCausalLM.from_pretrained(tmp_path / "converted").save_pretrained(tmp_path / "saved")
    code = {}
    for name in ("converted", "saved"):
        folder = tmp_path / name
        code[name] = {p.name: p.read_bytes() for p in folder.glob("*.py")}
        assert json.loads((folder / "config.json").read_text())["auto_map"] == AUTO_MAP, name
    assert code["converted"] == code["saved"]
    assert sorted(code["converted"]) == list(modeling_files()) == [
        "configuration_fiber_bundle.py", "fiber_attention.py", "fused_attention.py", "modeling_fiber_bundle.py"]


def test_card_names_the_transformers_range_of_pyproject(tmp_path):
    """The card's range is read from the installed distribution, whose only source is pyproject.toml."""
    import tomllib
    from pathlib import Path

    from huggingface_hub import ModelCard
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from fiber_bundle.model_cards import transformers_range

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = next(Requirement(line).specifier for line in pyproject["project"]["dependencies"]
                    if Requirement(line).name == "transformers")
    assert SpecifierSet(transformers_range()) == declared
    save_source(tmp_path / "src", "llama")
    convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    assert f"Tested with transformers {transformers_range()}." in ModelCard.load(tmp_path / "out" / "README.md").text


def test_loader_resolves_folders_and_refuses_what_is_not_a_source(tmp_path):
    from fiber_bundle.conversion.sources import (Location, SourceNotFoundError, load_model, load_tokenizer, locate,
                                                 open_source)

    source = save_source(tmp_path / "src", "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "src")
    assert locate(tmp_path / "src") == Location(tmp_path / "src")
    plain = load_model(tmp_path / "src")
    assert type(plain).__name__ == "LlamaForCausalLM" and not plain.training
    assert open_source(tmp_path / "src").family == "llama"
    convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    converted = load_model(tmp_path / "out")
    assert type(converted) is FiberBundleForCausalLM and not converted.training
    ids = random_ids(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, rtol=0, atol=1e-5)
    text = "w5 w6 w7"
    assert load_tokenizer(tmp_path / "out")(text).input_ids == load_tokenizer(tmp_path / "src")(text).input_ids != []

    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    cases = {
        tmp_path / "nowhere": "neither an existing folder nor a Hub model id",
        tmp_path / "missing.gguf": "GGUF file .* does not exist",
        tmp_path / "empty": "has no config.json",
        tmp_path / "weights.bin": "is a file but not a .gguf file",
    }
    for path, message in cases.items():
        for load in (locate, load_model, load_tokenizer, open_source):
            with pytest.raises(SourceNotFoundError, match=message):
                load(path)
    # a conversion error and a FileNotFoundError: convert and analyze both report it as a one-line error
    assert issubclass(SourceNotFoundError, ConversionError) and issubclass(SourceNotFoundError, FileNotFoundError)


@pytest.mark.heavy
def test_loader_reads_a_gguf_file_as_a_plain_model():
    from fiber_bundle.conversion.assets import SMOLLM2_GGUF, cache_dir
    from fiber_bundle.conversion.sources import Location, load_model, load_tokenizer, locate

    gguf = cache_dir() / "smollm2" / SMOLLM2_GGUF
    if not gguf.is_file():
        pytest.skip(f"no cached GGUF at {gguf} (tests/test_smollm2.py fetches it)")
    assert locate(gguf) == locate(gguf.parent, gguf_file=gguf.name) == Location(gguf.parent, gguf.name)
    model = load_model(gguf)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert not getattr(model, "is_quantized", False) and "quantization_config" not in model.config.to_dict()
    ids = load_tokenizer(gguf)("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_init_geometry_is_the_converted_draw_for_its_seed(tmp_path):
    """``init_geometry(seed)`` on the model class gives the same parameters for the same seed, on the meta-device
    structure conversion uses and on a loaded model alike: a converted folder holds exactly the seed's draw."""
    save_source(tmp_path / "src", "qwen3")
    convert_checkpoint(tmp_path / "src", tmp_path / "out", verify=False, seed=7)
    loaded = FiberBundleForCausalLM.from_pretrained(tmp_path / "out")
    geometry = {k: v.clone() for k, v in loaded.state_dict().items() if ".fiber." in k}
    structure = engine.meta_model(loaded.config)
    structure.init_geometry(7)
    drawn = {k: v for k, v in structure.state_dict().items() if ".fiber." in k}
    assert drawn.keys() == geometry.keys() and all(torch.equal(drawn[k], geometry[k]) for k in geometry)
    loaded.init_geometry(8)
    assert any(not torch.equal(v, geometry[k]) for k, v in loaded.state_dict().items() if k in geometry)
    loaded.init_geometry(7)
    assert all(torch.equal(v, geometry[k]) for k, v in loaded.state_dict().items() if k in geometry)
