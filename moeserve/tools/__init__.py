"""Tools around the engine: ``moeserve precompile`` and ``moeserve install-kernels`` (FlashInfer kernel
artifacts), ``moeserve env`` (what this machine can run), and the FP8 checkpoint export."""
