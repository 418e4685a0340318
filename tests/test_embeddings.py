"""Trainable embeddings and new tokens (model/embeddings.py): gradients equal transformers', adapters load in PEFT
(tied embeddings stay tied), merged folders load in transformers, resume is exact, and new tokens learn."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import train
from masters import param_groups
from model import LoRAConfig, load_model, load_tokenizer
from model.adapters import load_with_adapter, merge_and_save, save_adapter
from model.embeddings import EMBEDDINGS, add_tokens, parse_tokens, train_embeddings_
from model.weights import trainable_parameters
from tests.helpers import assert_close, interpreter, randomize_lora_b, read_metrics, refused, rel_err
from tests.test_train import cfg_for
from tests.tiny_models import make_run_folder

B, T = 2, 20
NEW = ["<tool>", "</tool>"]


@pytest.fixture(scope="module", params=["tinyllama", "qwen2"])
def base(request, tmp_path_factory):
    """(family, a model folder with a tokenizer whose 400 tokens are the embedding's 400 rows): untied, tied."""
    return request.param, make_run_folder(str(tmp_path_factory.mktemp(request.param)), family=request.param)


def hf_from(folder):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def ids_for(vocab, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def trained(folder, new_ids=(), all_rows=True, vocab=400, **load):
    """A LoRA model of `folder` with trainable embeddings, moved off their base values (random lora_B, embedding
    rows nudged), as after some training."""
    model, _ = load_model(folder, lora=LoRAConfig(r=4, alpha=8.0), **load)
    train_embeddings_(model, vocab, list(new_ids), all_rows)
    randomize_lora_b(model, std=0.1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in EMBEDDINGS:
            p = model.get_parameter(name)
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


# ----------------------------------------------------------------------------- --train-embeddings

@interpreter
def test_embedding_gradients_equal_transformers(base):
    """The fused head's dW (lm_head, and the tied embedding's two paths added) and the lookup's gradient equal
    transformers' on the same weights, for a summed token loss: through the Triton kernels on the tied model,
    the torch references on the untied one."""
    family, folder = base
    use_kernels = family == "qwen2"
    model, _ = load_model(folder, use_kernels=use_kernels)
    train_embeddings_(model, 400, [], all_rows=True)
    hf = hf_from(folder)
    ids, targets = ids_for(400), ids_for(400, seed=1)
    targets[0, :3] = -100
    loss = model(ids, targets=targets, reduction="sum")
    loss.backward()
    logits = hf(input_ids=ids).logits
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    ref.backward()
    assert_close(loss, ref, atol=1e-4, rtol=1e-5, name="loss")
    for name in EMBEDDINGS[:1] if family == "qwen2" else EMBEDDINGS:
        got, want = model.get_parameter(name).grad, hf.get_parameter(name).grad
        assert rel_err(got, want) < 1e-5, f"{family} {name}: rel err {rel_err(got, want):.2e}"


def test_bf16_model_trains_fp32_embeddings_exactly(base):
    """In a bf16 model the trained embeddings are fp32 masters, and the forward casts them back: the loss is
    bit-identical to the bf16 model's, the activations stay bf16 and the gradients arrive in fp32."""
    family, folder = base
    plain, _ = load_model(folder, dtype=torch.bfloat16)
    model, _ = load_model(folder, dtype=torch.bfloat16)
    train_embeddings_(model, 400, [], all_rows=True)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    ids = ids_for(400)
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids)) and model(ids).dtype == torch.bfloat16
    model(ids, targets=ids_for(400, seed=1), reduction="sum").backward()
    assert model.model.embed_tokens.weight.grad.dtype == torch.float32


def test_peft_loads_trained_embeddings(base, tmp_path):
    """The adapter holds the embeddings as PEFT's modules_to_save: PeftModel.from_pretrained gives the same logits,
    a tied pair stays one tensor in PEFT (ensure_weight_tying), and load_with_adapter reads it back."""
    from peft import PeftModel
    family, folder = base
    model = trained(folder)
    save_adapter(model, str(tmp_path / "adapter"), base_model=folder)
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    tied = family == "qwen2"
    assert config["modules_to_save"] == (["embed_tokens"] if tied else ["embed_tokens", "lm_head"])
    assert config["ensure_weight_tying"] == tied
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert keys["base_model.model.lm_head.weight"].shape == keys["base_model.model.model.embed_tokens.weight"].shape
    peft = PeftModel.from_pretrained(hf_from(folder), str(tmp_path / "adapter")).eval()
    inner = peft.base_model.model
    assert (inner.get_output_embeddings().weight is inner.get_input_embeddings().weight) == tied
    ids = ids_for(400)
    with torch.no_grad():
        ours = model(ids)
        assert rel_err(peft(input_ids=ids).logits, ours) < 1e-5
        again, _ = load_with_adapter(folder, str(tmp_path / "adapter"))
        assert torch.equal(again(ids), ours)


def test_peft_trained_embeddings_load_here(base, tmp_path):
    """An adapter PEFT trained with modules_to_save (its own key names and config; a tied pair with
    ensure_weight_tying) loads here to PEFT's logits."""
    from peft import LoraConfig, get_peft_model
    family, folder = base
    tied = family == "qwen2"
    peft = get_peft_model(hf_from(folder), LoraConfig(r=2, target_modules=["q_proj"], ensure_weight_tying=tied,
                                                      modules_to_save=["embed_tokens"] + ([] if tied else ["lm_head"])))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn_like(p) * 0.05)
    peft.save_pretrained(str(tmp_path / "adapter"))
    model, _ = load_with_adapter(folder, str(tmp_path / "adapter"))
    ids = ids_for(400)
    with torch.no_grad():
        assert rel_err(model(ids), peft.eval()(input_ids=ids).logits) < 1e-5


def test_other_modules_to_save_are_refused(base, tmp_path):
    family, folder = base
    save_adapter(trained(folder), str(tmp_path / "adapter"), base_model=folder)
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "modules_to_save": ["score"]}))
    with pytest.raises(ValueError, match=r"modules_to_save=\['score'\]; nanotune trains and loads only embed_tokens"):
        load_with_adapter(folder, str(tmp_path / "adapter"))


def test_merged_embeddings_load_in_transformers(base, tmp_path):
    family, folder = base
    model = trained(folder)
    merge_and_save(model, folder, str(tmp_path / "merged"))
    ids = ids_for(400)
    with torch.no_grad():
        assert rel_err(hf_from(str(tmp_path / "merged"))(input_ids=ids).logits, model(ids)) < 1e-5


def test_resume_with_trained_embeddings_is_bit_exact(run_model, tmp_path):
    """Checkpoints carry the embeddings and their AdamW moments: a resumed run repeats the losses exactly."""
    kw = dict(max_steps=4, save_every=2, train_embeddings=True, weight_decay=0.1)
    train.main(cfg_for(run_model, tmp_path / "full", **kw))
    ref = [r["loss"] for r in read_metrics(tmp_path / "full") if "loss" in r]
    step2 = os.path.join("checkpoints", "step-0000002")
    shutil.copytree(tmp_path / "full" / step2, tmp_path / "part" / step2)
    train.main(cfg_for(run_model, tmp_path / "part", resume="auto", **kw))
    assert [r["loss"] for r in read_metrics(tmp_path / "part") if "loss" in r] == ref[2:]
    a, b = (load_file(str(tmp_path / d / "adapter" / "adapter_model.safetensors")) for d in ("full", "part"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(os.path.join(run_model, "model.safetensors"))["model.embed_tokens.weight"]
    assert not torch.equal(a["base_model.model.model.embed_tokens.weight"], base)  # they trained


def test_resume_with_other_trained_weights_is_refused(run_model, tmp_path):
    """--train-embeddings and --add-tokens decide what a checkpoint holds: a resume cannot change them."""
    train.main(cfg_for(run_model, tmp_path / "run", max_steps=1, save_every=1))
    with pytest.raises(train.UserError, match="train_embeddings=False, this run has True"):
        train.main(cfg_for(run_model, tmp_path / "run", max_steps=2, resume="auto", train_embeddings=True))


# ----------------------------------------------------------------------------- --add-tokens

def test_add_tokens_grows_the_tokenizer(run_model):
    tok = load_tokenizer(run_model)
    grown, ids = add_tokens(tok, NEW)
    assert ids == [400, 401] and grown.vocab_size == 402 and tok.vocab_size == 400
    assert grown.encode("a <tool>b</tool>")[-3:] == [400, grown.encode("b")[0], 401]
    assert grown.encode_offsets("x<tool>", parse_special=False)[0][-1] == 400  # data text spells it too


@pytest.mark.parametrize("text, match", [(",<a>", "empty token"), ("<a>,<a>", "more than once")])
def test_bad_add_tokens_option(text, match):
    with pytest.raises(ValueError, match=match):
        parse_tokens(text)


def test_a_token_already_in_the_vocabulary_is_refused(run_model, tmp_path, capsys):
    refused(["--model", run_model, "--out-dir", str(tmp_path / "out"), "--device", "cpu", "--add-tokens",
             "<tool>,<|im_end|>"], capsys, str(tmp_path / "out"), r"'<\|im_end\|>' is already in the tokenizer's "
            r"vocabulary \(id \d+\)")


def test_new_rows_start_at_the_mean_and_old_logits_are_unchanged(base):
    """The embedding grows to exactly the tokenizer's length; the new rows are the mean of the old ones, and the
    logits of the old tokens (on old tokens) are those of the base model."""
    family, folder = base
    plain, _ = load_model(folder)
    model, _ = load_model(folder)
    tok, ids = add_tokens(load_tokenizer(folder), NEW)
    config = train_embeddings_(model, tok.vocab_size, ids, all_rows=False)
    assert config.vocab_size == model.model.embed_tokens.weight.shape[0] == model.lm_head.weight.shape[0] == 402
    for name in EMBEDDINGS:
        w, old = model.get_parameter(name), plain.get_parameter(name)
        assert torch.equal(w[:400], old) and torch.equal(w[400], w[401])
        assert_close(w[400], old.mean(0), atol=1e-7, rtol=0)
    x = ids_for(400)
    with torch.no_grad():
        assert torch.equal(model(x)[..., :400], plain(x))


def test_a_model_with_spare_rows_keeps_them(base):
    """An embedding longer than the tokenizer (Qwen2's spare rows): a tokenizer of 398 tokens gains 2, which take
    the last two rows, set to the mean of the 398 before them, and the row count stays, as AutoPeftModel leaves it."""
    family, folder = base
    model, _ = load_model(folder)
    mean = model.model.embed_tokens.weight[:398].mean(0)
    train_embeddings_(model, 400, [398, 399], all_rows=False)
    w = model.model.embed_tokens.weight
    assert w.shape[0] == model.config.vocab_size == 400 and torch.equal(w[398], w[399])
    assert_close(w[398], mean, atol=1e-7, rtol=0)


def test_only_new_rows_train_without_train_embeddings(base):
    """--add-tokens alone: the gradient reaches the new rows only, and AdamW leaves every other row as it was."""
    family, folder = base
    model, _ = load_model(folder, lora=LoRAConfig(r=4))
    train_embeddings_(model, 402, [400, 401], all_rows=False)
    before = {n: model.get_parameter(n).detach().clone() for n in EMBEDDINGS}
    opt = torch.optim.AdamW(param_groups(trainable_parameters(model), weight_decay=0.1), lr=1e-2)
    x = torch.cat([ids_for(400), torch.full((B, 2), 400)], 1)
    for _ in range(2):
        model(x[:, :-1], targets=x[:, 1:], reduction="sum").backward()
        opt.step()
        opt.zero_grad()
    for n in EMBEDDINGS:
        w = model.get_parameter(n)
        assert torch.equal(w[:400], before[n][:400]), n
        assert not torch.equal(w[400], before[n][400]), n


def test_auto_peft_model_loads_an_adapter_with_new_tokens(base, tmp_path):
    """AutoPeftModelForCausalLM reads the adapter's tokenizer, resizes the base to its length and loads the
    embeddings: the same logits, also on the new tokens; merge.py writes a folder transformers loads alike."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer
    family, folder = base
    tok, ids = add_tokens(load_tokenizer(folder), NEW)
    model = trained(folder, ids, all_rows=family == "qwen2", vocab=tok.vocab_size)
    adapter = str(tmp_path / "adapter")
    save_adapter(model, adapter, base_model=folder, tokenizer=tok)
    assert len(AutoTokenizer.from_pretrained(adapter)) == 402
    peft = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()
    x = ids_for(402)
    with torch.no_grad():
        ours = model(x)
        assert rel_err(peft(input_ids=x).logits, ours) < 1e-5
    from tests.helpers import run_script
    run_script("merge.py", "--model", folder, "--adapter", adapter, "--out", str(tmp_path / "merged"), "--dtype",
               "fp32")
    merged = str(tmp_path / "merged")
    assert AutoTokenizer.from_pretrained(merged).convert_tokens_to_ids(NEW) == ids
    with torch.no_grad():
        assert rel_err(hf_from(merged)(input_ids=x).logits, ours) < 1e-5


def test_nf4_base_with_new_tokens(base):
    """--quantize nf4 quantizes the projections only: the embeddings grow and train in fp32 beside them."""
    pytest.importorskip("bitsandbytes")
    family, folder = base
    model, _ = load_model(folder, lora=LoRAConfig(r=4), quantize="nf4")
    train_embeddings_(model, 402, [400, 401], all_rows=False)
    x = torch.cat([ids_for(400), torch.full((B, 2), 401)], 1)
    model(x[:, :-1], targets=x[:, 1:], reduction="sum").backward()
    g = model.model.embed_tokens.weight.grad
    assert g.dtype == torch.float32 and g[400:].abs().sum() > 0 and g[:400].abs().sum() == 0


def test_new_token_learns(run_model, tmp_path):
    """A task that needs the new token: every row ends in '<tool>'. Trained with --add-tokens alone, the loss of
    predicting it falls far, the adapter folder holds the grown tokenizer, and the old rows stay the base's."""
    rows = [{"text": f"{w} {w} <tool>"} for w in ("hello", "world", "the", "quick", "fox", "dog", "cat", "sun")]
    data = tmp_path / "tool.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = cfg_for(run_model, tmp_path / "out", data=str(data), add_tokens="<tool>", max_steps=10, lr=3e-2,
                  batch_size=8, eval_fraction=0, max_len=32)
    assert train.main(cfg) == 0
    adapter = str(tmp_path / "out" / "adapter")
    tok = load_tokenizer(adapter)
    assert tok.vocab_size == 401 and tok.token_to_id("<tool>") == 400

    def tool_loss(model):  # the mean loss of predicting '<tool>' at the end of each row
        losses = []
        for r in rows:
            x = torch.tensor([tok.encode(r["text"], add_special_tokens=True)])
            assert x[0, -1] == 400
            with torch.no_grad():
                losses.append(F.cross_entropy(model(x)[:, -2], x[:, -1]).item())
        return sum(losses) / len(losses)

    start, _ = load_model(run_model, lora=LoRAConfig(r=16))
    train_embeddings_(start, 401, [400], all_rows=False)
    tuned, _ = load_with_adapter(run_model, adapter)
    before, after = tool_loss(start), tool_loss(tuned)
    assert after < 0.25 * before, (before, after)
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    base = load_file(os.path.join(run_model, "model.safetensors"))
    for n in EMBEDDINGS:
        assert torch.equal(saved["base_model.model." + n][:400], base[n]), n


def test_gguf_export_of_an_adapter_with_new_tokens(run_model, tmp_path):
    """export_gguf.py takes the adapter's grown tokenizer by default: the GGUF has the new tokens, every row, and
    the adapted model's logits."""
    pytest.importorskip("gguf")
    from tests.helpers import run_script
    tok, ids = add_tokens(load_tokenizer(run_model), NEW)
    model = trained(run_model, ids, vocab=tok.vocab_size)
    save_adapter(model, str(tmp_path / "adapter"), base_model=run_model, tokenizer=tok)
    out = str(tmp_path / "tuned.gguf")
    done = run_script("export_gguf.py", "--model", run_model, "--adapter", tmp_path / "adapter", "--out", out,
                      "--ftype", "f32")
    assert done.returncode == 0, done.stderr
    assert [load_tokenizer(out).token_to_id(t) for t in NEW] == ids
    exported, _ = load_model(out)
    x = ids_for(402)
    with torch.no_grad():
        assert rel_err(exported(x), model(x)) < 1e-5
