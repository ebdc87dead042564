"""`kvpipe serve`: an OpenAI-compatible HTTP server over one `kvpipe.Conversation` (the model loaded
and the plan decided once). Requests are checked (`protocol.py`), admitted by the planner
(`admission.py`), queued and run one at a time on the device by a worker thread that reuses the
prefix they share with the previous request (`engine.py`), streamed back as server-sent events
(`app.py`), and counted in Prometheus text (`metrics.py`). `prefix_cache.py` is the LRU of kept
prompt KV over a host-RAM and a disk budget, written against a small store interface (not yet
used by the engine)."""
