"""LLM.generate shows vLLM's progress bar (finished prompts, input and output throughput) on a terminal and
nothing where stderr is captured or piped."""
from moeserve import LLM, SamplingParams


def test_generate_progress_bar_on_a_terminal_only(monkeypatch, capsys):
    llm = LLM(model="tiny", device="cpu", dtype="float32", num_kv_pages=64, max_model_len=64)
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    capsys.readouterr()
    quiet = llm.generate(prompts, params)  # use_tqdm is on by default, as in vLLM
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: treat stderr as a terminal
    shown = llm.generate(prompts, params)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert "input: " in err and "output: " in err and "toks/s" in err
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in quiet]
    assert llm.generate(prompts, params, use_tqdm=False) and capsys.readouterr().err == ""
