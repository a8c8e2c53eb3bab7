"""Serving (serving/, docs/deployment.md "Serving"): ``fiber-bundle serve`` runs transformers' own OpenAI-compatible
server on a Fiber Bundle folder, and continuous batching (requests of different lengths in one packed forward over the
paged cache) gives every request the tokens ``generate`` gives it alone, with the geometry awake."""

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import GenerationConfig

from fiber_bundle.serving.server import ServeError, check_model, serve_arguments
from helpers import random_ids, set_gates, tiny_model, tiny_tokenizer


def awake_model(seed=0):
    """A tiny float32 model with its geometry far from the graft (at the graft it is its backbone, and a q.k path would
    pass every test here): strong gates, and factors near the bounded map's limit, so that each token's metric and the
    factors' turn by its own position decide the greedy tokens."""
    model = set_gates(tiny_model(seed=seed, dtype=torch.float32), alpha=4.0, gamma=1.0)
    with torch.no_grad():
        for p in model.geometry_parameters():
            p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.fiber.attn_factor_proj.weight.mul_(30.0)
    return model


def greedy_alone(model, prompts, new_tokens):
    """Each prompt's greedy continuation by ``generate``, one request at a time."""
    out = []
    for ids in prompts:
        tokens = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)
        out.append(tokens[0, len(ids):].tolist())
    return out


# ---------------------------------------------------------------------------------------------------------------------
# continuous batching, in process
# ---------------------------------------------------------------------------------------------------------------------
def test_continuous_batching_gives_each_request_its_tokens_alone():
    """Three prompts of different lengths batched by transformers' ContinuousBatchingManager (packed tokens, the
    additive block mask, positions restarting per request, keys gathered from the paged cache) get exactly the greedy
    tokens ``generate`` gives each alone."""
    model = awake_model().eval()
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (5, 11, 17)]
    expected = greedy_alone(model, prompts, 8)
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    results = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
    assert [by_prompt[tuple(p)] for p in prompts] == expected


# ---------------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------------
def test_a_lora_adapter_or_a_folder_without_a_model_is_refused_with_the_fix(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ServeError, match=r"is a LoRA adapter, not a model: merge it into its base first, "
                                         r"`fiber-bundle merge .*adapter MERGED`"):
        check_model(str(adapter))
    with pytest.raises(ServeError, match="holds no config.json"):
        check_model(str(tmp_path))
    with pytest.raises(ServeError, match="is not a folder"):
        check_model(str(tmp_path / "missing"))
    check_model("someone/some-model")  # a Hub id: left to the server
    argv = serve_arguments("m", port=9, continuous_batching=True, extra=["--max-model-len", "64"])
    assert argv == ["serve", "m", "--trust-remote-code", "--host", "127.0.0.1", "--port", "9", "--dtype", "auto",
                    "--continuous-batching", "--max-model-len", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(port: int, process: subprocess.Popen, timeout: float = 240.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {process.stdout.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise AssertionError("the server did not become healthy in time")


@pytest.mark.heavy
@pytest.mark.parametrize("continuous_batching", [False, True], ids=["generate", "continuous-batching"])
def test_the_server_answers_concurrent_streamed_chats_with_generates_tokens(tmp_path, continuous_batching):
    """``fiber-bundle serve FOLDER`` in a subprocess on a free localhost port; four concurrent streamed chat completions
    at temperature 0 through the official ``openai`` client, each equal to ``generate`` on the same chat template;
    a malformed body gets 422, a prompt past the context and an unknown model name a 400 that names the problem, and
    the server answers on; SIGTERM stops it with exit code 0."""
    import openai

    model = awake_model()
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    chats = [[{"role": "user", "content": " ".join(f"w{3 + (7 * i + 5 * k) % 90}" for k in range(n))}]
             for i, n in enumerate((2, 5, 9, 14))]
    new_tokens = 6
    expected = []
    for chat in chats:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        expected.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))

    port = free_port()
    command = [sys.executable, "-m", "fiber_bundle.cli", "serve", str(folder), "--port", str(port),
               "--dtype", "float32", "--log-level", "warning"]
    if continuous_batching:
        command.append("--continuous-batching")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        wait_until_healthy(port, process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

        def chat(messages):
            stream = client.chat.completions.create(model=str(folder), messages=messages, temperature=0,
                                                    max_tokens=new_tokens, stream=True)
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(chat, chats))
        assert [a.split() for a in answers] == [e.split() for e in expected]

        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{not json",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=30)
        assert error.value.code == 422
        # a prompt past the context and an unknown model: a 4xx that names the problem, and the server serves on
        too_long = [{"role": "user", "content": " ".join(["w5"] * (model.config.max_position_embeddings + 10))}]
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=str(folder), messages=too_long, max_tokens=2)
        assert "takes at most 512, prompt and answer" in error.value.response.text
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="someone/unknown", messages=chats[0], max_tokens=2)
        assert "requested 'someone/unknown'" in error.value.response.text
        assert chat(chats[1]).split() == expected[1].split()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert code == 0, process.stdout.read()[-4000:]


def test_packed_requests_get_each_requests_logits_alone():
    """The packed layout continuous batching hands the model, in one forward: three prompts in one row, positions
    restarting per prompt (the block-diagonal mask built from them), each prompt's logits within float32 tolerance of
    its forward alone; each token's factors turn by its own position."""
    model = awake_model().eval()
    prompts = [random_ids(1, n, seed=n)[0] for n in (5, 11, 17)]
    packed = torch.cat(prompts)[None]
    positions = torch.cat([torch.arange(len(p)) for p in prompts])[None]
    with torch.no_grad():
        logits = model(packed, position_ids=positions, use_cache=False).logits[0]
        alone = [model(p[None], use_cache=False).logits[0] for p in prompts]
    torch.testing.assert_close(logits, torch.cat(alone), rtol=1e-5, atol=1e-5)
