"""`kvpipe serve`: an OpenAI-compatible HTTP server over one `kvpipe.Conversation` (the model loaded
and the plan decided once). Requests are checked (`protocol.py`), admitted by the planner
(`admission.py`), queued and run one at a time on the device by a worker thread that reuses the
prefix they share with the previous request (`engine.py`), streamed back as server-sent events
(`app.py`), and counted in Prometheus text (`metrics.py`). Beside that live conversation, the
prefix cache keeps more of them: an LRU over a host-RAM and a disk budget (`prefix_cache.py`)
of KV directories (`cache_store.py`), loaded by the engine instead of prefilling."""
