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

from fiber_bundle.serving import server
from fiber_bundle.serving.server import ServeError, check_model, serve_arguments
from helpers import decisive_geometry, random_ids, tiny_tokenizer


def small_cache(**options):
    """A paged cache of 2048 tokens (transformers would size it at 90 % of the machine's RAM on a CPU)."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=256, **options)


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
    tokens ``generate`` gives each alone, each with its log-probability alone within float32 tolerance."""
    model = decisive_geometry().eval()
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (5, 11, 17)]
    expected, expected_logprobs = [], []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids):]
        expected.append(tokens.tolist())
        logprobs = [torch.log_softmax(logits[0].double(), -1)[token] for logits, token in zip(out.logits, tokens)]
        expected_logprobs.append(torch.stack(logprobs))
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    results = model.generate_batch(prompts, generation_config=config, progress_bar=False,
                                   continuous_batching_config=small_cache(return_logprobs=True))
    by_prompt = {tuple(r.prompt_ids): r for r in results.values()}
    assert [by_prompt[tuple(p)].generated_tokens for p in prompts] == expected
    for ids, logprobs in zip(prompts, expected_logprobs):
        torch.testing.assert_close(torch.tensor(by_prompt[tuple(ids)].logprobs, dtype=torch.float64), logprobs,
                                   rtol=0, atol=1e-4)


@pytest.fixture
def attention_calls(monkeypatch):
    """The model's calls of each attention path under continuous batching, as (path, query rows, mask's ndim and
    whether it is additive); fresh self-check verdicts."""
    from modeling_fiber_bundle import fused_attention
    from modeling_fiber_bundle import modeling_fiber_bundle as modeling

    monkeypatch.setattr(fused_attention, "_verdicts", {})
    calls = []

    def spy(path, real):
        def run(query, factors, key, value, alpha, gamma, scale, mask=None, *args, **kwargs):
            calls.append((path, query.shape[2], None if mask is None else (mask.ndim, mask.is_floating_point())))
            return real(query, factors, key, value, alpha, gamma, scale, mask, *args, **kwargs)
        return run

    for name, path in (("cpp_geodesic_attention", "cpp"), ("blocked_geodesic_attention", "blocked"),
                       ("triton_geodesic_attention", "triton")):
        monkeypatch.setattr(modeling, name, spy(path, getattr(modeling, name)))
    return calls


@pytest.mark.parametrize("kernel", ["cpp", "blocked", "triton"])
def test_each_attention_path_reads_the_paged_cache_correctly(monkeypatch, attention_calls, kernel):
    """Under continuous batching (the paged cache's gathered keys, the additive (1, 1, Tq, Tkv) block mask) each path
    that "auto" or the config picks gives every request its tokens alone: the C++ operator (its tiles for packed
    prompts and steps of several requests, its one-row ``decode`` when one request decodes alone), the blocked PyTorch
    path, and the Triton kernel (under its interpreter, standing in for a GPU as in test_triton_attention.py)."""
    setting = {"cpp": "auto", "blocked": "pytorch", "triton": "auto"}[kernel]
    if kernel == "triton":
        pytest.importorskip("triton")
        from modeling_fiber_bundle import fused_attention

        if fused_attention.triton is None or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not set up (conftest.py sets TRITON_INTERPRET=1)")
        monkeypatch.setattr(fused_attention, "auto_device", lambda query: True)
    model = decisive_geometry().eval()
    model.config.fiber_attention_kernel = setting
    config = GenerationConfig(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    for lengths in ((9,), (5, 11, 17)):  # one request alone (one-row decoding steps), then three of different lengths
        prompts = [random_ids(1, n, seed=n)[0].tolist() for n in lengths]
        expected = greedy_alone(model, prompts, 5)
        attention_calls.clear()
        results = model.generate_batch(prompts, generation_config=config, progress_bar=False,
                                    continuous_batching_config=small_cache())
        by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
        assert [by_prompt[tuple(p)] for p in prompts] == expected
        assert {call[0] for call in attention_calls} == {kernel}
        assert all(call[2] == (4, True) for call in attention_calls)  # the paged route's additive block mask
        if len(lengths) == 1:
            assert any(call[1] == 1 for call in attention_calls)  # steps of one query row (decode, for the C++ path)


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


def test_on_a_cpu_the_paged_cache_is_sized_for_the_model_not_the_machine():
    """transformers sizes the paged cache at 90 % of a CPU machine's RAM: on a CPU ``fiber-bundle serve`` gives it
    CPU_CACHE_TOKENS tokens and forwards of CPU_MAX_BATCH_TOKENS, unless an option sizes it."""
    cpu = serve_arguments("m", continuous_batching=True, on_cpu=True)
    assert cpu[-4:] == ["--cb-num-blocks", str(server.CPU_CACHE_TOKENS // 256),
                        "--cb-max-batch-tokens", str(server.CPU_MAX_BATCH_TOKENS)]
    pages = serve_arguments("m", continuous_batching=True, on_cpu=True, extra=["--cb-block-size=64"])
    assert pages[pages.index("--cb-num-blocks") + 1] == str(server.CPU_CACHE_TOKENS // 64)
    for sized in (["--cb-num-blocks", "4"], ["--cb-max-memory-percent=0.1"], ["--cb-max-batch-tokens", "512"]):
        assert serve_arguments("m", continuous_batching=True, on_cpu=True, extra=sized)[-len(sized):] == sized
        assert "--cb-num-blocks" not in serve_arguments("m", continuous_batching=True, on_cpu=True, extra=sized)[:-2]
    assert "--cb-num-blocks" not in serve_arguments("m", continuous_batching=True, on_cpu=False)
    assert "--cb-num-blocks" not in serve_arguments("m", continuous_batching=False, on_cpu=True)
    assert server.runs_on_cpu(["--device", "cpu"]) and not server.runs_on_cpu(["--device=cuda:0"])


def test_the_server_hooks_follow_the_installed_transformers(monkeypatch):
    """The loader goes in until the release that fixes the upstream defect (a version check); a request naming another
    model than the one served gets 404 with OpenAI's error body, one naming none keeps the server's 400."""
    import transformers.cli.serving.model_manager as model_manager
    import transformers.cli.serving.server as server_module
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from transformers.cli.serving.utils import ModelNotServedError

    from fiber_bundle.serving.loader import FiberBundleModelLoader

    assert not server.server_loads_remote_code("5.25.0")  # no fixed release known yet
    monkeypatch.setattr(server, "SERVER_LOADS_REMOTE_CODE_FROM", (5, 30))
    assert server.server_loads_remote_code("5.30.0") and not server.server_loads_remote_code("5.29.2")

    def build_server(*args, **kwargs):  # the server's app factory, reduced to the two ways a request names no model
        app = FastAPI()

        @app.exception_handler(ValueError)
        async def bad_request(request, error):
            from fastapi.responses import JSONResponse

            return JSONResponse({"detail": str(error)}, status_code=400)

        @app.post("/v1/chat/completions")
        async def chat(body: dict):
            if "model" in body:
                raise ModelNotServedError(f"Server is pinned to 'm'; requested '{body['model']}'.")
            raise ModelNotServedError("The request names no model, and the server wasn't started with one.")

        return app

    for fixed, expected_loader in (("5.30.0", model_manager.ModelLoader), ("5.25.0", FiberBundleModelLoader)):
        monkeypatch.setattr(model_manager, "ModelLoader", model_manager.ModelLoader)
        monkeypatch.setattr(server_module, "build_server", build_server)
        monkeypatch.setattr(server, "server_loads_remote_code", lambda version=None: fixed == "5.30.0")
        server.install_server_hooks()
        assert model_manager.ModelLoader is expected_loader
    client = TestClient(server_module.build_server())
    named = client.post("/v1/chat/completions", json={"model": "other"})
    assert named.status_code == 404 and named.json()["error"]["code"] == "model_not_found"
    assert client.post("/v1/chat/completions", json={}).status_code == 400
    monkeypatch.setattr(model_manager, "ModelLoader", object)  # a server without what the route relies on
    with pytest.raises(ImportError, match="built against transformers 5.25's server.*ModelLoader._load_model"):
        server.install_server_hooks()


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
    a malformed body gets 422, a prompt past the context a 400 and an unknown model name a 404 that name the problem,
    and the server answers on; SIGTERM stops it with exit code 0."""
    import openai

    model = decisive_geometry()
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

    process, port = start_server(folder, *(["--continuous-batching"] if continuous_batching else []))
    try:
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
        with pytest.raises(openai.NotFoundError) as error:  # 404, OpenAI's model_not_found
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


def start_server(folder, *options) -> tuple[subprocess.Popen, int]:
    """``fiber-bundle serve FOLDER`` in a subprocess on a free localhost port, once it answers /health."""
    port = free_port()
    command = [sys.executable, "-m", "fiber_bundle.cli", "serve", str(folder), "--port", str(port),
               "--dtype", "float32", "--log-level", "warning", *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        wait_until_healthy(port, process)
    except BaseException:
        process.kill()
        raise
    return process, port


def server_usage(process) -> tuple[float, float]:
    """The server's resident memory (MiB) and CPU seconds so far, over its process and those it started (the
    model's)."""
    import psutil

    root = psutil.Process(process.pid)
    processes = [root, *root.children(recursive=True)]
    return (sum(p.memory_info().rss for p in processes) / 2**20,
            sum(p.cpu_times().user + p.cpu_times().system for p in processes))


@pytest.mark.heavy
@pytest.mark.parametrize("continuous_batching", [False, True], ids=["generate", "continuous-batching"])
def test_clients_that_disconnect_mid_stream_leave_nothing_behind(tmp_path, continuous_batching):
    """50 streamed chats of up to 500 tokens, each dropped by its client after two chunks: the server stops generating
    for them (it is idle a second later, where 50 abandoned generations would keep it busy for tens of seconds), its
    memory stays where it was, and the next request gets the answer it got before. Then SIGTERM with two long
    streams in flight: the server finishes or aborts them and exits 0."""
    import openai

    model = decisive_geometry()
    model.generation_config.eos_token_id = None  # every answer runs to max_tokens
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    chat = [{"role": "user", "content": "w5 w6 w7 w8"}]
    process, port = start_server(folder, *(["--continuous-batching"] if continuous_batching else []))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

        def answer(max_tokens=8):
            return client.chat.completions.create(model=str(folder), messages=chat, temperature=0,
                                                  max_tokens=max_tokens).choices[0].message.content

        before = answer()
        assert len(answer(500).split()) == 500  # a whole long answer once: the allocator's high-water mark
        memory_before, _ = server_usage(process)
        for _ in range(50):
            stream = client.chat.completions.create(model=str(folder), messages=chat, temperature=0, max_tokens=500,
                                                    stream=True)
            for count, _chunk in enumerate(stream):
                if count == 1:
                    break
            stream.close()  # the client goes away mid-stream
        time.sleep(1.0)
        _, cpu_start = server_usage(process)
        time.sleep(2.0)
        memory_after, cpu_end = server_usage(process)
        assert cpu_end - cpu_start < 0.5, "the server is still generating for clients that left"
        assert memory_after - memory_before < 64, (memory_before, memory_after)
        assert answer() == before

        def long_stream():
            stream = client.chat.completions.create(model=str(folder), messages=chat, temperature=0, max_tokens=500,
                                                    stream=True)
            chunks = []
            try:
                chunks.extend(stream)
            except (openai.APIError, OSError) as error:
                return ("error", repr(error))  # aborted by the shutdown: allowed
            text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1:]
            return (len(text.split()), finish)  # finished: all 500 tokens, and the reason
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            in_flight = [pool.submit(long_stream) for _ in range(2)]
            time.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=120)
            outcomes = [future.result(timeout=120) for future in in_flight]
        assert code == 0, process.stdout.read()[-4000:]
        assert all(outcome in ((500, ["length"]),) or outcome[0] == "error" for outcome in outcomes), outcomes
    finally:
        if process.poll() is None:
            process.kill()


def test_packed_requests_get_each_requests_logits_alone():
    """The packed layout continuous batching hands the model, in one forward: three prompts in one row, positions
    restarting per prompt (the block-diagonal mask built from them), each prompt's logits within float32 tolerance of
    its forward alone; each token's factors turn by its own position."""
    model = decisive_geometry().eval()
    prompts = [random_ids(1, n, seed=n)[0] for n in (5, 11, 17)]
    packed = torch.cat(prompts)[None]
    positions = torch.cat([torch.arange(len(p)) for p in prompts])[None]
    with torch.no_grad():
        logits = model(packed, position_ids=positions, use_cache=False).logits[0]
        alone = [model(p[None], use_cache=False).logits[0] for p in prompts]
    torch.testing.assert_close(logits, torch.cat(alone), rtol=1e-5, atol=1e-5)
