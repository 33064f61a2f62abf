"""TorchNeuron's torchtitan GPT-OSS-20B tutorial, for `neuronlocal run --dry-run`.

The tutorial (TorchNeuron's development snapshot, `docs/torchtitan/gpt-oss/`) clones
torchtitan, checks out 0a2107f9, applies its `TorchTitan.diff` and trains
`20b_tp4_fac.toml`: GPT-OSS-20B (24 layers, dim 2880, 32 experts, top 4, vocabulary
201,088), TP=4 x FSDP=16 on the 64 logical cores of one trn2.48xlarge, sequence 2048, local
batch 1, AdamW, clipping at 1.0, full activation checkpointing, eager, SDPA in place of
FlexAttention (no sliding window, no attention sinks). Its known limit: "may crash when
using 32 experts due to OOM". This script is that run, unchanged, through torchtitan's
`train.py` (`tests/torchtitan_job.py` holds the torch-version workarounds), from the root
of that checkout (the toml reads `./tests/assets`):

    cd torchtitan   # at 0a2107f9, with the tutorial's TorchTitan.diff applied
    PYTHONPATH=$PWD neuronlocal run --dry-run --instance trn2.48xlarge \
        --nproc-per-node 64 /path/to/bench/dry_run_gptoss_titan.py

Options of this script (before torchtitan's own, such as `--training.steps 2`):
`--experts N` trains the 20b flavor with N experts instead of 32 (top 4 kept), `--layers N`
with N layers instead of 24; either registers a flavor named for it beside torchtitan's.
Profiling is off (`--profiling.no_enable_profiling`): the commit's profiler lists a None
activity where there is no CUDA, which torch 2.13's profiler rejects.

torchtitan builds the model on `meta`, shards it and materialises it on the device shard by
shard, so a dry run holds no memory proportional to the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torchtitan_job  # noqa: E402  (torchtitan's entry point and its torch-version workarounds)

TOML = Path("torchtitan/models/gpt_oss/train_configs/20b_tp4_fac.toml")
BASE = "20b"


def _checkout() -> Path:
    """The current folder, checked to be the tutorial's patched torchtitan checkout."""
    root = Path.cwd()
    if not (root / TOML).is_file():
        raise SystemExit(f"{root / TOML} not found: run from the root of torchtitan at "
                         "0a2107f9 with TorchNeuron's docs/torchtitan/gpt-oss/TorchTitan.diff "
                         "applied (the tutorial's checkout)")
    sys.path.insert(0, str(root))  # before any installed torchtitan
    return root


def _flavor(experts: int | None, layers: int | None) -> str:
    """The flavor to train: 20b, or its name with another expert or layer count."""
    if experts is None and layers is None:
        return BASE
    return f"{BASE}_{experts or 32}experts_{layers or 24}layers"


def _register(flavor: str, experts: int | None, layers: int | None) -> None:
    """Add the flavor beside torchtitan's 20b (its other fields are 20b's)."""
    if flavor == BASE:
        return
    from torchtitan.models.gpt_oss import gptoss_configs

    base = gptoss_configs[BASE]
    gptoss_configs[flavor] = dataclasses.replace(
        base, n_layers=layers or base.n_layers,
        moe_args=dataclasses.replace(base.moe_args,
                                     num_experts=experts or base.moe_args.num_experts))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a whole number of at least 1")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=_positive, help="experts per MoE layer (20b: 32)")
    parser.add_argument("--layers", type=_positive, help="transformer layers (20b: 24)")
    ours, titan = parser.parse_known_args()
    root = _checkout()
    flavor = _flavor(ours.experts, ours.layers)
    # before torchtitan is imported: its ConfigManager.parse_args reads sys.argv[1:] as its
    # default argument, taken when its module is imported
    sys.argv = [sys.argv[0], "--job.config_file", str(TOML), "--model.flavor", flavor,
                "--profiling.no_enable_profiling", "--metrics.disable_color_printing",
                *titan]
    torchtitan_job._moe_kernels_without_triton()  # before torchtitan's MoE is imported
    import torchtitan

    if not Path(torchtitan.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"torchtitan imported from {torchtitan.__file__}, not {root}")
    _register(flavor, ours.experts, ours.layers)
    torchtitan_job.main()


if __name__ == "__main__":
    main()
