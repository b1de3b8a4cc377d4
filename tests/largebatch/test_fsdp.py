"""MultimodalModule under Lightning's FSDPStrategy: per-block wrapping, bf16 policy, sharded checkpoint resume.

Lightning's FSDP refuses the CPU accelerator (and torch's FSDP needs an accelerator device), so this test
needs a CUDA GPU and is skipped without one. The README's large-batch section has the multi-GPU command.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader
from torchvision.models.vision_transformer import EncoderBlock
from transformers.models.bert.modeling_bert import BertLayer

from mm_lightning.models import MultimodalModule
from tests.largebatch.lightning_helpers import Rows
from tests.models.helpers import EXACT_MODEL, module_kwargs, tiny_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDPStrategy needs CUDA GPUs"),
]
BLOCKS = {BertLayer, EncoderBlock}
# ITM off: its hard negatives are drawn from the global generator, whose state a plain resume does not restore;
# a constant learning rate, so the schedule does not depend on each run's max_steps
MODEL = tiny_config(EXACT_MODEL, objective={"itm_weight": 0.0}, optim={"min_lr_ratio": 1.0})


def _fit(root: Path, max_steps: int, ckpt_path: str | None = None) -> Trainer:
    torch.manual_seed(0)
    model = MultimodalModule(**module_kwargs(MODEL))
    trainer = Trainer(
        accelerator="cuda",
        devices=1,
        strategy=FSDPStrategy(
            auto_wrap_policy=BLOCKS, activation_checkpointing_policy=BLOCKS, state_dict_type="sharded"
        ),
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        max_steps=max_steps,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    # one batch per epoch, so a checkpoint after any step is at an epoch boundary and the resume is exact
    trainer.fit(model, DataLoader(Rows(8), batch_size=8), ckpt_path=ckpt_path)
    return trainer


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.float().cpu() for k, v in trainer.strategy.lightning_module_state_dict().items()}


def test_fsdp_wraps_blocks_and_resumes_from_a_sharded_checkpoint(tmp_path: Path) -> None:
    straight = _fit(tmp_path / "straight", 4)
    wrapped = [m for m in straight.strategy.model.modules() if type(m).__name__ == "FullyShardedDataParallel"]
    assert len(wrapped) > 2  # the root plus one unit per tower block
    assert "train/grad_norm" in straight.callback_metrics  # clipped by the FSDP root

    first = _fit(tmp_path / "first", 2)
    checkpoint = tmp_path / "half.ckpt"
    first.save_checkpoint(checkpoint)
    assert checkpoint.is_dir()  # sharded: a folder of per-rank shards
    resumed = _fit(tmp_path / "resumed", 4, ckpt_path=str(checkpoint))
    assert resumed.global_step == 4
    want, got = _weights(straight), _weights(resumed)
    difference = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"FSDP resume vs uninterrupted: max weight difference {difference:.2e}")
    assert difference < 1e-4
    # control: the run that stopped at step 2 has other weights
    control = max((_weights(first)[k] - want[k]).abs().max().item() for k in want)
    print(f"FSDP after 2 vs 4 steps: max weight difference {control:.2e}")
    assert control > 1e-3
