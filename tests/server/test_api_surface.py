"""What a vLLM user expects of the server beyond generation: log-probabilities in OpenAI's shapes (read by
the ``openai`` client, streamed and not, equal to transformers' float32 log-softmax of the same checkpoint),
``echo`` with prompt log-probabilities (lm-eval's loglikelihood request), /tokenize and /detokenize,
/version, defaults from generation_config.json, --chat-template, and metrics under vLLM's names."""
import json

import httpx
import openai
import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.server.cli import BackgroundServer, build_server
from moeserve.server.metrics import parse_metrics
from test_server import Handle, sse_events, tiny_config
from tokenizer_utils import make_tiny_model

TOL = 1e-4
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}" \
           "[assistant]{% endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_api"))
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 7, "max_new_tokens": 6,
                                                             "repetition_penalty": 1.3}))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    config = tiny_config(model_dir, chat_template=TEMPLATE)
    with BackgroundServer(build_server(config)) as srv:
        yield Handle(srv, config)


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def text_of(server, tid: int) -> str:
    return server.tokenizer.decode([tid])


def test_completion_logprobs_match_transformers_with_and_without_streaming(server, client, hf):
    prompt = [12, 13, 40, 41, 42]
    full = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = full.choices[0]
    ids = choice.token_ids
    ref = ref_logprobs(hf, prompt + ids)
    lp = choice.logprobs
    assert lp.tokens == [text_of(server, t) for t in ids]
    for i, t in enumerate(ids):
        want = ref[len(prompt) - 1 + i]
        assert abs(lp.token_logprobs[i] - want[t].item()) < TOL
        top = torch.topk(want, 3)
        for tid, value in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(lp.top_logprobs[i][text_of(server, tid)] - value) < TOL
        assert len(lp.top_logprobs[i]) <= 4
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(ids))]

    chunks = list(client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_echo_gives_prompt_logprobs_first_null(server, client, hf):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0: the prompt alone, each token scored."""
    prompt = "the quick brown fox jumps"
    ids = server.tokenizer.encode(prompt)
    out = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [text_of(server, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = ref_logprobs(hf, ids)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < TOL
    chunks = list(client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt) and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == len(ids) + 2


def test_prompt_logprobs_extension(server, hf):
    prompt = [20, 21, 22, 23]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2},
                   timeout=60).json()
    pl = r["choices"][0]["prompt_logprobs"]
    ref = ref_logprobs(hf, prompt)
    assert pl[0] is None and len(pl) == len(prompt)
    for p in range(1, len(prompt)):
        entry = pl[p][str(prompt[p])]
        assert abs(entry["logprob"] - ref[p - 1, prompt[p]].item()) < TOL
        assert entry["rank"] == int((ref[p - 1] >= ref[p - 1, prompt[p]]).sum())


def test_chat_logprobs_in_the_chat_shape(server, client, hf):
    messages = [{"role": "user", "content": "tell me a story"}]
    full = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True,
                                                                                     "return_token_ids": True})
    content = full.choices[0].logprobs.content
    ids = full.choices[0].token_ids
    prompt_ids = server.tokenizer.encode(server.state.chat_template and server.tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    ref = ref_logprobs(hf, prompt_ids + ids)
    assert [c.token for c in content] == [text_of(server, t) for t in ids]
    for i, (c, t) in enumerate(zip(content, ids)):
        want = ref[len(prompt_ids) - 1 + i]
        assert abs(c.logprob - want[t].item()) < TOL and c.bytes == list(c.token.encode())
        top = torch.topk(want, 2)
        assert [x.token for x in c.top_logprobs] == [text_of(server, tid) for tid in top.indices.tolist()]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOL)
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.logprob for x in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    plain = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_tokenize_round_trips_with_detokenize(server):
    text = "hello world how are you today"
    tok = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == server.tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 128
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}).json()
    assert httpx.post(server.url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == \
        server.tokenizer.decode(server.tokenizer.encode("[user] hello [assistant]"))
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [1, 999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={}).status_code == 400


def test_version(server):
    from moeserve import __version__
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_generation_config_defaults_apply_when_the_request_leaves_them_out(server):
    """generation_config.json says temperature 0 (greedy): a request without temperature is greedy."""
    body = {"prompt": [30, 31, 32], "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    default = [httpx.post(server.url + "/v1/completions", json=body | {"seed": s}).json() for s in (1, 2)]
    greedy = httpx.post(server.url + "/v1/completions", json=body | {"temperature": 0}).json()
    sampled = [httpx.post(server.url + "/v1/completions", json=body | {"temperature": 1.5, "seed": s}).json()
               for s in (1, 2, 3)]
    ids = [r["choices"][0]["token_ids"] for r in default]
    assert ids[0] == ids[1] == greedy["choices"][0]["token_ids"]
    assert any(r["choices"][0]["token_ids"] != ids[0] for r in sampled)


def test_generation_config_max_new_tokens_is_the_default_output_limit(server):
    """max_new_tokens 6 in generation_config.json bounds the output as vLLM does: a chat request without
    max_tokens (whose limit is otherwise the context left) and a completion asking for 9 stop after 6 tokens;
    one asking for 4 gets 4."""
    body = {"prompt": [30, 31, 32], "ignore_eos": True, "return_token_ids": True}
    asked = httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": 9}).json()
    assert len(asked["choices"][0]["token_ids"]) == 6 and asked["choices"][0]["finish_reason"] == "length"
    fewer = httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": 4}).json()
    assert len(fewer["choices"][0]["token_ids"]) == 4
    chat = httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 6


def test_llm_chat_and_defaults_offline(model_dir, server):
    llm = LLM(config=server.config)
    assert llm.get_default_sampling_params().temperature == 0.0 and llm.get_default_sampling_params().top_k == 7
    assert llm.get_default_sampling_params().max_tokens == 6
    messages = [{"role": "user", "content": "tell me a story"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), chat_template=TEMPLATE)[0]
    want = llm.generate({"prompt_token_ids": server.tokenizer.encode("[user] tell me a story [assistant]",
                                                                     add_special_tokens=False)},
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    served = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                                   "temperature": 0, "ignore_eos": True,
                                                                   "return_token_ids": True}).json()
    assert served["choices"][0]["token_ids"] == out.outputs[0].token_ids, "--chat-template is the one applied"


def test_metrics_under_vllm_names(server):
    before = parse_metrics(httpx.get(server.url + "/metrics").text)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True,
                                                         "stream": True})
    assert sse_events(r.text)[-1] == "[DONE]"
    m = parse_metrics(httpx.get(server.url + "/metrics").text)
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert m[name] == before.get(name, 0) + 1, name
    for name in ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"):
        assert m[name] == before.get(name, 0) + 3, name
    assert m["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 4
    assert m["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == 3
    key = 'vllm:request_success_total{finished_reason="length",model_name="tiny-moe"}'
    assert m[key] == before.get(key, 0) + 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in m
    assert m["vllm:kv_cache_usage_perc"] == 0.0
