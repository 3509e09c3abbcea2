"""Multi-LoRA serving (#33): PEFT adapters read and checked on the host (``peft``), kept in a
host tier and a device pool of slots (``manager``); the delta itself is computed at the
``Linear`` seam (``jaxserve.model.layers.lora``)."""
