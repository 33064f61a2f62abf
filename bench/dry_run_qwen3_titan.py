"""TorchNeuron's torchtitan Qwen3-8B recipe, for `neuronlocal run --dry-run`.

The recipe is TorchNeuron's `qwen3_8b_tp4_fsdp.toml` (its development snapshot's torchtitan
tutorial): Qwen3-8B, TP=4 x FSDP=16 on the 64 logical cores of one trn2.48xlarge, sequence
4096, local batch 1 (global 16), AdamW (lr 3e-4, eps 1e-8, 2 warm-up steps), gradient
clipping at 1.0, selective per-op activation checkpointing, eager. torchtitan 0.3.0 takes
configs as Python functions, not toml files: `qwen3_8b_tp4_fsdp` below is that toml as one,
registered beside torchtitan's own Qwen3 configs. Attention is FlexAttention, torchtitan
0.3.0's default (it refuses SDPA for language models; the toml's older torchtitan used
SDPA). Arguments after the script are torchtitan's (`--training.steps 2`, ...). From a
folder holding torchtitan's debug
assets (`python tests/torchtitan_job.py --make-assets .`, for the tokenizer and `c4_test`):

    PYTHONPATH=/work/titan-pkgs neuronlocal run --dry-run --instance trn2.48xlarge \
        --nproc-per-node 64 bench/dry_run_qwen3_titan.py

torchtitan builds the model on `meta`, shards it and materialises it on the device shard by
shard, so a dry run holds no memory proportional to the model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torchtitan_job  # noqa: E402  (torchtitan's entry point and its torch-version workarounds)

CONFIG = "qwen3_8b_tp4_fsdp"


def qwen3_8b_tp4_fsdp() -> Any:
    """TorchNeuron's qwen3_8b_tp4_fsdp.toml as a torchtitan 0.3.0 config."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.trainer import Trainer

    model_spec = model_registry("8B")  # flex: torchtitan 0.3.0 dropped SDPA
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(
            global_vocab_size=decoder_vocab_size(model_spec))),
        hf_assets_path="./tests/assets/tokenizer",
        metrics=MetricsProcessor.Config(log_freq=1),
        model_spec=model_spec,
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        optimizer=default_adamw(lr=3e-4, eps=1e-8),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=1, seq_len=4096, global_batch_size=16,
                                max_norm=1.0, steps=500),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1,
                                      tensor_parallel_degree=4),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=SelectiveAC.Config(),
    )


def main() -> None:
    torchtitan_job._no_triton_kernels()  # before torchtitan's models are imported
    from torchtitan.models.qwen3 import config_registry

    setattr(config_registry, CONFIG, qwen3_8b_tp4_fsdp)
    sys.argv = [sys.argv[0], "--module", "qwen3", "--config", CONFIG,
                "--parallelism.spmd-backend", "partial_dtensor", "--validator.no-enable",
                "--metrics.disable-color-printing", *sys.argv[1:]]
    torchtitan_job.main()


if __name__ == "__main__":
    main()
