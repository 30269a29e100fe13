"""Operator backends: attention, MoE, linear, sampling, norm, RoPE and activation."""
