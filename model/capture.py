"""What the CUDA-graph captures of the training step (step.py) and of decoding (model/generate.py) share.

    warm_up(fn)                   fn() once, eagerly, on a side stream, before a capture
    capture(graph, fn, pool)      fn() recorded into graph; where the capture fails, the process is put back
"""
import warnings

import torch


def warm_up(fn):
    """fn() run once eagerly on a side stream, after the work queued before it and before the work queued after
    it: what PyTorch initialises lazily (cuBLAS handles and workspaces, the autograd engine's threads) must start
    before a capture, not inside it. Returns fn's result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return out


def capture(graph, fn, pool=None):
    """fn() recorded into `graph` (torch.cuda.graph) in the memory pool `pool` (a torch.cuda.graph_pool_handle();
    None: a new one); returns fn's result. A capture that fails raises its error after `end_failed_capture` has
    put back what the failed capture leaves behind."""
    stream = torch.cuda.current_stream()
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    try:
        with torch.cuda.graph(graph, pool=pool):
            return fn()
    except Exception:
        end_failed_capture(stream, pool)
        raise


def end_failed_capture(stream, pool):
    """When a capture fails, torch.cuda.graph's end raises before its own clean-up, and leaves behind:
    - the CUDA generator in its capture mode, in which it refuses every draw outside a capture ("Offset increment
      outside graph capture": dropout, sampling). An empty capture, begun and ended here, ends it; the
      generator's seed and offset stay as they were;
    - its side stream as the current stream: `stream`, the one before, is made current again;
    - the caching allocator's routing of the capture's allocations into the graph's memory pool: while it lasts,
      the allocator never frees cached memory to satisfy an allocation, and defers freeing any memory that two
      streams used, so the process runs out of memory. The routing ends here, and the pool is released.
    Where the capture's end ran (the error came from before the capture began, or from fn without spoiling the
    capture), `stream` is current again and nothing is left behind.
    The two private calls (torch._C._cuda_endAllocateToPool, _cuda_releasePool) are what torch.cuda.graph's
    own end calls; they can go when a failed `with torch.cuda.graph(...)` cleans up after itself: then
    tests/test_step.py's test_graph_step_goes_on_eagerly_when_the_capture_fails passes with this function
    reduced to its first line."""
    if torch.cuda.current_stream() == stream:
        return
    empty = torch.cuda.CUDAGraph()
    with torch.cuda.device(stream.device), torch.cuda.stream(torch.cuda.Stream()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns that the graph is empty
        empty.capture_begin()
        empty.capture_end()
    torch.cuda.set_stream(stream)
    try:
        torch._C._cuda_endAllocateToPool(stream.device.index, pool)
    except RuntimeError:  # the capture's end got as far as ending the routing
        return
    torch._C._cuda_releasePool(stream.device.index, pool)
