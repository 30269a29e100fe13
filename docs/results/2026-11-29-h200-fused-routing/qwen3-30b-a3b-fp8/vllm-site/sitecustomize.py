"""Written by moeserve bench: load FlashInfer modules from a moeserve kernel cache in every process
of a vLLM baseline worker (vLLM's engine core runs in a child process)."""
import os

if os.environ.get("MOESERVE_VLLM_KERNEL_CACHE"):
    try:
        from moeserve.kernels import jit_hook, use_kernel_cache
        use_kernel_cache(os.environ["MOESERVE_VLLM_KERNEL_CACHE"], None)
        jit_hook.install()
    except Exception as e:
        print(f"[bench] moeserve kernel cache not used in pid {os.getpid()}: {e!r}", flush=True)
