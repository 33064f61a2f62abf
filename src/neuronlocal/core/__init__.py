"""The core layer: what every other layer may import, and which imports none of them.

config (the env-var table, parsing, `Config`), hardware (instance profiles), state (this
process's config, profile and config error), logs (TORCH_NEURONX_LOG_LEVEL), counters
(collectives and user counters) and dynamo_metrics (one record per compiled graph). The
layer order of the whole package is in docs/architecture.md; tests/test_layering.py keeps it.
"""

VERSION = "0.1.0"  # pyproject.toml's version; part of every compile-cache key
