"""The training rules a config plugs into ``MultimodalModule`` by ``class_path``, each a subclass of its slot's
base class (which is also the default): ``param_groups`` (learning-rate groups), ``batch_embedding`` (how a
training batch is embedded), ``adapters`` (what trains in a tower's place), here; ``term_weighting`` and
``sample_weighting`` (loss weights beyond fixed ones, :mod:`mm_lightning.models.losses.objective`); and
``reranker`` (validation and test re-ranked by the matching head; default none). A checkpoint records a rule as
``class_path`` + ``init_args``; a load admits only a subclass of the slot's base class
(:mod:`mm_lightning.checkpoints.loading`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from mm_lightning.evaluation.rerank import Reranker
from mm_lightning.models.draws import seed_part
from mm_lightning.models.losses.objective import SampleWeighting, TermWeighting
from mm_lightning.models.towers.contract import EncoderOutput
from mm_lightning.recorded import Recorded

NamedParameters = list[tuple[str, nn.Parameter]]
Batch = dict[str, Any]
Embedded = tuple[EncoderOutput, Tensor, EncoderOutput, Tensor]


class ParamGroupRule(Recorded):
    """Learning-rate groups ahead of the whole towers (``model.param_groups``): a parameter joins the first group
    that holds it, the rest of each tower its tower's group. This one adds none."""

    def groups(self, towers: dict[str, tuple[nn.Module, float]]) -> dict[str, tuple[NamedParameters, float]]:
        """``{group name: (named parameters, lr)}`` from ``{"image"|"text": (tower, the tower's lr)}``."""
        return {}


class WholeBatch(Recorded):
    """Embeds a training batch in one forward of each tower (``model.batch_embedding``). Another way (chunks with
    gradient caching, say) is a subclass: :meth:`embed` returns the batch's outputs, and :meth:`backward` may
    back-propagate the loss itself."""

    def setup(self, trainer_strategy: object, model: Any) -> None:
        """Checks at fit start (none needed)."""

    def check_wrapper(self, wrapped: object) -> None:
        """Checks the model as the strategy wrapped it, when training starts (none needed)."""

    def embed(self, model: Any, batch: Batch) -> Embedded:
        """``(image_out, image_emb, text_out, text_emb)`` of the batch, with their graphs."""
        seed_part("image")
        image_out, image_emb = model.encode_images(batch["image"])
        seed_part("text")
        text_out, text_emb = model.encode_text(batch)
        return image_out, image_emb, text_out, text_emb

    def loss_rows(self, batch: Batch) -> Batch:
        """The rows of ``batch`` that the loss reads (image ids) for the embeddings :meth:`embed` returned: the
        batch itself, unless the rule moved rows between processes."""
        return batch

    def backward(self, loss: Tensor) -> bool:
        """Back-propagates ``loss`` itself when it must (False: the ordinary backward is right)."""
        return False


class TowerAdapters(Recorded):
    """Changes each tower once it is built and its freezing applied (``model.adapters``): this one leaves them as
    they are. A subclass (peft's LoRA, say) adds modules that train in place of the tower; :meth:`merge` folds them
    back into plain weights when the network is loaded for export or inference."""

    # options a checkpoint's record of this rule may not hold (they would name a module to import)
    importing_options: tuple[str, ...] = ()

    def apply(self, kind: str, tower: nn.Module, training: Any) -> None:
        """Changes the ``kind`` tower in place; ``training`` is its :class:`~mm_lightning.models.config.TowerTraining`."""

    def merge(self, network: nn.Module) -> None:
        """Folds what :meth:`apply` added back into the towers' own weights (their original parameter names)."""


# each rule's slot in MultimodalModule and the base class it takes
RULES: dict[str, type] = {
    "param_groups": ParamGroupRule,
    "batch_embedding": WholeBatch,
    "term_weighting": TermWeighting,
    "sample_weighting": SampleWeighting,
    "adapters": TowerAdapters,
    "reranker": Reranker,
}
