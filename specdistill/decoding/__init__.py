"""Lossless speculative decoding: sampling warpers, the engine, draft-length policies and statistics."""
