"""TRL's trainers on a Fiber Bundle model (training/trl_recipes.py, docs/fine_tuning.md "With TRL"): where TRL computes
something itself it equals the model's own computation, with the geometry awake (at the graft the model is its
backbone, and a computation that ignored the metric would pass)."""

import pytest
import torch

from helpers import awake_model, decisive_geometry, tiny_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import SFTConfig, SFTTrainer  # noqa: E402

from fiber_bundle.training.trl_recipes import lora_config, with_metric_learning_rate  # noqa: E402

# TRL 1.16's configs default gradient_checkpointing=True, a name transformers 5.25 deprecated
# (activation_checkpointing): every SFTConfig / DPOConfig / GRPOConfig warns, whatever the user passes; TRL calls
# gradient_checkpointing_disable around its reference and generation forwards, and PEFT 0.21 reads
# is_gradient_checkpointing. Theirs to fix; the aliases still apply.
pytestmark = pytest.mark.filterwarnings("ignore:`[a-z_]*gradient_checkpointing[a-z_]*` is deprecated:FutureWarning")


def text_dataset(n=12, seed=0):
    """Texts of 4 to 30 words of the tiny tokenizer's vocabulary, different lengths so that packing mixes them."""
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for i in range(n):
        length = 4 + (7 * i) % 27
        words = torch.randint(3, 97, (length,), generator=gen).tolist()
        texts.append(" ".join(f"w{w}" for w in words))
    return datasets.Dataset.from_dict({"text": texts})


def sft_config(tmp_path, **overrides) -> SFTConfig:
    """TRL's SFT defaults, on the CPU, without reporting; float32 / float64 weights stay as they are (bf16 off: TRL
    turns bf16 autocast on wherever the CPU supports it)."""
    fields = dict(output_dir=str(tmp_path / "sft"), use_cpu=True, bf16=False, report_to=[], max_steps=2,
                  per_device_train_batch_size=2, max_length=64, logging_steps=1, save_strategy="no",
                  dataloader_num_workers=0, seed=0)
    return SFTConfig(**{**fields, **overrides})


def first_batch(trainer):
    return next(iter(trainer.get_train_dataloader()))


def gradients(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------------------------------
def test_sft_fused_head_loss_equals_the_models_own_loss(tmp_path):
    """SFT's default loss runs the base model and projects through the LM head itself, in tiles
    (``add_fused_lm_head``): on a packed, padding-free batch its collator built, it equals the model's own loss."""
    model = awake_model(torch.float32)
    trainer = SFTTrainer(model=model, args=sft_config(tmp_path, packing=True), train_dataset=text_dataset(),
                         processing_class=tiny_tokenizer())
    batch = first_batch(trainer)
    assert "attention_mask" not in batch and (batch["position_ids"] == 0).sum() > 1  # several samples in one row
    with torch.no_grad():
        fused = trainer.model(**batch, fused_lm_head=True).loss
        own = trainer.model(**batch).loss
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=0)


def samples_of(batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (input_ids, labels) of each sample of a padding-free row: it starts where position_ids is 0."""
    ids, labels, positions = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
    return [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]


def test_a_packed_batch_gives_each_sample_its_loss_and_gradients_alone(tmp_path):
    """TRL's packing flattens a batch into one row, position_ids restarting per sample and no attention mask: the model
    builds the block-diagonal mask from the positions and turns each token's factors by its own position, so the
    packed loss and gradients equal those of the samples run one by one (float64)."""
    model = awake_model()
    trainer = SFTTrainer(model=model, args=sft_config(tmp_path, packing=True), train_dataset=text_dataset(),
                         processing_class=tiny_tokenizer())
    batch = first_batch(trainer)
    samples = samples_of(batch)
    assert len(samples) >= 3
    model.zero_grad()
    tokens = sum(int((labels[1:] != -100).sum()) for _, labels in samples)

    def loss_of(ids, labels):  # the sum of the token losses in float64 (the model's own loss_function is float32)
        logits = model(ids[None], **({"position_ids": positions} if len(ids) == batch_len else {})).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum") / tokens

    batch_len, positions = batch["input_ids"].shape[1], batch["position_ids"]
    packed = loss_of(batch["input_ids"][0], batch["labels"][0])  # one row, no attention mask: as TRL feeds it
    packed.backward()
    packed_grads = gradients(model)

    model.zero_grad()
    total = 0.0
    for ids, labels in samples:  # each alone
        loss = loss_of(ids, labels)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(packed.detach(), total, rtol=1e-10, atol=0)
    alone = gradients(model)
    assert packed_grads.keys() == alone.keys()
    for name in alone:
        torch.testing.assert_close(packed_grads[name], alone[name], rtol=1e-8, atol=1e-12, msg=name)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    """TRL turns gradient checkpointing on by default: the same batch gives the same loss and gradients with it as
    without it (float64)."""
    model = awake_model()
    trainer = SFTTrainer(model=model, args=sft_config(tmp_path, packing=True), train_dataset=text_dataset(),
                         processing_class=tiny_tokenizer())
    assert trainer.args.gradient_checkpointing  # TRL's default
    batch = first_batch(trainer)
    results = []
    for checkpointing in (True, False):
        if checkpointing:
            model.activation_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)
        else:
            model.activation_checkpointing_disable()
        model.train()
        model.zero_grad()
        loss = model(**batch, fused_lm_head=True).loss
        loss.backward()
        results.append((loss.detach(), gradients(model)))
    (loss_on, grads_on), (loss_off, grads_off) = results
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-12, atol=0)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name in grads_on:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=1e-10, atol=1e-14, msg=name)


def test_completion_only_loss_on_chat_data_masks_the_prompt(tmp_path):
    """A conversational prompt-completion dataset (``messages`` split into prompt and completion): TRL's labels mask
    every prompt token, and the loss is the model's mean loss over the completion's tokens alone."""
    tokenizer = tiny_tokenizer()
    rows = {"prompt": [[{"role": "user", "content": "w5 w6 w7 w8 w9"}], [{"role": "user", "content": "w11 w12"}]],
            "completion": [[{"role": "assistant", "content": "w20 w21 w22"}],
                           [{"role": "assistant", "content": "w30 w31 w32 w33"}]]}
    model = awake_model()
    trainer = SFTTrainer(model=model, args=sft_config(tmp_path), train_dataset=datasets.Dataset.from_dict(rows),
                         processing_class=tokenizer)
    batch = first_batch(trainer)
    for i in range(2):
        prompt_ids = tokenizer.apply_chat_template(rows["prompt"][i], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        row = batch["input_ids"][i].tolist()
        start = next(j for j in range(len(row)) if row[j:j + len(prompt_ids)] == prompt_ids)
        assert (batch["labels"][i, :start + len(prompt_ids)] == -100).all()  # the prompt is masked
        assert (batch["labels"][i, start + len(prompt_ids):] != -100).any()  # the completion is not
    with torch.no_grad():
        fused = trainer.model(**batch, fused_lm_head=True).loss
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
    torch.testing.assert_close(fused.double(), expected, rtol=1e-6, atol=0)  # TRL's fused head computes in float32


# ---------------------------------------------------------------------------------------------------------------------
# LoRA with the metric alongside
# ---------------------------------------------------------------------------------------------------------------------
def test_lora_recipe_trains_the_metric_alongside_and_the_adapter_reloads_and_merges(tmp_path):
    """``peft_config=lora_config()`` gives a TRL user ``fiber-bundle train --mode lora``: LoRA on the backbone's
    projections, every ``fiber`` module trained in full (saved with the adapter), and with
    ``with_metric_learning_rate`` the metric at its own rate. The folder is given by path with trust_remote_code, as
    users do; the adapter reloads with ``AutoPeftModelForCausalLM`` to the same logits and merges with the project's
    ``merge``."""
    from peft import AutoPeftModelForCausalLM

    from fiber_bundle.training.merge import merge_adapter
    from fiber_bundle.training.modes import is_geometry_parameter

    model = awake_model(torch.float32)
    tokenizer = tiny_tokenizer()
    base = tmp_path / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    args = sft_config(tmp_path, packing=True, trust_remote_code=True, learning_rate=1e-3, max_steps=3)
    trainer = SFTTrainer(model=str(base), args=args, train_dataset=text_dataset(), peft_config=lora_config(),
                         processing_class=tokenizer)
    with_metric_learning_rate(trainer, 2e-2)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any(is_geometry_parameter(n) for n in trainable)
    assert all("lora_" in n or is_geometry_parameter(n) for n in trainable)
    rates = sorted(group["lr"] for group in trainer.optimizer.param_groups)
    assert rates == [1e-3, 2e-2]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any(is_geometry_parameter(n) for n in moved) and any("lora_B" in n for n in moved)

    adapter = tmp_path / "adapter"
    trainer.save_model(str(adapter))
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(ids).logits
        reloaded = AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True).eval()
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
    merge_adapter(adapter, tmp_path / "merged", base=base)
    from modeling_fiber_bundle import FiberBundleForCausalLM

    merged = FiberBundleForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# DPO with PEFT
# ---------------------------------------------------------------------------------------------------------------------
def preference_dataset():
    """Prompts whose chosen answer repeats a word the rejected one does not: something a few steps can learn."""
    prompts, chosen, rejected = [], [], []
    for i in range(8):
        prompts.append(" ".join(f"w{3 + (5 * i + k) % 90}" for k in range(4 + i % 3)))
        chosen.append(" ".join(["w7"] * (3 + i % 2)))
        rejected.append(" ".join(f"w{40 + (3 * i + k) % 50}" for k in range(3 + i % 2)))
    return datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def completion_logps(model, batch) -> torch.Tensor:
    """Each row's summed log-probability of its completion tokens (``completion_mask``), from the model's full logits in
    float64: the plain computation DPO's reference must equal."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return (logps * batch["completion_mask"][:, 1:]).sum(-1)


def test_dpo_with_peft_raises_the_margin_and_its_reference_is_the_base_model(tmp_path):
    """DPO with the LoRA + metric recipe and no reference model: TRL takes the reference with the adapter disabled,
    which must be the base model (the ``fiber`` copies PEFT trains under ``modules_to_save`` switched off too), after
    training as before it; a few steps raise the chosen-minus-rejected reward margin."""
    from trl import DPOConfig, DPOTrainer

    from modeling_fiber_bundle import FiberBundleForCausalLM

    model = awake_model(torch.float32)
    tokenizer = tiny_tokenizer()
    base = tmp_path / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), use_cpu=True, bf16=False, report_to=[], max_steps=6,
                     per_device_train_batch_size=4, learning_rate=5e-3, logging_steps=1, save_strategy="no",
                     trust_remote_code=True, seed=0, beta=0.1)
    trainer = DPOTrainer(model=str(base), args=args, train_dataset=preference_dataset(), processing_class=tokenizer,
                         peft_config=lora_config())
    batch = first_batch(trainer)
    base_model = FiberBundleForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        expected = completion_logps(base_model, batch)
        before = torch.cat(trainer.compute_ref_log_probs(trainer.model, batch))
    torch.testing.assert_close(before.double(), expected, rtol=1e-5, atol=1e-4)
    trainer.train()
    margins = [log["rewards/margins"] for log in trainer.state.log_history if "rewards/margins" in log]
    assert margins[0] == pytest.approx(0.0, abs=1e-6) and margins[-1] > 0.05, margins
    with torch.no_grad():
        after = torch.cat(trainer.compute_ref_log_probs(trainer.model, batch))
        policy = completion_logps(trainer.model, batch)
    torch.testing.assert_close(after.double(), expected, rtol=1e-5, atol=1e-4)  # the reference did not move
    assert (policy - expected).abs().max() > 1e-2  # the policy did


# ---------------------------------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------------------------------
def count_w7(completions, **kwargs) -> list[float]:
    """A verifiable reward: how often the completion says w7."""
    return [float(c.split().count("w7")) for c in completions]


def grpo_trainer(tmp_path, folder, tokenizer, continuous_batching: bool):
    from trl import GRPOConfig, GRPOTrainer

    from fiber_bundle.training.trl_recipes import continuous_batching_config

    args = GRPOConfig(output_dir=str(tmp_path / f"grpo-{continuous_batching}"), use_cpu=True, bf16=False,
                      report_to=[], max_steps=1, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, learning_rate=1e-3, save_strategy="no", trust_remote_code=True,
                      seed=0, generation_kwargs={"do_sample": False},
                      use_transformers_continuous_batching=continuous_batching,
                      transformers_continuous_batching_config=continuous_batching_config() if continuous_batching
                      else None)
    prompts = datasets.Dataset.from_dict({"prompt": [f"w{5 + i} w{9 + i} w{20 + 3 * i}" + " w3" * i
                                                     for i in range(4)]})
    return GRPOTrainer(model=str(folder), reward_funcs=count_w7, args=args, train_dataset=prompts,
                       processing_class=tokenizer, peft_config=lora_config())


def test_grpo_generates_the_same_greedy_completions_through_generate_and_continuous_batching(tmp_path):
    """GRPO's generation by ``generate`` (left-padded prompts) and by transformers' continuous batching (the paged
    cache, packed requests) gives the same greedy completions; a step runs with either; its log-probabilities of the
    last ``logits_to_keep`` positions equal the full forward's, and the model's own ``logits_to_keep`` slices the same
    logits."""
    model = decisive_geometry()
    tokenizer = tiny_tokenizer()
    folder = tmp_path / "base"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # prompts whose greedy answer does not end at once (transformers' continuous batching ignores min_new_tokens)
    candidates = [tokenizer(f"w{5 + i} w{9 + i}" + " w3" * (i % 5))["input_ids"] for i in range(24)]
    with torch.no_grad():
        prompt_ids = [ids for ids in candidates
                      if model(torch.tensor([ids])).logits[0, -1].argmax() != tokenizer.eos_token_id][:3]
    assert len(prompt_ids) == 3 and len({len(ids) for ids in prompt_ids}) > 1
    completions = {}
    for continuous_batching in (False, True):
        trainer = grpo_trainer(tmp_path, folder, tokenizer, continuous_batching)
        completions[continuous_batching], _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
        trainer.train()
        assert trainer.state.global_step == 1
    assert completions[False] == completions[True] and all(len(c) >= 2 for c in completions[False]), completions

    ids = torch.tensor([prompt_ids[2] + completions[False][2]])
    keep = len(completions[False][2])
    with torch.no_grad():
        full = trainer.model(input_ids=ids).logits
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), keep)
        kept = trainer.model(input_ids=ids, logits_to_keep=keep).logits
    expected = torch.log_softmax(full[:, -keep - 1:-1].double(), -1).gather(-1, ids[:, -keep:, None])[..., 0]
    torch.testing.assert_close(logps.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept, full[:, -keep:], rtol=1e-5, atol=1e-6)  # the head on fewer rows: float32 rounding


# ---------------------------------------------------------------------------------------------------------------------
# The model card of a TRL output folder
# ---------------------------------------------------------------------------------------------------------------------
def test_publish_renders_a_card_for_a_trl_output_folder_from_what_it_records(tmp_path):
    """``fiber-bundle publish --dry-run`` on the folder ``SFTTrainer.save_model`` wrote: the card TRL saved (PEFT's
    template, the base as a local path) is replaced by the project's, which says what the folder records (the trainer,
    and with ``trainer.save_state()`` the steps and the last loss) and what it cannot know; rendered again, the same."""
    from fiber_bundle.training.publish import publish

    model = awake_model(torch.float32)
    tokenizer = tiny_tokenizer()
    base = tmp_path / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    trainer = SFTTrainer(model=str(base), args=sft_config(tmp_path, packing=True, trust_remote_code=True),
                         train_dataset=text_dataset(), peft_config=lora_config(), processing_class=tokenizer)
    trainer.train()
    bare, recorded = tmp_path / "bare", tmp_path / "recorded"
    trainer.save_model(str(bare))
    trainer.save_model(str(recorded))
    trainer.args.output_dir = str(recorded)
    trainer.save_state()
    assert "trl" in (bare / "README.md").read_text()  # TRL's tags on PEFT's card

    for folder in (bare, recorded):
        publish(folder, "me/tiny-sft", dry_run=True, check_load=False, base_model_id="me/tiny-base")
        card = (folder / "README.md").read_text()
        assert "trained with TRL's `SFTTrainer`" in card and "- trl\n" in card and "- sft\n" in card
        assert "The metric parameters it trained alongside the LoRA pairs are saved in full" in card
        assert "does not record the training data" in card and str(tmp_path) not in card
        publish(folder, "me/tiny-sft", dry_run=True, check_load=False)
        assert (folder / "README.md").read_text() == card
    bare_card, recorded_card = (bare / "README.md").read_text(), (recorded / "README.md").read_text()
    assert "the steps and the losses (save them beside the model with `trainer.save_state()`" in bare_card
    loss = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry][-1]
    assert f"{trainer.state.global_step} steps, last logged training loss {loss:.4g}" in recorded_card


# ---------------------------------------------------------------------------------------------------------------------
# The recipes of docs/fine_tuning.md, and SFT on the real checkpoint
# ---------------------------------------------------------------------------------------------------------------------
def trl_recipes() -> list[str]:
    """The Python snippets of docs/fine_tuning.md's "With TRL" section, as written."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "fine_tuning.md").read_text()
    section = text[text.index("## With TRL"):]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.heavy
def test_the_documented_recipes_run(tmp_path, monkeypatch):
    """SFT, DPO and GRPO as docs/fine_tuning.md writes them, on a tiny folder standing in for the main job's output
    (the same code, its paths moved under tmp_path): each trains, SFT's folder reloads as an adapter and publishes a
    card."""
    from peft import AutoPeftModelForCausalLM

    from fiber_bundle.training.publish import publish

    recipes = trl_recipes()
    assert len(recipes) == 3 and all("out/smollm2-fbt-metric" in code for code in recipes)
    out = tmp_path / "out"
    model, tokenizer = decisive_geometry(), tiny_tokenizer()
    model.save_pretrained(out / "smollm2-fbt-metric")
    tokenizer.save_pretrained(out / "smollm2-fbt-metric")
    monkeypatch.chdir(tmp_path)
    for code in recipes:
        namespace = {}
        exec(compile(code, "docs/fine_tuning.md", "exec"), namespace)  # noqa: S102  the documented snippet itself
        assert namespace["trainer"].state.global_step == namespace["args"].max_steps
    AutoPeftModelForCausalLM.from_pretrained(out / "smollm2-sft", trust_remote_code=True)
    publish(out / "smollm2-sft", "you/smollm2-sft", dry_run=True, check_load=False,
            base_model_id="you/SmolLM2-135M-Instruct-FBT")
    assert "steps, last logged training loss" in (out / "smollm2-sft" / "README.md").read_text()


@pytest.mark.heavy
def test_sft_on_the_real_checkpoint(converted, tmp_path):
    """SFTTrainer with the LoRA + metric recipe on the SmolLM2-135M conversion (geometry at the graft, woken by the
    metric's own rate): two packed steps of pydoc text run, the metric moves off the graft, and the adapter reloads to
    the same logits."""
    from peft import AutoPeftModelForCausalLM

    from fiber_bundle.training.data import pydoc_topics

    train, _ = pydoc_topics()
    args = SFTConfig(output_dir=str(tmp_path / "sft"), trust_remote_code=True, max_steps=2,
                     per_device_train_batch_size=2, max_length=128, packing=True, packing_strategy="bfd_split",
                     learning_rate=1e-3, bf16=False, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                     logging_steps=1)
    trainer = SFTTrainer(model=str(converted), args=args, train_dataset=train.select(range(8)),
                         peft_config=lora_config())
    with_metric_learning_rate(trainer, 2e-2)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(0 < loss < 10 for loss in losses)
    gates = [p for n, p in trainer.model.named_parameters() if n.endswith("attn_gate") and p.requires_grad]
    assert gates and max(g.abs().max().item() for g in gates) > 0  # off the graft
    trainer.save_model(str(tmp_path / "adapter"))
    ids = torch.tensor([[1, 504, 3500, 28, 4982, 314]])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(ids).logits
        reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", trust_remote_code=True).eval()
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-4, atol=1e-4)
