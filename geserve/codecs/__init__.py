"""Tensor encodings shared by every layer: the dtype table and BYTES framing."""
