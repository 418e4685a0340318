"""Experiment trackers: the records of metrics.jsonl, also sent to TensorBoard, Weights & Biases or trackio.

    trackers = open_trackers(["tensorboard"], out_dir, config=asdict(cfg))   # check_trackers() first
    trackers.log({"loss": 2.31, "lr": 2e-4, ...}, step)
    trackers.close()

Each tracker is an optional extra, imported only when asked for:
    tensorboard  pip install -e ".[tensorboard]"   event files in OUT_DIR/tensorboard
    wandb        pip install -e ".[wandb]"         WANDB_MODE=offline keeps the run local
    trackio      pip install -e ".[trackio]"       a local dashboard (`trackio show`)
Numbers are logged as scalars; text (generated samples) as text where the tracker has it.
A resumed run continues the same W&B/trackio run: its id is kept in the run folder.
"""
import importlib
import json
import math
import os
import re
import secrets

from model.files import atomic_file, open_read

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}  # name -> module to import
PROJECT = "nanotune"
ID_BYTES = 64  # the longest W&B run id read from a run folder's .wandb_id


def check_trackers(names):
    """Raise ValueError, naming the extra to install, unless every tracker in `names` can be used."""
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"--report-to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)} (or none)")
        try:
            importlib.import_module(TRACKERS[name])
        except ImportError as e:
            raise ValueError(f"--report-to {name} needs the {name} package ({e}); install it with "
                             f"pip install -e \".[{name}]\"") from None


class _TensorBoard:
    def __init__(self, out_dir, config):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()), 0)

    def log(self, record, step):
        for k, v in record.items():
            if isinstance(v, str):
                self.writer.add_text(k, v, step)
            else:
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class _RunWithId:
    """W&B and trackio share an API: init(project, name, config, resume), log(dict, step), finish()."""

    def __init__(self, module, out_dir, config):
        self.lib = importlib.import_module(module)
        name = os.path.basename(os.path.abspath(out_dir))
        if module == "wandb":
            run_id = _wandb_id(os.path.join(out_dir, ".wandb_id"))
            self.lib.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, id=run_id, resume="allow",
                          dir=out_dir, config=config)
        else:
            self.lib.init(project=PROJECT, name=name, config=config, resume="allow")

    def log(self, record, step):
        self.lib.log(record, step=step)

    def close(self):
        self.lib.finish()


def _wandb_id(path):
    """The W&B run id kept in `path` (the run folder's .wandb_id), or a new one written there. The file is read
    and written only as a regular file, never through a symlink (model/files.py), and must hold a short id of
    letters and digits: it is sent to W&B, so a planted link must not send another file's contents."""
    if not os.path.lexists(path):
        run_id = secrets.token_hex(4)
        with atomic_file(path, "wb") as f:
            f.write(run_id.encode())
        return run_id
    try:
        with open_read(path) as f:
            text = f.read(ID_BYTES + 1)
    except (OSError, ValueError) as e:  # ValueError: a link or special file (UnsafePath)
        raise ValueError(f"cannot read the W&B run id in {path} ({e}); remove the file to start a new W&B "
                         "run") from None
    run_id = text.decode("ascii", "replace").strip()
    if len(text) > ID_BYTES or not re.fullmatch(r"[0-9A-Za-z]+", run_id):
        raise ValueError(f"{path} does not hold a W&B run id (a short string of letters and digits); remove the "
                         "file to start a new W&B run")
    return run_id


class Trackers:
    def __init__(self, trackers):
        self.trackers = trackers

    def log(self, record, step):
        """Send a metrics.jsonl record (its "step" key aside): numbers as scalars (non-finite ones skipped),
        strings, and anything else (the samples' list) as JSON text."""
        record = {k: v for k, v in record.items() if k != "step" and v is not None and not isinstance(v, bool)}
        record = {k: v if isinstance(v, (int, float, str)) else json.dumps(v, ensure_ascii=False)
                  for k, v in record.items()}
        record = {k: v for k, v in record.items() if isinstance(v, str) or math.isfinite(v)}
        for t in self.trackers:
            t.log(record, step)

    def close(self):
        for t in self.trackers:
            t.close()


def open_trackers(names, out_dir, config):
    """Start every tracker in `names` (already checked by check_trackers)."""
    return Trackers([_TensorBoard(out_dir, config) if n == "tensorboard" else _RunWithId(TRACKERS[n], out_dir, config)
                     for n in names])
