"""The KV store: every (layer, KV head) unit's buffers in its tier (GPU, pinned host RAM, disk),
the transfer slots offloaded groups are fetched into, their layout, and the pinned host arena."""
