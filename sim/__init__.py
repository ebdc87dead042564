"""The simulated backend: SimPy lanes consuming a stage graph against a hardware profile, and
the planning logic scored by it. Never imports torch."""
