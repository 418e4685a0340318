"""The train.py experience: --help, --config files, --num-epochs, the progress display, hardware defaults,
device and dtype choice, the NF4 header, quiet imports and downloads, runs without Triton, and samples."""
import dataclasses
import importlib.util
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import tomllib
import torch

import config
import data
import evaluation
import runlog
import train
from model import LoRAConfig, load_model, load_tokenizer
from model.adapters import load_with_adapter
from model.generate import generate, stop_ids
from tests.helpers import builtin_jsonl, read_metrics, refused, untimed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """60 Alpaca examples of the builtin dataset, 6 of them held out (--eval-fraction 0.1): quick to tokenize."""
    return builtin_jsonl(str(tmp_path_factory.mktemp("data")), 60)


def args(run_model, dataset, out, *extra, steps=3):
    """A few seconds of training, samples off unless asked for."""
    return ["--model", run_model, "--data", dataset, "--eval-fraction", "0.1", "--out-dir", str(out),
            "--device", "cpu", "--no-kernels", "--max-len", "96",
            "--batch-size", "2", "--warmup-steps", "1", "--eval-every", "0", "--save-every", "0", "--eval-batches",
            "1", "--sample-every", "0", *(["--max-steps", str(steps)] if steps else []), *map(str, extra)]


def held_out_rows(cfg, tok):
    """The eval rows train.py reads for `cfg` (load_datasets with its data options)."""
    return data.load_datasets(tok, **cfg.data_options(), log=lambda line: None, with_rows=True)[2]




def run_python(code, *argv):
    """Run `code` in a fresh interpreter at the repository root; (status, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, argv)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


# ----------------------------------------------------------------------------- --help


def test_help_shows_defaults_and_choices():
    text = " ".join(config.build_parser().format_help().split())  # the help, unwrapped
    assert "--dtype {auto,bf16,fp16,fp32}" in text and "--quantize {nf4}" in text
    assert "--device {auto,cpu,cuda,cuda:N,mps}" in text and "untested here" in text
    assert "(any of: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)" in text
    assert "--lr LR peak learning rate" in text and "(default: 0.0002)" in text
    assert f"(default: {config.GPU_DEFAULTS['max_len']}; {config.CPU_DEFAULTS['max_len']} on CPU and mps)" in text
    assert "(default: -1)" in text and "--config FILE" in text
    assert "(default: None)" not in text, "an option without a default says what happens in its own help"
    assert "python train.py --model tinyllama" in text, "the description keeps its examples"


def test_help_groups_its_options():
    """--help lists the options under the groups of config.OPTION_GROUPS, each group once, in that order, and
    every option in exactly one of them."""
    text = config.build_parser().format_help()
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == ["options", *config.OPTION_GROUPS], titles
    names = [n for group in config.OPTION_GROUPS.values() for n in group]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(config.TrainConfig))
    model_part = text.split("\nmodel:\n")[1].split("\ndata:\n")[0]
    assert "--tokenizer" in model_part and "--lr" not in model_part


def test_a_tokenizer_of_another_folder(run_model, dataset, tmp_path, capsys):
    """--tokenizer loads the tokenizer from another folder; one the model cannot embed is refused."""
    other = tmp_path / "tok"
    shutil.copytree(run_model, other)
    assert train.cli(args(run_model, dataset, tmp_path / "out", "--tokenizer", str(other))) == 0
    from tests.tiny_tokenizer import make_test_tokenizer
    big = tmp_path / "big"
    make_test_tokenizer(str(big), tokens=[f"word{i}" for i in range(1000)])
    refused(args(run_model, dataset, tmp_path / "out2", "--tokenizer", str(big)), capsys, tmp_path / "out2",
            r"the tokenizer has \d+ tokens but the model's embedding has \d+ rows")


def test_plot_without_matplotlib_is_one_line(tmp_path):
    """scripts/plot.py names the extra to install where matplotlib is missing (CI has none)."""
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed here")
    except ImportError:
        pass
    r = subprocess.run([sys.executable, "scripts/plot.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == ('error: plot.py draws with matplotlib, which is not installed: '
                                                      'pip install -e ".[plot]"'), r.stderr


def test_script_help_shows_defaults():
    """Each script's --help shows its defaults; export_gguf.py, without the optional gguf package, says in one
    line how to install it."""
    code = """
        import contextlib, io, runpy, sys
        for script in ("generate.py", "export_gguf.py", "merge.py"):
            sys.argv, text = [script, "--help"], io.StringIO()
            with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
                runpy.run_path("scripts/" + script, run_name="__main__")
            print(script, "(default: as-trained)" in " ".join(text.getvalue().split()))
    """
    status, out, err = run_python(code)
    has_gguf = importlib.util.find_spec("gguf") is not None
    assert status == 0 and out.split() == ["generate.py", "True", "export_gguf.py", str(has_gguf), "merge.py",
                                           "True"], out + err[-2000:]
    if not has_gguf:
        status, out, err = run_python("import runpy, sys; sys.argv = ['export_gguf.py', '--help']; "
                                      "runpy.run_path('scripts/export_gguf.py', run_name='__main__')")
        assert status == 1 and err.strip().splitlines() == ["error: reading or writing GGUF files needs the gguf "
                                                            "package: pip install 'gguf>=0.10' (or pip install -e "
                                                            "'.[gguf]')"], err


# ----------------------------------------------------------------------------- --config


def test_config_file_then_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("max-len: 64\nlr: 2e-4  # YAML reads this as a string\nlora_targets: q_proj,v_proj\n"
                    "packing: false\nnum_epochs: 2\noverwrite: true\n")
    cfg = config.parse_args(["--config", str(path), "--max-len", "80"])
    assert (cfg.max_len, cfg.lr, cfg.lora_targets, cfg.packing, cfg.num_epochs) == (80, 2e-4, "q_proj,v_proj", False, 2)
    assert cfg.overwrite is False, "what to do with an existing run folder comes from the command line only"
    assert cfg.batch_size is None, "an option in neither place keeps its default"
    # --max-steps on the command line replaces the file's --num-epochs, and the other way round.
    cfg = config.parse_args(["--config", str(path), "--max-steps", "7"])
    assert (cfg.max_steps, cfg.num_epochs) == (7, None)
    path.write_text(json.dumps({"max_steps": 9}))
    path = path.rename(tmp_path / "run.json")
    assert (config.parse_args(["--config", str(path), "--num-epochs", "1.5"]).num_epochs,
            config.parse_args(["--config", str(path)]).max_steps) == (1.5, 9)


@pytest.mark.parametrize("text, match", [
    ("max_len: 64\nlearning_rate: 1e-4\n", r"run\.yaml: unknown option 'learning_rate'; the options are those of "
                                           r"train\.py --help"),
    ("max_len: sixty\n", r"run\.yaml: max_len must be an integer or null, got 'sixty'"),
    ("packing: 1\n", r"run\.yaml: packing must be true or false, got 1"),
    ("max_steps: 10\nnum_epochs: 2\n", r"--max-steps 10 and --num-epochs 2\.0 both set the run's length: pass one"),
    ("- max_len\n", r"run\.yaml: expected option: value pairs at the top level, got a list"),
    ("max_len: [1\n", r"run\.yaml: not valid YAML \(line 2"),
], ids=["unknown-key", "not-an-int", "not-a-bool", "steps-and-epochs", "a-list", "bad-yaml"])
def test_bad_config_file(run_model, tmp_path, capsys, text, match):
    (tmp_path / "run.yaml").write_text(text)
    refused(["--config", str(tmp_path / "run.yaml"), "--out-dir", str(tmp_path / "out")], capsys, tmp_path / "out",
            match)


def test_steps_and_epochs_on_the_command_line(run_model, dataset, tmp_path, capsys):
    refused(args(run_model, dataset, tmp_path / "out", "--num-epochs", "1"), capsys, tmp_path / "out",
            r"--max-steps 3 and --num-epochs 1\.0 both set the run's length: pass one")


def test_train_config_json_repeats_the_run(run_model, dataset, tmp_path, monkeypatch):
    """A run's train_config.json, passed back to --config with another --out-dir, gives the same metrics
    (samples included); it records the hardware defaults the run took."""
    monkeypatch.setattr(evaluation, "SAMPLE_TOKENS", 8)  # short answers: a quicker test
    first, again = tmp_path / "first", tmp_path / "again"
    argv = ["--model", run_model, "--data", dataset, "--eval-fraction", "0.1", "--out-dir", str(first), "--device",
            "cpu", "--max-steps", "2", "--warmup-steps", "1", "--eval-every", "1", "--lr", "3e-3", "--batch-size", "2"]
    assert train.cli(argv) == 0
    with open(first / "train_config.json") as f:
        recorded = json.load(f)
    assert (recorded["max_len"], recorded["eval_batches"]) == (config.CPU_DEFAULTS["max_len"],
                                                              config.CPU_DEFAULTS["eval_batches"])
    assert recorded["gradient_checkpointing"] is True, "the choice left to the run is recorded, not null"
    assert train.cli(["--config", str(first / "train_config.json"), "--out-dir", str(again)]) == 0
    rows = read_metrics(first)
    assert any("samples" in r for r in rows) and any("eval_loss" in r for r in rows)
    assert untimed(read_metrics(again)) == untimed(rows)


def test_example_config_is_valid():
    cfg = config.parse_args(["--config", os.path.join(ROOT, "docs", "example-config.yaml")])
    assert cfg.model and cfg.lr > 0


# ----------------------------------------------------------------------------- --num-epochs


def test_num_epochs_sets_the_steps(run_model, dataset, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--num-epochs", "0.5", "--grad-accum", "2", steps=None)) == 0
    stdout = capsys.readouterr().out
    n_batches = int(re.search(r"(\d+) batches per epoch", stdout)[1])
    steps = math.ceil(0.5 * n_batches / 2)
    assert f"training {steps} steps: " in stdout and "(--num-epochs 0.5), 2 micro-batch(es) per step" in stdout
    assert len([r for r in read_metrics(out) if "loss" in r]) == steps
    with open(out / "train_config.json") as f:
        recorded = json.load(f)
    assert (recorded["max_steps"], recorded["num_epochs"]) == (steps, None), "repeats the same steps via --config"


def test_run_length_warns_when_the_warm_up_is_the_whole_run():
    cfg = config.TrainConfig(max_steps=4, warmup_steps=4)
    steps, lines = config.run_length(cfg, batches_per_epoch=8)
    assert steps == 4 and lines[0] == "training 4 steps: 0.5 epochs of 8 batches, 1 micro-batch(es) per step"
    assert lines[1].startswith("warning: --warmup-steps 4 is not below the run's 4 steps")
    cfg = config.TrainConfig(num_epochs=1.5, warmup_steps=3, grad_accum=4)
    steps, lines = config.run_length(cfg, batches_per_epoch=10)
    assert (steps, len(lines)) == (4, 1)  # ceil(15 / 4)
    assert cfg.max_steps is None and cfg.num_epochs == 1.5, "the parsed options are never changed"


# ----------------------------------------------------------------------------- progress


@pytest.mark.parametrize("rate, text", [(17.2, "17 tok/s"), (950, "950 tok/s"), (999.7, "1.0k tok/s"),
                                        (1234, "1.2k tok/s"), (35_100, "35.1k tok/s"), (1.23e6, "1.2M tok/s")])
def test_human_rate(rate, text):
    assert runlog.human_rate(rate) == text


def test_human_duration():
    assert [runlog.human_duration(s) for s in (45, 720, 9000)] == ["45 s", "12 min", "2.5 h"]


def test_plain_lines_without_a_terminal(run_model, dataset, tmp_path, capsys, monkeypatch):
    """Not a terminal: a line per step with a readable rate, on CPU the process's memory, and the time left;
    the first step's rate leaves out the step-0 eval; one line estimates the time left after the second step."""
    real, skipped, pause = train.evaluate, [0.0], 1000.0

    def slow_evaluate(*a, **k):  # takes `pause` seconds, as every clock train.py may read sees it
        skipped[0] += pause
        return real(*a, **k)

    def shifted(clock):  # the real clock, plus the pauses of the evaluations so far
        return lambda: clock() + skipped[0]

    monkeypatch.setattr(train, "evaluate", slow_evaluate)
    for name in ("time", "perf_counter", "monotonic"):
        monkeypatch.setattr(time, name, shifted(getattr(time, name)))
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--eval-every", "2")) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"^estimated time: about \d+ s for the 1 step left \([\d.e-]+ s per step after the first",
                     stdout, re.M), stdout
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3, stdout
    for line in lines:
        assert re.fullmatch(r"step \d/3 \| loss [\d.]+ \| lr [\d.e+-]+ \| grad norm [\d.]+ \| "
                            r"\d+(\.\d[kM])? tok/s \| RSS \d+\.\d\d GiB( \| ETA [\d.]+ (s|min|h))?", line), line
    assert ["ETA" in line for line in lines] == [False, True, False], ("the time left, once a step after the first "
                                                                        "is timed")
    first = next(r for r in read_metrics(out) if "loss" in r)
    counted = 2 * 96 / first["tokens_per_s"]  # the seconds that step 1's rate counts (2 packed rows of 96)
    assert counted < pause, f"step 1's rate counts {counted:.2f} s: the {pause} s eval before it is in it"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal(run_model, dataset, tmp_path, monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    assert train.cli(args(run_model, dataset, tmp_path / "out", "--eval-every", "2")) == 0
    text = screen.getvalue()
    assert "3/3" in text and ("step/s" in text or "s/step" in text), text
    assert re.search(r"loss [\d.]+, \d+(\.\d[kM])? tok/s", text), text
    assert not re.search(r"^step \d/3 \|", text, re.M), "the bar replaces the plain lines"
    assert "eval step 2: loss" in text and "estimated time: about" in text, "other lines still show"
    assert len(read_metrics(tmp_path / "out")) == 3 + 3, "metrics.jsonl gets every step (and eval) either way"


# ----------------------------------------------------------------------------- hardware


def test_cpu_defaults_fill_what_is_unset():
    cfg, line = config.with_hardware_defaults(config.TrainConfig(device="cpu", eval_batches=5), "cpu")
    assert (cfg.max_len, cfg.batch_size, cfg.eval_batches, cfg.max_steps) == (
        config.CPU_DEFAULTS["max_len"], config.CPU_DEFAULTS["batch_size"], 5, config.CPU_DEFAULTS["max_steps"])
    assert line == f"CPU defaults: max-len {config.CPU_DEFAULTS['max_len']}; set them to override"
    assert cfg.offload_activations is False, "layer inputs have no slower memory to go to on the CPU"
    cfg, _ = config.with_hardware_defaults(config.TrainConfig(device="cpu", num_epochs=1.0), "cpu")
    assert cfg.max_steps is None, "--num-epochs decides the steps once the data is read"


def test_gpu_defaults():
    cfg, line = config.with_hardware_defaults(config.TrainConfig(device="cuda"), "cuda")
    assert line is None and {k: getattr(cfg, k) for k in config.GPU_DEFAULTS} == config.GPU_DEFAULTS
    assert cfg.offload_activations is True, "checkpointed layer inputs wait in pinned CPU memory by default"
    cfg, _ = config.with_hardware_defaults(config.parse_args(["--no-offload-activations"]), "cuda")
    assert cfg.offload_activations is False


@pytest.mark.parametrize("cuda, mps, picked", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_device_auto(monkeypatch, cuda, mps, picked):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert config.pick_device(config.TrainConfig(device="auto")) == picked


def test_mps_without_apple_silicon(run_model, dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    refused(args(run_model, dataset, tmp_path / "out", "--device", "mps"), capsys, tmp_path / "out",
            r"--device mps: torch sees no Apple silicon GPU .*use --device cpu, or auto")


def test_kernels_without_cuda_fail_before_loading(run_model, dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "load_tokenizer", lambda *a: pytest.fail("the tokenizer was loaded"))
    argv = [a for a in args(run_model, dataset, tmp_path / "out") if a != "--no-kernels"]
    refused(argv + ["--kernels"], capsys, tmp_path / "out",
            r"--kernels: the Triton kernels run on NVIDIA GPUs \(CUDA\), and this run is on cpu; leave out --kernels")


def cuda_like(monkeypatch, bf16):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")


@pytest.mark.parametrize("device, dtype, bf16, expected, words", [
    ("cpu", "auto", None, torch.float32, "fp32: on CPU"),
    ("cpu", "bf16", None, torch.bfloat16, "as requested"),
    ("cpu", "fp32", None, torch.float32, "as requested"),
    ("mps", "auto", None, torch.float32, "fp32: the safe choice on Apple silicon (mps)"),
    ("mps", "fp16", None, torch.float16, "as requested"),
    ("cuda", "auto", True, torch.bfloat16, "bf16: this GPU (Tesla T4) supports it"),
    ("cuda", "auto", False, torch.float16, "fp16 with dynamic loss scaling: this GPU (Tesla T4) has no bf16"),
    ("cuda", "fp16", True, torch.float16, "as requested"),
])
def test_choose_dtype(monkeypatch, device, dtype, bf16, expected, words):
    """Every branch: the reason names a GPU only on one."""
    if device == "cuda":
        cuda_like(monkeypatch, bf16)
    got, why = config.choose_dtype(config.TrainConfig(dtype=dtype), torch.device(device))
    assert got == expected and words in why, why
    assert device == "cuda" or "GPU" not in why, why


def test_choose_dtype_refuses(monkeypatch):
    with pytest.raises(train.UserError, match=r"--dtype fp16 needs a CUDA GPU"):
        config.choose_dtype(config.TrainConfig(dtype="fp16"), torch.device("cpu"))
    cuda_like(monkeypatch, bf16=False)
    with pytest.raises(train.UserError, match=r"--dtype bf16: this GPU \(Tesla T4\) has no bf16"):
        config.choose_dtype(config.TrainConfig(dtype="bf16"), torch.device("cuda"))


# ----------------------------------------------------------------------------- NF4, bitsandbytes, the hub


def test_nf4_header(run_model, dataset, tmp_path, capsys):
    from model.qlora import NF4Weight, nf4_bytes
    model, _ = load_model(run_model, lora=LoRAConfig(r=4, alpha=8), quantize="nf4")
    weights = [m for m in model.modules() if isinstance(m, NF4Weight)]
    # Per weight: 4-bit codes, an 8-bit absmax per 64 values, an fp32 scale per 256 of those, an fp32 offset.
    sizes = [w.shape.numel() for w in weights]
    assert weights and nf4_bytes(model) == sum(n // 2 + math.ceil(n / 64) + 4 * math.ceil(n / 64 / 256) + 4
                                               for n in sizes)
    assert train.cli(args(run_model, dataset, tmp_path / "out", "--quantize", "nf4", "--max-steps", "1")) == 0
    assert f"base weights quantized to NF4 ({nf4_bytes(model) / 2**30:.2f} GiB)" in capsys.readouterr().out


# Loads bitsandbytes as on a CPU with AVX512-BF16, where its CPU backend probes for the `kernels` package.
AVX512_BF16 = """
import importlib.abc, importlib.machinery, sys
class AVX512BF16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            module.has_avx512bf16 = lambda: True
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, AVX512BF16())
"""


def test_bitsandbytes_imports_quietly():
    """The check holds only while bitsandbytes warns on a plain import: when that stops, the workaround goes."""
    status, _, err = run_python(AVX512_BF16 + "import bitsandbytes")
    assert status == 0 and "Failed to load CPU gemm_4bit_forward" in err, err
    status, _, err = run_python(AVX512_BF16 + "from model.qlora import import_bitsandbytes; import_bitsandbytes()")
    assert status == 0 and err == "", err


def test_offline_download_is_one_line(tmp_path):
    """huggingface_hub's retry warnings do not reach the console: only nanotune's one error line does."""
    code = """
        import sys, huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError
        from huggingface_hub.utils import logging
        def offline(repo_id, **kwargs):
            logging.get_logger("huggingface_hub.utils._http").warning("Retrying in 8s [Retry 5/5].")
            raise LocalEntryNotFoundError("Cannot reach the hub")
        huggingface_hub.snapshot_download = offline
        import train
        sys.exit(train.cli(sys.argv[1:]))
    """
    status, out, err = run_python(code, "--model", "someone/some-model", "--out-dir", tmp_path / "out",
                                  "--device", "cpu")
    assert status == 2 and "Retrying" not in out + err, out + err
    assert err.startswith("error: cannot download 'someone/some-model': the hub is unreachable") and \
        err.count("\n") == 1, err


# ----------------------------------------------------------------------------- no Triton


def test_pyproject_needs_triton_on_linux_only():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert [d for d in deps if d.startswith("triton")] == ["triton>=3.1; sys_platform == 'linux'"]
    assert any(d.startswith("tqdm") for d in deps) and any(d.startswith("pyyaml") for d in deps)


def test_cpu_run_without_triton(run_model, dataset, tmp_path):
    from tests.test_kernels import HIDE_TRITON
    code = HIDE_TRITON + textwrap.dedent("""
        import train
        status = train.cli(sys.argv[1:])
        assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported"
        sys.exit(status)
    """)
    status, out, err = run_python(code, *args(run_model, dataset, tmp_path / "out", "--max-steps", "2"))
    assert status == 0, (out + err)[-3000:]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").exists()


# ----------------------------------------------------------------------------- samples


def test_held_out_prompt(run_model, tmp_path):
    """A sample's prompt is the row encoded as for training up to its last answer, and the expected answer is
    that answer's text; rows of every format, with and without a chat template."""
    from tests.tiny_tokenizer import make_test_tokenizer
    chat_tok = load_tokenizer(run_model)
    make_test_tokenizer(str(tmp_path), chat_template=None)
    plain_tok = load_tokenizer(str(tmp_path))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "ok?"},
            {"role": "assistant", "content": "yes"}]
    cases = [(chat_tok, {"instruction": "Add.", "input": "1 + 2", "output": "3"}, "Add.\n\n1 + 2", "3"),
             (plain_tok, {"instruction": "Add.", "input": "1 + 2", "output": "3"}, "Add.\n\n1 + 2", "3"),
             (chat_tok, {"messages": chat}, "ok?", "yes"),
             (chat_tok, {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
              "Hi", "Hello"),
             (chat_tok, {"prompt": chat[1:2], "completion": chat[2:3]}, "Hi", "Hello"),
             (plain_tok, {"prompt": "Q: 1 + 1 =", "completion": " 2"}, "Q: 1 + 1 =", "2")]
    for tok, row, question, answer in cases:
        ids, _ = data.encode_example(row, tok)
        got_question, prompt, expected = data.held_out_prompt(row, tok)
        assert (got_question, expected) == (question, answer), row
        assert ids[:len(prompt)] == prompt and tok.decode(ids[len(prompt):]).strip() == answer, row
    assert data.held_out_prompt({"text": "Once upon a time"}, plain_tok) is None


def test_samples_before_during_and_after(run_model, dataset, tmp_path, capsys, monkeypatch):
    """--sample-every 2: answers to the first 3 held-out prompts at steps 0 and 2, and at the end (step 3),
    on the console and in metrics.jsonl; the last ones are the greedy answers of the saved adapter."""
    monkeypatch.setattr(evaluation, "SAMPLE_TOKENS", 8)  # short answers: a quicker test
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--sample-every", "2", "--lr", "3e-3")) == 0
    stdout = capsys.readouterr().out
    for when in ("before training", "at step 2", "after training"):
        assert f"held-out samples {when} (greedy):" in stdout
    assert len(re.findall(r"^sample: \S.* -> .* \(expected: .+\)$", stdout, re.M)) == 3 * 3
    records = [r for r in read_metrics(out) if "samples" in r]
    assert [r["step"] for r in records] == [0, 2, 3]

    model, mcfg = load_with_adapter(run_model, str(out / "adapter"))
    tok = load_tokenizer(run_model)
    cfg = config.TrainConfig(data=dataset, eval_fraction=0.1, max_len=96)
    cases = evaluation.sample_prompts(cfg, tok, mcfg, held_out_rows(cfg, tok))
    assert [(s["prompt"], s["expected"]) for s in records[-1]["samples"]] == [(p, e) for p, _, e in cases]
    for sample, (_, ids, _) in zip(records[-1]["samples"], cases, strict=True):
        answer = tok.decode(generate(model, ids, evaluation.SAMPLE_TOKENS, stop_ids=stop_ids(tok, mcfg))).strip()
        assert sample["answer"] == answer


def test_sample_prompts_are_the_held_out_rows(run_model, tmp_path):
    """A user dataset: the sampled prompts are those of the rows load_datasets holds out for eval, encoded as
    training encodes them (each held-out example starts with its prompt)."""
    rows = data.builtin_dataset("train")[:60]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(run_model)
    cfg = config.TrainConfig(data=str(path), eval_fraction=0.1, seed=5)
    _, held_out, eval_rows = data.load_datasets(tok, data=str(path), eval_fraction=0.1, seed=5, with_rows=True)
    assert len(eval_rows) == len(held_out) == 6
    assert [data.encode_example(r, tok) for r in eval_rows] == held_out  # the rows of the eval examples, in order
    _, mcfg = load_model(run_model)
    cases = evaluation.sample_prompts(cfg, tok, mcfg, eval_rows)
    assert len(cases) == 3
    for text, ids, expected in cases:
        assert any(e[:len(ids)] == ids for e, _ in held_out[:3]), text
        assert any(r["output"] == expected and r["instruction"] in text for r in rows)


def test_samples_off_and_resume(run_model, dataset, tmp_path, capsys, monkeypatch):
    """--sample-every 0 writes no samples; a run resumed from a checkpoint writes the same sample records as
    the uninterrupted run."""
    monkeypatch.setattr(evaluation, "SAMPLE_TOKENS", 8)  # short answers: a quicker test
    assert train.cli(args(run_model, dataset, tmp_path / "off")) == 0
    assert "sample:" not in capsys.readouterr().out
    assert not any("samples" in r for r in read_metrics(tmp_path / "off"))

    opts = ("--max-steps", "4", "--save-every", "2", "--sample-every", "2", "--lr", "3e-3")
    assert train.cli(args(run_model, dataset, tmp_path / "full", *opts)) == 0
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-0000002", part / "checkpoints" / "step-0000002")
    with open(tmp_path / "full" / "metrics.jsonl") as f:  # the records as they stood at the checkpoint
        (part / "metrics.jsonl").write_text("".join(line for line in f if json.loads(line)["step"] <= 2))
    assert train.cli(args(run_model, dataset, part, *opts, "--resume", "auto")) == 0
    assert untimed(read_metrics(part)) == untimed(read_metrics(tmp_path / "full"))
    assert [r["step"] for r in read_metrics(part) if "samples" in r] == [0, 2, 4]


def test_sample_prompts_follow_the_data_options(run_model, tmp_path):
    """--eval-data is sampled from its first rows (no share held out), its columns renamed by --columns; --system-prompt
    and --chat-template render the prompt as training does."""
    rows = [{"question": f"What is {i} times 10?", "answer": str(10 * i)} for i in range(5)]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = load_tokenizer(run_model)
    _, mcfg = load_model(run_model)
    cfg = config.TrainConfig(data=str(path), eval_data=str(path), columns="instruction=question,output=answer",
                            system_prompt="Be brief.", chat_template=str(template), max_len=96)
    cases = evaluation.sample_prompts(cfg, tok, mcfg, held_out_rows(cfg, tok))
    assert [(q, a) for q, _, a in cases] == [(r["question"], r["answer"]) for r in rows[:3]]
    assert tok.decode(cases[0][1]).endswith("[system] Be brief.\n[user] What is 0 times 10?\n[assistant]")


def test_missing_optional_package_is_one_line(tmp_path, capsys, monkeypatch):
    """A .gguf model without the gguf package: one error line naming the install, no traceback, nothing
    written."""
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    monkeypatch.delitem(sys.modules, "model.gguf", raising=False)
    out = tmp_path / "out"
    refused(["--model", str(fake), "--device", "cpu", "--out-dir", str(out)], capsys, out,
            r"needs the gguf package: pip install")


def test_generate_reports_each_token(run_model):
    """on_token sees every new token as it is chosen (scripts/generate.py's progress bar counts them)."""
    model, _ = load_model(run_model)
    seen = []
    out = generate(model, [1, 5, 9], 6, on_token=seen.append)
    assert seen == out and len(out) >= 1


def test_tokenizing_shows_a_bar_on_a_terminal(run_model, tmp_path, monkeypatch):
    """On a terminal, tokenizing draws a tqdm bar on stderr instead of the periodic progress lines."""
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(data.cache, "PROGRESS_EVERY", 0.0)
    rows = [{"text": f"document {i}"} for i in range(3 * data.CHUNK)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = []
    data.load_datasets(load_tokenizer(run_model), data=str(path), num_proc=1, log=logs.append)
    assert "data: tokenizing" in screen.getvalue() and f"/{len(rows)}" in screen.getvalue()
    assert not any(re.match(r"data: tokenized \d+/", line) for line in logs), logs


def test_resuming_a_finished_run_says_it_is_complete(run_model, dataset, tmp_path, capsys):
    """--resume auto on a run that has reached --max-steps and written its adapter: one line that it is complete,
    exit 0, and nothing redone (no eval, no new record, the adapter untouched)."""
    out = tmp_path / "out"
    assert train.cli(args(run_model, dataset, out, "--eval-fraction", "0.2")) == 0
    records, adapter = (out / "metrics.jsonl").read_text(), (out / "adapter" / "adapter_model.safetensors").stat()
    capsys.readouterr()
    assert train.cli(args(run_model, dataset, out, "--eval-fraction", "0.2", "--resume", "auto")) == 0
    stdout = capsys.readouterr().out
    assert f"the run in {out} is complete (3 of 3 steps, adapter in {out / 'adapter'}); nothing to do" in stdout
    assert "eval step" not in stdout and (out / "metrics.jsonl").read_text() == records
    assert (out / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns == adapter.st_mtime_ns
