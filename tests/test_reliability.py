"""Reliability: every bad input is one early `error: ...` line (exit 2, no traceback, no output folder);
one run per folder (a lock); checkpoints are atomic, checksummed and never hold NaN; signals stop a run
after its step and never interrupt a save; a resume is exact or refused; a failed write or an
out-of-memory step ends in one line, after saving what can be saved. docs/reliability.md lists the
guarantees and the tests here that show them.

Most cases call `train.cli` in-process: it is what `python train.py` runs, and an exception that
escapes it is a traceback. Signals are sent in-process too, to the test's own process, while a guard
turns any signal that train.py does not handle into a test failure. Subprocesses are kept to what needs
a process: hub offline mode (read at import), a kill, and a second process holding the lock.
"""
import dataclasses
import errno
import fcntl
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections import namedtuple

import pytest
import torch

import checkpoint
import config
import data
import memory
import precision
import runlog
import statefiles
import step
import train
from masters import param_groups
from model import LoRAConfig, load_model, read_config
from model.lora import lora_parameters
from tests.helpers import builtin_jsonl, read_metrics, refused, signal_after_line, untimed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """24 short Alpaca examples: a run on them starts in a fraction of the builtin dataset's time."""
    return builtin_jsonl(str(tmp_path_factory.mktemp("data")), 24)


def args(run_model, dataset, out, *extra):
    return ["--model", run_model, "--data", dataset, "--out-dir", str(out), "--device", "cpu", "--dtype", "fp32",
            "--no-kernels", "--max-len", "96", "--batch-size", "2", "--max-steps", "2", "--warmup-steps", "1",
            "--eval-every", "0", "--save-every", "0", "--eval-batches", "1", "--sample-every", "0", *map(str, extra)]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("extra, match", [
    (["--model", "no-such-model"], r"unknown model 'no-such-model'.*Known short names: .*tinyllama"),
    (["--batch-size", "0"], r"--batch-size must be > 0, got 0"),
    (["--max-len", "-1"], r"--max-len must be > 0, got -1"),
    (["--lr", "0"], r"--lr must be > 0, got 0"),
    (["--lr=-1e-4"], r"--lr must be > 0, got -0.0001"),
    (["--lora-targets", "q_proj,qkv"], r"unknown module\(s\) \['qkv'\]; this model has q_proj,k_proj"),
    (["--dtype", "fp16"], r"--dtype fp16 needs a CUDA GPU .* use --dtype fp32 on CPU"),
    (["--keep-checkpoints", "-1"], r"--keep-checkpoints must be >= 0, got -1"),
    (["--lr", "inf"], r"--lr must be a finite number, got inf"),
    (["--lr", "1e39"], r"--lr must be at most 1 \(AdamW moves each weight by about lr per step"),
    (["--lora-alpha", "0"], r"--lora-alpha must be > 0 \(the update is scaled by alpha / r\), got 0"),
    (["--lora-alpha", "nan"], r"--lora-alpha must be a finite number, got nan"),
    (["--eval-fraction", "1.0"], r"--eval-fraction must be at least 0 and below 1 .*got 1\.0"),
    (["--eval-fraction=-0.5"], r"--eval-fraction must be at least 0 and below 1 .*got -0\.5"),
    (["--min-lr-ratio=-2"], r"--min-lr-ratio must be between 0 and 1 .*below 0 the lr turns negative\), got -2"),
    (["--warmup-steps=-3"], r"--warmup-steps must be >= 0, got -3"),
    (["--grad-clip", "nan"], r"--grad-clip must be a finite number, got nan"),
    (["--log-every", "0"], r"--log-every must be > 0, got 0"),
    (["--device", "tpu"], r"--device must be auto, cpu, cuda, cuda:N, mps, got 'tpu'"),
    (["--resume-anyway"], r"--resume-anyway goes with --resume"),
    (["--max-len", "300"], r"--max-len 300 is longer than this model's context of 256 tokens "
                           r"\(max_position_embeddings in its config\).*Use --max-len 256 or less"),
    (["--sample-every=-2"], r"--sample-every must be a number of steps, -1 \(only before training and at the end\) "
                            r"or 0 \(never\), got -2"),
    (["--num-epochs", "0"], r"--num-epochs must be > 0, got 0\.0"),
    (["--cuda-graphs", "maybe"], r"--cuda-graphs must be one of auto, on, off, got 'maybe'"),
    (["--quantize", "nf8"], r"--quantize must be one of nf4 \(or left out\), got 'nf8'"),
    (["--dtype", "fp8"], r"--dtype must be one of auto, bf16, fp16, fp32, got 'fp8'"),
], ids=["model-name", "batch-size", "max-len", "lr-zero", "lr-negative", "lora-targets", "fp16-on-cpu",
        "keep-checkpoints", "lr-inf", "lr-overflow", "lora-alpha-zero", "lora-alpha-nan", "eval-fraction-all",
        "eval-fraction-negative", "min-lr-ratio", "warmup-steps", "grad-clip-nan", "log-every", "device-tpu",
        "resume-anyway-alone", "max-len-past-context", "sample-every", "num-epochs-zero", "cuda-graphs",
        "quantize", "dtype"])
def test_bad_option(run_model, dataset, tmp_path, capsys, extra, match):
    refused(args(run_model, dataset, tmp_path / "out", *extra), capsys, tmp_path / "out", match)


def test_cuda_without_a_gpu(run_model, dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused(args(run_model, dataset, tmp_path / "out", "--device", "cuda"), capsys, tmp_path / "out",
            r"--device cuda: torch sees no CUDA GPU .*use --device cpu, or auto")


def test_bf16_on_a_gpu_without_it(run_model, dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    refused(args(run_model, dataset, tmp_path / "out", "--device", "cuda", "--dtype", "bf16"), capsys,
            tmp_path / "out", r"--dtype bf16: this GPU \(Tesla T4\) has no bf16; use --dtype fp16")


def test_quantize_without_bitsandbytes(run_model, dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    refused(args(run_model, dataset, tmp_path / "out", "--quantize", "nf4"), capsys, tmp_path / "out",
            r"--quantize nf4 needs bitsandbytes, which cannot be imported .*pip install bitsandbytes")


def _break_config(folder, **changes):
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


BROKEN_MODELS = {  # how to break a model folder -> what the error says
    "no-config": (lambda d: os.remove(os.path.join(d, "config.json")), r"no config.json in .*needs config.json and"),
    "no-safetensors": (lambda d: os.remove(os.path.join(d, "model.safetensors")),
                       r"no \*\.safetensors in .*convert a PyTorch \.bin checkpoint"),
    "truncated": (lambda d: _truncate(os.path.join(d, "model.safetensors")),
                  r"cannot read .*model\.safetensors.*truncated or corrupt\. Delete it and download it again"),
    "corrupt": (lambda d: open(os.path.join(d, "model.safetensors"), "wb").write(b"\x07" * 4096),
                r"cannot read .*model\.safetensors.*truncated or corrupt"),
    "architecture": (lambda d: _break_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2"),
                     r"unsupported architecture \['GPT2LMHeadModel'\]; nanotune supports \[.*'LlamaForCausalLM'"),
    "vocab": (lambda d: _break_config(d, vocab_size=10),
              r"the tokenizer has \d+ tokens but the model's embedding has 10 rows.*Use the tokenizer of this model"),
}


@pytest.mark.parametrize("case", BROKEN_MODELS)
def test_broken_model_folder(run_model, dataset, tmp_path, capsys, case):
    folder = str(tmp_path / "model")
    shutil.copytree(run_model, folder)
    breaks, match = BROKEN_MODELS[case]
    breaks(folder)
    refused(args(folder, dataset, tmp_path / "out"), capsys, tmp_path / "out", match)


def test_hub_unreachable_offline(tmp_path):
    """The one full command-line run here: `python train.py` prints the error line, exits 2, no traceback."""
    hf = tmp_path / "hf"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub")}
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "train.py", "--model", "tinyllama", "--out-dir", str(out), "--device", "cpu"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: cannot download 'TinyLlama/TinyLlama-1.1B-Chat-v1.0': the hub is unreachable")
    assert "pass a local folder with config.json and *.safetensors: --model /path/to/folder" in r.stderr
    assert not out.exists()


def _write(path, text):
    path.write_text(text)
    return str(path)


DATASETS = {  # a bad --data -> what the error says
    "missing": (lambda d: str(d / "nope.jsonl"), r"no such file: '.*nope\.jsonl'\. The dataset can be a local"),
    "empty": (lambda d: _write(d / "e.jsonl", "\n"), r"e\.jsonl is empty: it needs at least one example"),
    "not-json": (lambda d: _write(d / "t.jsonl", '{"text": "a"}\nhello\n'),
                 r"t\.jsonl: line 2 is not valid JSON .*one JSON object per line"),
    "not-a-data-file": (lambda d: _write(d / "t.xlsx", "text\nhello\n"), r"unsupported file type '\.xlsx'"),
    "unknown-fields": (lambda d: _write(d / "u.jsonl", json.dumps({"question": "a", "answer": "b"}) + "\n"),
                       r"line 1: no known fields \(found \['answer', 'question'\]\)\. Known formats: 'text'"),
}


@pytest.mark.parametrize("case", DATASETS)
def test_bad_dataset(run_model, tmp_path, capsys, case):
    make, match = DATASETS[case]
    refused(args(run_model, make(tmp_path), tmp_path / "out"), capsys, tmp_path / "out", match)


def test_every_example_too_long(run_model, dataset, tmp_path, capsys):
    refused(args(run_model, dataset, tmp_path / "out", "--max-len", "8"), capsys, tmp_path / "out",
            r"every training example is longer than --max-len 8 \(the shortest has \d+ tokens\); raise --max-len")


def test_every_label_masked(run_model, dataset, tmp_path, capsys, monkeypatch):
    # Every valid example format trains at least its EOS; the guard is for what a custom encoder might do.
    encode = data.encode_example
    monkeypatch.setattr(data.cache, "encode_example",
                        lambda *a, **k: (encode(*a, **k)[0], [False] * len(encode(*a, **k)[0])))
    refused(args(run_model, dataset, tmp_path / "out"), capsys, tmp_path / "out",
            r"no example has any target token \(every label is masked\).*--train-on-inputs")


def test_out_dir_holding_a_run(run_model, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert train.cli(args(run_model, dataset, out)) == 2
    err = capsys.readouterr().err
    assert "already holds a run. Pass --resume auto to continue it, --overwrite to replace it" in err
    assert os.listdir(out) == ["metrics.jsonl"] and (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_out_dir_not_writable(run_model, dataset, tmp_path, capsys):
    """A path under a regular file can be written by no one, root included (chmod does not stop root)."""
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    refused(args(run_model, dataset, out), capsys, out, r"cannot write to --out-dir .*\(Not a directory: .*file'\)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; the test above covers root")
def test_out_dir_read_only(run_model, dataset, tmp_path, capsys):
    (tmp_path / "ro").mkdir(mode=0o500)
    out = tmp_path / "ro" / "out"
    refused(args(run_model, dataset, out), capsys, out, r"cannot write to --out-dir .*\(Permission denied")


def test_too_little_disk(run_model, dataset, tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2 << 30, (2 << 30) - (1 << 20), 1 << 20))
    refused(args(run_model, dataset, tmp_path / "out"), capsys, tmp_path / "out",
            r"only 1 MiB free in .*a checkpoint needs about \d+ MiB.*free space or use another --out-dir")


def test_resume_mismatch(run_model, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--max-steps", "1")) == 0
    before = sorted(os.listdir(out)), (out / "metrics.jsonl").read_text()
    capsys.readouterr()

    assert train.cli(args(run_model, dataset, out, "--max-steps", "2", "--resume", "auto", "--lora-r", "8")) == 2
    assert "the checkpoint was trained with lora_r=16, this run has 8. Resume with the same model and LoRA " \
           "settings" in capsys.readouterr().err
    folder = out / "checkpoints" / "step-0000001"
    _rewrite(folder, lambda ck: ck.update(world_size=2))  # as if 2 processes had written it
    assert train.cli(args(run_model, dataset, out, "--max-steps", "2", "--resume", "auto")) == 2
    assert "written by 2 process(es), this run has 1. Resume with the same number (torchrun --nproc_per_node=2)" \
           in capsys.readouterr().err
    assert (sorted(os.listdir(out)), (out / "metrics.jsonl").read_text()) == before, "a refused resume changed the run"

    missing = tmp_path / "new" / "checkpoints" / "step-0000001"
    refused(args(run_model, dataset, tmp_path / "new", "--resume", missing), capsys, tmp_path / "new",
            r"--resume .*step-0000001: no checkpoint found \(looked for .*new/checkpoints/step-0000001/state\.json\)")

def test_damaged_checkpoint_falls_back_to_the_one_before(run_model, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "2")) == 0
    ckpts = out / "checkpoints"
    newest = ckpts / "step-0000002" / "tensors.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated after it was written
    capsys.readouterr()
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3", "--resume", "auto",
                          "--resume-anyway")) == 0  # one more step than the first run
    captured = capsys.readouterr()
    assert f"warning: cannot read checkpoint {ckpts / 'step-0000002'}" in captured.err
    assert f"resumed from {ckpts / 'step-0000001'} at step 1" in captured.out
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]

    assert sorted(p for p in os.listdir(ckpts) if p.startswith("step-")) == ["step-0000002", "step-0000003"]
    (ckpts / "step-0000003" / "state.json").write_bytes(b"not a checkpoint")
    (ckpts / "step-0000002" / "state.json").write_text('{"weights": [0]}')  # readable, but not ours
    assert train.cli(args(run_model, dataset, out, "--max-steps", "4", "--resume", "auto")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: --resume auto: no readable checkpoint: ") and "step-0000002 (Damaged: state.json " \
        "does not match its sha256" in err
    assert "Delete them and resume from an earlier one (--resume PATH), or start again in a new --out-dir" in err


def test_disk_full_while_saving_keeps_the_previous_checkpoint(run_model, dataset, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    real_save, calls = statefiles.save_file, []

    def save(tensors, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:  # the second checkpoint: the disk fills up half way
            open(f, "wb").write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, f, *a, **k)

    monkeypatch.setattr(statefiles, "save_file", save)
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    ckpts = out / "checkpoints"
    assert err.startswith(f"error: cannot write checkpoint {ckpts / 'step-0000002'} ([Errno 28] No space left on "
                          f"device). Free disk space in {out}"), err
    assert f"the last good checkpoint is {ckpts / 'step-0000001'}: continue from it with --resume auto" in err
    assert sorted(os.listdir(ckpts)) == ["step-0000001"], "the partial save must be removed, the first kept"
    monkeypatch.setattr(statefiles, "save_file", real_save)
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3", "--resume", "auto")) == 0
    assert f"resumed from {ckpts / 'step-0000001'} at step 1" in capsys.readouterr().out


# ----------------------------------------------------------------------------- NaN / inf


def test_nan_stops_naming_step_and_checkpoint(run_model, dataset, tmp_path, capsys, monkeypatch):
    """An absurd lr (past what --lr accepts) overflows the weights after the first step; the run stops at the
    step that is NaN."""
    monkeypatch.setattr(train, "lr_at", lambda cfg, max_steps, step: 1e30)
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "5")) == 2
    err = capsys.readouterr().err
    ckpt = os.path.join(str(out), "checkpoints", "step-0000001")
    assert err.startswith("error: the loss or gradient is NaN/inf at step 2 "), err
    assert f"The last good checkpoint is {ckpt}: lower --lr (or check the data) and continue from it with " \
           f"--resume {ckpt}" in err
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_fp16_stops_after_too_many_skipped_steps(run_model, dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "choose_dtype", lambda cfg, device: (torch.float16, "test: fp16 on CPU"))
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--max-steps", "5", "--loss-scale", "1e30",
                          "--max-skipped-steps", "2")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 fp16 steps in a row had inf/NaN gradients (up to step 3; loss scale now "
                          "1.25e+29), more than --max-skipped-steps 2. No checkpoint was saved yet: lower --lr, "
                          "or use --dtype bf16"), err

# ----------------------------------------------------------------------------- interruptions


def test_killed_mid_checkpoint_keeps_the_previous_one(run_model, dataset, tmp_path, capsys):
    """SIGKILL while the second checkpoint is half written: the first stays whole, and --resume auto
    takes it (not the half-written *.tmp, which already holds a state.json)."""
    out = tmp_path / "out"
    stall_second_save = (
        "import sys, time, checkpoint, train\n"
        "real, calls = checkpoint.save_adapter, []\n"
        "def save_adapter(*a, **k):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        print('stalled mid-save', flush=True)\n"
        "        time.sleep(300)\n"
        "    real(*a, **k)\n"
        "checkpoint.save_adapter = save_adapter\n"
        "sys.exit(train.cli(sys.argv[1:]))\n")
    p = subprocess.Popen([sys.executable, "-c", stall_second_save,
                          *args(run_model, dataset, out, "--save-every", "2", "--max-steps", "10")],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in p.stdout:
            lines.append(line)
            if "stalled mid-save" in line:
                break
        p.kill()
    finally:
        p.wait(timeout=60)
    assert "stalled mid-save" in lines[-1], "".join(lines[-30:])
    ckpts = out / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step-0000002", "step-0000004.tmp"]
    assert (ckpts / "step-0000004.tmp" / "state.json").exists()
    assert (ckpts / "step-0000002" / "adapter" / "adapter_model.safetensors").exists()
    assert checkpoint.Checkpoints(config.TrainConfig(out_dir=str(out))).list()[-1] == str(ckpts / "step-0000002")

    assert train.cli(args(run_model, dataset, out, "--save-every", "2", "--max-steps", "3", "--resume", "auto",
                          "--resume-anyway")) == 0  # 3 steps, not the first run's 10
    assert f"resumed from {ckpts / 'step-0000002'} at step 2" in capsys.readouterr().out
    assert sorted(os.listdir(ckpts)) == ["step-0000002", "step-0000003"], "the stray *.tmp was not cleaned up"
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3], "records past the checkpoint must be dropped on resume"


def test_ctrl_c_checkpoints_and_resume_is_exact(run_model, dataset, tmp_path, capsys):
    """SIGINT after the first step: the step finishes, a checkpoint is written, exit 130 with how to resume;
    resuming reproduces the uninterrupted run's metrics exactly (lora dropout on: the RNG state counts)."""
    opts = ["--max-steps", "12", "--eval-every", "3", "--lora-dropout", "0.1", "--lr", "3e-3"]
    out = tmp_path / "out"
    code, stdout, stderr = signal_after_line(args(run_model, dataset, out, *opts), "step 1/12", signal.SIGINT)
    assert code == 130, stderr[-3000:]
    step = int(stdout.split("interrupted after step ")[1].split(":")[0])
    ckpt = out / "checkpoints" / f"step-{step:07d}"
    assert f"interrupted after step {step}: saved {ckpt}. To continue, run the same command with --resume auto" \
           in stdout
    assert 1 <= step < 12 and (ckpt / "state.json").exists()
    assert f"SIGINT: stopping after step {step}, then saving a checkpoint" in stderr, stderr[-3000:]

    assert train.cli(args(run_model, dataset, out, *opts, "--resume", "auto")) == 0
    assert train.cli(args(run_model, dataset, tmp_path / "ref", *opts)) == 0
    assert untimed(read_metrics(out)) == untimed(read_metrics(tmp_path / "ref"))


# ----------------------------------------------------------------------------- one run per folder


def test_keep_checkpoints(run_model, dataset, tmp_path, capsys):
    """0 keeps every checkpoint (the --help says so); 1 keeps the newest, the one just written."""
    with pytest.raises(SystemExit):
        config.parse_args(["--help"])
    assert "(0: keep all)" in " ".join(capsys.readouterr().out.split())
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3",
                          "--keep-checkpoints", 0)) == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step-0000001", "step-0000002", "step-0000003"]
    out = tmp_path / "one"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3",
                          "--keep-checkpoints", 1)) == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step-0000003"]
    assert f"checkpoint {out / 'checkpoints' / 'step-0000003'}" in capsys.readouterr().out


HOLD_LOCK = """
import fcntl, os, socket, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)  # as train.py does: a longer PID written by an earlier run must not show through
os.write(fd, f"{os.getpid()} {socket.gethostname()}\\n".encode())
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_folder_in_use_is_refused(run_model, dataset, tmp_path, capsys):
    """Another process holds out/.lock (as a running train.py does): a second run, even with --overwrite, stops
    with one line naming that process, and writes nothing; once the holder is gone, the folder is free."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--max-steps", "1")) == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out / ".lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
        capsys.readouterr()
        for extra in (["--resume", "auto"], ["--overwrite"]):
            assert train.cli(args(run_model, dataset, out, "--max-steps", "1", *extra)) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(f"error: --out-dir {str(out)!r} is in use by another run "
                                                           f"(PID {holder.pid} on "), err
            assert "wait for it to finish or stop it, or choose another --out-dir" in err
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before, "a refused run changed the folder"
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert train.cli(args(run_model, dataset, out, "--max-steps", "1", "--overwrite")) == 0


def test_the_lock_is_held_while_training_and_released_after(run_model, dataset, tmp_path, monkeypatch):
    out, seen = tmp_path / "out", []
    real = step.EagerStep.__call__

    def micro_step(*a):
        fd = os.open(out / ".lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append("free")
        except BlockingIOError:
            seen.append(open(out / ".lock").read().split()[0])
        finally:
            os.close(fd)
        return real(*a)

    monkeypatch.setattr(step.EagerStep, "__call__", micro_step)
    assert train.cli(args(run_model, dataset, out)) == 0
    assert seen == [str(os.getpid())] * 2
    fd = os.open(out / ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: raises BlockingIOError otherwise
    os.close(fd)


# ----------------------------------------------------------------------------- signals


class SignalLeaked(Exception):
    """A signal reached the test instead of train.py's handler."""


@pytest.fixture
def signal_guard():
    """SIGINT and SIGTERM raise SignalLeaked unless train.py handles them (pytest would stop on a SIGINT, and a
    SIGTERM would end the test process); the previous handlers come back afterwards."""
    def leaked(signum, frame):
        raise SignalLeaked(signal.Signals(signum).name)
    previous = {s: signal.signal(s, leaked) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def send_on_call(monkeypatch, owner, name, calls, signum, times=1):
    """Make call number `calls` (1-based) of owner.name send `signum` to this process `times` times first."""
    real, n = getattr(owner, name), []

    def wrapper(*a, **k):
        n.append(1)
        if len(n) == calls:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return real(*a, **k)

    monkeypatch.setattr(owner, name, wrapper)


def test_sigterm_stops_after_the_step_and_saves(run_model, dataset, tmp_path, capfd, monkeypatch, signal_guard):
    """SIGTERM (a scheduler, `timeout`, a container stop) during step 2: a line at once, the step finishes, a
    checkpoint is written, exit status 143 (128 + 15), and the run resumes from it."""
    out = tmp_path / "out"
    send_on_call(monkeypatch, step.EagerStep, "__call__", 2, signal.SIGTERM)
    assert train.cli(args(run_model, dataset, out, "--max-steps", "4")) == 143
    captured = capfd.readouterr()
    ckpt = out / "checkpoints" / "step-0000002"
    assert "SIGTERM: stopping after step 2, then saving a checkpoint" in captured.err
    assert f"interrupted after step 2: saved {ckpt}. To continue, run the same command with --resume auto" \
           in captured.out
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and (ckpt / "state.json").exists()
    assert not (out / "adapter").exists()


@pytest.mark.parametrize("owner, name, calls", [
    ("train", "any_rank", 1),  # at the top of step 1, before it starts
    ("train", "any_rank", 2),  # between steps 1 and 2: after step 1's line, before step 2 starts
    ("train", "log_step", 1),  # while step 1's line is written
    ("step.EagerStep", "__call__", 2),  # inside step 2
], ids=["before-step-1", "between-steps", "in-step-1-line", "in-step-2"])
def test_the_signal_line_names_the_step_the_run_stops_after(run_model, dataset, tmp_path, capfd, monkeypatch,
                                                            signal_guard, owner, name, calls):
    """Wherever in the loop a Ctrl-C lands, the step its line announces is the step the run stops after and
    saves: the loop decides at one point, after naming the step in progress."""
    out = tmp_path / "out"
    send_on_call(monkeypatch, {"train": train, "step.EagerStep": step.EagerStep}[owner], name, calls,
                 signal.SIGINT)
    assert train.cli(args(run_model, dataset, out, "--max-steps", "4")) == 130
    captured = capfd.readouterr()
    announced = int(captured.err.split("SIGINT: stopping after step ")[1].split(",")[0])
    stopped = int(captured.out.split("interrupted after step ")[1].split(":")[0])
    assert announced == stopped == read_metrics(out)[-1]["step"], (captured.err, captured.out)


def test_ctrl_c_while_saving_waits(run_model, dataset, tmp_path, capfd, monkeypatch, signal_guard):
    """Two Ctrl-C during the final checkpoint (the only one, --save-every 0): "saving, please wait"; the
    checkpoint, the eval and the adapter are all written, and the run is complete (exit 0)."""
    out = tmp_path / "out"
    send_on_call(monkeypatch, statefiles, "save_file", 1, signal.SIGINT, times=2)
    assert train.cli(args(run_model, dataset, out, "--eval-fraction", "0.1")) == 0
    captured = capfd.readouterr()
    assert captured.err.count("saving, please wait") == 2, captured.err
    assert "one more Ctrl-C aborts" in captured.err
    assert (out / "checkpoints" / "step-0000002" / "state.json").exists()
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert "eval_loss" in read_metrics(out)[-1] and "done: adapter in" in captured.out
    assert sorted(os.listdir(out / "checkpoints")) == ["step-0000002"]


def test_a_third_ctrl_c_aborts_the_save_and_loses_only_it(run_model, dataset, tmp_path, capfd, monkeypatch,
                                                          signal_guard):
    out = tmp_path / "out"
    send_on_call(monkeypatch, statefiles, "save_file", 2, signal.SIGINT, times=3)  # the step-2 (final) checkpoint
    assert train.cli(args(run_model, dataset, out, "--save-every", "1")) == 130
    err = capfd.readouterr().err
    ckpts = out / "checkpoints"
    assert err.endswith(f"interrupted: the newest checkpoint is {ckpts / 'step-0000001'}: continue from it with "
                        "--resume auto\n"), err
    assert "Traceback" not in err
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--resume", "auto")) == 0
    assert sorted(os.listdir(ckpts)) == ["step-0000001", "step-0000002"], "the aborted save's *.tmp is removed"


def test_ctrl_c_before_training_exits_at_once(run_model, dataset, tmp_path, capfd, monkeypatch, signal_guard):
    send_on_call(monkeypatch, train, "load_model", 1, signal.SIGINT)
    assert train.cli(args(run_model, dataset, tmp_path / "out")) == 130
    assert capfd.readouterr().err == "interrupted: no checkpoint was saved\n"
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- NaN never passes


@pytest.mark.parametrize("save_every, max_steps", [(0, 1), (1, 3)], ids=["final-checkpoint", "periodic"])
def test_nan_weights_are_never_saved(run_model, dataset, tmp_path, capsys, monkeypatch, save_every, max_steps):
    """An lr of inf (past what --lr accepts) turns the LoRA weights into NaN in step 1, with a finite loss and
    gradient. No checkpoint and no adapter is written, and none is named as the last good one."""
    monkeypatch.setattr(train, "lr_at", lambda cfg, max_steps, step: float("inf"))
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", save_every, "--max-steps", max_steps)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: not saving checkpoint {out / 'checkpoints' / 'step-0000001'}: ") and \
        "hold NaN/inf after step 1. No checkpoint was saved yet: lower --lr" in err, err
    assert not (out / "checkpoints").exists() and not (out / "adapter").exists()


def test_nonfinite_optimizer_state_is_found(run_model):
    model, _ = load_model(run_model, lora=LoRAConfig(r=2))
    params = dict(lora_parameters(model))
    optimizer = torch.optim.AdamW(param_groups(list(params.items()), 0.0))
    for p in params.values():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert checkpoint.nonfinite(model, optimizer) == []
    name = next(iter(params))
    optimizer.state[params[name]]["exp_avg_sq"][0, 0] = float("nan")
    assert checkpoint.nonfinite(model, optimizer) == [f"{name} (optimizer exp_avg_sq)"]


def test_nan_on_the_first_step_points_at_the_inputs(run_model, dataset, tmp_path, capsys):
    """A NaN in a base weight makes step 1's loss NaN before the adapter changed: the error says the learning
    rate is not the cause, and points at the weights, the data and the options."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "model"
    shutil.copytree(run_model, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert train.cli(args(str(folder), dataset, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the loss or gradient is NaN/inf at step 1 (loss nan"), err
    assert "before any update of the adapter, so the learning rate is not the cause" in err
    assert "Check the base model's weights, the data and the options" in err and "lower --lr" not in err


@pytest.mark.parametrize("bad", ["loss", "grad norm"])
@pytest.mark.parametrize("optimizer_kind", ["fused AdamW", "AdamW", "SGD"])
def test_nonfinite_step_is_skipped(bad, optimizer_kind):
    """LossScaler.step skips the update where the loss or grad norm is NaN/inf, for any optimizer: fused AdamW
    (the update is queued before the host reads them, and skipped on the device) leaves the weights and its
    state exactly as they were, and so do the others (stepped only after the host has seen them); the step
    does not count as an update."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = {"fused AdamW": lambda: torch.optim.AdamW([w], lr=0.1, fused=True),
                 "AdamW": lambda: torch.optim.AdamW([w], lr=0.1, fused=False, foreach=False),
                 "SGD": lambda: torch.optim.SGD([w], lr=0.1, momentum=0.9)}[optimizer_kind]()
    scaler = precision.LossScaler(1.0, 1, enabled=False)
    w.grad = torch.randn(4, 3)
    assert scaler.step(optimizer, torch.tensor(1.0), torch.tensor(2.0))
    before = w.detach().clone(), {k: v.clone() for k, v in optimizer.state[w].items()}
    w.grad = torch.full((4, 3), float("nan"))  # what a step would apply if it were not skipped
    loss, norm = (float("nan"), 2.0) if bad == "loss" else (1.0, float("inf"))
    assert not scaler.step(optimizer, torch.tensor(loss), torch.tensor(norm))
    assert torch.equal(w, before[0])
    assert all(torch.equal(optimizer.state[w][k], v) for k, v in before[1].items())
    w.grad = torch.randn(4, 3)
    assert scaler.step(optimizer, torch.tensor(1.0), torch.tensor(2.0))
    assert not torch.equal(w, before[0]) and torch.isfinite(w).all()
    if optimizer_kind != "SGD":  # Adam counts its updates
        assert precision.updates_applied(optimizer) == 2


# ----------------------------------------------------------------------------- exact resume


def test_resume_refuses_a_different_trajectory(run_model, dataset, tmp_path, capsys):
    """A resume with options that change what the run computes is refused, naming each difference, unless
    --resume-anyway; a model path with a trailing / is the same model."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1")) == 0
    before = sorted(os.listdir(out)), (out / "metrics.jsonl").read_text(), (out / "train_config.json").read_text()
    other = tmp_path / "other.jsonl"  # other examples, and more of them
    other.write_text("".join(json.dumps(e) + "\n" for e in data.builtin_dataset("train")[24:60]))
    step1 = out / "checkpoints" / "step-0000001"
    changed = ["--batch-size", "1", "--grad-accum", "2", "--max-steps", "3", "--resume", step1]
    assert train.cli(args(run_model, str(other), out, *changed)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume {step1}: this run differs from the checkpoint's in batch_size 2 -> 1; "
                          "grad_accum 1 -> 2; max_steps 2 -> 3; the tokenized training data"), err
    assert "pass --resume-anyway to continue with the new ones" in err
    assert (sorted(os.listdir(out)), (out / "metrics.jsonl").read_text(),
            (out / "train_config.json").read_text()) == before, "a refused resume changed the run"

    assert train.cli(args(run_model + "/", dataset, out, "--resume", "auto")) == 0  # nothing left to do
    assert train.cli(args(run_model, str(other), out, *changed, "--resume-anyway")) == 0
    captured = capsys.readouterr()
    assert f"warning: --resume-anyway: continuing {step1} with batch_size 2 -> 1;" in captured.err
    assert "The learning-rate schedule is the new one's from step 1 on: it does not restart its warm-up" in \
        captured.err, "max_steps changed: the warning says what becomes of the schedule"
    assert re.search(r"warning: the data changed: it now makes \d+ rows \(the checkpoint's made \d+\); reading it "
                     "from its first batch", captured.err), captured.err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_resuming_an_older_checkpoint_sets_the_newer_aside(run_model, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    ckpts = out / "checkpoints"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3",
                          "--keep-checkpoints", 0)) == 0
    capsys.readouterr()
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "2", "--keep-checkpoints", 0,
                          "--resume", ckpts / "step-0000001", "--resume-anyway", "--lr", "1e-3")) == 0
    out_text = capsys.readouterr().out
    aside = [d for d in os.listdir(ckpts) if d.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(os.listdir(ckpts / aside[0])) == ["step-0000002", "step-0000003"]
    assert f"moved 2 newer checkpoint(s) (step-0000002, step-0000003) of the abandoned run to {ckpts / aside[0]}: " \
           "this run continues from step 1" in out_text
    assert sorted(d for d in os.listdir(ckpts) if d.startswith("step-")) == ["step-0000001", "step-0000002"]
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "2", "--keep-checkpoints", 0,
                          "--resume", "auto", "--lr", "1e-3")) == 0
    assert f"resumed from {ckpts / 'step-0000002'} at step 2" in capsys.readouterr().out


def _flip_tensor_bytes(tensors):
    """Flip 16 bytes inside the tensor data of a safetensors file (past its 8-byte length and JSON header)."""
    with open(tensors, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
    with open(tensors, "r+b") as f:
        f.seek(start + 16)
        chunk = f.read(16)
        f.seek(start + 16)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _rewrite(folder, change):
    """Change a checkpoint's state and write its manifest again, as a different program would."""
    ck = statefiles.read_state(folder)
    change(ck)
    for name in ("state.json", "tensors.safetensors", "manifest.json"):
        os.remove(folder / name)
    statefiles.write_state(folder, ck)
    statefiles.write_manifest(folder)


def _rewrite_lora(folder, change):
    _rewrite(folder, lambda ck: change(ck["lora"]))


DAMAGES = {  # how the newest checkpoint is damaged -> what the warning says
    "flipped-bytes": (lambda d: _flip_tensor_bytes(d / "tensors.safetensors"),
                      r"tensors\.safetensors does not match its sha256 in manifest\.json: it changed after it was "
                      r"written"),
    "missing-tensor": (lambda d: _rewrite_lora(d, lambda lora: lora.pop(next(iter(lora)))),
                       r"its LoRA tensors do not fit the model: missing \['model\.layers\.0\..*lora_A'\]"),
    "wrong-shape": (lambda d: _rewrite_lora(d, lambda lora: lora.update({k: v[:1] for k, v in list(lora.items())[:1]})),
                    r"its LoRA tensors do not fit the model: shape of model\.layers\.0\..*lora_A \(1, (\d+)\) "
                    r"\(the model's is \(16, \1\)\)"),
    "no-state": (lambda d: os.remove(d / "state.json"), r"Damaged: no state\.json"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_checkpoint_is_found_and_skipped(run_model, dataset, tmp_path, capsys, damage):
    """A checkpoint changed after it was written (checksums), one whose tensors do not fit the model, and a
    folder without state.json: each is skipped with a warning, and the run resumes from the one before it."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1")) == 0
    make, match = DAMAGES[damage]
    make(out / "checkpoints" / "step-0000002")
    capsys.readouterr()
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--resume", "auto")) == 0
    captured = capsys.readouterr()
    assert re.search(rf"warning: cannot read checkpoint .*step-0000002 \(.*{match}", captured.err), captured.err
    assert f"resumed from {out / 'checkpoints' / 'step-0000001'} at step 1" in captured.out


def test_resume_auto_without_a_checkpoint_starts_a_new_run(run_model, dataset, tmp_path, capsys):
    """So that one command starts a job and restarts it; the records of a run that saved nothing go."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--resume", "auto")) == 0
    assert f"--resume auto: no checkpoint in {out / 'checkpoints'}; starting a new run" in capsys.readouterr().out
    shutil.rmtree(out / "checkpoints")
    assert train.cli(args(run_model, dataset, out, "--resume", "auto")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


# ----------------------------------------------------------------------------- metrics.jsonl


def _strict(line):
    def refuse(name):
        raise ValueError(f"bare {name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_metrics_are_strict_json(run_model, dataset, tmp_path, monkeypatch):
    """A skipped fp16 step has an inf grad norm: it is written as null."""
    monkeypatch.setattr(train, "choose_dtype", lambda cfg, device: (torch.float16, "test: fp16 on CPU"))
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--loss-scale", "1e30")) == 0
    rows = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["skipped"] and rows[0]["grad_norm"] is None


def test_resume_keeps_the_metrics_history_in_place(run_model, dataset, tmp_path, monkeypatch):
    """The records past the checkpoint are cut off in place (one truncate); the history before it is neither
    rewritten nor at risk: here every attempt to write an old record again fails, as a full disk would."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", "2", "--max-steps", "4")) == 0
    history = (out / "metrics.jsonl").read_bytes()
    dumps = json.dumps

    def failing_dumps(obj, *a, **k):
        if isinstance(obj, dict) and obj.get("step", 99) < 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return dumps(obj, *a, **k)

    monkeypatch.setattr(json, "dumps", failing_dumps)
    assert train.cli(args(run_model, dataset, out, "--save-every", "2", "--max-steps", "4",
                          "--resume", out / "checkpoints" / "step-0000002")) == 0
    after = (out / "metrics.jsonl").read_bytes()
    first_two = b"".join(history.splitlines(keepends=True)[:2])
    assert after.startswith(first_two) and [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


class FullDisk(io.TextIOWrapper):
    """metrics.jsonl on a disk that fills up after `room` records."""
    room = 2

    def write(self, s):
        FullDisk.room -= 1
        if FullDisk.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(s)


def test_disk_full_writing_metrics(run_model, dataset, tmp_path, capsys, monkeypatch):
    """One error line; an emergency checkpoint of the last complete step; the run resumes from it."""
    real_open = runlog.open_append
    out = tmp_path / "out"
    FullDisk.room = 2
    monkeypatch.setattr(runlog, "open_append", lambda path: FullDisk(open(path, "ab"), encoding="utf-8"))
    assert train.cli(args(run_model, dataset, out, "--max-steps", "4")) == 2
    err = capsys.readouterr().err
    ckpt = out / "checkpoints" / "step-0000003"
    assert err.count("\n") == 1 and err.startswith(f"error: cannot write {out / 'metrics.jsonl'} (No space left on "
                                                   f"device). The last good checkpoint is {ckpt}: free disk space in "
                                                   f"{out} and continue from it with --resume {ckpt}"), err
    monkeypatch.setattr(runlog, "open_append", real_open)
    assert train.cli(args(run_model, dataset, out, "--max-steps", "4", "--resume", "auto")) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 4]  # step 3's record was the one that did not fit


def test_disk_full_writing_the_adapter(run_model, dataset, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError
    real = checkpoint.save_adapter

    def save_adapter(model, folder, **k):
        if ".tmp" not in folder:  # the run's adapter/, not a checkpoint's
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(model, folder, **k)

    monkeypatch.setattr(checkpoint, "save_adapter", save_adapter)
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out)) == 2
    err = capsys.readouterr().err
    ckpt = out / "checkpoints" / "step-0000002"
    assert err.count("\n") == 1 and err.startswith(f"error: cannot write the adapter to {out / 'adapter'} "), err
    assert f"Nothing is lost: the final checkpoint {ckpt} holds the same weights, and {ckpt}/adapter is this " \
           "adapter" in err
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists()


# ----------------------------------------------------------------------------- out of memory


def test_out_of_memory_saves_the_last_step_and_says_what_to_do(run_model, dataset, tmp_path, capsys, monkeypatch):
    """A CUDA out-of-memory error in step 3 (simulated): one line with the fixes, after a checkpoint of step 2,
    rewound to where step 3 began, so that resuming it gives exactly the uninterrupted run (dropout on)."""
    opts = ["--max-steps", "4", "--lora-dropout", "0.1", "--lr", "3e-3"]
    real, calls = step.EagerStep.__call__, []

    def micro_step(*a):
        loss = real(*a)  # dropout has drawn its random numbers, gradients have accumulated
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return loss

    monkeypatch.setattr(step.EagerStep, "__call__", micro_step)
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, *opts)) == 2
    err = capsys.readouterr().err
    ckpt = out / "checkpoints" / "step-0000002"
    assert err == ("error: out of GPU memory in step 3 (micro-batches of 2 x 96 tokens). The last good checkpoint "
                   f"is {ckpt}: lower --batch-size (a larger --grad-accum keeps the step's size) or --max-len, or add "
                   "--offload-activations (a resume with other sizes needs --resume-anyway) and continue from it with "
                   f"--resume {ckpt}\n"), err
    monkeypatch.setattr(step.EagerStep, "__call__", real)
    assert train.cli(args(run_model, dataset, out, *opts, "--resume", "auto")) == 0
    assert train.cli(args(run_model, dataset, tmp_path / "ref", *opts)) == 0
    assert untimed(read_metrics(out)) == untimed(read_metrics(tmp_path / "ref"))


def test_activation_memory_estimate(run_model, monkeypatch):
    mcfg = read_config(run_model)
    cfg = config.TrainConfig(model=run_model, max_len=256, batch_size=4, gradient_checkpointing=True)
    base = memory.activation_bytes(cfg, mcfg, torch.bfloat16, False, checkpointing=True)
    assert memory.activation_bytes(dataclasses.replace(cfg, batch_size=8), mcfg, torch.bfloat16, False, True) > \
        1.9 * base
    assert memory.activation_bytes(cfg, mcfg, torch.bfloat16, False, checkpointing=False) > base
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (base // 2, 80 << 30))
    warning = memory.memory_warning(cfg, mcfg, torch.bfloat16, False, torch.device("cuda"), True)
    assert warning.startswith("warning: a micro-batch of 4 x 256 tokens needs about ") and \
        "expect out-of-memory. To fit: lower --batch-size" in warning and "add --offload-activations" in warning
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * base, 80 << 30))
    assert memory.memory_warning(cfg, mcfg, torch.bfloat16, False, torch.device("cuda"), True) is None
    assert memory.memory_warning(cfg, mcfg, torch.bfloat16, False, torch.device("cpu"), True) is None


def test_offload_beyond_the_host_memory_is_warned(run_model, monkeypatch):
    """Activation offload keeps every layer's input of a micro-batch in page-locked host memory: more than the
    host has available gets one warning line before training, with what to change; nothing without offload."""
    available = memory.host_available()  # this machine's: bytes, or None where /proc/meminfo is missing
    assert available is None or available > 0
    mcfg = read_config(run_model)
    cfg = config.TrainConfig(model=run_model, max_len=256, batch_size=4, gradient_checkpointing=True,
                             offload_activations=True)
    need = mcfg.n_layers * 4 * 256 * mcfg.hidden_size * 2
    assert memory.offload_bytes(cfg, mcfg, torch.bfloat16) == need
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 << 30, 80 << 30))
    monkeypatch.setattr(memory, "host_available", lambda: need)
    warning = memory.memory_warning(cfg, mcfg, torch.bfloat16, False, torch.device("cuda"), True)
    assert warning.startswith("warning: activation offload keeps every layer's input of a 4 x 256 micro-batch") and \
        "expect the host to run out of memory" in warning and "--no-offload-activations" in warning
    monkeypatch.setattr(memory, "host_available", lambda: 2 * need)
    assert memory.memory_warning(cfg, mcfg, torch.bfloat16, False, torch.device("cuda"), True) is None
    monkeypatch.setattr(memory, "host_available", lambda: need)
    no_offload = dataclasses.replace(cfg, offload_activations=False)
    assert memory.memory_warning(no_offload, mcfg, torch.bfloat16, False, torch.device("cuda"), True) is None


@pytest.mark.parametrize("room", ["all", "o", "attention", "none"])
def test_the_offload_line_says_what_waits_in_host_memory(run_model, monkeypatch, room):
    """On a CUDA GPU with offload, the header says what a micro-batch keeps in page-locked host memory: the layer
    inputs, and where the host has room for them the attention outputs (then backward does not recompute attention),
    o's outputs (nor o) and q | k | v's (nor q | k | v); no line on a CPU or without offload."""
    import model.offload
    net, mcfg = load_model(run_model, lora=LoRAConfig(r=4))
    cfg = config.TrainConfig(model=run_model, max_len=8192, batch_size=64, gradient_checkpointing=True,
                             offload_activations=True)  # long enough for GiB in two decimals
    tokens = 64 * 8192
    inputs = mcfg.n_layers * tokens * mcfg.hidden_size * 2
    attention = mcfg.n_layers * tokens * mcfg.n_heads * (mcfg.head_dim * 2 + 4)  # bf16 outputs, fp32 lse
    qkv = mcfg.n_layers * tokens * (mcfg.n_heads + 2 * mcfg.n_kv_heads) * mcfg.head_dim * 2
    outputs = mcfg.n_layers * tokens * mcfg.hidden_size * 2
    kept = {"all": attention + outputs + qkv, "o": attention + outputs, "attention": attention, "none": 0}[room]
    monkeypatch.setattr(model.offload, "host_available", lambda: inputs + 2 * kept)
    line = memory.offload_line(net, cfg, torch.bfloat16, torch.device("cuda"))
    what, then = {"all": ("layer inputs, attention outputs and o's and q | k | v's outputs",
                          "recomputes neither attention nor o nor q | k | v"),
                  "o": ("layer inputs, attention outputs and o's outputs", "recomputes neither attention nor o"),
                  "attention": ("layer inputs and attention outputs", "does not recompute attention"),
                  "none": ("layer inputs", "recomputes attention")}[room]
    assert line == (f"activation offload: a micro-batch's {what} wait in page-locked host memory, about "
                    f"{(inputs + kept) / 2**30:.2f} GiB; backward {then}")
    assert memory.offload_line(net, cfg, torch.bfloat16, torch.device("cpu")) is None
    no_offload = dataclasses.replace(cfg, offload_activations=False)
    assert memory.offload_line(net, no_offload, torch.bfloat16, torch.device("cuda")) is None


def test_checkpointing_follows_the_free_memory(run_model, monkeypatch):
    """Left unset, gradient checkpointing is off where every layer's activations fit in half of the free GPU
    memory, on where they do not, and on without a CUDA GPU; a value given is kept."""
    mcfg = read_config(run_model)
    cfg = config.TrainConfig(model=run_model, max_len=256, batch_size=4)
    need = memory.activation_bytes(cfg, mcfg, torch.bfloat16, False, checkpointing=False)
    choose = lambda c, device="cuda": memory.choose_checkpointing(c, mcfg, torch.bfloat16, False,  # noqa: E731
                                                                    torch.device(device), world=1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * need, 80 << 30))
    on, why = choose(cfg)
    assert not on and why.startswith(f"the activations of every layer (about {need / 2**30:.1f} GiB) fit in half"), why
    assert choose(dataclasses.replace(cfg, gradient_checkpointing=True)) == (True, "as requested")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * need - 1, 80 << 30))
    on, why = choose(cfg)
    assert on and why.startswith("without it the activations"), why
    assert choose(dataclasses.replace(cfg, gradient_checkpointing=False)) == (False, "as requested")
    assert choose(cfg, "cpu")[0] is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_out_of_memory(run_model, dataset, tmp_path, capsys, monkeypatch):
    """What the CUDA allocator raises (step 2 asks for 1 PiB) is caught: one line, after a checkpoint of step 1;
    the estimate warns before the first step for a micro-batch far past the free memory."""
    real, calls = step.EagerStep.__call__, []

    def micro_step(*a):
        if threading.current_thread() is not threading.main_thread():  # the warm start's step (step.py)
            return real(*a)
        calls.append(1)
        if len(calls) == 2:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        return real(*a)

    monkeypatch.setattr(step.EagerStep, "__call__", micro_step)
    out = tmp_path / "out"
    # eager steps: a capture would call the eager step three times in step 1 (two warm-ups, the capture)
    assert train.cli(args(run_model, dataset, out, "--device", "cuda", "--dtype", "bf16", "--kernels",
                          "--cuda-graphs", "off")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of GPU memory in step 2 "), err
    assert (out / "checkpoints" / "step-0000001" / "state.json").exists()
    mcfg = read_config(run_model)
    cfg = config.TrainConfig(model=run_model, max_len=256, batch_size=10 ** 6)
    assert "expect out-of-memory" in memory.memory_warning(cfg, mcfg, torch.bfloat16, True, torch.device("cuda"), True)
