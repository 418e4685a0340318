"""The FP8 (e4m3) quantization kernels against their pure-torch references, bit for bit: row-wise quantization
of activations (kernels/fp8_quantize.py), tensor-wise quantization of those stored transposed
(kernels/fp8_quantize_tensor.py) and NF4 straight to e4m3 (kernels/nf4_to_fp8.py), whose result is also
bitsandbytes' dequantized fp32 weight quantized with the same scales. On CPU the kernels run in Triton's
interpreter (tests/conftest.py); tests/test_fp8_gpu.py repeats them at real sizes on a GPU."""
import pytest
import torch

from kernels.fp8_quantize import fp8_quantize_rows
from kernels.fp8_quantize_tensor import fp8_quantize_tensor
from kernels.nf4_to_fp8 import nf4_to_fp8
from kernels.references import (
    E4M3,
    fp8_quantize_rows_reference,
    fp8_quantize_tensor_reference,
    fp8_reciprocal,
    fp8_scale,
    nf4_to_fp8_reference,
    to_e4m3,
)
from model.qlora import NF4Weight
from tests.helpers import assert_bit_equal

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# (1, 1) and (5, 7): less than a tile; (33, 300), (17, 513): several row tiles, each row in registers (row-major)
# or several K loops (transposed), partial ones last; (5, 8200): rows wider than one pass holds, read twice.
SHAPES = [(1, 1), (5, 7), (33, 300), (17, 513), (5, 8200)]
# NF4 shapes whose bitsandbytes CPU dequantization equals its CUDA one (tests/test_nf4.py's), and (37, 75): an
# odd number of values, compared with the reference alone (tests/test_nf4.py says why).
NF4_SHAPES = [(5, 6), (37, 74), (64, 64), (130, 130)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)




def e4m3_edges():
    """Every finite e4m3 value, the midpoints between neighbours (ties: the even one wins) and the fp32 values
    just either side of each midpoint, of both signs: every rounding case of fp32 to e4m3 below 448."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448, ascending
    mids = (values[1:] + values[:-1]) / 2
    nearby = torch.cat([values, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    return torch.cat([nearby, -nearby])


def test_rounding_is_torchs_at_every_edge():
    """A row whose amax is 448 has scale 1: the kernel's e4m3 rounding of each value is torch's (nearest, even)."""
    x = e4m3_edges()[None, :].to(DEVICE)
    q, s = fp8_quantize_rows(x)
    assert s.item() == 1.0
    assert_bit_equal(q, x.to(E4M3), "e4m3 rounding")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_quantize_rows_equals_reference(shape, dtype, layout):
    """Values over 11 decades (so that some land in e4m3's subnormals), a zero row (scale 1), and the input
    row-major or stored transposed (as the MLP's H and [dG | dU] are)."""
    x = torch.randn(shape, device=DEVICE) * torch.logspace(-8, 3, shape[1], device=DEVICE)
    x[0] = 0
    x = x.to(dtype)
    if layout == "transposed":
        x = x.t().contiguous().t()
    q, s = fp8_quantize_rows(x)
    q_ref, s_ref = fp8_quantize_rows_reference(x)
    assert q.is_contiguous() and s.shape == (shape[0],)
    assert_bit_equal(s, s_ref, "scales")
    assert_bit_equal(q, q_ref, "e4m3 values")
    assert s[0].item() == 1.0 and not q[0].float().any(), "a zero row: scale 1, zeros"
    amax = x.float().abs().amax(1)
    assert torch.equal(s, fp8_scale(amax)) and (s[1:] == (amax[1:].double() / 448).float()).all()


@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_quantize_rows_of_tiny_values_have_scale_one(layout):
    """A row whose amax / 448 is below fp32's smallest normal has scale 1 (its reciprocal would overflow, and
    0 · inf give NaN): zeros; the other rows keep their own scales."""
    x = torch.randn(3, 70, device=DEVICE)
    x[1] *= 1e-37
    x[2, :5] = torch.tensor([1e-40, -3e-42, 0.0, 2e-39, 1e-45])
    x[2, 5:] = 0
    if layout == "transposed":
        x = x.t().contiguous().t()
    q, s = fp8_quantize_rows(x)
    q_ref, s_ref = fp8_quantize_rows_reference(x)
    assert_bit_equal(s, s_ref, "scales")
    assert_bit_equal(q, q_ref, "e4m3 values")
    assert s[1:].tolist() == [1.0, 1.0] and not q[1:].float().any() and not q.float().isnan().any()
    assert s[0].item() == (x[0].abs().amax().double() / 448).float().item()


def test_quantize_rows_refuses_bad_input():
    with pytest.raises(ValueError, match="2-D fp32/bf16/fp16"):
        fp8_quantize_rows(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="2-D fp32/bf16/fp16"):
        fp8_quantize_rows(torch.zeros(2, 3, dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize("shape", SHAPES + [(70, 130)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_quantize_tensor_equals_reference(shape, dtype, layout):
    """Values over 11 decades (some in e4m3's subnormals, some flushed to zero), the amax in one row, and the input
    stored transposed (the MLP's H and [dG | dU]) or row-major; (70, 130): partial tiles along both dimensions."""
    x = torch.randn(shape, device=DEVICE) * torch.logspace(-8, 3, shape[1], device=DEVICE)
    x[-1, -1] = -1e4
    x = x.to(dtype)
    if layout == "transposed":
        x = x.t().contiguous().t()
    q, s = fp8_quantize_tensor(x)
    q_ref, s_ref = fp8_quantize_tensor_reference(x)
    assert q.is_contiguous() and s.shape == (shape[0],) and s.is_contiguous()
    assert_bit_equal(s, s_ref, "scales")
    assert_bit_equal(q, q_ref, "e4m3 values")
    amax = x.float().abs().amax()
    assert (s == (amax.double() / 448).float()).all(), "one scale, amax / 448, in every row"
    assert q[-1, -1].float().item() == -448.0


def test_quantize_tensor_rounds_as_torch_at_every_edge():
    """An amax of 448 gives scale 1: the kernel's e4m3 rounding of each value, stored transposed, is torch's."""
    x = e4m3_edges().view(-1, 2).to(DEVICE)
    x = x.t().contiguous().t()
    q, s = fp8_quantize_tensor(x)
    assert (s == 1).all()
    assert_bit_equal(q, x.to(E4M3), "e4m3 rounding")


@pytest.mark.parametrize("scale", [0.0, 1e-37], ids=["zeros", "tiny"])
def test_quantize_tensor_of_tiny_values_has_scale_one(scale):
    """A tensor whose amax / 448 is below fp32's smallest normal (all zeros, or tiny) has scale 1: zeros, no NaN."""
    x = (torch.randn(40, 70, device=DEVICE) * scale).t()
    q, s = fp8_quantize_tensor(x)
    assert_bit_equal(q, fp8_quantize_tensor_reference(x)[0], "e4m3 values")
    assert (s == 1).all() and s.shape == (70,) and not q.float().any()


def test_quantize_tensor_of_an_empty_tensor():
    for shape in [(0, 5), (5, 0)]:
        q, s = fp8_quantize_tensor(torch.zeros(shape, device=DEVICE))
        assert q.shape == shape and q.dtype == E4M3 and s.tolist() == [1.0] * shape[0]


def test_quantize_tensor_refuses_bad_input():
    with pytest.raises(ValueError, match="2-D fp32/bf16/fp16"):
        fp8_quantize_tensor(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="2-D fp32/bf16/fp16"):
        fp8_quantize_tensor(torch.zeros(2, 3, dtype=torch.float64, device=DEVICE))


def nf4_weight(shape, device=DEVICE):
    """An NF4Weight of a random fp32 weight, with an outlier so that the absmax scales spread widely."""
    w = torch.randn(shape, device=device)
    w.view(-1)[w.numel() // 3] = 40.0
    return NF4Weight(w)


def scales(n, device=DEVICE):
    return torch.rand(n, device=device) * 0.1 + 0.01


@pytest.mark.parametrize("shape", NF4_SHAPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_nf4_to_fp8_equals_quantized_bitsandbytes(shape, transposed):
    R, K = shape
    nf4 = nf4_weight(shape)
    scale = scales(K if transposed else R)
    w = nf4.dequantize(kernel=False)  # bitsandbytes, fp32
    expected = to_e4m3(w / scale[None, :]).t() if transposed else to_e4m3(w / scale[:, None])
    out = torch.empty((K, R) if transposed else (R, K), dtype=E4M3, device=DEVICE)
    assert nf4_to_fp8([(nf4.data(), shape)], fp8_reciprocal(scale), out, transposed) is out
    assert_bit_equal(out, expected.contiguous(), "kernel")
    assert_bit_equal(nf4_to_fp8_reference(nf4.data(), shape, scale, transposed), expected.contiguous(), "reference")


def group_reference(weights, scale, transposed):
    """The group [W_1; W_2; ...] as e4m3, from nf4_to_fp8_reference per projection."""
    if transposed:
        return torch.cat([nf4_to_fp8_reference(w.data(), w.shape, scale, True) for w in weights], 1)
    ends = torch.tensor([w.shape[0] for w in weights]).cumsum(0).tolist()
    return torch.cat([nf4_to_fp8_reference(w.data(), w.shape, scale[e - w.shape[0]:e]) for w, e in zip(weights, ends)])


@pytest.mark.parametrize("rows, K", [((37,), 75), ((70,), 192), ((64, 16, 16), 128), ((70, 5, 24), 64),
                                     ((3, 65, 1), 75)], ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_nf4_to_fp8_of_a_group_in_one_launch(rows, K, transposed, monkeypatch):
    """A group of projections [W_1; W_2; ...] (q, k, v) in one launch, each projection's values its reference's.
    (37,) x 75: an odd number of values (bytes straddle rows); (70,) x 192: whole 64-value blocks a row, over
    several row tiles and a partial column tile; (64, 16, 16): whole tiles, then projections smaller than one;
    (70, 5, 24) and (3, 65, 1): projections that end inside a tile, with and without whole blocks a row."""
    import kernels.nf4_to_fp8 as module
    launches = []
    kernel = module._nf4_to_fp8_kernel
    monkeypatch.setattr(module, "_nf4_to_fp8_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: launches.append(grid) or kernel[grid]})())
    weights = [nf4_weight((R, K)) for R in rows]
    scale = scales(K if transposed else sum(rows))
    out = torch.empty((K, sum(rows)) if transposed else (sum(rows), K), dtype=E4M3, device=DEVICE)
    assert nf4_to_fp8([(w.data(), w.shape) for w in weights], fp8_reciprocal(scale), out, transposed) is out
    assert len(launches) == 1
    assert_bit_equal(out, group_reference(weights, scale, transposed), "kernel")


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_nf4_to_fp8_writes_into_a_slice_of_a_buffer(transposed):
    """A group into rows [3, 35) of a larger buffer, or transposed into its columns [3, 35): exactly its slice,
    nothing else written."""
    weights, K = [nf4_weight((24, 64)), nf4_weight((8, 64))], 64
    scale = scales(K if transposed else 32)
    buffer = torch.full((K, 40) if transposed else (40, K), 3.0, device=DEVICE).to(E4M3)
    out = buffer[:, 3:35] if transposed else buffer[3:35]
    nf4_to_fp8([(w.data(), w.shape) for w in weights], fp8_reciprocal(scale), out, transposed)
    assert_bit_equal(out, group_reference(weights, scale, transposed), "slice")
    for untouched in ((buffer[:, :3], buffer[:, 35:]) if transposed else (buffer[:3], buffer[35:])):
        assert (untouched.float() == 3).all(), "values outside the slice were written"


def test_nf4_to_fp8_refuses_mismatched_arguments():
    nf4 = nf4_weight((8, 64))
    q = [(nf4.data(), (8, 64))]
    with pytest.raises(ValueError, match=r"out must be \(64, 8\) e4m3"):
        nf4_to_fp8(q, scales(64), torch.empty(8, 64, dtype=E4M3, device=DEVICE), transposed=True)
    with pytest.raises(ValueError, match="out must be"):
        nf4_to_fp8(q, scales(8), torch.empty(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"reciprocal must be \(8,\) fp32"):
        nf4_to_fp8(q, scales(64), torch.empty(8, 64, dtype=E4M3, device=DEVICE))
    with pytest.raises(ValueError, match="of one K"):
        nf4_to_fp8(q + [(nf4_weight((8, 128)).data(), (8, 128))], scales(16),
                   torch.empty(16, 64, dtype=E4M3, device=DEVICE))
    with pytest.raises(ValueError, match="packed must be 512"):
        nf4_to_fp8([(nf4.data(), (16, 64))], scales(16), torch.empty(16, 64, dtype=E4M3, device=DEVICE))
