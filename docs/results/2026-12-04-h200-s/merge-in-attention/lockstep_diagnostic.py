import sys, torch, tempfile
sys.path.insert(0, "tests")
from hf_models import make_checkpoint
from lockstep import lockstep
from moeserve.config import make_config
from moeserve.engine.engine import LLMEngine
GPU_QWEN2 = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=128,
                 intermediate_size=256, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                 vocab_size=512, initializer_range=0.05)
TORCH_OPS = ("attention", "moe", "routing", "norm", "rope", "activation", "sampling", "linear")
fast = {k: "flashinfer" for k in ("attention", "norm", "rope", "activation", "sampling")} | {"moe": "triton"}
PROMPT_LENS = [5, 40, 130, 17, 66]
for seed in (31, 32):
    d = tempfile.mkdtemp()
    make_checkpoint("qwen2_moe", d, seed=seed, **GPU_QWEN2)
    def eng(b, eager, **o):
        return LLMEngine(make_config(model=d, dtype="bfloat16", device="cuda", backends=b, page_size=16,
                         max_num_batched_tokens=96, num_kv_pages=48, max_model_len=384, max_num_seqs=1,
                         enforce_eager=eager, cuda_graph_batch_sizes=[1], **o))
    g = torch.Generator().manual_seed(33)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    for name, a, b in (("off-vs-torch", dict(attention_layer_kernel=False), None),
                       ("on-vs-torch", dict(attention_layer_kernel=True), None),
                       ("on-vs-off", dict(attention_layer_kernel=True), dict(attention_layer_kernel=False))):
        x = eng(fast, False, **a)
        y = eng({k: "torch" for k in TORCH_OPS}, True) if b is None else eng(fast, False, **b)
        r = lockstep(x, y, prompts, 10, follow="fast")
        print(f"seed {seed} {name}: worst cos {r.worst:.4f} agreement {r.agreement:.3f} graph steps {r.graph_steps}", flush=True)
        del x, y; torch.cuda.empty_cache()
