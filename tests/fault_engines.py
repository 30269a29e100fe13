"""Engines with faults on cue, built inside the engine-core process (``build_server(config,
engine_factory="fault_engines:faulty_engine")``): a request whose prompt starts with ``FAIL_ADD_TOKEN`` is
refused with an unexpected error, and a step that decodes a request whose prompt starts with
``FAIL_STEP_TOKEN`` raises (once per such request)."""
from __future__ import annotations

FAIL_ADD_TOKEN = 251
FAIL_STEP_TOKEN = 250


def faulty_engine(config):
    from moeserve.engine.engine import LLMEngine

    engine = LLMEngine(config)
    real_add, real_launch = engine.add_request, engine.runner.launch
    doomed: set[str] = set()

    def add_request(prompt_token_ids, params=None, request_id=None):
        if prompt_token_ids[0] == FAIL_ADD_TOKEN:
            raise KeyError("injected failure in add_request")
        seq = real_add(prompt_token_ids, params, request_id)
        if prompt_token_ids[0] == FAIL_STEP_TOKEN:
            doomed.add(seq.request_id)
        return seq

    def launch(step):
        hit = [r.request_id for r in step.requests if r.request_id in doomed and r.start > 0]
        if hit:
            doomed.difference_update(hit)
            raise RuntimeError("injected kernel failure")
        return real_launch(step)

    engine.add_request, engine.runner.launch = add_request, launch
    return engine
