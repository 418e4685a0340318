"""kernels/sample.py (a decoding step's token a row, by the exponential race, and its log-prob) against the float64
reference, and against model/generate.py's torch path: the same generator state, the same tokens. On CPU the kernels
run in Triton's interpreter (tests/conftest.py), over small rows cut in several chunks; `pytest -m gpu` repeats the
checks at a rollout's size."""
import pytest
import torch

from kernels.references import sample_tokens_reference
from kernels.sample import CPU_PROGRAMS, launch_config
from kernels.sample import sample_tokens as sample_kernel
from model import load_model
from model.generate import sample_groups, sample_tokens
from model.transformer import Ops
from tests.helpers import assert_close, interpreter

BLOCK = 512  # small blocks, so that a row of 1000 or 5003 logits is read in several chunks of one or more blocks
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def draw(B, V, temperature, dtype, seed=0, device="cpu"):
    """Logits (B, V) of spread 3 in `dtype`, and E ~ Exp(1) (B, V) fp32 at a temperature > 0 (else None)."""
    g = torch.Generator(device).manual_seed(seed)
    logits = (3 * torch.randn(B, V, generator=g, device=device)).to(dtype)
    noise = torch.empty(B, V, device=device).exponential_(generator=g) if temperature > 0 else None
    return logits, noise


def check(logits, temperature, noise, **launch):
    """The kernel's tokens equal the float64 reference's, and its log-probs are within fp32 rounding of them."""
    tokens, logps = sample_kernel(logits, temperature, noise, **launch)
    want_tokens, want_logps = sample_tokens_reference(logits, temperature, noise)
    assert tokens.dtype == torch.long and logps.dtype == torch.float32
    assert tokens.tolist() == want_tokens.tolist()
    assert_close(logps, want_logps.float(), atol=1e-5, rtol=1e-5, name="logps")
    return tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("V", [1000, 5003])
@pytest.mark.parametrize("rows", [1, 3, 16])
@interpreter
def test_the_kernel_equals_the_float64_reference(rows, V, temperature, dtype):
    """Tokens and log-probs against float64, with V not a multiple of the block: several chunks a row (the last one
    partial) for 1 and 3 rows, one chunk of several blocks a row for 16."""
    logits, noise = draw(rows, V, temperature, dtype)
    check(logits, temperature, noise, max_block=BLOCK)


def test_launch_config_splits_few_rows_into_chunks():
    """A rollout's 16 rows of Qwen2.5's vocabulary on an H100 (264 programs aimed at) fill about the GPU; every
    chunk but the last is whole blocks, and the chunks cover the row."""
    for rows, V, programs in ((16, 151936, 264), (64, 151936, 264), (1, 1000, 8), (3, 5003, 8), (16, 5003, 8)):
        block, chunk, chunks = launch_config(rows, V, programs, max_block=2048)
        assert chunk % block == 0 and (chunks - 1) * chunk < V <= chunks * chunk
    assert 200 <= 16 * launch_config(16, 151936, 264)[2] <= 264


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@interpreter
def test_a_maximum_in_the_last_chunk(temperature, dtype):
    """Row b's most likely token is V - 1 - b, in the last, partial chunk: it is the argmax, and is drawn (its
    probability is about 1), and the log-sum-exp of the chunks is dominated by that chunk's."""
    V = 5003
    logits, noise = draw(4, V, temperature, dtype)
    for b in range(4):
        logits[b, V - 1 - b] = 40.0
    tokens = check(logits, temperature, noise, max_block=BLOCK)
    assert tokens.tolist() == [V - 1, V - 2, V - 3, V - 4]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@interpreter
def test_ties_go_to_the_lowest_index(temperature):
    """Equal best scores in one lane (two blocks apart), in two lanes of a chunk and in two chunks of a row give the
    lowest index, as torch.argmax does."""
    V = 3000
    logits, noise = draw(2, V, temperature, torch.float32)
    assert launch_config(2, V, CPU_PROGRAMS, BLOCK)[1:] == (1024, 3)  # row 0's 188, 700 and 710 share its first chunk
    for b, places in ((0, (188, 700, 710, 2900)), (1, (1300, 2999))):
        logits[b, list(places)] = 20.0
        if noise is not None:
            noise[b, list(places)] = 0.5
    assert check(logits, temperature, noise, max_block=BLOCK).tolist() == [188, 1300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@interpreter
def test_the_same_tokens_as_the_torch_path(temperature, dtype):
    """model/generate.py `sample_tokens` with the kernel draws, from the same generator state, the tokens its torch
    path draws, with the same log-probs, and leaves the generator where the torch path leaves it."""
    logits, _ = draw(16, 1000, 0.0, dtype)
    results = []
    for kernel in (None, sample_kernel):
        g = torch.Generator().manual_seed(1)
        tokens, logps = sample_tokens(logits, temperature, generator=g, kernel=kernel)
        results.append((tokens, logps, torch.rand(1, generator=g)))
    (tokens, logps, after), (k_tokens, k_logps, k_after) = results
    assert k_tokens.tolist() == tokens.tolist() and k_after == after
    assert_close(k_logps, logps, atol=1e-5, rtol=1e-5, name="logps")


def test_a_cut_takes_the_torch_path():
    """top_k > 0 or top_p < 1 samples with torch (the kernel draws from the whole distribution)."""
    def refuse(*args):
        raise AssertionError("the kernel ran with a cut")
    logits, _ = draw(3, 100, 0.0, torch.float32)
    for kw in ({"top_k": 5}, {"top_p": 0.9}):
        sample_tokens(logits, 1.0, generator=torch.Generator().manual_seed(0), kernel=refuse, **kw)


def test_bad_arguments_are_one_clear_error():
    logits, noise = draw(2, 10, 1.0, torch.float32)
    with pytest.raises(ValueError, match="noise E ~ Exp"):
        sample_kernel(logits, 1.0)
    with pytest.raises(ValueError, match="noise E ~ Exp"):
        sample_kernel(logits, 0.0, noise)
    with pytest.raises(ValueError, match=r"noise must be \[B, V\] = \[2, 10\]"):
        sample_kernel(logits, 1.0, noise[:, :5])


@interpreter
def test_a_rollout_draws_with_the_models_kernel(llama_folder):
    """The kernels' ops carry the sampler, the references' do not; a GroupSampler draws every step's tokens with its
    model's, and samples the completions (and log-probs) that the torch path samples from the same seed."""
    assert Ops(use_kernels=True).sample_tokens is sample_kernel and Ops(use_kernels=False).sample_tokens is None
    model, _ = load_model(llama_folder)
    model.eval()

    def rollout():
        return sample_groups(model, [[3, 17, 9, 40, 2], [5, 6]], 2, max_new_tokens=3, temperature=0.7,
                             generator=torch.Generator().manual_seed(0))
    completions, logps = rollout()
    calls = []
    model.ops.sample_tokens = lambda *args: calls.append(args[1]) or sample_kernel(*args)
    k_completions, k_logps = rollout()
    assert calls == [0.7] * 3
    assert k_completions == completions
    assert_close(torch.tensor(k_logps), torch.tensor(logps), atol=1e-5, rtol=1e-5, name="logps")


@gpu
@needs_cuda
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("rows", [16, 64])
def test_a_rollouts_rows_on_the_gpu(rows, temperature):
    """Qwen2.5's vocabulary in bf16, the launcher's own chunks for this GPU: the float64 reference's tokens and
    log-probs, and the torch path's tokens from the same generator state."""
    logits, noise = draw(rows, 151936, temperature, torch.bfloat16, device="cuda")
    check(logits, temperature, noise)
    results = []
    for kernel in (None, sample_kernel):
        g = torch.Generator("cuda").manual_seed(1)
        results.append(sample_tokens(logits, temperature, generator=g, kernel=kernel)[0].tolist())
    assert results[0] == results[1]
