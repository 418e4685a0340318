"""Trackers (tracking.py): TensorBoard event files and an offline W&B run hold the logged scalars;
an unknown or missing tracker is one clear error."""
import glob
import json
import sys

import pytest

import tracking

RECORDS = [{"step": 1, "loss": 2.5, "lr": 1e-4, "skipped": False},
           {"step": 2, "loss": 2.0, "lr": 2e-4, "grad_norm": float("nan")},
           {"step": 2, "eval_loss": 1.75, "samples": [{"prompt": "2+2", "answer": "4", "expected": "4"}]}]


def test_unknown_tracker():
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'; choose from tensorboard, wandb, trackio"):
        tracking.check_trackers(["mlflow"])


def test_missing_tracker_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # makes `import trackio` raise ImportError
    with pytest.raises(ValueError, match=r'pip install -e "\.\[trackio\]"'):
        tracking.check_trackers(["trackio"])


def test_tensorboard_holds_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tracking.check_trackers(["tensorboard"])
    t = tracking.open_trackers(["tensorboard"], str(tmp_path), config={"lr": 1e-4})
    for r in RECORDS:
        t.log(r, r["step"])
    t.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.5), (2, 2.0)]
    assert [e.step for e in acc.Scalars("eval_loss")] == [2]
    assert "grad_norm" not in acc.Tags()["scalars"]  # NaN is not logged
    assert "skipped" not in acc.Tags()["scalars"]
    texts = acc.Tensors("samples/text_summary")  # the samples' list, as JSON text
    assert [e.step for e in texts] == [2]
    assert json.loads(texts[0].tensor_proto.string_val[0]) == RECORDS[2]["samples"]


def test_wandb_offline_run_holds_the_scalars(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = tracking.open_trackers(["wandb"], str(tmp_path), config={"lr": 1e-4})
    for r in RECORDS:
        t.log(r, r["step"])
    t.log({"lr": 3e-4}, 3)  # a later step commits step 2's records to the run's summary
    summary = dict(wandb.run.summary)
    config_lr = wandb.run.config["lr"]
    t.close()
    assert summary["loss"] == 2.0 and summary["eval_loss"] == 1.75 and summary["lr"] == 2e-4
    assert "grad_norm" not in summary and config_lr == 1e-4
    run_id = open(tmp_path / ".wandb_id").read()
    assert glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
