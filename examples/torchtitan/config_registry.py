"""torchtitan configs that train on a torchdata-ext pipeline (see README.md here).

    torchrun --nproc_per_node=2 -m torchtitan.train \
        --module examples.torchtitan --config llama3_debugmodel_torchdata_ext

torchtitan imports this module (``--module``) and calls the function named by ``--config``.
"""

from __future__ import annotations

from torchtitan.models.llama3.config_registry import llama3_debugmodel

from torchdata_ext.torchtitan import TokenDataLoader


def llama3_debugmodel_torchdata_ext():  # -> torchtitan.trainer.Trainer.Config
    """torchtitan's llama3 debug model, fed by examples/torchtitan/pipeline.yaml."""
    config = llama3_debugmodel()
    config.dataloader = TokenDataLoader.Config(
        pipeline="examples/torchtitan/pipeline.yaml", num_workers=2
    )
    config.training.seq_len = 512
    config.checkpoint.enable = True
    config.checkpoint.interval = 5
    config.checkpoint.last_save_model_only = False
    return config
