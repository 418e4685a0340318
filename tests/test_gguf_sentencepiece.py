"""SentencePiece tokenizers from GGUF metadata (`tokenizer.ggml.model = "llama"`: Llama 2, TinyLlama,
Gemma): the ids of the Hugging Face tokenizer transformers converts from the same SentencePiece model,
on whitespace runs, digits, unicode, bytes outside the vocabulary and special tokens."""
import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

gguf = pytest.importorskip("gguf", reason="the optional gguf package is not installed: pip install -e '.[gguf]'")

from model import load_tokenizer  # noqa: E402
from model.gguf import sentencepiece_merges  # noqa: E402
from tests.tiny_tokenizer import _CORPUS  # noqa: E402

TEXTS = [
    "Hello world, the quick brown fox.",
    "   leading spaces, trailing   ",
    "two  spaces\n\nnewlines\tand\ttabs \n ",
    "In 2024, 1234567 people paid $3.50 at 12:45pm.",
    "naïve café, Ünïcödé, 日本語のテキスト, Ελληνικά 🤗🚀 👩‍💻",
    "<s>system</s> text<start_of_turn>user\nhi<end_of_turn>\n<|user|>x",
    "", " ", "▁ already a meta space", "</s></s>", "a  b   c    d",
]
SPECIALS = ["<start_of_turn>", "<end_of_turn>"]  # control tokens of the chat format
USER_DEFINED = ["<|user|>", "▁▁"]  # the second one, as Gemma's runs of spaces


def sentencepiece_model(vocab_size=360):
    """(pieces, scores, types) laid out as a SentencePiece BPE model is: <unk>, <s>, </s>, the chat
    tokens, the 256 byte pieces, merged pieces by merge order (score -rank), then single characters. The merges
    come from training a BPE on our corpus with words kept apart, as SentencePiece does."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.train_from_iterator([_CORPUS] * 20, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    spec = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    merged = list(dict.fromkeys(m.replace(" ", "") for m in merges))
    chars = [t for t in spec["vocab"] if len(t) == 1]
    T = gguf.TokenType
    pieces = [("<unk>", 0.0, T.UNKNOWN), ("<s>", 0.0, T.CONTROL), ("</s>", 0.0, T.CONTROL)]
    # User-defined pieces score -1000, as in Gemma's file: below many merged pieces, matched whole all the same.
    pieces += [(t, 0.0, T.CONTROL) for t in SPECIALS] + [(t, -1000.0, T.USER_DEFINED) for t in USER_DEFINED]
    pieces += [(f"<0x{b:02X}>", 0.0, T.BYTE) for b in range(256)]
    pieces += [(t, -float(k), T.NORMAL) for k, t in enumerate(m for m in merged if m not in USER_DEFINED)]
    pieces += [(t, -float(len(merged) + k), T.NORMAL) for k, t in enumerate(c for c in chars if c not in merged)]
    return [p for p, _, _ in pieces], [s for _, s, _ in pieces], [k for _, _, k in pieces]


def hf_tokenizer(pieces, types, add_space_prefix):
    """The tokenizer.json transformers' converter writes for this SentencePiece model (TinyLlama's
    layout: the "▁" prefix as a normalizer, so each run of text between special tokens gets one)."""
    from transformers.convert_slow_tokenizer import generate_merges
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=generate_merges(vocab), unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if add_space_prefix else [])
                                          + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    T = gguf.TokenType
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p, k in zip(pieces, types)
                            if k in (T.CONTROL, T.UNKNOWN)])
    # A user-defined piece of "▁"s stays a vocabulary token, formed by merges, as transformers converts it.
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p, k in zip(pieces, types)
                    if k == T.USER_DEFINED and "▁" not in p])
    return tok


def write_gguf(path, pieces, scores, types, add_space_prefix):
    """The tokenizer metadata convert_hf_to_gguf writes for a SentencePiece model (_set_vocab_sentencepiece;
    user-defined pieces with spaces for "▁", so that llama.cpp finds them in raw text)."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([p.replace("▁", " ") if k == gguf.TokenType.USER_DEFINED else p for p, k in zip(pieces, types)])
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0)
    w.add_add_bos_token(True), w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize("add_space_prefix", [True, False], ids=["llama", "gemma"])
def test_sentencepiece_from_gguf_matches_hugging_face(tmp_path, add_space_prefix):
    pieces, scores, types = sentencepiece_model()
    ref = hf_tokenizer(pieces, types, add_space_prefix)
    ours = load_tokenizer(write_gguf(str(tmp_path / "t.gguf"), pieces, scores, types, add_space_prefix))
    assert ours.vocab_size == len(pieces) and (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, True)
    fell_back = False
    for text in TEXTS:
        want = ref.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == want, text
        assert ours.decode(want, skip_special_tokens=False) == ref.decode(want, skip_special_tokens=False), text
        fell_back |= any(pieces[i].startswith("<0x") for i in want)
    assert fell_back, "no text needed byte fallback"
    assert ours.encode("hi", add_special_tokens=True)[0] == 1


def test_merges_follow_scores_not_ids():
    """The merge rank is the joined token's score (ties by id), whatever order the ids are in."""
    merges = sentencepiece_merges(["a", "b", "c", "ab", "bc", "abc"], [0.0, 0.0, 0.0, -5.0, -1.0, -3.0])
    assert merges == [("b", "c"), ("a", "bc"), ("ab", "c"), ("a", "b")]


# ----------------------------------------------------------------------------- export


def spm_folder(folder, add_space_prefix, family="gemma"):
    """A Hugging Face folder: a tiny `family` model whose tokenizer is the SentencePiece one above."""
    import os

    import torch
    import transformers as tf
    pieces, scores, types = sentencepiece_model()
    os.makedirs(folder)
    hf_tokenizer(pieces, types, add_space_prefix).save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}, f)
    cls = {"gemma": tf.GemmaConfig, "llama": tf.LlamaConfig}[family]
    torch.manual_seed(0)
    cfg = cls(vocab_size=len(pieces), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, bos_token_id=1, eos_token_id=2)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return str(folder), (pieces, scores, types)


@pytest.mark.parametrize("family, add_space_prefix", [("gemma", False), ("llama", True)])
def test_sentencepiece_export_round_trip(tmp_path, family, add_space_prefix):
    """A SentencePiece tokenizer is exported as llama.cpp's converter writes its SentencePiece model
    (tokenizer.ggml.model "llama", the same tokens and types, scores that rank merges the same), and
    the file's tokenizer gives the folder's ids."""
    from model import load_model
    from model.gguf_export import save_gguf
    folder, (pieces, scores, types) = spm_folder(tmp_path / "hf", add_space_prefix, family)
    tok = load_tokenizer(folder)
    path = save_gguf(load_model(folder)[0], tok, str(tmp_path / "m.gguf"), ftype="f32")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    assert fields["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in fields
    # A user-defined piece of "▁"s is an ordinary token of the Hugging Face vocabulary, and is written as one.
    types = [gguf.TokenType.NORMAL if k == gguf.TokenType.USER_DEFINED and "▁" in p else k
             for p, k in zip(pieces, types)]
    assert fields["tokenizer.ggml.tokens"] == pieces and fields["tokenizer.ggml.token_type"] == types
    hf_merges = [tuple(m) for m in json.loads(tok.tok.to_str())["model"]["merges"]]
    assert sentencepiece_merges(pieces, fields["tokenizer.ggml.scores"]) == hf_merges  # the scores rank them
    assert fields["tokenizer.ggml.add_space_prefix"] is add_space_prefix
    assert (fields["tokenizer.ggml.unknown_token_id"], fields["tokenizer.ggml.add_bos_token"]) == (0, True)
    back = load_tokenizer(path)
    for text in TEXTS:
        assert back.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True), text


def test_tokenizers_llama_cpp_cannot_reproduce_are_refused(tmp_path, monkeypatch, capsys):
    """A WordPiece tokenizer, and a SentencePiece-style BPE whose merges are not the ones its vocabulary
    implies, are refused in one line by the export script, before the model is loaded or a file written."""
    import os

    from tests.helpers import refusal_here
    folder, (pieces, _, types) = spm_folder(tmp_path / "hf", True)
    path = os.path.join(folder, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    spec["model"]["merges"] = spec["model"]["merges"][::-1]
    with open(path, "w") as f:
        json.dump(spec, f)
    r = refusal_here(monkeypatch, capsys, "export_gguf.py", "--model", folder, "--out", tmp_path / "m.gguf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "llama.cpp would split text differently" in r.stderr
    wp = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    wp.save(path)
    r = refusal_here(monkeypatch, capsys, "export_gguf.py", "--model", folder, "--out", tmp_path / "m.gguf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "WordPiece" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "m.gguf")
