"""CrossAttentionFusion: batch-first attention, padding mask (with control), per-sample independence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mm_lightning.models import CrossAttentionFusion


def _inputs(seed: int = 0, batch: int = 3, n_img: int = 5, length: int = 4, dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(batch, n_img, dim, generator=g)
    text = torch.randn(batch, length, dim, generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 2:] = 0  # sample 1 already has padding
    return image, text, mask


def _pad(text: torch.Tensor, mask: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Appends ``extra`` padding tokens with arbitrary (large) values."""
    garbage = torch.randn(text.shape[0], extra, text.shape[2]) * 100
    return torch.cat([text, garbage], 1), torch.cat(
        [mask, torch.zeros(mask.shape[0], extra, dtype=mask.dtype)], 1
    )


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_appending_padding_leaves_fused_output_unchanged(bidirectional: bool, num_layers: int) -> None:
    torch.manual_seed(0)
    fusion = CrossAttentionFusion(16, num_heads=4, num_layers=num_layers, bidirectional=bidirectional).eval()
    image, text, mask = _inputs()
    padded_text, padded_mask = _pad(text, mask, extra=6)
    with torch.no_grad():
        out = fusion(image, text, mask)
        out_padded = fusion(image, padded_text, padded_mask)
    assert out.shape == (3, fusion.out_dim)
    torch.testing.assert_close(out_padded, out, atol=1e-6, rtol=0)


def test_control_without_mask_padding_changes_the_output() -> None:
    torch.manual_seed(0)
    fusion = CrossAttentionFusion(16, num_heads=4).eval()
    image, text, mask = _inputs()
    padded_text, _ = _pad(text, mask, extra=6)
    all_real = torch.ones(padded_text.shape[:2], dtype=torch.long)
    with torch.no_grad():
        out = fusion(image, text, mask)
        unmasked = fusion(image, padded_text, all_real)
    assert (unmasked - out).abs().max() > 1e-2


def test_samples_do_not_mix_across_the_batch() -> None:
    """Batch-first tensors fed to a sequence-first attention would mix samples; here they stay separate."""
    torch.manual_seed(0)
    fusion = CrossAttentionFusion(16, num_heads=4).eval()
    image, text, mask = _inputs()
    changed = text.clone()
    changed[2] += 5
    with torch.no_grad():
        out, out_changed = fusion(image, text, mask), fusion(image, changed, mask)
    torch.testing.assert_close(out_changed[:2], out[:2], atol=1e-6, rtol=0)
    assert (out_changed[2] - out[2]).abs().max() > 1e-3


def test_uses_batch_first_multihead_attention_and_checks_heads() -> None:
    fusion = CrossAttentionFusion(16, num_heads=8, num_layers=2)
    attns = [m for m in fusion.modules() if isinstance(m, nn.MultiheadAttention)]
    assert len(attns) == 2 and all(a.batch_first and a.num_heads == 8 for a in attns)
    with pytest.raises(ValueError, match="divisible"):
        CrossAttentionFusion(10, num_heads=8)


def test_every_parameter_gets_a_gradient() -> None:
    """DDP requires it: a parameter without gradient on one rank breaks the reducer."""
    fusion = CrossAttentionFusion(16, num_heads=4, num_layers=2, bidirectional=True)
    image, text, mask = _inputs()
    fusion(image, text, mask).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in fusion.parameters())
