"""model/capture.py: a capture that fails leaves the process as it was before (GPU only)."""
import pytest
import torch
import torch.nn.functional as F

from model.capture import capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failed_capture_leaves_the_process_as_it_was():
    """After a capture that fails (a dropout draw, then a host sync, which a capture forbids): the current stream
    is the one before, the CUDA generator draws again, and the caching allocator frees cached memory to make
    room for new allocations, which it never does while a capture is under way."""
    x = torch.randn(64, 64, device="cuda")

    def spoiled():
        y = F.dropout(x, 0.5)
        float(y.sum())  # a host sync: not allowed inside a capture
        return y
    with pytest.raises(Exception, match="capturing|capture"):
        capture(torch.cuda.CUDAGraph(), spoiled)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.manual_seed(0)
    assert 0 < int((F.dropout(torch.ones(1000, device="cuda"), 0.5) == 0).sum()) < 1000
    torch.cuda.empty_cache()
    n = int(0.6 * torch.cuda.mem_get_info()[0]) >> 30  # GiB
    blocks = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(n)]
    del blocks  # n GiB now cached in blocks of 1 GiB: n blocks of 1.5 GiB fit only if they are freed
    blocks = [torch.empty(3 << 29, dtype=torch.uint8, device="cuda") for _ in range(n)]
    del blocks
    torch.cuda.empty_cache()


def test_the_private_torch_internals_nanotune_uses_are_there():
    """The private PyTorch names nanotune calls, each from one function (model/capture.py's end_failed_capture,
    model/transformer.py's _VarlenAttention): a torch that renames one fails here, not inside a training run."""
    forward = torch.ops.aten._flash_attention_forward.default._schema
    backward = torch.ops.aten._flash_attention_backward.default._schema
    assert "window_size_left" in str(forward) and "window_size_left" in str(backward), (forward, backward)
    assert [a.name for a in forward.arguments[:3]] == ["query", "key", "value"]
    if torch.cuda.is_available():  # a CUDA build's bindings
        assert callable(torch._C._cuda_endAllocateToPool) and callable(torch._C._cuda_releasePool)
