"""Bad requests against the real server: each gets its 4xx in OpenAI's error format naming the parameter,
nothing reaches the engine, and the server keeps serving. Also the API key."""
import httpx
import pytest

from moeserve.server.cli import BackgroundServer, build_server
from test_server import MAX_MODEL_LEN, Handle, tiny_config
from tokenizer_utils import make_tiny_model

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny_errors"), vocab_size=VOCAB)
    config = tiny_config(model_dir, api_key=KEY, max_queue_len=16)
    with BackgroundServer(build_server(config)) as srv:
        yield Handle(srv, config)


def post(server, path, body=None, content=None, headers=AUTH):
    h = dict(headers)
    if content is not None:
        h["content-type"] = "application/json"
    return httpx.post(server.url + path, json=body, content=content, headers=h, timeout=60)


def assert_error(r, status: int, param, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def good_completion(server):
    r = post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


C = {"prompt": "hello world", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

BAD_COMPLETIONS = [
    # wrong types
    (C | {"max_tokens": "5"}, "max_tokens"), (C | {"temperature": "hot"}, "temperature"),
    (C | {"top_p": [1]}, "top_p"), (C | {"top_k": 2.5}, "top_k"), (C | {"min_p": "0.1"}, "min_p"),
    (C | {"seed": "7"}, "seed"), (C | {"n": 1.5}, "n"), (C | {"stream": "yes"}, "stream"),
    (C | {"stop": 5}, "stop"), (C | {"stop_token_ids": ["a"]}, "stop_token_ids[0]"), (C | {"ignore_eos": 1}, "ignore_eos"),
    (C | {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": 5}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"max_tokens": 3}, "prompt"),
    (C | {"user": 3}, "user"),
    # out of range
    (C | {"max_tokens": 0}, "max_tokens"), (C | {"max_tokens": -3}, "max_tokens"),
    (C | {"temperature": -0.5}, "temperature"), (C | {"temperature": 1000.0}, "temperature"),
    (C | {"top_p": 0.0}, "top_p"), (C | {"top_p": 1.5}, "top_p"), (C | {"top_k": -2}, "top_k"),
    (C | {"min_p": 1.5}, "min_p"), (C | {"min_p": -0.1}, "min_p"), (C | {"seed": -1}, "seed"),
    (C | {"n": 0}, "n"), (C | {"n": 1000}, "n"), (C | {"min_tokens": -1}, "min_tokens"),
    (C | {"min_tokens": 9}, "min_tokens"), (C | {"stop": [""]}, "stop"), (C | {"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": [1, VOCAB]}, "prompt"), ({"prompt": [-1, 2]}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"), ({"prompt": [[1, 2], []]}, "prompt"),
    # unsupported
    (C | {"logprobs": 21}, "logprobs"), (C | {"logprobs": -1}, "logprobs"), (C | {"prompt_logprobs": 30}, "prompt_logprobs"),
    (C | {"echo": "yes"}, "echo"), (C | {"max_tokens": 0, "echo": False}, "max_tokens"), (C | {"suffix": "x"}, "suffix"), (C | {"best_of": 3}, "best_of"), (C | {"logit_bias": {"1": 2.0}}, "logit_bias"),
    (C | {"presence_penalty": 0.5}, "presence_penalty"), (C | {"frequency_penalty": -1.0}, "frequency_penalty"),
    (C | {"repetition_penalty": 1.2}, "repetition_penalty"), (C | {"stream_options": {"include_usage": True}},
                                                              "stream_options"),
]

BAD_CHATS = [
    ({"messages": "hi"}, "messages"), ({"messages": []}, "messages"), ({"max_tokens": 3}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    (CHAT | {"max_completion_tokens": 0}, "max_completion_tokens"), (CHAT | {"max_tokens": -1}, "max_tokens"),
    (CHAT | {"logprobs": 1}, "logprobs"), (CHAT | {"top_logprobs": 2}, "top_logprobs"),
    (CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT | {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT | {"temperature": -1}, "temperature"), (CHAT | {"stop": [1]}, "stop"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_completion_parameters(server, body, param):
    err = assert_error(post(server, "/v1/completions", body), 400, param)
    assert param.split(".")[0].split("[")[0] in err["message"]


@pytest.mark.parametrize("body,param", BAD_CHATS, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_chat_parameters(server, body, param):
    err = assert_error(post(server, "/v1/chat/completions", body), 400, param)
    assert param.split(".")[0].split("[")[0] in err["message"]


@pytest.mark.parametrize("content", ['{"prompt": "hi"', "[1, 2]", "", "null", '"text"', "{'prompt': 1}"])
def test_malformed_bodies(server, content):
    assert_error(post(server, "/v1/completions", content=content), 400, None)
    assert_error(post(server, "/v1/chat/completions", content=content), 400, None)


def test_unknown_model_is_404_model_not_found(server):
    assert_error(post(server, "/v1/completions", C | {"model": "gpt-4"}), 404, "model", "model_not_found")
    assert_error(post(server, "/v1/chat/completions", CHAT | {"model": "gpt-4"}), 404, "model", "model_not_found")


def test_context_length_errors_name_both_lengths(server):
    err = assert_error(post(server, "/v1/completions", {"prompt": [1] * 200}), 400, "prompt")
    assert "200" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    err = assert_error(post(server, "/v1/completions", {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}), 400, "prompt")
    assert str(MAX_MODEL_LEN) in err["message"]
    err = assert_error(post(server, "/v1/completions", {"prompt": [1] * 100, "max_tokens": 50}), 400, "max_tokens")
    assert all(s in err["message"] for s in ("100", "50", str(MAX_MODEL_LEN)))
    err = assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 150}]}),
                       400, "messages")
    assert str(MAX_MODEL_LEN) in err["message"]
    err = assert_error(post(server, "/v1/chat/completions", CHAT | {"max_completion_tokens": 500}), 400,
                       "max_completion_tokens")
    assert "500" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    ok = post(server, "/v1/completions", {"prompt": [1] * 100, "max_tokens": 28, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 28


def test_chat_needs_a_tokenizer_with_a_chat_template(server, monkeypatch):
    monkeypatch.setattr(server.state.tokenizer, "chat_template", None)
    err = assert_error(post(server, "/v1/chat/completions", CHAT), 400, "messages")
    assert "chat template" in err["message"]
    monkeypatch.setattr(server.state, "tokenizer", None)
    err = assert_error(post(server, "/v1/chat/completions", CHAT), 400, "messages")
    assert "tokenizer" in err["message"]
    err = assert_error(post(server, "/v1/completions", C), 400, "prompt")
    assert "tokenizer" in err["message"]
    good_completion(server)  # token ids still work without a tokenizer


def test_api_key_is_required_on_v1_routes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = post(server, "/v1/completions", C, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny-moe"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_unknown_fields_are_ignored_and_unknown_routes_are_404(server):
    r = post(server, "/v1/completions", C | {"not_an_openai_field": {"x": 1}, "user": "someone"})
    assert r.status_code == 200
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_server_is_unharmed_by_all_of_the_above(server):
    """Runs last: no bad request reached the engine or left pages behind, and good requests still work."""
    good_completion(server)
    stream = post(server, "/v1/chat/completions", CHAT | {"stream": True})
    assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
    server.wait_pool_full()
    assert server.load()["waiting"] == 0
    m = server.metrics()
    assert m['moeserve_requests_rejected_total{model_name="tiny-moe",status="400"}'] >= len(BAD_COMPLETIONS)
    assert m['moeserve_requests_total{model_name="tiny-moe",outcome="error"}'] == 0
