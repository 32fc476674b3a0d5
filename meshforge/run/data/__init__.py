"""Data a step trains on: the synthetic source, streamed corpora, tokenizers and the loader that picks one."""
