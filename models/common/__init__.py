"""What the model families share: the decoder (attention, RoPE, norms, SwiGLU), the MoE blocks,
HF config and name helpers, TP plans of the decoder, the JAX decoder, the `ModelSpec` type and
the weight adapter's base class."""
