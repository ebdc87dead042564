"""`kvpipe calibrate`: the measurements that fill a hardware profile (GPU rates, attention,
links, disk, host issue costs, codecs), their timers, and the small-op recorder they use."""
