#!/usr/bin/env bash
# TRL SFTTrainer with TP=2 x FSDP=2 on 4 neuron cores (torchrun, c10d backend "neuron"),
# compared step by step with the same training on CPU in one process.
#   bash examples/tp_fsdp_sft.sh            (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m torch.distributed.run --nproc_per_node 4 examples/sft_trl.py --tp 2 --fsdp 2 \
    --json "$TMP/tp.json"
"$PY" examples/sft_trl.py --json "$TMP/one.json"
"$PY" - "$TMP/tp.json" "$TMP/one.json" <<'PYEOF'
import json, sys
tp, one = (json.load(open(p)) for p in sys.argv[1:])
diff = max(abs(a - b) for a, b in zip(tp["neuron"], one["cpu"]))
print("TP2xFSDP2 neuron:", tp["neuron"]); print("1 process cpu:   ", one["cpu"])
print(f"max |loss diff| = {diff:.2e}")
sys.exit(0 if diff < 5e-3 else "TP x FSDP losses differ from CPU")
PYEOF
