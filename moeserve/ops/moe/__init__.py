"""Mixture-of-experts: routing and the expert computation backends."""
