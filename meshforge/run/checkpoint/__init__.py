"""Distributed checkpoints (DCP) and what a rank contributes to them."""
