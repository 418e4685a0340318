"""Output files of export_gguf.py, merge.py and plot.py: never an existing file without --overwrite,
never the input, never through a planted link, and one error line for a failed write; the adapter
and tokenizer files those tools read: one line naming the file for a damaged one."""
import errno
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf", reason="the optional gguf package is not installed: pip install -e '.[gguf]'")

from model import LoRAConfig, load_model, load_tokenizer  # noqa: E402
from model.adapters import load_adapter, load_with_adapter, read_adapter_config, save_adapter  # noqa: E402
from model.files import atomic_path  # noqa: E402
from model.gguf_export import save_gguf  # noqa: E402
from tests.helpers import ROOT, refusal_here, run_script  # noqa: E402
from tests.tiny_models import make_run_folder  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(model folder, a .gguf of it, an adapter folder for it)."""
    root = tmp_path_factory.mktemp("safety")
    folder = make_run_folder(str(root / "base"))
    model, _ = load_model(folder, lora=LoRAConfig(r=4))
    save_adapter(model, str(root / "adapter"))
    path = save_gguf(model, load_tokenizer(folder), str(root / "base.gguf"), ftype="f32")
    return folder, path, str(root / "adapter")


def _one_line_error(r, match):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert match in r.stderr, r.stderr


def _digest(path):
    with open(path, "rb") as f:
        return f.read()


def test_export_refuses_an_existing_out_and_its_own_input(base, tmp_path, monkeypatch, capsys):
    """The refusals run in this process (`refusal_here`); the export that goes ahead, as a user runs it."""
    folder, src, _ = base
    before = _digest(src)
    for extra in ((), ("--overwrite",)):  # the input is never written, even with --overwrite
        _one_line_error(refusal_here(monkeypatch, capsys, "export_gguf.py", "--model", src, "--out", src, "--ftype",
                                     "f32", *extra), "is the input")
    link = tmp_path / "link.gguf"  # the same file under another name
    os.symlink(src, link)
    _one_line_error(refusal_here(monkeypatch, capsys, "export_gguf.py", "--model", src, "--out", link, "--overwrite"),
                    "is the input")
    assert _digest(src) == before
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    _one_line_error(refusal_here(monkeypatch, capsys, "export_gguf.py", "--model", folder, "--out", out),
                    "pass --overwrite")
    assert out.read_bytes() == b"keep me"
    r = run_script("export_gguf.py", "--model", folder, "--out", out, "--overwrite", "--ftype", "f32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_model(str(out))[1].n_layers == 2
    assert sorted(os.listdir(tmp_path)) == ["link.gguf", "m.gguf"]  # no temporary file left


def test_export_replaces_a_planted_link_not_its_target(base, tmp_path):
    """--overwrite of an --out that is a link replaces the link; the file it points to stays as it was."""
    folder, _, _ = base
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.gguf"
    os.symlink(victim, out)
    r = run_script("export_gguf.py", "--model", folder, "--out", out, "--overwrite", "--ftype", "f32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert victim.read_text() == "precious" and not out.is_symlink()


def test_atomic_path_failure_leaves_the_target(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match=r"cannot write .*t\.bin: the disk is full"):
        with atomic_path(str(target)) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["t.bin"]


@pytest.mark.parametrize("code, match", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only"),
                                         (errno.EACCES, "permission denied")])
def test_export_write_errors_are_one_line(base, tmp_path, monkeypatch, capsys, code, match):
    """A write that fails in the middle of the file (monkeypatched GGUF writer) is one line, and leaves nothing."""
    import gguf

    def fail(self, *args, **kwargs):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    monkeypatch.setattr(sys, "path", sys.path)
    import export_gguf
    out = tmp_path / "m.gguf"
    with pytest.raises(SystemExit) as e:
        from cli import run_tool
        run_tool(lambda: export_gguf.main(["--model", base[0], "--out", str(out), "--ftype", "f32"]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and match in err, err
    assert os.listdir(tmp_path) == []


def test_export_and_merge_over_the_file_size_limit(base, tmp_path):
    """RLIMIT_FSIZE (ulimit -f) smaller than the output: one line from each tool, and no output."""
    folder, _, adapter = base
    limit = "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); " \
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    for script, args, match in [("export_gguf.py", ["--out", tmp_path / "m.gguf", "--ftype", "f32"], "m.gguf"),
                                ("merge.py", ["--adapter", adapter, "--out", tmp_path / "merged"], "merged")]:
        r = subprocess.run([sys.executable, "-c", limit, os.path.join(ROOT, "scripts", script), "--model", folder,
                            *map(str, args)], cwd=ROOT, capture_output=True, text=True)
        _one_line_error(r, "file-size limit")
        assert match in r.stderr
    assert os.listdir(tmp_path) == []


def test_merge_refuses_a_folder_it_cannot_write(base, tmp_path, monkeypatch):
    folder, _, adapter = base
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: os.path.abspath(p) != str(ro))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    monkeypatch.setattr(sys, "path", sys.path)
    import merge
    with pytest.raises(ValueError, match="cannot be written"):
        merge.main(["--model", folder, "--adapter", adapter, "--out", str(ro / "merged")])


def test_plot_does_not_follow_a_planted_link(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, run / "loss.png")
    r = run_script("plot.py", run)
    assert r.returncode == 0, r.stderr[-2000:]
    assert victim.read_text() == "precious" and not (run / "loss.png").is_symlink()
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- damaged inputs


def _write_config(adapter, tmp_path, edit):
    copy = tmp_path / "adapter"
    copy.mkdir()
    for name in os.listdir(adapter):
        (copy / name).write_bytes(open(os.path.join(adapter, name), "rb").read())
    path = copy / "adapter_config.json"
    cfg = json.loads(path.read_text())
    path.write_text(edit(cfg) if callable(edit) else edit)
    return str(copy)


@pytest.mark.parametrize("edit, match", [
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "r"}), r"adapter_config\.json: r is missing"),
    (lambda c: json.dumps({**c, "r": "4"}), r"adapter_config\.json: r is '4'; it must be a positive whole number"),
    (lambda c: json.dumps({**c, "lora_alpha": None}), r"adapter_config\.json: lora_alpha is None"),
    ('{"r": 4,', r"adapter_config\.json is not valid JSON"),
    ("[1, 2]", r"adapter_config\.json should hold a JSON object"),
])
def test_damaged_adapter_config_is_one_line(base, tmp_path, edit, match):
    adapter = _write_config(base[2], tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        read_adapter_config(adapter)


def test_adapter_rank_that_disagrees_with_its_weights(base, tmp_path):
    """r in adapter_config.json differs from the rank of the saved weights: said as such, not as another base."""
    adapter = _write_config(base[2], tmp_path, lambda c: json.dumps({**c, "r": 8}))
    with pytest.raises(ValueError, match=r"has rank 4, but adapter_config\.json says r=8.*disagree"):
        load_with_adapter(base[0], adapter)
    model, _ = load_model(base[0], lora=LoRAConfig(r=4))
    load_adapter(model, base[2])  # the undamaged adapter still loads


@pytest.mark.parametrize("template", [[{"name": "default"}], ["{{ x }}"], [], {"default": "x"}, 3])
def test_chat_template_of_the_wrong_shape(base, tmp_path, template):
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes(open(os.path.join(base[0], name), "rb").read())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template is a"):
        load_tokenizer(str(folder))
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(str(folder)).chat_template == "D"

