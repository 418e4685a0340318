"""The training micro-step (step.py): eager on CPU, and the CUDA-graph replay against eager on GPU.

The eager step is the reference. On CPU: bucket padding leaves the loss and gradients unchanged.
On GPU (`pytest -m gpu`, a Llama 3-shaped tiny model): a replayed step gives the eager step's loss, gradients and
updated LoRA weights, for packed and padded batches, with and without checkpointing (and activation offload), in
fp32, bf16 and fp16 (with a loss scale), with dropout, and across a change of length bucket.
"""
from types import SimpleNamespace

import pytest
import torch

import data
import memory
import step
from model import LoRAConfig, load_model
from model.lora import lora_parameters
from model.transformer import documents
from tests.helpers import randomize_lora_b, rel_err

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(folder, device, dtype=torch.float32, dropout=0.0, ckpt="off", kernels=False, quantize=None):
    model, _ = load_model(folder, dtype=dtype, device=device, use_kernels=kernels, quantize=quantize,
                          lora=LoRAConfig(r=4, alpha=8, dropout=dropout))
    randomize_lora_b(model)
    model.gradient_checkpointing = ckpt != "off"
    model.offload_activations = ckpt == "on+offload"
    model.train()
    return model, [p for _, p in lora_parameters(model)]


def _packed(vocab, B=2, T=128, seed=0):
    """Rows of exactly T tokens holding several documents each, like data.pack makes."""
    g = torch.Generator().manual_seed(seed)
    docs = [[(int(torch.randint(5, 40, (1,), generator=g)),) for _ in range(6)] for _ in range(B)]
    encoded = [(torch.randint(3, vocab, (n,), generator=g).tolist(), [True] * n)
               for row in docs for (n,) in row]
    rows, _ = data.pack(encoded, T, pad_id=0)
    return {k: v[:B] for k, v in rows.items()}


def _padded(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    encoded = [(torch.randint(3, vocab, (n,), generator=g).tolist(), [i % 3 != 0 for i in range(n)])
               for n in lengths]
    return data.pad_batch(encoded, pad_id=0)


def _grads(params):
    return [p.grad.detach().clone() for p in params]


def _zero(params):
    for p in params:
        if p.grad is not None:
            p.grad.zero_()


def _run(run_step, params, batch, loss_mult=1.0):
    _zero(params)
    loss = run_step(batch, data.num_targets(batch), loss_mult)
    return float(loss), _grads(params)


def test_bucket_padding_keeps_loss_and_gradients(run_model):
    """Padding a batch to its length bucket adds tokens that nothing attends to and nothing predicts."""
    model, params = _model(run_model, "cpu")
    batch = _padded(model.config.vocab_size, [37, 50, 21])
    padded = step.pad_to_bucket(batch, max_len=2048)
    assert padded["input_ids"].shape == (3, step.SHORTEST)
    eager = step.EagerStep(model, torch.device("cpu"))
    loss, grads = _run(eager, params, batch)
    loss_p, grads_p = _run(eager, params, padded)
    assert data.num_targets(padded) == data.num_targets(batch)
    assert abs(loss - loss_p) < 1e-6
    for g, gp in zip(grads, grads_p):
        assert rel_err(gp, g) < 1e-5


def test_random_model_has_the_loaded_models_parameters(run_model):
    """model/load.py's random_model (the warm start's copy) builds the model that load_model builds, parameter for
    parameter and dtype for dtype, with the same LoRA init, finite outputs, the same weights every time, and
    without a draw from the process's generator."""
    from model import read_config
    from model.load import random_model
    loaded, mcfg = load_model(run_model, dtype=torch.bfloat16, lora=LoRAConfig(r=4), lora_seed=3)
    state = torch.get_rng_state()
    made = [random_model(mcfg, torch.bfloat16, "cpu", lora=LoRAConfig(r=4), lora_seed=3) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), state)
    a, b = (dict(m.named_parameters()) for m in made)
    ref = dict(loaded.named_parameters())
    assert a.keys() == ref.keys()
    for k, p in ref.items():
        assert (a[k].shape, a[k].dtype, a[k].requires_grad) == (p.shape, p.dtype, p.requires_grad), k
        assert torch.equal(a[k], b[k]), k
        if "lora_" in k:
            assert torch.equal(a[k], p), k  # the adapters' init is the loader's
    ids = torch.randint(0, mcfg.vocab_size, (2, 16))
    assert torch.isfinite(made[0](ids).float()).all()
    assert read_config(run_model) == mcfg


def test_warm_start_only_on_cuda(run_model):
    """Without a CUDA device there are no one-time kernel loads to move: WarmStart.start starts nothing."""
    from model import read_config
    batch = _padded(256, [20, 30])
    assert step.WarmStart.start(read_config(run_model), batch, torch.device("cpu"), torch.float32,
                                lora=LoRAConfig(r=4)) is None


def test_warm_start_only_where_memory_is_plentiful():
    """The warm start runs beside the loading, so the model and the copy must fit in half the free memory together:
    a TinyLlama-shaped run (2.2 GB of bf16 weights) warms up on an 80 GiB GPU, not on one with 8 GiB free."""
    from model.config import ModelConfig
    mcfg = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, n_layers=22, n_heads=32,
                       n_kv_heads=4, head_dim=64)
    small = ModelConfig(**{**mcfg.to_dict(), "n_layers": 1, "layer_types": ["full"]})
    batch = {"input_ids": torch.zeros(4, 2048, dtype=torch.long)}
    assert memory.warm_start_fits(mcfg, small, batch, torch.bfloat16, True, 78 << 30)
    assert not memory.warm_start_fits(mcfg, small, batch, torch.bfloat16, True, 8 << 30)
    assert memory.warm_start_fits(mcfg, small, batch, torch.bfloat16, True, 12 << 30)
    # all the logits, without the kernels
    assert not memory.warm_start_fits(mcfg, small, batch, torch.bfloat16, False, 12 << 30)


def test_padding_in_pieces_keeps_loss_and_gradients(run_model):
    """A packed row's padding split into several documents (data.pack) gives the loss and gradients of the same
    padding as one document: no target and no other document sees it."""
    model, params = _model(run_model, "cpu")
    V = model.config.vocab_size
    encoded = [(list(range(3, 3 + n)), [i % 2 == 0 for i in range(n)]) for n in (20, 9, 15)]
    whole = data._stack([data._row(encoded, 128, 0)], 128)
    pieces = data._stack([data._row(encoded, 128, 0, piece=16)], 128)
    assert int(pieces["doc_ids"].max()) > int(whole["doc_ids"].max()) and V > 3 + 20
    eager = step.EagerStep(model, torch.device("cpu"))
    (loss, grads), (loss_p, grads_p) = _run(eager, params, whole), _run(eager, params, pieces)
    assert abs(loss - loss_p) < 1e-6
    for g, gp in zip(grads, grads_p):
        assert rel_err(gp, g) < 1e-5


@pytest.mark.parametrize("micro_steps, shapes", [(step.SHORT_RUN, [(2, 128)]),
                                                 (step.SHORT_RUN + 1, [(2, 64), (2, 128)])])
def test_a_short_run_pads_short_batches_to_the_shortest_graph(micro_steps, shapes, monkeypatch):
    """In a run of at most SHORT_RUN micro-steps, batches of rows up to SHORTEST - BUCKET tokens are padded to
    SHORTEST (one graph for all of them); in a longer one, to their own bucket (a graph of their own)."""
    graph = step.GraphStep(None, torch.device("cpu"), [], max_len=2048, shortest=step.shortest_bucket(micro_steps),
                           warmed=True)
    captured = []

    def capture(batch, num_targets, loss_mult):  # the shape each batch is captured with, no GPU
        captured.append(tuple(batch["input_ids"].shape))
        return SimpleNamespace(load=lambda *a: None, graph=SimpleNamespace(replay=lambda: None), loss=None)

    monkeypatch.setattr(graph, "_capture", capture)
    for T in (40, 100, 64, 3, 50, 20, 100):
        graph(_padded(64, [T, 2]), 1, 1.0)
    assert captured == shapes


def test_bucket_never_exceeds_max_len():
    batch = data.pad_batch([([5] * 70, [True] * 70)], pad_id=0)
    assert step.pad_to_bucket(batch, max_len=100)["input_ids"].shape[1] == 100
    assert step.pad_to_bucket(batch, max_len=70)["input_ids"].shape[1] == 70


@pytest.mark.parametrize("T, bucket", [(1, 128), (64, 128), (128, 128), (129, 192), (250, 256), (257, 320)])
def test_buckets_are_multiples_of_64_from_128(T, bucket):
    batch = data.pad_batch([([5] * T, [True] * T)], pad_id=0)
    assert step.pad_to_bucket(batch, max_len=2048)["input_ids"].shape[1] == bucket


def test_documents_of_packed_and_padded_rows():
    """A document starts at every row and wherever doc_ids changes; bucketing pads the count with empty
    documents to a power of two and rounds the longest length up to one, never past the row length."""
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]])
    docs = documents(doc_ids)
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 10, 17, 20] and docs.max_len == 7
    assert docs.cu_seqlens.dtype == torch.int32, "flash attention's kernels read int32 offsets"
    docs = documents(doc_ids, bucket=True)
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 10, 17, 20, 20, 20, 20] and docs.max_len == 8
    docs = documents(torch.zeros(3, 10, dtype=torch.long), bucket=True)
    assert docs.cu_seqlens.tolist() == [0, 10, 20, 30, 30] and docs.max_len == 10
    batch = _padded(64, [37, 50, 21])  # each row: its example, then its padding as a document of its own
    assert documents(batch["doc_ids"]).cu_seqlens.tolist() == [0, 37, 50, 100, 121, 150]


def test_eager_step_accumulates_into_grads(run_model):
    """Two micro-steps add their gradients, as the optimizer step's grad accumulation needs."""
    model, params = _model(run_model, "cpu")
    batch = _packed(model.config.vocab_size)
    eager = step.EagerStep(model, torch.device("cpu"))
    _, once = _run(eager, params, batch)
    eager(batch, data.num_targets(batch), 1.0)
    for g, p in zip(once, params):
        assert rel_err(p.grad, 2 * g) < 1e-6


@pytest.mark.parametrize("ckpt", ["off", "on"])
def test_graph_body_matches_eager_backward(run_model, ckpt):
    """What a graph records (autograd.grad, then one multi-tensor add into .grad), run uncaptured on the CPU:
    the loss and the accumulated gradients of backward(), with the loss multiplier applied, twice in a row."""
    model, params = _model(run_model, "cpu", ckpt=ckpt)
    batch = _packed(model.config.vocab_size)
    n = data.num_targets(batch)
    loss, want = _run(step.EagerStep(model, torch.device("cpu")), params, batch, loss_mult=3.0)
    body = step.GraphStep(model, torch.device("cpu"), params, max_len=128)
    g = SimpleNamespace(batch={**batch, "docs": None}, num_targets=torch.tensor(float(n)),
                        loss_mult=torch.tensor(3.0))
    _zero(params)
    for times in (1, 2):
        got = body._step(g)
        assert abs(float(got) - loss) < 1e-6
        for p, w in zip(params, want):
            assert rel_err(p.grad, times * w) < 1e-6


TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("ckpt", ["off", "on", "on+offload"])
def test_graph_step_matches_eager(llama_folder, dtype, layout, ckpt):
    """A replayed step gives the eager step's loss, gradients and AdamW update."""
    dev = torch.device("cuda")
    model, params = _model(llama_folder, dev, dtype=dtype, ckpt=ckpt, kernels=True)
    V = model.config.vocab_size
    batch = _packed(V) if layout == "packed" else _padded(V, [37, 50, 21])
    if layout == "padded" and dtype != torch.float32:
        batch = step.pad_to_bucket(batch, 2048)  # the same shape in both: the same kernels, so the same rounding
    mult = 1024.0 if dtype == torch.float16 else 1.0
    eager = step.EagerStep(model, dev)
    graph = step.GraphStep(model, dev, params, max_len=2048, warmed=True)
    loss_e, grads_e = _run(eager, params, batch, mult)
    loss_g, grads_g = _run(graph, params, batch, mult)
    loss_r, grads_r = _run(graph, params, batch, mult)  # a replay of the captured graph
    assert len(graph.graphs) == 1 and not graph.failed  # captured, not fallen back to eager steps
    tol = TOL[dtype]
    assert abs(loss_g - loss_e) <= tol * abs(loss_e) and loss_r == loss_g
    for ge, gg, gr in zip(grads_e, grads_g, grads_r):
        assert rel_err(gg, ge) < tol and torch.equal(gg, gr)
    # the optimizer update from the replayed gradients equals the eager one
    start = [p.detach().clone() for p in params]
    for grads in (grads_e, grads_r):
        with torch.no_grad():
            for p, s, g in zip(params, start, grads):
                p.copy_(s)
                p.grad.copy_(g)
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        opt.step()
        if grads is grads_e:
            updated_e = [p.detach().clone() for p in params]
    for p, u in zip(params, updated_e):
        assert rel_err(p, u) < tol


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("ckpt", ["off", "on+offload"])
def test_graph_step_across_bucket_changes(llama_folder, ckpt, dropout):
    """Batches of other lengths capture one graph per bucket (after the first without a warm-up: the offload's
    buffers grow inside the capture, and the dropout masks are the eager step's); going back replays the first
    graph. With dropout the eager step runs the bucket-padded batch, so that both draw masks of one shape."""
    dev = torch.device("cuda")
    model, params = _model(llama_folder, dev, kernels=True, ckpt=ckpt, dropout=dropout)
    V = model.config.vocab_size
    eager = step.EagerStep(model, dev)
    graph = step.GraphStep(model, dev, params, max_len=2048, warmed=True, shortest=step.BUCKET)  # a long run's buckets
    for i, lengths in enumerate(([37, 50], [150, 90], [20, 60], [100, 30], [260, 5])):
        batch = _padded(V, lengths, seed=i)
        states = []
        eager_batch = step.pad_to_bucket(batch, 2048, step.BUCKET) if dropout else batch
        for run_step, b in ((graph, batch), (eager, eager_batch)):
            torch.cuda.manual_seed(i)  # the graph first: a new bucket's offload buffers grow inside its capture
            states.append(_run(run_step, params, b) + (torch.cuda.get_rng_state(dev),))
        (loss_g, grads_g, rng_g), (loss_e, grads_e, rng_e) = states
        assert abs(loss_g - loss_e) < 1e-5 * abs(loss_e) and torch.equal(rng_g, rng_e)
        for ge, gg in zip(grads_e, grads_g):
            assert rel_err(gg, ge) < 1e-5
    shapes = sorted(dict((name, size) for name, *size in key[:-2])["input_ids"] for key in graph.graphs)
    assert shapes == [[2, 64], [2, 128], [2, 192], [2, 320]]  # keys: (name, *shape) per tensor, then the documents
    assert not graph.failed


@pytest.mark.gpu
@gpu
def test_graph_step_goes_on_eagerly_when_the_capture_fails(llama_folder):
    """A step that cannot be captured (here: a host sync inside the forward) goes on eagerly after one warning
    line, with the eager step's results, LoRA dropout included: the CUDA generator draws again after the failed
    capture, from where it stood."""
    dev = torch.device("cuda")
    model, params = _model(llama_folder, dev, dtype=torch.bfloat16, kernels=True, dropout=0.1)

    def syncing(*args, **kwargs):
        loss = model(*args, **kwargs)
        float(loss)  # a host sync: not allowed inside a capture
        return loss
    lines = []
    graph = step.GraphStep(syncing, dev, params, max_len=2048, warmed=True, log=lines.append)
    eager = step.EagerStep(model, dev)
    batch = step.pad_to_bucket(_padded(model.config.vocab_size, [37, 50, 21]), 2048)
    for seed in range(2):
        runs = []
        for run_step in (graph, eager):
            torch.cuda.manual_seed(seed)  # the same dropout masks in both
            runs.append(_run(run_step, params, batch))
        (loss_g, grads_g), (loss_e, grads_e) = runs
        assert loss_g == loss_e
        for ge, gg in zip(grads_e, grads_g):
            assert rel_err(gg, ge) < TOL[torch.bfloat16]
    assert graph.failed and len(lines) == 1 and lines[0].startswith("warning: CUDA graph capture failed"), lines
    assert torch.cuda.current_stream(dev) == torch.cuda.default_stream(dev)  # not the failed capture's stream


@pytest.mark.gpu
@gpu
def test_graph_step_captures_a_new_shape_again_after_a_failed_capture(llama_folder):
    """A later shape whose first capture fails (here: a host sync in its first forward only, as a kernel's first
    launch inside a capture would fail it) is warmed up and captured again: the run stays on graphs, with one note
    line, and the replays give the eager step's losses and gradients, LoRA dropout included."""
    dev = torch.device("cuda")
    model, params = _model(llama_folder, dev, dtype=torch.bfloat16, kernels=True, dropout=0.1)
    first = _padded(model.config.vocab_size, [37, 50, 21])
    second = _padded(model.config.vocab_size, [300, 20])
    synced = []

    def syncing_once(input_ids, *args, **kwargs):
        loss = model(input_ids, *args, **kwargs)
        if input_ids.shape[1] > 128 and not synced:  # the second shape (320 tokens) until a forward has synced
            synced.append(float(loss))
        return loss
    lines = []
    graph = step.GraphStep(syncing_once, dev, params, max_len=2048, warmed=True, log=lines.append)
    eager = step.EagerStep(model, dev)
    for rows in (first, second, second):
        batch = step.pad_to_bucket(rows, 2048)
        runs = []
        for run_step in (graph, eager):
            torch.cuda.manual_seed(7)  # the same dropout masks in both
            runs.append(_run(run_step, params, batch))
        (loss_g, grads_g), (loss_e, grads_e) = runs
        assert loss_g == loss_e
        for ge, gg in zip(grads_e, grads_g):
            assert rel_err(gg, ge) < TOL[torch.bfloat16]
    assert synced and not graph.failed and len(graph.graphs) == 2, (synced, graph.failed, len(graph.graphs))
    assert len(lines) == 1 and lines[0].startswith("note: CUDA graph capture of a new batch shape failed"), lines


@pytest.mark.gpu
@gpu
def test_graph_step_dropout_draws_new_masks(llama_folder):
    """With LoRA dropout, every replay draws new masks (never the captured ones again)."""
    dev = torch.device("cuda")
    model, params = _model(llama_folder, dev, dropout=0.3, kernels=True)
    batch = _packed(model.config.vocab_size)
    graph = step.GraphStep(model, dev, params, max_len=2048, warmed=True)
    losses = [_run(graph, params, batch)[0] for _ in range(3)]
    assert len(graph.graphs) == 1 and not graph.failed
    assert len(set(losses)) == 3 and all(torch.isfinite(torch.tensor(losses)))
    model.eval()  # dropout off: the eager loss without dropout is near the dropout losses
    no_drop, _ = _run(step.EagerStep(model, dev), params, batch)
    assert all(abs(l - no_drop) < 0.2 * no_drop for l in losses)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ckpt", ["off", "on+offload"])
def test_graph_step_dropout_draws_the_eager_masks(llama_folder, ckpt):
    """With LoRA dropout, replayed steps draw the masks that eager steps draw from the same generator state, and
    leave the generator where eager steps leave it: the capture's warm-up gives back what it drew. So a run resumed
    from a checkpoint, which captures anew, continues with the uninterrupted run's masks (with checkpointing, the
    recompute redraws the forward's masks in both)."""
    dev = torch.device("cuda")
    model, params = _model(llama_folder, dev, dropout=0.3, ckpt=ckpt, kernels=True)
    batch = _packed(model.config.vocab_size)
    runs, states = [], []
    graph = step.GraphStep(model, dev, params, max_len=2048, warmed=True)
    for run_step in (step.EagerStep(model, dev), graph):
        torch.cuda.manual_seed(1234)
        runs.append([_run(run_step, params, batch) for _ in range(3)])
        states.append(torch.cuda.get_rng_state(dev))
    assert len(graph.graphs) == 1 and not graph.failed
    assert torch.equal(states[0], states[1])
    (eager, graphed), (no_drop, _) = runs, _run(step.EagerStep(model.eval(), dev), params, batch)
    assert len({loss for loss, _ in eager}) == 3 and all(abs(loss - no_drop) > 1e-4 for loss, _ in eager)
    for (loss_e, grads_e), (loss_g, grads_g) in zip(eager, graphed):
        assert abs(loss_g - loss_e) <= 1e-5 * abs(loss_e)
        for ge, gg in zip(grads_e, grads_g):
            assert rel_err(gg, ge) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("ckpt", ["off", "on+offload"])
def test_graph_step_matches_eager_with_nf4_weights(llama_folder, layout, ckpt):
    """QLoRA: a step whose base weights bitsandbytes dequantizes from NF4 (in forward and again in backward) replays
    with the eager step's loss and gradients, and replays of new batches follow the eager steps on them."""
    dev = torch.device("cuda")
    model, params = _model(llama_folder, dev, dtype=torch.bfloat16, ckpt=ckpt, kernels=True, quantize="nf4")
    assert model.model.layers[0].mlp.down_proj.nf4 is not None
    V = model.config.vocab_size
    first = _packed(V) if layout == "packed" else step.pad_to_bucket(_padded(V, [37, 50, 21]), 2048)
    shifted = lambda t, k: torch.where(t == data.IGNORE_INDEX, t, (t + k) % V)  # noqa: E731 other tokens, same shape
    batches = [{**first, "input_ids": shifted(first["input_ids"], k), "targets": shifted(first["targets"], k)}
               for k in range(3)]
    eager = step.EagerStep(model, dev)
    graph = step.GraphStep(model, dev, params, max_len=2048, warmed=True)
    for batch in batches:
        loss_e, grads_e = _run(eager, params, batch)
        loss_g, grads_g = _run(graph, params, batch)
        assert abs(loss_g - loss_e) <= TOL[torch.bfloat16] * abs(loss_e)
        for ge, gg in zip(grads_e, grads_g):
            assert rel_err(gg, ge) < TOL[torch.bfloat16]
    assert len(graph.graphs) == 1 and not graph.failed


FRESH_PROCESS = """
import json, sys, torch, step
from model import LoRAConfig, read_config
from tests.test_step import _model, _padded, _run, TOL
from tests.helpers import rel_err
folder, start, ckpt, dev = sys.argv[1], sys.argv[2], sys.argv[3], torch.device("cuda")
batch = step.pad_to_bucket(_padded(read_config(folder).vocab_size, [37, 50, 21]), 2048)
if start == "warm-start":
    warm = step.WarmStart.start(read_config(folder), batch, dev, torch.bfloat16, lora=LoRAConfig(r=4, alpha=8),
                                max_len=2048)
    assert warm is not None and warm.join()
warm_ups = []
real_warm_up = step.GraphStep._warm_up
step.GraphStep._warm_up = lambda self, g: warm_ups.append(1) or real_warm_up(self, g)
model, params = _model(folder, dev, dtype=torch.bfloat16, kernels=True, ckpt=ckpt, dropout=0.1)
graph = step.GraphStep(model, dev, params, max_len=2048, log=print, warmed=start != "none")
runs = []
for run_step in (graph, graph, graph, step.EagerStep(model, dev)):  # 2 or 3 replays (see the test), the eager step
    torch.cuda.manual_seed(0)  # the same dropout masks in each
    runs.append(_run(run_step, params, batch))
(loss_f, grads_f), (loss_g, grads_g), (loss_r, grads_r), (loss_e, grads_e) = runs
print(json.dumps({"warm_ups": len(warm_ups), "graphs": len(graph.graphs), "failed": graph.failed,
                  "loss": max(abs(loss_g - loss_e), abs(loss_f - loss_e)) / abs(loss_e),
                  "replay_equal": loss_r == loss_g and all(torch.equal(a, b) for a, b in zip(grads_g, grads_r)),
                  "grads": max(rel_err(g, e) for g, e in zip(grads_f + grads_g, grads_e + grads_e)),
                  "tol": TOL[torch.bfloat16]}))
"""


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("start, ckpt, warm_ups", [("warm-start", "off", 0), ("warm-start", "on+offload", 0),
                                                   ("none", "off", 0), ("none", "on+offload", 0), ("told", "off", 1)])
def test_first_capture_after_a_warm_start_in_a_fresh_process(llama_folder, start, ckpt, warm_ups):
    """In a process whose only step so far is WarmStart's, the first step is captured without a warm-up and
    replays the eager step's loss and gradients (LoRA dropout on: the same masks). Without a WarmStart, the first
    step runs eagerly (a real step, no warm-up thrown away) and the second is captured, without a warm-up too.
    Told that a step ran when none has (nothing started: the capture fails), it warms up, captures again and
    replays as well. In fresh processes: in this one, earlier tests have stepped already, and what a missing
    warm-up would leave to start inside the capture has started."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT
    r = subprocess.run([sys.executable, "-c", FRESH_PROCESS, llama_folder, start, ckpt], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["warm_ups"] == warm_ups and out["graphs"] == 1 and not out["failed"], r.stdout[-3000:]
    assert out["loss"] <= out["tol"] and out["grads"] < out["tol"] and out["replay_equal"], out


@pytest.mark.parametrize("mode, expected", [("auto", None), ("on", None), ("off", "--cuda-graphs off")])
def test_when_graphs_are_used(mode, expected):
    """auto and on replay graphs on one CUDA GPU, with LoRA dropout and QLoRA too (see their GPU tests)."""
    reason = step.graphs_off_reason(mode, torch.device("cuda"), 1)
    assert reason == expected if expected is None else reason.startswith(expected)


@pytest.mark.parametrize("device, world, why", [("cpu", 1, "no CUDA GPU"), ("cuda", 2, "data parallelism")])
def test_graphs_on_refuses_what_cannot_be_captured(device, world, why):
    assert why in step.graphs_off_reason("auto", torch.device(device), world)
    with pytest.raises(ValueError, match=f"--cuda-graphs on: not possible because .*{why}"):
        step.graphs_off_reason("on", torch.device(device), world)
