"""What a run folder, a checkpoint or a config file that someone else wrote cannot do: run code (planted
pickles), write outside the run folder (planted links), or exhaust the machine (YAML alias bombs); and what a
hangup cannot take (the checkpoint of the steps since the last save). Tiny models, CPU."""
import ast
import errno
import os
import pickle
import pty
import re
import select
import signal
import sys
import time
import types

import pytest
import torch

import checkpoint
import config
import lifecycle
import statefiles
import train
from tests.helpers import builtin_jsonl, signal_after_line, untimed
from tests.test_reliability import ROOT, args, read_metrics

PAYLOAD_MARK = "nanotune-payload-ran"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return builtin_jsonl(str(tmp_path_factory.mktemp("data")), 24)


class Payload:
    """Unpickling this runs `open(path, "w")`: the file's existence says that the payload ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant_pickle(folder, marker):
    """Replace a checkpoint's state with a state.pt whose unpickling runs code, and rewrite its manifest so
    that the checksums pass: what anyone who can write the folder can do."""
    for name in (statefiles.STATE, statefiles.TENSORS, statefiles.MANIFEST):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    with open(os.path.join(folder, statefiles.LEGACY_STATE), "wb") as f:
        pickle.dump({"step": Payload(str(marker))}, f)
    statefiles.write_manifest(folder)


@pytest.mark.parametrize("how", ["auto", "path"])
def test_a_planted_pickle_in_a_checkpoint_never_runs(run_model, dataset, tmp_path, capsys, how):
    """A checkpoint whose state was replaced by a pickle payload (manifest rewritten) is refused as damaged,
    on --resume auto and on --resume PATH, and the payload never runs; auto falls back to the one before."""
    out, marker = tmp_path / "out", tmp_path / PAYLOAD_MARK
    assert train.cli(args(run_model, dataset, out, "--save-every", "1")) == 0
    newest = out / "checkpoints" / "step-0000002"
    plant_pickle(newest, marker)
    capsys.readouterr()
    resume = "auto" if how == "auto" else str(newest)
    code = train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3", "--resume", resume,
                          "--resume-anyway"))
    err = capsys.readouterr().err
    assert not marker.exists(), "unpickling the planted state.pt ran its payload"
    assert re.search(r"cannot read checkpoint .*step-0000002 \(UnpicklingError", err), err
    assert code == (0 if how == "auto" else 2)


def test_checkpoints_hold_no_pickle(run_model, dataset, tmp_path):
    """A checkpoint is JSON and safetensors: every file in it parses as one of them (or is the adapter's
    README), so nothing in it is ever unpickled."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out)) == 0
    folder = out / "checkpoints" / "step-0000002"
    names = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    assert names == ["adapter/README.md", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                     "adapter/nanotune.json", "manifest.json", "state.json", "tensors.safetensors"], names
    ck = statefiles.read_state(folder)
    assert ck["step"] == 2 and ck["optimizer"]["state"] and ck["lora"]


def test_a_legacy_state_pt_checkpoint_still_resumes(run_model, dataset, tmp_path, capsys):
    """A checkpoint of the earlier format (state.pt, torch.save of plain containers and tensors) resumes to the
    same metrics as the new format: it is read with torch.load(weights_only=True)."""
    opts = ["--save-every", "1", "--max-steps", "3", "--lora-dropout", "0.1"]
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, *opts)) == 0
    uninterrupted = read_metrics(out)
    ckpts = out / "checkpoints"
    checkpoint.remove_tree(ckpts / "step-0000003")
    folder = ckpts / "step-0000002"
    ck = statefiles.read_state(folder)
    ck["rng"] = [{**r, "python": (r["python"][0], tuple(r["python"][1]), r["python"][2])} for r in ck["rng"]]
    for name in (statefiles.STATE, statefiles.TENSORS, statefiles.MANIFEST):
        os.remove(folder / name)
    torch.save({k: v for k, v in ck.items() if k != "eval_hash"}, folder / statefiles.LEGACY_STATE)
    statefiles.write_manifest(folder)
    capsys.readouterr()
    assert train.cli(args(run_model, dataset, out, *opts, "--resume", "auto")) == 0
    assert f"resumed from {folder} at step 2" in capsys.readouterr().out
    assert untimed(read_metrics(out)) == untimed(uninterrupted)


def test_nothing_in_the_project_unpickles():
    """No product code calls torch.load without weights_only=True, pickle.load(s), or np.load with pickles."""
    offenders = []
    for folder in (".", "data", "model", "kernels", "scripts", "scripts/bench"):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if not name.endswith(".py"):
                continue
            path = os.path.join(ROOT, folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if not isinstance(node, ast.Call):
                    continue
                func = ast.unparse(node.func)
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if (func.endswith("torch.load") and kw.get("weights_only") != "True") or \
                        func in ("pickle.load", "pickle.loads", "pickle.Unpickler") or \
                        (func.endswith("np.load") and kw.get("allow_pickle") == "True"):
                    offenders.append(f"{folder}/{name}:{node.lineno} {func}")
    assert offenders == []


# ----------------------------------------------------------------------------- links in the run folder


@pytest.mark.parametrize("name", [".lock", "train_config.json", "metrics.jsonl"])
def test_a_link_in_the_run_folder_is_refused_before_anything_is_written(run_model, dataset, tmp_path, capsys,
                                                                         name):
    """A symbolic link planted at a file the run writes (its target outside the folder) is refused with one
    line before the run starts, on a new run (--overwrite) and on --resume; the target is never touched."""
    out, outside = tmp_path / "out", tmp_path / "outside.txt"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1")) == 0
    outside.write_text("keep me")
    (out / name).unlink(missing_ok=True)
    os.symlink(outside, out / name)
    for extra in (["--overwrite"], ["--resume", "auto", "--max-steps", "3", "--resume-anyway"]):
        capsys.readouterr()
        assert train.cli(args(run_model, dataset, out, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: {str(out / name)!r} is a symbolic link; nanotune does not write through links or " \
                      "into special files. Remove it (or choose another folder) and run again", err
        assert outside.read_text() == "keep me"


def test_a_link_at_a_temp_name_is_never_followed(run_model, dataset, tmp_path):
    """Links planted at the names of the temporary files of earlier versions (train_config.json.tmp, a
    checkpoint's step-N.tmp, adapter.tmp-PID) are left alone or removed: their targets are never written."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("keep me")
    assert train.cli(args(run_model, dataset, out, "--save-every", "1")) == 0
    for name in ("train_config.json.tmp", f"adapter.tmp-{os.getpid()}", "checkpoints/step-0000001.tmp"):
        os.symlink(outside, out / name)
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3", "--resume", "auto",
                          "--resume-anyway")) == 0
    assert sorted(os.listdir(outside)) == ["f"] and (outside / "f").read_text() == "keep me"


def test_foreign_files_in_out_adapter_are_refused_before_training(run_model, dataset, tmp_path, capsys):
    """out/adapter/ holding files that are not an earlier adapter: refused before the first step, not after
    the whole run; the files stay."""
    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "notes.txt").write_text("mine")
    assert train.cli(args(run_model, dataset, out)) == 2
    err = capsys.readouterr().err
    assert "adapter' exists and is not an earlier output of this kind (it has no adapter_config.json)" in err
    assert "(the run writes its adapter there at the end)" in err
    assert not (out / "metrics.jsonl").exists() and (out / "adapter" / "notes.txt").read_text() == "mine"


def test_only_exact_step_folders_are_checkpoints(run_model, dataset, tmp_path, capsys):
    """A user's copy step-0000002-backup is neither resumed from nor deleted by rotation."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--keep-checkpoints", "1")) == 0
    ckpts = out / "checkpoints"
    os.rename(ckpts / "step-0000002", ckpts / "step-0000002-backup")
    capsys.readouterr()
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--keep-checkpoints", "1", "--max-steps",
                          "3", "--resume", "auto", "--resume-anyway")) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert sorted(os.listdir(ckpts)) == ["step-0000002-backup", "step-0000003"]


# ----------------------------------------------------------------------------- config files, eval data


def test_a_yaml_alias_bomb_gives_a_short_error_at_once(tmp_path):
    """A few hundred bytes of nested YAML aliases expand to billions of items: the error repeats only the
    value's start."""
    level = '["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'
    lines = [f"a0: &a0 {level}"] + [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 7)]
    path = tmp_path / "bomb.yaml"
    path.write_text("model: [" + ", ".join(f"&a{i} " + line.split(f'&a{i} ')[1] for i, line in enumerate(lines))
                    + "]\n")
    assert len(path.read_bytes()) < 600
    with pytest.raises(train.UserError) as e:
        config.parse_args(["--config", str(path)])
    assert len(str(e.value)) < 400 and str(e.value).startswith(f"--config {path}: model must be a string, got [["), \
        str(e.value)[:500]


def test_resume_with_other_eval_data_says_so(run_model, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    other = tmp_path / "eval.jsonl"
    other.write_text("".join(open(dataset).readlines()[:4]))
    assert train.cli(args(run_model, dataset, out, "--save-every", "1")) == 0
    capsys.readouterr()
    assert train.cli(args(run_model, dataset, out, "--max-steps", "3", "--resume", "auto", "--resume-anyway",
                          "--eval-data", str(other))) == 0
    assert "the eval data differs from the checkpoint's" in capsys.readouterr().err


def test_eval_data_equal_to_the_training_data_is_warned(run_model, dataset, tmp_path, capsys):
    assert train.cli(args(run_model, dataset, tmp_path / "out", "--eval-data", dataset)) == 0
    assert "--eval-data is the training data" in capsys.readouterr().err


# ----------------------------------------------------------------------------- hangups


def _train_in_pty(argv, stderr_path, ignore_hup=False):
    """Start train.py on a new pseudo-terminal (its controlling terminal, as under ssh) with its standard error in
    a file (what it says after the hangup, kept for the test's message); returns (pid, fd). SIGHUP is delivered as
    a fresh process has it, whatever the test process inherited (nohup, a blocked mask), unless ignore_hup."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec train.py
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_hup else signal.SIG_DFL)
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-u", "train.py", *argv])
    return pid, fd


def _wait_for_records(fd, out, n, timeout=120):
    """Read the terminal (a progress bar: the records, not the text, say where the run is) until out's
    metrics.jsonl holds n records."""
    end = time.time() + timeout
    while time.time() < end and len(read_metrics(out) if (out / "metrics.jsonl").exists() else []) < n:
        _read_until(fd, "\n", timeout=0.2)
    assert len(read_metrics(out)) >= n


def _read_until(fd, text, timeout=120):
    seen, end = b"", time.time() + timeout
    while text.encode() not in seen and time.time() < end:
        if select.select([fd], [], [], 1)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:
                break
    return seen.decode(errors="replace")


def test_a_console_write_that_fails_with_eio_is_dropped(monkeypatch):
    """A print to a hung-up terminal fails with EIO before the SIGHUP handler has run: while a run trains
    (StopSignals), such a write or flush is dropped and the console detached, so no print ends the run with an
    error before the signal saves it; any other write error still raises."""
    def fail(code):
        def raise_(*_):
            raise OSError(code, os.strerror(code))
        return raise_

    detached = []
    monkeypatch.setattr(lifecycle, "detach_console", lambda: detached.append(True))
    dead = types.SimpleNamespace(write=fail(errno.EIO), flush=fail(errno.EIO), isatty=lambda: True)
    with lifecycle.StopSignals(say=False):
        assert isinstance(sys.stdout, lifecycle.HangupSafe) and isinstance(sys.stderr, lifecycle.HangupSafe)
    assert not isinstance(sys.stdout, lifecycle.HangupSafe)  # put back
    console = lifecycle.HangupSafe(dead)
    assert console.write("step 3\n") == 7 and console.isatty()
    console.flush()
    assert detached == [True, True]
    with pytest.raises(OSError, match="No space"):
        lifecycle.HangupSafe(types.SimpleNamespace(write=fail(errno.ENOSPC))).write("x")


def test_a_hangup_saves_a_checkpoint_and_exits(run_model, dataset, tmp_path):
    """The terminal goes away (its master side closed, as when an ssh connection drops) during training: the
    run stops after its step and saves a checkpoint although every write to the terminal now fails, then exits
    with 129 (128 + SIGHUP)."""
    out = tmp_path / "out"
    stderr = tmp_path / "stderr.txt"
    pid, fd = _train_in_pty(args(run_model, dataset, out, "--max-steps", "200", "--log-every", "1"), stderr)
    _wait_for_records(fd, out, 2)
    os.close(fd)  # the hangup: SIGHUP to the terminal's session, and EIO for its writes
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 129, (status, stderr.read_text()[-3000:])
    saved = [d for d in os.listdir(out / "checkpoints") if re.fullmatch(r"step-\d+", d)]
    assert len(saved) == 1 and 2 <= int(saved[0][5:]) < 200
    assert [r["step"] for r in read_metrics(out) if "loss" in r][-1] == int(saved[0][5:])


def test_a_nohup_run_trains_on_after_its_terminal_goes(run_model, dataset, tmp_path):
    """A run started with SIGHUP ignored (nohup) whose terminal then goes away: its writes to the terminal fail with
    EIO, and it trains on to the end, as nohup asks, with every step recorded and its adapter saved."""
    out, stderr = tmp_path / "out", tmp_path / "stderr.txt"
    pid, fd = _train_in_pty(args(run_model, dataset, out, "--max-steps", "8", "--log-every", "1"), stderr,
                            ignore_hup=True)
    _wait_for_records(fd, out, 2)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, stderr.read_text()[-3000:])
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 9))
    assert (out / "adapter" / "adapter_config.json").exists()


def test_a_hangup_under_nohup_is_ignored(run_model, dataset, tmp_path):
    out = tmp_path / "out"
    code, _, stderr = signal_after_line(args(run_model, dataset, out, "--max-steps", "6"), "step 1/6", signal.SIGHUP,
                                        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert code == 0, stderr[-2000:]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]
