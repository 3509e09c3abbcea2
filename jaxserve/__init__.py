"""jaxserve: an LLM inference server on JAX/XLA."""
