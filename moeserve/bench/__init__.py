"""Benchmarks: the offline static/mixed workloads (moeserve beside vLLM), the roofline, the kernel
cross-check, and the report (terminal table, JSON, markdown, plots) every benchmark writes through.

``moeserve bench`` runs the offline benchmark; ``moeserve bench kernels`` the kernel bench;
``moeserve compare A.json B.json`` prints two result files side by side.
"""
