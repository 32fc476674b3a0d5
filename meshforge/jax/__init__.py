"""meshforge.jax: the torch -> JAX bridge (arrays, weights, shardings, parity) and the JAX
trainer (`backend=jax`). Needs the `jax` extra."""
