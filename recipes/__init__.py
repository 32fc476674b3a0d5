"""Recipes shipped with meshforge (TOML data; this file only makes them importable resources)."""
