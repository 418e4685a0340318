"""The NF4 dequantization kernel (kernels/nf4_dequantize.py) against bitsandbytes' `dequantize_4bit` and the
pure-torch reference: bit for bit, in every output dtype, for odd shapes, into rows of a larger buffer. On CPU
the kernel runs in Triton's interpreter (tests/conftest.py); `pytest -m gpu` repeats it at real sizes."""
import pytest
import torch
from bitsandbytes.functional import get_4bit_type

from kernels.nf4_dequantize import nf4_dequantize
from kernels.references import NF4_LEVELS, nf4_dequantize_reference
from model.qlora import NF4Weight
from tests.helpers import assert_bit_equal

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# (5, 6): one partial block; (37, 74): blocks across rows, the last partial; (130, 130): more than 256 blocks, so
# two absmax scales, the second partial. Real weights have an even width; bitsandbytes dequantizes an odd one
# by a torch.compile'd function (seconds on CPU), so the odd ones are compared with the reference alone.
SHAPES = [(3, 2), (5, 6), (37, 74), (64, 64), (130, 130)]
ODD_SHAPES = [(1, 1), (37, 75)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)




def nf4_weight(shape, dtype, device=DEVICE):
    """An NF4Weight of a random weight, with an outlier so that the absmax scales spread widely."""
    w = torch.randn(shape, device=device)
    w.view(-1)[w.numel() // 3] = 40.0
    return NF4Weight(w.to(dtype))


def test_levels_are_bitsandbytes_nf4():
    assert torch.equal(torch.tensor(NF4_LEVELS), get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kernel_and_reference_equal_bitsandbytes(shape, dtype):
    nf4 = nf4_weight(shape, dtype)
    expected = nf4.dequantize(kernel=False)  # bitsandbytes
    assert_bit_equal(nf4_dequantize(nf4.data(), torch.empty(shape, dtype=dtype, device=DEVICE)), expected, "kernel")
    assert_bit_equal(nf4_dequantize_reference(nf4.data(), shape, dtype), expected, "reference")
    assert_bit_equal(nf4.dequantize(kernel=True), expected, "NF4Weight.dequantize(kernel=True)")


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kernel_equals_reference_for_an_odd_number_of_values(shape, dtype):
    nf4 = nf4_weight(shape, dtype)
    out = torch.empty(shape, dtype=dtype, device=DEVICE)
    assert_bit_equal(nf4_dequantize(nf4.data(), out), nf4_dequantize_reference(nf4.data(), shape, dtype), "kernel")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kernel_writes_into_rows_of_a_buffer(dtype):
    """Two weights into consecutive rows of one buffer: each its own rows, exactly, and nothing else written."""
    weights = [nf4_weight((24, 70), dtype), nf4_weight((9, 70), dtype)]
    buffer = torch.full((40, 70), 7.0, dtype=dtype, device=DEVICE)
    nf4_dequantize(weights[0].data(), buffer[3:27])
    nf4_dequantize(weights[1].data(), buffer[27:36])
    assert_bit_equal(buffer[3:27], weights[0].dequantize(kernel=False), "first weight's rows")
    assert_bit_equal(buffer[27:36], weights[1].dequantize(kernel=False), "second weight's rows")
    assert (buffer[:3] == 7).all() and (buffer[36:] == 7).all(), "rows outside the slices were written"
    for kernel in (False, True):  # NF4Weight.dequantize writes into the given rows by either path
        out = buffer[3:27]
        assert weights[0].dequantize(out=out, kernel=kernel) is out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kernel_writes_into_the_first_columns_of_a_buffer(dtype):
    """A weight of rows of 128 values into the first 128 columns of a (24, 150) buffer (the [W | B] of model/lora.py):
    its values exactly, and the other columns untouched; by either path of NF4Weight.dequantize, and through a
    copy where the rows are not a multiple of 64 values."""
    nf4 = nf4_weight((24, 128), dtype)
    expected = nf4.dequantize(kernel=False)
    buffer = torch.full((24, 150), 7.0, dtype=dtype, device=DEVICE)
    assert nf4_dequantize(nf4.data(), buffer[:, :128]).data_ptr() == buffer.data_ptr()
    assert_bit_equal(buffer[:, :128], expected, "the weight's columns")
    assert (buffer[:, 128:] == 7).all(), "columns after the weight were written"
    for kernel in (False, True):
        buffer.fill_(7.0)
        nf4.dequantize(out=buffer[:, :128], kernel=kernel)
        assert_bit_equal(buffer[:, :128], expected, f"NF4Weight.dequantize(kernel={kernel})")
        assert (buffer[:, 128:] == 7).all()
    odd = nf4_weight((6, 70), dtype)
    buffer = torch.full((6, 80), 7.0, dtype=dtype, device=DEVICE)
    odd.dequantize(out=buffer[:, :70], kernel=True)
    assert_bit_equal(buffer[:, :70], odd.dequantize(kernel=False), "rows of 70 values, copied")
    assert (buffer[:, 70:] == 7).all()


def test_kernel_refuses_a_mismatched_output():
    nf4 = nf4_weight((8, 64), torch.float32)
    with pytest.raises(ValueError, match="packed must be 224 .* for a weight of 448 values; got 256"):
        nf4_dequantize(nf4.data(), torch.empty(8, 56, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        nf4_dequantize(nf4.data(), torch.empty(64, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="row-strided, rows of a multiple of 64"):
        nf4_dequantize(nf4_weight((8, 70), torch.float32).data(), torch.empty(8, 80, device=DEVICE)[:, :70])
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        nf4_dequantize(nf4.data(), torch.empty(8, 64, dtype=torch.float64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (1027, 3583)], ids=str)
def test_kernel_equals_bitsandbytes_on_gpu(shape, dtype):
    nf4 = nf4_weight(shape, dtype, device="cuda")
    expected = nf4.dequantize(kernel=False)
    assert_bit_equal(nf4.dequantize(kernel=True), expected, "kernel")
    assert_bit_equal(nf4_dequantize_reference(nf4.data(), shape, dtype), expected, "reference")
