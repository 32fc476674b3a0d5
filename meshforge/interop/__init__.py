"""Weights in other systems' formats, read a slice at a time (HF safetensors, arrays in memory)."""
