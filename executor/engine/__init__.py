"""Running a stage graph: the run entry point and its session (device, model, prompt, budgets), the
lane actors that issue each lane's stages on its stream or thread, the interpreter that runs a
stage's payload, torch.compile settings and SIGTERM handling."""
