"""Prometheus metrics with Triton's names, labels and text, from the models' statistics."""
