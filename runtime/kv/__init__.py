"""Paged KV cache: codecs (reference encoders/decoders), page pools and block tables."""
