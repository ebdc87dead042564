"""Several GPUs (or CPU processes) of one host on torch.distributed: each rank runs the engine on
its shard of the KV heads with the projections and MLP sharded to match (`shard.py`, two
all-reduces per layer), launched by kvpipe itself or under torchrun, a dead rank ending every
rank (`launch.py`)."""
