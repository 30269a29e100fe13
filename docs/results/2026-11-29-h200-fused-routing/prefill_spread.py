"""Does a 512-token prefill take longer after the GPU has idled? (run as committed here, on the H200)

Qwen3-30B-A3B in block FP8 with dummy weights; the model directory holds the config.json that
``python3 -c "from moeserve.quant.export import write_fp8_config as w; w('qwen3-30b-a3b', '$HOME/m/qwen3-30b-a3b-fp8')"``
writes, and ``~/fi-full`` is the kernel cache of ``moeserve precompile``. Each line times five calls of
``LLM.generate`` with one 512-token prompt and ``max_tokens=1`` (host clock), back to back, after an idle
pause, and after an idle pause followed by 50 ms of large matmuls; it prints the SM clock, memory clock
and power before the call. Output: ``prefill-spread.txt``.
"""
import os, subprocess, time, statistics, torch
from moeserve import LLM, SamplingParams
home = os.path.expanduser("~")
llm = LLM(model=f"{home}/m/qwen3-30b-a3b-fp8", load_format="dummy", max_model_len=4096, max_num_seqs=64,
          kernel_cache_dir=f"{home}/fi-full")
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(0, 150000, (512,), generator=g).tolist()} for _ in range(40)]
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
def clocks():
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()
def spin(ms):
    t = time.perf_counter()
    while time.perf_counter() - t < ms / 1e3:
        a @ a
    torch.cuda.synchronize()
it = iter(prompts)
for _ in range(3):
    llm.generate(next(it), sp)
for name, idle, busy in [("back to back", 0, 0), ("after 0.5 s idle", 0.5, 0), ("after 2 s idle", 2.0, 0),
                         ("after 2 s idle + 50 ms matmul", 2.0, 50)]:
    ts = []
    for _ in range(5):
        time.sleep(idle)
        c = clocks() if idle else ""
        if busy:
            spin(busy)
        t = time.perf_counter(); llm.generate(next(it), sp); ts.append(1e3 * (time.perf_counter() - t))
    print(f"{name:32s} ms: {' '.join(f'{x:6.1f}' for x in ts)}  median {statistics.median(ts):6.1f}   clocks before: {c}")
