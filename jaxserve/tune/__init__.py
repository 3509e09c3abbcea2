"""``jaxserve tune``: replay a workload through the real scheduler with a calibrated step-time
model, over a grid of scheduler settings, and recommend one under latency SLOs.

* ``trace``: presets (qa, long-doc, mixed, multi-turn) and JSONL traces as request lists;
* ``step_model``: step seconds from padded shapes, batch size and context, fitted to a
  calibration run of the real engine;
* ``simulate``: the replay through ``Scheduler`` + ``KVCacheManager`` on a virtual clock;
* ``grid``: the grid of settings replayed, the table, the recommendation, JSON and plot;
  the ``jaxserve tune`` parser.
"""
