"""kvpipe's vocabulary, shared by both backends: model, workload, plan, stages and graph, memory and
cost formulas, units, trace and report, the rule plans and the replay rule. Never imports torch,
simpy or anything heavy; the command line is in kvpipe/."""
