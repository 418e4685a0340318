"""Reliability (issue 7): every bad input is one early `error: ...` line (exit 2, no traceback, no output
folder); checkpoints are atomic; Ctrl-C checkpoints and resumes exactly; NaN never passes silently.

Most cases call `train.cli` in-process: it is what `python train.py` runs, and an exception that
escapes it is a traceback. Subprocesses are kept to what needs a process: hub offline mode (read at
import), and signals.
"""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import namedtuple

import pytest
import torch

import checkpoint
import data
import train
from tests.helpers import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """24 short Alpaca examples: a run on them starts in a fraction of the builtin dataset's time."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in data.builtin_dataset("train")[:24]))
    return str(path)


def args(run_model, dataset, out, *extra):
    return ["--model", run_model, "--data", dataset, "--out-dir", str(out), "--device", "cpu", "--dtype", "fp32",
            "--no-kernels", "--max-len", "96", "--batch-size", "2", "--max-steps", "2", "--warmup-steps", "1",
            "--eval-every", "0", "--save-every", "0", "--eval-batches", "1", *map(str, extra)]


def refused(argv, capsys, out, match):
    """`train.py argv` stops with exit status 2 and one error line matching `match`, before creating `out`."""
    assert train.cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(match, err), err
    assert not os.path.exists(out), f"{out} was created"
    return err


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("extra, match", [
    (["--model", "no-such-model"], r"unknown model 'no-such-model'.*Known short names: .*tinyllama"),
    (["--batch-size", "0"], r"--batch-size must be > 0, got 0"),
    (["--max-len", "-1"], r"--max-len must be > 0, got -1"),
    (["--lr", "0"], r"--lr must be > 0, got 0"),
    (["--lr=-1e-4"], r"--lr must be > 0, got -0.0001"),
    (["--lora-targets", "q_proj,qkv"], r"unknown module\(s\) \['qkv'\]; this model has q_proj,k_proj"),
    (["--dtype", "fp16"], r"--dtype fp16 needs a CUDA GPU .* use --dtype fp32 on CPU"),
], ids=["model-name", "batch-size", "max-len", "lr-zero", "lr-negative", "lora-targets", "fp16-on-cpu"])
def test_bad_option(run_model, dataset, tmp_path, capsys, extra, match):
    refused(args(run_model, dataset, tmp_path / "out", *extra), capsys, tmp_path / "out", match)


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
    "not-a-json-file": (lambda d: _write(d / "t.csv", "text\nhello\n"), r"unsupported file type '\.csv'"),
    "unknown-fields": (lambda d: _write(d / "u.jsonl", json.dumps({"prompt": "a", "completion": "b"}) + "\n"),
                       r"line 1: no known fields \(found \['completion', 'prompt'\]\)\. Known formats: 'text'"),
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
    monkeypatch.setattr(data, "encode_example", lambda *a, **k: (encode(*a, **k)[0], [False] * len(encode(*a, **k)[0])))
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
    state = out / "checkpoints" / "step-0000001" / "state.pt"
    ck = torch.load(state, weights_only=False)
    torch.save({**ck, "world_size": 2}, state)
    assert train.cli(args(run_model, dataset, out, "--max-steps", "2", "--resume", "auto")) == 2
    assert "written by 2 process(es), this run has 1. Resume with the same number (torchrun --nproc_per_node=2)" \
           in capsys.readouterr().err
    assert (sorted(os.listdir(out)), (out / "metrics.jsonl").read_text()) == before, "a refused resume changed the run"

    refused(args(run_model, dataset, tmp_path / "new", "--resume", "auto"), capsys, tmp_path / "new",
            r"--resume auto: no checkpoint found \(looked for .*new/checkpoints/step-\*/state\.pt\)")

def test_damaged_checkpoint_falls_back_to_the_one_before(run_model, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "2")) == 0
    ckpts = out / "checkpoints"
    newest = ckpts / "step-0000002" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated after it was written
    capsys.readouterr()
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3", "--resume", "auto")) == 0
    captured = capsys.readouterr()
    assert f"warning: cannot read checkpoint {ckpts / 'step-0000002'}" in captured.err
    assert f"resumed from {ckpts / 'step-0000001'} at step 1" in captured.out
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]

    assert sorted(os.listdir(ckpts)) == ["step-0000002", "step-0000003"]  # --keep-checkpoints 2
    (ckpts / "step-0000003" / "state.pt").write_bytes(b"not a checkpoint")
    torch.save({"weights": torch.zeros(1)}, ckpts / "step-0000002" / "state.pt")  # readable, but not ours
    assert train.cli(args(run_model, dataset, out, "--max-steps", "4", "--resume", "auto")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: --resume auto: no readable checkpoint: ") and "step-0000002 (KeyError" in err
    assert "Delete them and resume from an earlier one (--resume PATH), or start again in a new --out-dir" in err


def test_disk_full_while_saving_keeps_the_previous_checkpoint(run_model, dataset, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    real_save, calls = torch.save, []

    def save(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:  # the second checkpoint: the disk fills up half way
            open(f, "wb").write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    ckpts = out / "checkpoints"
    assert err.startswith(f"error: cannot write checkpoint {ckpts / 'step-0000002'} ([Errno 28] No space left on "
                          f"device). Free disk space in {out}"), err
    assert f"the last good checkpoint is {ckpts / 'step-0000001'}: continue from it with --resume auto" in err
    assert sorted(os.listdir(ckpts)) == ["step-0000001"], "the partial save must be removed, the first kept"
    monkeypatch.setattr(torch, "save", real_save)
    assert train.cli(args(run_model, dataset, out, "--save-every", "1", "--max-steps", "3", "--resume", "auto")) == 0
    assert f"resumed from {ckpts / 'step-0000001'} at step 1" in capsys.readouterr().out


# ----------------------------------------------------------------------------- NaN / inf


def test_nan_stops_naming_step_and_checkpoint(run_model, dataset, tmp_path, capsys):
    """An absurd lr overflows the weights after the first step; the run stops at the step that is NaN."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--lr", "1e30", "--save-every", "1", "--max-steps", "5")) == 2
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
    takes it (not the half-written *.tmp, which already holds a state.pt)."""
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
    assert (ckpts / "step-0000004.tmp" / "state.pt").exists()
    assert (ckpts / "step-0000002" / "adapter" / "adapter_model.safetensors").exists()
    assert checkpoint.RunFolder(train.TrainConfig(out_dir=str(out))).checkpoints()[-1] == str(ckpts / "step-0000002")

    assert train.cli(args(run_model, dataset, out, "--save-every", "2", "--max-steps", "3", "--resume", "auto")) == 0
    assert f"resumed from {ckpts / 'step-0000002'} at step 2" in capsys.readouterr().out
    assert sorted(os.listdir(ckpts)) == ["step-0000002", "step-0000003"], "the stray *.tmp was not cleaned up"
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3], "records past the checkpoint must be dropped on resume"


def test_ctrl_c_checkpoints_and_resume_is_exact(run_model, dataset, tmp_path, capsys):
    """SIGINT after the first step: the step finishes, a checkpoint is written, exit 0 with how to resume;
    resuming reproduces the uninterrupted run's metrics exactly (lora dropout on: the RNG state counts)."""
    opts = ["--max-steps", "12", "--eval-every", "3", "--lora-dropout", "0.1", "--lr", "3e-3"]
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-u", "train.py", *args(run_model, dataset, out, *opts)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("step 1/12"):
            p.send_signal(signal.SIGINT)
            break
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-3000:]
    step = int(stdout.split("interrupted after step ")[1].split(":")[0])
    ckpt = out / "checkpoints" / f"step-{step:07d}"
    assert f"interrupted after step {step}: saved {ckpt}. To continue, run the same command with --resume auto" \
           in stdout
    assert 1 <= step < 12 and (ckpt / "state.pt").exists()

    assert train.cli(args(run_model, dataset, out, *opts, "--resume", "auto")) == 0
    assert train.cli(args(run_model, dataset, tmp_path / "ref", *opts)) == 0
    drop_timing = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]  # noqa: E731
    assert drop_timing(read_metrics(out)) == drop_timing(read_metrics(tmp_path / "ref"))
