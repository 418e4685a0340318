"""Activation offload: the checkpointed layer inputs wait in pinned CPU memory, copied on a side stream.

With gradient checkpointing the only activations kept from forward to backward are the layer
inputs, one (B, T, H) tensor per layer (TinyLlama at 4 x 2048 in bf16: 32 MiB each, 0.7 GiB in all).
`ActivationOffload` moves each of them to the CPU while the next layers compute, and brings it
back while the layer after it in backward order is recomputed:

    forward, layer i    the copy stream waits for layer i's output, then copies x_i to its CPU buffer.
                        At layer i + 1 the compute stream waits for that copy and x_i is freed, so
                        at most two layer inputs are on the GPU at any time.
    end of forward      the last layer's input stays on the GPU: backward needs it first.
    backward, layer i   the compute stream waits for x_i (already on its way), and the copy stream
                        starts bringing x_{i-1} back while layer i is recomputed and differentiated.

The copies run on the GPU's copy engines, beside the compute stream. Everything is a stream
operation on fixed buffers (the CPU buffers stay allocated from step to step), so a training step
with offload captures into a CUDA graph and replays (step.py). On a CPU device the copies are
plain copies into CPU buffers, which keeps the bookkeeping testable there.

The hooks are torch's saved-tensor hooks around the reentrant checkpoint of one layer: the
checkpoint saves its inputs (x, the RoPE tables, the mask), and only x is moved.
"""
import weakref
from dataclasses import dataclass

import torch


@dataclass
class _Saved:
    """One layer input while it is away: its CPU copy, and on the GPU again once fetched."""
    index: int  # the layer's place in this forward
    host: torch.Tensor  # the CPU copy (a view of that layer's buffer)
    step: int  # the forward that wrote it; a later forward overwrites the buffer
    cuda: bool  # copied out on the copy stream (else a plain CPU copy)
    gpu: torch.Tensor | None = None  # the tensor backward gets, once a copy back has been issued
    ready: torch.cuda.Event | None = None  # recorded on the copy stream when `gpu` holds the data


class ActivationOffload:
    """The layer inputs of one forward at a time: `begin()`, then each layer's checkpoint inside
    `hooks(x)`, then `end()`; backward unpacks them in reverse order."""

    def __init__(self):
        self.stream = None  # the copy stream (made on first use, on the device of the inputs)
        self.buffers = {}  # layer index -> flat CPU buffer (pinned on CUDA), grown for a longer batch
        self.kept = []  # every buffer ever made: a graph captured with an older one still reads it
        self.pinned = []  # the CUDA buffers among them, registered with the driver until this object goes
        weakref.finalize(self, _unregister, self.pinned).atexit = False  # at exit the process's memory goes anyway
        self.saved = []  # this forward's layer inputs, in layer order
        self.leaving = []  # (GPU tensor, event): inputs being copied out, freed once the compute stream waits
        self.step = 0
        self.layer_input = None  # (data_ptr, shape) of the input of the layer being checkpointed

    def begin(self):
        """Start a forward: the previous one's inputs are released (their backward is over)."""
        self._release()
        self.saved = []
        self.step += 1

    def hooks(self, x):
        """The saved-tensor hooks for the checkpoint of one layer whose input is x (B, T, H). They
        recognise x by its address and shape: autograd keeps the hooks as long as what they saved,
        so a reference to x inside them would keep x on the GPU."""
        self.layer_input = (x.data_ptr(), x.shape)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def end(self):
        """End a forward: the last layer's input stays on the GPU, since backward needs it first."""
        if self.saved and self.leaving:
            self.saved[-1].gpu = self.leaving[-1][0]

    def _pack(self, t):
        if (t.data_ptr(), t.shape) != self.layer_input:
            return t  # the RoPE tables and the mask: shared by every layer, they cost nothing to keep
        saved = _Saved(len(self.saved), self._host_view(len(self.saved), t), self.step, t.is_cuda)
        self.saved.append(saved)
        if not t.is_cuda:
            saved.host.copy_(t)
            return saved
        self._release()  # the previous layer's input: its copy has had this layer's compute to finish
        stream = self._stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete once this layer has run
        with torch.cuda.stream(stream):
            saved.host.copy_(t, non_blocking=True)
            done = stream.record_event()
        self.leaving.append((t, done))  # t must outlive the copy: the compute stream waits for it first
        return saved

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.step != self.step:
            raise RuntimeError("activation offload keeps the layer inputs of one forward at a time: run "
                               "backward before the next forward (or turn off offload_activations)")
        if not saved.cuda:
            return saved.host
        compute = torch.cuda.current_stream()
        self._release()  # the copies out are long done; the compute stream must wait for them before reuse
        if saved.gpu is None:  # not prefetched (a second backward through a retained graph)
            self._fetch(saved)
        if saved.ready is not None:
            compute.wait_event(saved.ready)
        x, saved.gpu, saved.ready = saved.gpu, None, None
        if saved.index > 0:
            self._fetch(self.saved[saved.index - 1])  # the next layer backward will need
        return x

    def _fetch(self, saved):
        """Start copying a layer input back to the GPU on the copy stream."""
        compute = torch.cuda.current_stream()
        gpu = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=compute.device)
        stream = self._stream(compute.device)
        stream.wait_stream(compute)  # the memory of `gpu` may have been in use until now
        with torch.cuda.stream(stream):
            gpu.copy_(saved.host, non_blocking=True)
            saved.ready = stream.record_event()
        saved.gpu = gpu

    def _release(self):
        """The compute stream waits for every copy out, after which those GPU tensors may be freed."""
        for t, done in self.leaving:
            torch.cuda.current_stream(t.device).wait_event(done)
        self.leaving = []

    def reserve(self, layers, numel, dtype, cuda):
        """Layers 0 to layers - 1 given buffers of at least `numel` elements of `dtype` now: before a CUDA graph's
        capture (step.py), since a buffer first made inside one comes from torch's pinned allocator, at a power of
        two (`_pinned`)."""
        for i in range(layers):
            self._buffer(i, numel, dtype, cuda)

    def _host_view(self, i, t):
        """A (B, T, H) view of layer i's CPU buffer."""
        return self._buffer(i, t.numel(), t.dtype, t.is_cuda)[:t.numel()].view(t.shape)

    def _buffer(self, i, numel, dtype, cuda):
        """Layer i's CPU buffer, made or grown (at least doubled) when it holds fewer than numel elements."""
        buf = self.buffers.get(i)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            size = numel if buf is None or buf.dtype != dtype else max(numel, 2 * buf.numel())
            buf = _pinned(size, dtype, self.pinned) if cuda else torch.empty(size, dtype=dtype)
            self.buffers[i] = buf
            self.kept.append(buf)
        return buf

    def _stream(self, device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream


def _pinned(size, dtype, pinned):
    """A flat CPU buffer of exactly `size` elements in page-locked memory, appended to `pinned`. torch's pinned
    allocator (`pin_memory=True`) rounds each request up to a power of two, so a layer input of 2.5 GiB would hold
    4 GiB of host memory and a long sequence would run the host out of memory at 2/3 of the length it can take;
    ordinary memory registered with the CUDA driver is page-locked at its own size. A CUDA graph's capture refuses
    the registration, so a buffer first needed inside one comes from torch's allocator (`reserve` avoids that)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=dtype, pin_memory=True)
    buf = torch.empty(size, dtype=dtype)
    nbytes = buf.numel() * buf.element_size()
    error = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
    if error:
        raise RuntimeError(f"activation offload could not page-lock {nbytes / 2**30:.2f} GiB of host memory (CUDA "
                           f"error {error}): shorten the sequences, or turn offload off (--no-offload-activations)")
    pinned.append(buf)
    return buf


def _unregister(pinned):
    """Unlock the host buffers of an `ActivationOffload` that is gone, before their memory is freed."""
    for buf in pinned:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    pinned.clear()
