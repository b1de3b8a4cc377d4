"""Inductor-compiled towers vs eager on the GPU machine (CPU and CUDA), and compile times."""
import time, torch
from torch._dynamo.utils import counters
from mm_lightning.models import MultimodalModule
from tests.largebatch.lightning_helpers import EXACT_MODEL
from tests.models.helpers import make_batch, tiny_config
for device in ("cpu", "cuda"):
    torch._dynamo.reset(); counters.clear()
    torch.manual_seed(0)
    cfg = tiny_config(EXACT_MODEL, loss={"itm_weight": 0.0})
    eager = MultimodalModule(**cfg).to(device)
    comp = MultimodalModule(**cfg, compile=True).to(device)
    comp.load_state_dict(eager.state_dict()); comp.configure_model()
    for m in (eager, comp):
        m.training_step({k: v.to(device) for k, v in make_batch(6, 5, seed=9).items()}, 0).backward(); m.zero_grad()
    torch._dynamo.reset(); counters.clear()
    t = time.time()
    for i, L in enumerate((7, 9, 12, 8, 15)):
        b = {k: v.to(device) for k, v in make_batch(6, L, seed=i).items()}
        le, lc = eager.training_step(b, 0), comp.training_step(b, 0)
        le.backward(); lc.backward()
        g = max((p.grad - q.grad).abs().max().item() for p, q in zip(eager.parameters(), comp.parameters()) if p.grad is not None)
        print(device, "len", L, "loss eager", le.item(), "compiled", lc.item(), "max grad diff", g, "t", round(time.time() - t, 1))
        eager.zero_grad(); comp.zero_grad()
    print(device, "graphs", dict(counters["stats"]), "compile+run s", round(time.time() - t, 1))
