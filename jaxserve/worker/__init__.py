"""Model runner side: the persistent batch and padded step inputs (``batch_builder``, numpy), KV
pool sizing and allocation (``kv_cache_alloc``), the jitted step with warm-up (``model_runner``),
and the on-device sampler (``sampler``, ``sampling_metadata``)."""
