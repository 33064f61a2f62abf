"""Writes the synthetic chat trace of docs/serving.md's worked example (JSONL on stdout).

2,000 requests arriving as a Poisson process at 2 per second (or the rate given as the first
argument); prompt and output lengths log-normal (medians about 270 and 120 tokens, long
tails, capped at 7,000 and 1,000):

    python examples/serve_trace.py > chat.jsonl
    python examples/serve_trace.py 20 > chat20.jsonl
    neuronlocal serve-plan llama-3.1-8b --trace chat.jsonl --tp 8 --batch 8 --max-len 8192
"""

from __future__ import annotations

import json
import random
import sys


def main() -> None:
    rate = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    rng, t = random.Random(7), 0.0
    for _ in range(2000):
        t += rng.expovariate(rate)
        prompt = min(7000, max(8, int(rng.lognormvariate(5.6, 0.9))))
        output = min(1000, max(1, int(rng.lognormvariate(4.8, 0.8))))
        print(json.dumps({"prompt_tokens": prompt, "output_tokens": output,
                          "arrival_s": round(t, 3)}))


if __name__ == "__main__":
    main()
