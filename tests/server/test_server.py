"""The OpenAI-compatible server, started for real (uvicorn on a free port, tiny random checkpoint, CPU,
the engine core in a child process), seen through the official ``openai`` client and raw HTTP: shapes,
streaming framing, concurrency, disconnects, queue limits, engine failures, and agreement with
``LLM.generate``."""
import asyncio
import json
import time

import httpx
import openai
import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import make_config
from moeserve.server.cli import BackgroundServer, build_server
from moeserve.server.metrics import parse_metrics
from moeserve.server.protocol import ChatCompletionChunk, CompletionChunk
from fault_engines import FAIL_ADD_TOKEN, FAIL_STEP_TOKEN
from tokenizer_utils import make_tiny_model

MAX_MODEL_LEN = 128


def tiny_config(model_dir, **server):
    return make_config(model=str(model_dir), dtype="float32", device="cpu", max_num_seqs=8, page_size=4,
                       num_kv_pages=300, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256,
                       enforce_eager=True, server={"served_model_name": "tiny-moe", **server})


class Handle:
    def __init__(self, srv: BackgroundServer, config):
        self.srv, self.url, self.config = srv, srv.url, config
        self.state = srv.app.state.server
        self.client = self.state.client
        self.tokenizer = self.state.tokenizer

    def metrics(self) -> dict:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def load(self) -> dict:
        return self.client.load()

    def wait_pool_full(self, timeout: float = 5.0) -> None:
        """Every KV page back and no request left in the engine core (as it last reported)."""
        deadline = time.monotonic() + timeout
        while (self.load()["kv_pages_used"] or self.load()["sequences"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        load = self.load()
        assert load["kv_pages_used"] == 0 and load["sequences"] == 0, load


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny_server"))
    config = tiny_config(model_dir, max_queue_len=64)
    with BackgroundServer(build_server(config, engine_factory="fault_engines:faulty_engine")) as srv:
        yield Handle(srv, config)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(raw: str) -> list[str]:
    """The payloads of ``data: ...`` events; asserts the framing (every event ends with a blank line)."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def test_models_health_and_metrics_endpoints(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-moe"]
    m = server.metrics()
    assert m["moeserve_kv_pages_total"] == server.load()["kv_pages_total"] == 299
    assert m["moeserve_kv_pages_used"] == 0
    assert m["moeserve_num_requests_running"] == 0 and m["moeserve_num_requests_waiting"] == 0


def test_completion_with_openai_client(server, client):
    before = server.metrics()
    out = client.completions.create(model="tiny-moe", prompt="hello world", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == "tiny-moe"
    assert len(out.choices) == 1 and out.choices[0].index == 0 and out.choices[0].finish_reason == "length"
    assert isinstance(out.choices[0].text, str) and out.choices[0].text
    prompt_len = len(server.tokenizer.encode("hello world"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (prompt_len, 6,
                                                                                              prompt_len + 6)
    after = server.metrics()
    assert after['moeserve_requests_total{model_name="tiny-moe",outcome="length"}'] == \
        before['moeserve_requests_total{model_name="tiny-moe",outcome="length"}'] + 1
    assert after["moeserve_generation_tokens_total"] - before["moeserve_generation_tokens_total"] == 6
    assert after["moeserve_prompt_tokens_total"] - before["moeserve_prompt_tokens_total"] == prompt_len
    assert after["moeserve_time_to_first_token_seconds_count"] == before["moeserve_time_to_first_token_seconds_count"] + 1
    assert after["moeserve_inter_token_latency_seconds_count"] == before["moeserve_inter_token_latency_seconds_count"] + 5
    # the time to first token split: the engine's queue and prefill (measured in the core), the hand-off (the rest)
    grew = {n: after[f"moeserve_{n}_sum"] - before[f"moeserve_{n}_sum"] for n in (
        "time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_handoff_time_seconds")}
    for n in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_handoff_time_seconds"):
        assert after[f"moeserve_{n}_count"] == before[f"moeserve_{n}_count"] + 1 and grew[n] >= 0
    assert grew["request_prefill_time_seconds"] > 0
    parts = grew["request_queue_time_seconds"] + grew["request_prefill_time_seconds"] + \
        grew["request_handoff_time_seconds"]
    assert parts == pytest.approx(grew["time_to_first_token_seconds"], abs=1e-6)


def test_greedy_output_equals_llm_generate(server):
    """The server and the offline API, same checkpoint and config: same greedy tokens and text."""
    llm = LLM(config=server.config)
    text_prompt, id_prompt = "the quick brown fox", [7, 99, 3, 150, 42, 8]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate([text_prompt, {"prompt_token_ids": id_prompt}], params)
    for prompt, expected in zip([text_prompt, id_prompt], want):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert got["token_ids"] == expected.outputs[0].token_ids
        assert got["text"] == expected.outputs[0].text
        streamed = httpx.post(server.url + "/v1/completions", json=body | {"stream": True}, timeout=60).text
        chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected.outputs[0].token_ids
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected.outputs[0].text


def test_stop_string_ends_the_text_before_it_streamed_or_not(server):
    body = {"prompt": "tell me a story", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    url = server.url + "/v1/completions"
    free = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    stop = free.split()[3]
    expected = free[:free.find(stop)]
    plain = httpx.post(url, json=body | {"stop": [stop, "never-seen"]}, timeout=60).json()["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == (expected, "stop")
    chunks = [json.loads(e) for e in sse_events(httpx.post(url, json=body | {"stop": stop, "stream": True},
                                                          timeout=60).text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_stream_framing_and_usage(server):
    body = {"model": "tiny-moe", "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk, token_chunks = chunks[-1], chunks[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in token_chunks)
    for c in chunks:
        CompletionChunk.model_validate(c)  # the documented chunk shape
    assert len({c["id"] for c in chunks}) == 1
    finish = [c["choices"][0]["finish_reason"] for c in token_chunks]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])

    plain = httpx.post(server.url + "/v1/completions", json=body | {"stream_options": None}, timeout=60)
    assert all(json.loads(e)["choices"] for e in sse_events(plain.text)[:-1]), "no usage chunk unless asked"

    running = body | {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [json.loads(e) for e in sse_events(httpx.post(server.url + "/v1/completions", json=running).text)[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[0]["usage"]["prompt_tokens"] == 3


def test_chat_with_openai_client_stream_and_not(server, client):
    messages = [{"role": "system", "content": "you are a robot"}, {"role": "user", "content": "tell me a story"}]
    full = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=7, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    template = server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(server.tokenizer.encode(template, add_special_tokens=False))
    assert full.usage.completion_tokens == 7

    chunks = list(client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=7, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump(exclude_none=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"


def test_batched_prompts_and_n(server):
    body = {"prompt": ["hello world", "the lazy dog"], "n": 2, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    ids = [c["token_ids"] for c in out["choices"]]
    assert ids[0] == ids[1] and ids[2] == ids[3], "greedy choices of one prompt agree"
    tok = server.tokenizer
    assert out["usage"]["prompt_tokens"] == len(tok.encode("hello world")) + len(tok.encode("the lazy dog"))
    assert out["usage"]["completion_tokens"] == 16
    lists = httpx.post(server.url + "/v1/completions", json={"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2,
                                                           "ignore_eos": True}, timeout=60).json()
    assert len(lists["choices"]) == 2 and lists["usage"]["prompt_tokens"] == 5


async def _stream_tokens(client: httpx.AsyncClient, url: str, prompt, max_tokens: int) -> tuple[int, int, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    tokens, usage, last = 0, None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line[6:]
                if last != "[DONE]":
                    chunk = json.loads(last)
                    tokens += sum(len(c["token_ids"]) for c in chunk["choices"])
                    usage = chunk["usage"] or usage
    return tokens, usage["completion_tokens"], last


def test_32_concurrent_streams_all_complete(server):
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(_stream_tokens(c, server.url, [1 + i, 2, 3 + i], 8) for i in range(32)))

    results = asyncio.run(main())
    assert results == [(8, 8, "[DONE]")] * 32
    server.wait_pool_full()


def _abort_count(server) -> float:
    return server.metrics()['moeserve_requests_total{model_name="tiny-moe",outcome="abort"}']


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    aborted = _abort_count(server)
    body = {"prompt": [9, 8, 7], "max_tokens": 120, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
        assert server.load()["kv_pages_used"] > 0
    server.wait_pool_full()
    assert _abort_count(server) == aborted + 1
    assert server.load()["running"] == 0


def test_client_disconnect_without_streaming_aborts(server):
    aborted = _abort_count(server)
    body = {"prompt": [9, 8, 7, 6], "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    server.wait_pool_full()
    deadline = time.monotonic() + 5
    while _abort_count(server) == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abort_count(server) == aborted + 1


def test_full_queue_answers_503_and_accepted_requests_finish(server):
    """Running requests do not count against server.max_queue_len; waiting and queued ones do."""
    async def one(c: httpx.AsyncClient, i: int, max_tokens: int):
        body = {"prompt": [3, 4, i], "max_tokens": max_tokens, "ignore_eos": True}
        r = await c.post(server.url + "/v1/completions", json=body)
        return r.status_code, r.json()

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            long = [asyncio.create_task(one(c, i, 100)) for i in range(8)]  # fill the batch (max_num_seqs 8)
            deadline = time.monotonic() + 30  # a loaded machine takes a while to admit all 8
            while server.load()["running"] < 8 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            server.client.max_queue_len = 2
            running = server.load()["running"]
            extra = await asyncio.gather(*(one(c, 100 + i, 4) for i in range(6)))
            return running, await asyncio.gather(*long), extra

    try:
        running, long, extra = asyncio.run(main())
    finally:
        server.client.max_queue_len = 64
    assert running == 8
    assert all(status == 200 and b["usage"]["completion_tokens"] == 100 for status, b in long)
    refused = [b for status, b in extra if status == 503]
    accepted = [b for status, b in extra if status == 200]
    assert len(accepted) >= 2 and refused and len(refused) + len(accepted) == 6
    assert all(b["error"]["code"] == "queue_full" and "max_queue_len" in b["error"]["message"] for b in refused)
    assert all(b["usage"]["completion_tokens"] == 4 for b in accepted)
    server.wait_pool_full()
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_failing_engine_step_fails_its_requests_and_the_server_keeps_serving(server):
    """The engine core runs ``fault_engines.faulty_engine``: decoding a prompt that starts with
    FAIL_STEP_TOKEN raises inside the step."""
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": [FAIL_STEP_TOKEN, 5, 5], "max_tokens": 8,
                                                           "ignore_eos": True}, timeout=60)
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "injected kernel failure" in err["message"]
    server.wait_pool_full()
    good = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 5, 5], "max_tokens": 3, "ignore_eos": True},
                      timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    assert server.metrics()['moeserve_requests_total{model_name="tiny-moe",outcome="error"}'] >= 1


def test_failing_add_request_is_a_500_for_that_request_only(server):
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": [FAIL_ADD_TOKEN, 1], "max_tokens": 2,
                                                           "stream": True}, timeout=60)
    events = sse_events(bad.text)
    assert json.loads(events[0])["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    assert "injected failure" in json.loads(events[0])["error"]["message"]
    good = httpx.post(server.url + "/v1/completions", json={"prompt": [14, 1], "max_tokens": 2}, timeout=60)
    assert good.status_code == 200
    server.wait_pool_full()


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_prefix_cache_metrics(server):
    """Prefix caching (on by default): the second request of the same 21-token prompt finds its 5 full pages
    of 4 tokens (20 tokens) in the cache; usage and both metric names say so."""
    prompt = list(range(40, 61))
    before = server.metrics()
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    second = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get("moeserve_prefix_cache_hits_total", 0) - before.get("moeserve_prefix_cache_hits_total", 0) >= 20:
            break
        time.sleep(0.05)
    for name in ("moeserve_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"):
        assert m[name] - before.get(name, 0) == 2 * len(prompt), name
    for name in ("moeserve_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"):
        assert m[name] - before.get(name, 0) == 20, name
