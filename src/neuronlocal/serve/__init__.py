"""`neuronlocal serve-plan`: which buckets and how many replicas for a traffic trace, at what
latency and cost.

trace.py reads a trace (JSONL, CSV, a run report); sim.py simulates serving it with
continuous batching on estimated step times, over replicas by join-shortest-queue;
capacity.py says what a replica sustains against the arrival rate and what it costs; slo.py
searches the cheapest rental meeting latency targets; plan.py fits the bucket lists (with
`compile.bucketing.fit_buckets`) against the powers-of-two baseline; configs.py prints the
plan for NxD Inference, vLLM-Neuron and transformers' generate; replay.py runs part of the
trace on neuron with the plan; validate.py checks the simulation against such measured
serving; cli.py is the command.
docs/serving.md has the model.
"""
