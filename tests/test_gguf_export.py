"""GGUF exports that llama.cpp loads: the pre-tokenizer as llama.cpp names it, BOS/EOS use as the
tokenizer really does it, the unknown token and space prefix kept; imports of every pre-tokenizer
name llama.cpp writes; and the card of an adapter trained on a GGUF base."""
import json
import os

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

gguf = pytest.importorskip("gguf", reason="the optional gguf package is not installed: pip install -e '.[gguf]'")

from model import LoRAConfig, load_model, load_tokenizer  # noqa: E402
from model.adapters import save_adapter  # noqa: E402
from model.gguf import PRE_TOKENIZER_NAMES  # noqa: E402
from model.gguf_export import save_gguf  # noqa: E402
from tests.tiny_models import make_run_folder  # noqa: E402

TEXTS = ["Hello world's WE'LL 12345 3.14", "  two  spaces\n\n\ttab", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_run_folder(str(tmp_path_factory.mktemp("export")), family="llama")


def _fields(path):
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.ggml.")}


def _copy_folder(src, dst, config_edit=None, tokenizer_edit=None):
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    if config_edit:
        path = os.path.join(dst, "tokenizer_config.json")
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump(config_edit(cfg), f)
    if tokenizer_edit:
        path = os.path.join(dst, "tokenizer.json")
        tok = HFTokenizer.from_file(path)
        tokenizer_edit(tok)
        tok.save(path)
    return dst


def _export(folder, path):
    model, _ = load_model(folder)
    return save_gguf(model, load_tokenizer(folder), str(path), ftype="f32")


def test_export_names_the_pre_tokenizer_as_llama_cpp_does(folder, tmp_path):
    """A GPT-2-splitting tokenizer is written as "gpt-2" (llama.cpp refuses "gpt2"), BOS use as configured,
    and both add_bos_token and add_eos_token always present."""
    meta = _fields(_export(folder, tmp_path / "m.gguf"))
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.ggml.add_space_prefix"] is False


@pytest.mark.parametrize("template, bos, eos", [(None, False, False), ("<s> $A", True, False),
                                                 ("<s> $A </s>", True, True)])
def test_bos_and_eos_follow_the_post_processor(folder, tmp_path, template, bos, eos):
    """Without add_bos_token in tokenizer_config.json (SmolLM2), BOS/EOS use is what tokenizer.json's
    post-processor adds, not "a BOS token exists"; the export writes it, and the import reads it back."""
    def post(tok):
        if template is None:  # SmolLM2's: byte-level offsets only
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        else:
            tok.post_processor = processors.TemplateProcessing(
                single=template, special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    src = _copy_folder(folder, str(tmp_path / "src"), lambda c: {k: v for k, v in c.items() if k != "add_bos_token"},
                       post)
    tok = load_tokenizer(src)
    assert (tok.add_bos, tok.add_eos) == (bos, eos)
    path = _export(src, tmp_path / "m.gguf")
    meta = _fields(path)
    assert (meta["tokenizer.ggml.add_bos_token"], meta["tokenizer.ggml.add_eos_token"]) == (bos, eos)
    back = load_tokenizer(path)
    assert (back.add_bos, back.add_eos) == (bos, eos)
    for text in TEXTS:
        assert back.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True)


def test_unknown_token_is_kept(folder, tmp_path):
    def unk(tok):
        spec = json.loads(tok.to_str())
        spec["model"]["unk_token"] = "<pad>"
        tok.__setstate__(HFTokenizer.from_str(json.dumps(spec)).__getstate__())
    src = _copy_folder(folder, str(tmp_path / "src"), tokenizer_edit=unk)
    pad = load_tokenizer(src).token_to_id("<pad>")
    path = _export(src, tmp_path / "m.gguf")
    assert _fields(path)["tokenizer.ggml.unknown_token_id"] == pad
    assert json.loads(load_tokenizer(path).tok.to_str())["model"]["unk_token"] == "<pad>"


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZER_NAMES))
def test_import_accepts_llama_cpp_pre_tokenizer_names(folder, tmp_path, name):
    """A file whose tokenizer.ggml.pre is any name llama.cpp maps to a known split loads, and
    every alias of the GPT-2 split tokenizes as the source tokenizer does."""
    path = _export(folder, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "renamed.gguf"), "llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = name if key == "tokenizer.ggml.pre" else f.contents()
        w.add_key_value(key, value, f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_tokenizer(str(tmp_path / "renamed.gguf"))
    if PRE_TOKENIZER_NAMES[name] == "gpt-2":
        want = load_tokenizer(folder)
        for text in TEXTS:
            assert tok.encode(text) == want.encode(text), (name, text)


def test_unknown_pre_tokenizer_name_is_one_line(folder, tmp_path, monkeypatch):
    import model.gguf as mg
    monkeypatch.setitem(mg.PRE_TOKENIZER_NAMES, "gpt-2", "gpt-2")
    path = _export(folder, tmp_path / "m.gguf")
    monkeypatch.delitem(mg.PRE_TOKENIZER_NAMES, "gpt-2")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre 'gpt-2' is not supported"):
        load_tokenizer(path)


def test_adapter_card_of_a_gguf_base(folder, tmp_path):
    """The card of an adapter on a .gguf base does not promise AutoPeftModelForCausalLM; it says how to load it."""
    path = _export(folder, tmp_path / "base.gguf")
    model, _ = load_model(path, lora=LoRAConfig(r=2))
    save_adapter(model, str(tmp_path / "adapter"), base_model=path)
    with open(tmp_path / "adapter" / "README.md") as f:
        card = f.read()
    assert "AutoPeftModelForCausalLM.from_pretrained" not in card
    assert f"scripts/merge.py --model {path}" in card and 'gguf_file="base.gguf"' in card
    save_adapter(model, str(tmp_path / "adapter2"), base_model=folder)
    with open(tmp_path / "adapter2" / "README.md") as f:
        assert "AutoPeftModelForCausalLM.from_pretrained" in f.read()


def test_tokenizer_option_of_export_and_merge(folder, tmp_path, monkeypatch):
    """--tokenizer FOLDER: the export and the merged folder carry that folder's tokenizer and template."""
    import sys

    from tests.helpers import ROOT
    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "scripts"), *sys.path])
    import export_gguf
    import merge
    base = _export(folder, tmp_path / "base.gguf")
    other = _copy_folder(folder, str(tmp_path / "other"), lambda c: {**c, "chat_template": "{{ 'other' }}"})
    export_gguf.main(["--model", base, "--tokenizer", other, "--out", str(tmp_path / "out.gguf"), "--ftype", "f32"])
    assert load_tokenizer(str(tmp_path / "out.gguf")).chat_template == "{{ 'other' }}"
    model, _ = load_model(base, lora=LoRAConfig(r=2))
    save_adapter(model, str(tmp_path / "adapter"), base_model=base)
    merge.main(["--model", base, "--adapter", str(tmp_path / "adapter"), "--tokenizer", other,
                "--out", str(tmp_path / "merged")])
    assert load_tokenizer(str(tmp_path / "merged")).chat_template == "{{ 'other' }}"
