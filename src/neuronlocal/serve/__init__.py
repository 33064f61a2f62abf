"""`neuronlocal serve-plan`: which buckets for a traffic trace, and what p99 latency.

trace.py reads a trace (JSONL, CSV, a run report); sim.py simulates serving it with
continuous batching on estimated step times; plan.py fits the bucket lists (with
`compile.bucketing.fit_buckets`) against the powers-of-two baseline; configs.py prints the
plan for NxD Inference, vLLM-Neuron and transformers' generate; replay.py runs part of the
trace on neuron with the plan; cli.py is the command. docs/serving.md has the model.
"""
