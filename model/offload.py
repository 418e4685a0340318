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

A layer's first run may also hand over tensors that its recompute reads instead of computing them again (its
attention's output and log-sum-exp, o's output and q | k | v's: `keep`, model/transformer.py). They travel with
the layer's input: copied out with it (one wait and one event for all of them, so that a CUDA graph keeps one side
branch of copies), brought back with it, and given back by `take`. They more than double the host memory a forward
holds and the bytes it copies, so the model hands them over only where the host has room for them (`room_for`) and
the layer's work hides their copies (`Transformer.kept_tensors`).
"""
import weakref
from dataclasses import dataclass, field

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
    kept: list = field(default_factory=list)  # a layer input's: what the layer's first run handed over (`keep`)


class ActivationOffload:
    """The layer inputs of one forward at a time: `begin()`, then each layer's checkpoint inside
    `hooks(x)`, then `end()`; backward unpacks them in reverse order."""

    def __init__(self):
        self.stream = None  # the copy stream (made on first use, on the device of the inputs)
        self.buffers = {}  # layer index -> flat CPU buffer (pinned on CUDA), grown for a longer batch
        self.kept_buffers = {}  # (layer index, slot) -> the same, for the tensors a layer's first run hands over
        self.room = {}  # (bytes a forward would hand over, its inputs' bytes) -> whether the host has room (`room_for`)
        self.made = []  # every buffer ever made: a graph captured with an older one still reads it
        self.pinned = []  # the CUDA buffers among them, registered with the driver until this object goes
        weakref.finalize(self, _unregister, self.pinned).atexit = False  # at exit the process's memory goes anyway
        self.saved = []  # this forward's layer inputs, in layer order
        self.pending = []  # (record, tensor): what the layer in its first run handed over, until its input is packed
        self.leaving = []  # (record, GPU tensor, event): tensors being copied out, freed once the compute stream waits
        self.step = 0
        self.layer_input = None  # (data_ptr, shape) of the input of the layer being checkpointed

    def begin(self):
        """Start a forward: the previous one's inputs are released (their backward is over)."""
        self._release()
        self.saved = []
        self.pending = []
        self.step += 1

    def hooks(self, x):
        """The saved-tensor hooks for the checkpoint of one layer whose input is x (B, T, H). They
        recognise x by its address and shape: autograd keeps the hooks as long as what they saved,
        so a reference to x inside them would keep x on the GPU."""
        self.layer_input = (x.data_ptr(), x.shape)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def end(self):
        """End a forward: the last layer's input (and what it handed over) stays on the GPU, since backward needs it
        first."""
        for saved, t, _ in self.leaving:  # only the last layer's: each layer's input releases the layer before
            saved.gpu = t

    def _pack(self, t):
        if (t.data_ptr(), t.shape) != self.layer_input:
            return t  # the RoPE tables and the mask: shared by every layer, they cost nothing to keep
        i = len(self.saved)
        saved = _Saved(i, self._host_view(self.buffers, i, t), self.step, t.is_cuda, kept=[r for r, _ in self.pending])
        self.saved.append(saved)
        if t.is_cuda:
            self._release(i)  # the previous layer's: their copies have had this layer's compute to finish
        records, tensors = [saved, *saved.kept], [t, *(k for _, k in self.pending)]
        self.pending = []
        self._copy_out(records, tensors)
        return saved

    def keep(self, *tensors):
        """Hand over tensors that the recompute of the layer now in its first run reads (model/transformer.py): they
        are copied out with the layer's input, once the checkpoint packs it at the end of the first run, and brought
        back with it. Returns what `take` gives back for each."""
        i = len(self.saved)
        records = [_Saved(i, self._host_view(self.kept_buffers, (i, len(self.pending) + j), t), self.step, t.is_cuda)
                   for j, t in enumerate(tensors)]
        self.pending += zip(records, tensors)
        return records

    def take(self, saved):
        """The tensor that `keep` handed over, on the GPU again (its copy back started with its layer's input)."""
        return self._back(saved)

    def room_for(self, kept, inputs):
        """Whether the host has room for `kept` bytes of page-locked memory a forward beside the `inputs` bytes of
        the layer inputs' buffers: at most half of the memory it has available once those buffers are made (the
        other half stays for the rest of the process and the host's own needs). Decided once for each size, so that
        every step of one shape does the same (and a CUDA graph captures it)."""
        if (kept, inputs) not in self.room:
            available = host_available()
            made = sum(b.numel() * b.element_size() for b in self.buffers.values())
            self.room[kept, inputs] = available is None or kept <= (available - max(0, inputs - made)) / 2
        return self.room[kept, inputs]

    def _copy_out(self, records, tensors):
        """Copy tensors to their records' CPU views: on the copy stream, once the compute stream has made them."""
        if not tensors[0].is_cuda:
            for saved, t in zip(records, tensors):
                saved.host.copy_(t)
            return
        stream = self._stream(tensors[0].device)
        stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
        with torch.cuda.stream(stream):
            for saved, t in zip(records, tensors):
                saved.host.copy_(t, non_blocking=True)
            done = stream.record_event()
        # each tensor must outlive its copy: the compute stream waits for the copies before any is freed
        self.leaving += [(saved, t, done) for saved, t in zip(records, tensors)]

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        x = self._back(saved)
        if saved.cuda and saved.index > 0:
            layer = self.saved[saved.index - 1]
            self._fetch(layer, *layer.kept)  # what the next layer backward will need
        return x

    def _back(self, saved):
        """A tensor that was copied out, on its device again: waits for its copy back (issued now if it was not)."""
        if saved.step != self.step:
            raise RuntimeError("activation offload keeps the layer inputs of one forward at a time: run "
                               "backward before the next forward (or turn off offload_activations)")
        if not saved.cuda:
            return saved.host
        self._release()  # the copies out are long done; the compute stream must wait for them before reuse
        if saved.gpu is None:  # not prefetched (a second backward through a retained graph)
            self._fetch(saved)
        if saved.ready is not None:
            torch.cuda.current_stream().wait_event(saved.ready)
        t, saved.gpu, saved.ready = saved.gpu, None, None
        return t

    def _fetch(self, *records):
        """Start copying tensors back to the GPU on the copy stream (one wait for the compute stream, one event)."""
        compute = torch.cuda.current_stream()
        gpus = [torch.empty_strided(r.host.shape, r.host.stride(), dtype=r.host.dtype, device=compute.device)
                for r in records]
        stream = self._stream(compute.device)
        stream.wait_stream(compute)  # the memory of the new tensors may have been in use until now
        with torch.cuda.stream(stream):
            for r, gpu in zip(records, gpus):
                gpu.copy_(r.host, non_blocking=True)
            ready = stream.record_event()
        for r, gpu in zip(records, gpus):
            r.gpu, r.ready = gpu, ready

    def _release(self, before=None):
        """The compute stream waits for every copy out (of the layers before layer `before`), after which those GPU
        tensors may be freed."""
        still, waited = [], set()
        for saved, t, done in self.leaving:
            if before is not None and saved.index >= before:
                still.append((saved, t, done))
            elif id(done) not in waited:  # one event for the tensors copied together
                torch.cuda.current_stream(t.device).wait_event(done)
                waited.add(id(done))
        self.leaving = still

    def reserve(self, layers, numel, dtype, cuda, kept=()):
        """Layers 0 to layers - 1 given buffers of at least `numel` elements of `dtype` now, and for each (numel,
        dtype) in `kept` a buffer for what a layer hands over (`keep`, in that order): before a CUDA graph's capture
        (step.py), since a buffer first made inside one comes from torch's pinned allocator, at a power of two
        (`_pinned`)."""
        for i in range(layers):
            self._buffer(self.buffers, i, numel, dtype, cuda)
            for slot, (n, kept_dtype) in enumerate(kept):
                self._buffer(self.kept_buffers, (i, slot), n, kept_dtype, cuda)

    def _host_view(self, buffers, key, t):
        """A view of the CPU buffer `buffers[key]` with t's shape and strides (t's elements fill a span of its size:
        a contiguous tensor or a transposed one, such as an attention output), so that a copy is one memcpy."""
        assert _dense(t), f"activation offload: a tensor with gaps or overlaps, strides {t.stride()}"
        flat = self._buffer(buffers, key, t.numel(), t.dtype, t.is_cuda)
        return flat.as_strided(t.shape, t.stride())

    def _buffer(self, buffers, key, numel, dtype, cuda):
        """The CPU buffer `buffers[key]`, made or grown (at least doubled) when it holds fewer than numel elements."""
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            size = numel if buf is None or buf.dtype != dtype else max(numel, 2 * buf.numel())
            buf = _pinned(size, dtype, self.pinned) if cuda else torch.empty(size, dtype=dtype)
            buffers[key] = buf
            self.made.append(buf)
        return buf

    def _stream(self, device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream


def _dense(t):
    """Whether t's elements fill a span of t.numel() elements: its dimensions, by stride, are those of a contiguous
    tensor in some order."""
    span = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size > 1 and stride != span:
            return False
        span *= size
    return True


def _pinned(size, dtype, pinned):
    """A flat CPU buffer of exactly `size` elements in page-locked memory, appended to `pinned`. torch's pinned
    allocator (`pin_memory=True`) rounds each request up to a power of two, so a layer input of 2.5 GiB would hold
    4 GiB of host memory and a long sequence would run the host out of memory at 2/3 of the length it can take;
    ordinary memory registered with the CUDA driver is page-locked at its own size. A CUDA graph's capture refuses
    the registration, so a buffer first needed inside one comes from torch's allocator (`reserve` avoids that)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=dtype, pin_memory=True)
    _unregister([])  # those of offloads gone during a capture
    buf = torch.empty(size, dtype=dtype)
    nbytes = buf.numel() * buf.element_size()
    error = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
    if error:
        raise RuntimeError(f"activation offload could not page-lock {nbytes / 2**30:.2f} GiB of host memory (CUDA "
                           f"error {error}): shorten the sequences, or turn offload off (--no-offload-activations)")
    pinned.append(buf)
    return buf


# The host buffers of offloads that went while a CUDA graph was being captured, which refuses the driver's calls: the
# garbage collector may free an offload (and so call `_unregister`) at any allocation, inside a capture too. They
# are unlocked, and freed, outside one: when the next buffer is made or the next offload goes.
_deferred = []


def _unregister(pinned):
    """Unlock the host buffers of an `ActivationOffload` that is gone, before their memory is freed (later, if a CUDA
    graph is being captured now)."""
    _deferred.extend(pinned)
    pinned.clear()
    if _deferred and not torch.cuda.is_current_stream_capturing():  # (CUDA is asked only where buffers were locked)
        while _deferred:
            torch.cuda.cudart().cudaHostUnregister(_deferred.pop().data_ptr())


def host_available():
    """The host memory available to a new allocation, in bytes (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
