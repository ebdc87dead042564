"""kvpipe's vocabulary: model, workload, plan, stages and graph, cost formulas, trace and report,
and the command line. Never imports torch, simpy or anything heavy."""
