"""A tiny byte-level BPE tokenizer for tests: trained in milliseconds on a fixed text, no download.

    folder = make_test_tokenizer(tmp_path / "tok")          # ChatML template, BOS <s>, EOS </s>, pad <pad>
    tok = model.tokenizer.load_tokenizer(folder)

Keyword options write the tokenizer_config.json variants tests need (no chat template, pad == eos,
a Qwen-like EOS of '<|im_end|>' without BOS, or any other template), and add the tokens of other
families' templates (Llama 3's '<|eot_id|>', Gemma's '<start_of_turn>', Qwen3's '<think>').
"""
import json
import os
from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# ChatML, written the way Hugging Face tokenizer_config.json files write it ('\n' is a Jinja escape).
CHATML = (r"{{ bos_token }}{% for message in messages %}"
          r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          r"{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_NO_BOS = CHATML.removeprefix("{{ bos_token }}")  # Qwen-style: the template writes no BOS

_CORPUS = """\
### Instruction:
Add the two numbers.

### Input:
1234 + 5678

### Response:
6912
The quick brown fox jumps over the lazy dog. Hello there, how are you today?
user assistant system Convert the distance to meters. How many minutes are in 12 hours?
Sort the numbers from smallest to largest. Reverse the string. 0 1 2 3 4 5 6 7 8 9 10 100 km kg min
"""


@lru_cache(maxsize=8)
def _tokenizer_json(special_tokens=(), tokens=()):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 20, trainer)
    # Added after training, with ids from 400 on, so the tokens above keep their ids and merges.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])
    return tok.to_str()


def make_test_tokenizer(folder, *, chat_template=CHATML, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                        add_bos_token=True, special_tokens=(), tokens=()):
    """Write tokenizer.json and tokenizer_config.json into `folder` and return its path.
    chat_template=None writes a tokenizer without one (a base model); pad_token=None, none.
    special_tokens (control tokens, like '<|eot_id|>') and tokens (plain added tokens, like Qwen3's
    '<think>') extend the vocabulary beyond its 400 trained tokens."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(_tokenizer_json(tuple(special_tokens), tuple(tokens)))
    config = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "add_bos_token": add_bos_token}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)
