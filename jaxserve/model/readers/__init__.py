"""Checkpoint readers: a checkpoint's tensors by name, with stored shapes and dtypes
(``base.CheckpointReader``): Hugging Face safetensors, GGUF, our orbax layout."""
