"""Any Lightning logger from YAML: ``configs/loggers.yaml`` (TensorBoard, CSV, MLflow's local store) plus W&B
offline, in one CLI run: each receives the validation metrics, in the run dir; the retrieval grid reaches those
that take images."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests import preloaded
from tests.conftest import tiny_demo_args

REPO = Path(__file__).resolve().parents[1]
WANDB_OFFLINE = {
    "class_path": "lightning.pytorch.loggers.WandbLogger",
    "init_args": {"project": "t", "offline": True},
}


@pytest.mark.timeout(300)
def test_every_logger_of_the_shipped_overlay_and_wandb_gets_the_metrics(tmp_path: Path) -> None:
    from mlflow import MlflowClient  # seconds to import: only here

    overlay = yaml.safe_load((REPO / "configs" / "loggers.yaml").read_text())
    overlay["trainer"]["logger"].append(WANDB_OFFLINE)
    (tmp_path / "loggers.yaml").write_text(yaml.safe_dump(overlay))
    run_dir = tmp_path / "run"
    args = tiny_demo_args(
        run_dir, "--config", "loggers.yaml", "--trainer.callbacks+=mm_lightning.extras.RetrievalGridLogger"
    )
    done = preloaded.run(
        [sys.executable, "-m", "mm_lightning", "fit", *args], cwd=tmp_path, capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]

    tensorboard = EventAccumulator(str(run_dir / "version_0")).Reload()
    expected = [round(e.value, 6) for e in tensorboard.Scalars("val/r1_t2i")]
    assert len(expected) == 2  # validations at steps 3 and 6
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        assert [round(float(r["val/r1_t2i"]), 6) for r in csv.DictReader(f) if r["val/r1_t2i"]] == expected

    client = MlflowClient(
        f"sqlite:///{tmp_path}/logs/mlflow.db"
    )  # the overlay's relative store, from the cwd
    (run,) = client.search_runs([client.get_experiment_by_name("mm_lightning").experiment_id])
    assert [round(m.value, 6) for m in client.get_metric_history(run.info.run_id, "val/r1_t2i")] == expected
    grids = [a.path for a in client.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png")]
    assert len(grids) == 2 and all("retrieval_grid" in g for g in grids)

    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    assert len(list(wandb_run.glob("files/media/images/val/retrieval_grid_*.png"))) == 2
    assert b"val/r1_t2i" in next(wandb_run.glob("*.wandb")).read_bytes()  # the run's records, synced later
