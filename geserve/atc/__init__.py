"""Compiling a `ge` model's ONNX file into an `.om` with CANN's ATC, at load or offline, and caching the result."""
