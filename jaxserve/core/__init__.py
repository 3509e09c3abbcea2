"""Scheduler and paged KV-cache manager: pure Python, no jax (vLLM V1's ``v1/core``).

Modules: ``request`` (Request, RequestStatus, FinishReason), ``sched_output`` (what the
scheduler hands the runner), ``runner_output`` (what the runner hands back),
``engine_core_output`` (what the scheduler hands the engine), ``kv_cache_utils`` /
``block_pool`` / ``kv_cache_manager`` (paged KV cache with prefix caching), ``request_queue``
and ``scheduler``.
"""
