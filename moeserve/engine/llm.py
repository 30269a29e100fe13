"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from moeserve.config import EngineConfig, make_config
from moeserve.engine.engine import LLMEngine
from moeserve.engine.requests import RequestError
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.tokenizer import apply_chat_template, generation_defaults, load_chat_template
from moeserve.progress import progress_bar


class LLM:
    """An engine for offline batches.

    ``LLM(model="tiny")`` runs the embedded tiny model; ``model`` may also be a preset name, a directory
    holding config.json (and safetensors and a tokenizer), a config.json path, or a Hugging Face model id
    (``Qwen/Qwen1.5-MoE-A2.7B``: fetched into the Hugging Face cache, or found there offline). Other keyword
    arguments are engine config fields (``max_num_seqs=8``, ``backends={"moe": "triton"}``, ...).
    """

    def __init__(self, model: str = "tiny", load_format: str = "auto", dtype: str = "auto", device: str = "auto",
                 config: EngineConfig | None = None, **engine_options: Any):
        if config is None:
            config = make_config(model=model, load_format=load_format, dtype=dtype, device=device, **engine_options)
        self.engine = LLMEngine(config)
        self.config = config

    def shutdown(self) -> None:
        """Stop the engine's other ranks (tensor_parallel_size > 1); the object is unusable afterwards."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's ``generation_config.json`` defaults (temperature, top_p,
        top_k, min_p, and max_new_tokens as max_tokens) applied, as vLLM's ``--generation-config auto``."""
        defaults = generation_defaults(self.engine.source.config_dir, self.config.generation_config)
        return SamplingParams(**defaults)

    def _prompt_ids(self, i: int, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                return prompt, self.engine.tokenize(prompt)
            except RequestError as e:
                raise RequestError(f"prompts[{i}]: {e}") from None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self._prompt_ids(i, prompt["prompt"])
        raise RequestError(f"prompts[{i}]: must be a string or a dict with 'prompt_token_ids', "
                           f"got {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is checked before any is queued, so a bad one
        raises ``RequestError`` naming its index and the engine is left as it was.

        ``use_tqdm`` shows a progress bar of finished requests with the input and output throughput, as
        vLLM's does, when stderr is a terminal (a pipe, a log file or a test's captured output gets none)."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        parsed = [self._prompt_ids(i, p) for i, p in enumerate(prompts)]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        for i, ((_, ids), sp, salt) in enumerate(zip(parsed, params, salts)):
            try:
                self.engine.validate(ids, sp)
                if salt is not None and not isinstance(salt, str):
                    raise RequestError(f"cache_salt: must be a string, got {type(salt).__name__}")
            except RequestError as e:
                raise RequestError(f"prompts[{i}]: {e}") from None
        engine = self.engine
        groups = []  # per prompt: its sub-requests (n of them)
        for (text, ids), sp, salt in zip(parsed, params, salts):
            subs = []
            for j in range(sp.n):
                sub = sp if sp.n == 1 else dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j)
                subs.append(engine.add_request(ids, sub, cache_salt=salt))
            groups.append((text, subs))
        total = sum(len(s) for _, s in groups)
        with progress_bar("Processed prompts", total, fields={"speed": ""}, show_fields="{task.fields[speed]}",
                          enabled=None if use_tqdm else False) as advance:
            t0 = time.perf_counter()
            pending = {s.request_id for _, subs in groups for s in subs}
            prompt_tokens = output_tokens = 0
            while pending:
                for seq in engine.step():
                    if seq.is_finished and seq.request_id in pending:
                        pending.discard(seq.request_id)
                        prompt_tokens += seq.num_prompt_tokens
                        output_tokens += seq.num_generated
                        dt = max(time.perf_counter() - t0, 1e-9)
                        advance(speed=f"input: {prompt_tokens / dt:,.2f} toks/s, output: {output_tokens / dt:,.2f} "
                                "toks/s")
                if not engine.has_unfinished() and pending:
                    raise RuntimeError(f"requests {sorted(pending)} were dropped by the scheduler")
        results = []
        for text, subs in groups:
            outs = [engine.output(s, text, index=j) for j, s in enumerate(subs)]
            first = outs[0]
            first.outputs = [o.outputs[0] for o in outs]
            for j, c in enumerate(first.outputs):
                c.index = j
            results.append(first)
        return results

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to conversations: ``messages`` is one conversation (a list of ``{"role",
        "content"}`` dicts) or a list of them. The model's chat template applies unless ``chat_template``
        (inline or a file) is given; the prompt is the template's text, tokenized as vLLM does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = load_chat_template(chat_template)
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                ids = apply_chat_template(self.engine.tokenizer, conv, template, add_generation_prompt,
                                          **(chat_template_kwargs or {}))
            except ValueError as e:
                raise RequestError(f"messages[{i}]: {e}" if len(conversations) > 1 else str(e)) from None
            prompts.append({"prompt_token_ids": ids, "prompt": None})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
