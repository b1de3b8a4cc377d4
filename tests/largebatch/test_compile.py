"""``compile=True``: compiled towers give the eager loss, and new caption lengths do not recompile.

The tests compile with the ``aot_eager`` backend: the same Dynamo capture, guards and AOTAutograd graphs as
the default (inductor) backend, without generating C++ kernels, which takes minutes on a small CPU machine.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mm_lightning.models import MultimodalModule
from tests.models.helpers import EXACT_MODEL, make_batch, module_kwargs, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _pair() -> tuple[MultimodalModule, MultimodalModule]:
    config = tiny_config(EXACT_MODEL, objective={"itm_weight": 0.0})
    torch.manual_seed(0)
    eager = MultimodalModule(**module_kwargs(config))
    compiled = MultimodalModule(**module_kwargs(config), compile={"backend": "aot_eager"})
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()  # what the Trainer calls at fit start
    # the first training batch runs under the FLOP counter (which Dynamo leaves to eager): measure it here
    for model in (eager, compiled):
        model.backward(model.training_step(make_batch(size=6, length=5, seed=99), 0))
        model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    counters.clear()
    return eager, compiled


def test_compiled_towers_give_the_eager_loss_and_do_not_recompile_for_new_lengths() -> None:
    eager, compiled = _pair()
    for step, length in enumerate((7, 9, 12, 8, 15)):
        batch = make_batch(size=6, length=length, seed=step, captions_per_image=2)
        loss_eager, loss_compiled = eager.training_step(batch, step), compiled.training_step(batch, step)
        torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-6)
        loss_eager.backward()
        loss_compiled.backward()
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        eager.zero_grad(set_to_none=True)
        compiled.zero_grad(set_to_none=True)
    # one graph per tower, both really compiled: the text tower is compiled for dynamic lengths from the start
    print("Dynamo graphs after 5 caption lengths:", dict(counters["stats"]))
    assert counters["stats"]["unique_graphs"] == 2
    # checkpoints keep their keys: the towers are compiled in place
    assert compiled.state_dict().keys() == eager.state_dict().keys()

    # control: a text tower compiled for static shapes recompiles when the length changes
    torch._dynamo.reset()
    counters.clear()
    compiled.model.text_encoder.compile(backend="aot_eager", dynamic=False)
    for length in (7, 9, 12):
        batch = make_batch(6, length)
        compiled.model.text_encoder(batch["input_ids"], batch["attention_mask"])
    assert counters["stats"]["unique_graphs"] == 3
