"""The training step captures without graph breaks: the heads, the losses and the matching head's hard negatives,
and the demo's towers through the project's wrappers, so ``torch.compile``'s modes, CUDA graphs included, can take
the step whole."""

from __future__ import annotations

import pytest
import torch

from mm_lightning.models.losses import weighted_sum
from mm_lightning.models.towers.contract import EncoderOutput
from tests.models.helpers import pair_loader, tiny_module
from tests.models.test_hard_negatives import _batch, _reference_itm


def _graph_breaks(fn, *inputs):  # noqa: ANN001, ANN002, ANN202
    """Dynamo's graph breaks in ``fn`` on ``inputs`` (``torch._dynamo.explain``: captures, compiles nothing)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*inputs)
    return [str(reason.reason) for reason in explained.break_reasons]


@pytest.mark.parametrize("loss", ["ContrastiveLoss", "SigLipLoss"])
def test_the_step_after_the_towers_is_one_graph(loss: str) -> None:
    torch.manual_seed(0)
    module = tiny_module(loss={"class_path": f"mm_lightning.models.losses.{loss}"})
    network, batch = module.model, next(iter(pair_loader(batch_size=8)))
    image_out, _ = network.encode_images(batch["image"])
    text_out, _ = network.encode_text(batch)
    image_out, text_out = (
        EncoderOutput(o.pooled.detach(), o.tokens.detach(), o.mask) for o in (image_out, text_out)
    )

    def step(image_pooled, image_tokens, text_pooled, text_tokens, text_mask, ids):  # noqa: ANN001, ANN202
        image = EncoderOutput(image_pooled, image_tokens, image_out.mask)
        text = EncoderOutput(text_pooled, text_tokens, text_mask)
        terms, metrics = network.losses(
            ids, None, image, network.image_proj(image_pooled), text, network.text_proj(text_pooled)
        )
        return weighted_sum(terms, module.objective.fixed_weights), metrics["itm_accuracy"]

    inputs = (
        image_out.pooled,
        image_out.tokens,
        text_out.pooled,
        text_out.tokens,
        text_out.mask,
        batch["image_id"],
    )
    assert _graph_breaks(step, *inputs) == []
    torch.manual_seed(1)
    want, _ = step(*inputs)
    torch.manual_seed(1)
    # aot_eager traces the backward too (AOTAutograd) and runs both graphs without a compiler
    got, accuracy = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
    got.backward()
    torch.testing.assert_close(got, want)
    assert 0 <= accuracy <= 1 and network.itm.head.weight.grad is not None


def test_control_the_row_dropping_matching_head_does_not_compile_to_one_graph() -> None:
    itm, inputs = _batch([0, 0, 1, 2, 3, 4, 5, 5])
    breaks = _graph_breaks(lambda *args: _reference_itm(itm, *args)[0], *inputs)
    assert breaks and any("dynamic shape" in b.lower() or "item()" in b for b in breaks), breaks


def test_the_demo_towers_with_their_wrappers_are_one_graph_each() -> None:
    # the demo's tower families (torchvision's ResNet, transformers' BERT under SDPA) through the project's
    # wrappers: the padding mask, the pooling, the projections
    network, batch = tiny_module().model, next(iter(pair_loader(batch_size=8)))
    assert _graph_breaks(network.encode_images, batch["image"]) == []
    assert _graph_breaks(network.encode_text, batch) == []
