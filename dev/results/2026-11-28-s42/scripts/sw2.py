"""SwiGLU backward variants at Llama-3.1-8B's --fp8 MLP shapes: the dot's accumulator as the loaded tile, FMAs in
place of the dot, fewer steps a program; bits against the kernel as is."""
import os, sys, torch, triton, triton.language as tl
sys.path.insert(0, ".")
import kernels.glu as glu
from kernels.swiglu import swiglu_backward, swiglu_forward
from kernels.glu import tile, tile_steps, block_amax
from kernels.decode_linear import dot_constexprs
from kernels.softcap_attention import _dot

I, N, r = int(os.environ.get("I", 14336)), int(os.environ.get("N", 4096)), 16
dev = os.environ.get("DEV", "cuda")
torch.manual_seed(0)
gu = torch.randn(2 * I, N, device=dev, dtype=torch.bfloat16)
dh0 = torch.randn(I, N, device=dev, dtype=torch.bfloat16) * 0.01
b = torch.randn(2 * I, 2 * r, device=dev, dtype=torch.bfloat16) * 0.01
xa = torch.randn(N, 2 * r, device=dev, dtype=torch.bfloat16)
a_d = torch.randn(r, I, device=dev, dtype=torch.bfloat16) * 0.01
dyb = torch.randn(N, r, device=dev, dtype=torch.bfloat16)
terms = ((b[:I, :r], xa[:, :r]), (b[I:, r:], xa[:, r:]))
dh_term = (a_d.t(), dyb)
amax = torch.empty((), device=dev, dtype=torch.bfloat16)
el = I * N * 2
bwd_bytes, fwd_bytes = 6 * el, 3 * el

def timeit(fn, reps=20):
    for _ in range(3): fn()
    if dev == 'cpu':
        return 0.0
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(3):
        s.record()
        for _ in range(reps): fn()
        e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / reps * 1000)
    return min(ts)

@triton.jit
def _right(term, cols, n_cols, BLOCK_K: tl.constexpr):
    l_ptr, l_stride0, l_stride1, r_ptr, r_stride0, r_stride1, k = term
    c = tl.arange(0, BLOCK_K)
    return tl.load(r_ptr + cols[None, :] * r_stride0 + c[:, None] * r_stride1,
                   mask=(cols[None, :] < n_cols) & (c[:, None] < k), other=0.0)

@triton.jit
def _left(term, rows, n_rows, BLOCK_K: tl.constexpr):
    l_ptr, l_stride0, l_stride1, r_ptr, r_stride0, r_stride1, k = term
    c = tl.arange(0, BLOCK_K)
    return tl.load(l_ptr + rows[:, None] * l_stride0 + c[None, :] * l_stride1,
                   mask=(rows[:, None] < n_rows) & (c[None, :] < k), other=0.0)

@triton.jit
def _fma(term, rows, cols, n_rows, n_cols, acc, BLOCK_K: tl.constexpr):
    l_ptr, l_stride0, l_stride1, r_ptr, r_stride0, r_stride1, k = term
    for c in tl.static_range(BLOCK_K):
        lc = tl.load(l_ptr + rows * l_stride0 + c * l_stride1, mask=rows < n_rows, other=0.0).to(tl.float32)
        rc = tl.load(r_ptr + cols * r_stride0 + c * r_stride1, mask=cols < n_cols, other=0.0).to(tl.float32)
        acc += lc[:, None] * rc[None, :]
    return acc

@triton.jit
def _bwd(dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, amax_ptr, n, n_cols, terms, dh_term,
         MODE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
         BLOCK_K: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr, DTYPE: tl.constexpr,
         OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    amax = tl.zeros((), dtype=tl.float32)
    gate_term, up_term = terms
    col_tiles = tl.cdiv(n_cols, BLOCK_C)
    cols = (tl.program_id(0) % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    rg = _right(gate_term, cols, n_cols, BLOCK_K)
    ru = _right(up_term, cols, n_cols, BLOCK_K)
    rh = _right(dh_term, cols, n_cols, BLOCK_K)
    n_rows = n // n_cols
    for step in tl.range(0, tile_steps(n, n_cols, True, BLOCK_R, BLOCK_C, STEPS), num_stages=STAGES):
        offs, mask, rows, cols_ = tile(step, n, n_cols, True, BLOCK, BLOCK_R, BLOCK_C, STEPS)
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:  # the dot, then the add
            dh += _dot(_left(dh_term, rows, n_rows, BLOCK_K), rh, DTYPE, OPERAND, PRECISION)
            g += _dot(_left(gate_term, rows, n_rows, BLOCK_K), rg, DTYPE, OPERAND, PRECISION)
            u += _dot(_left(up_term, rows, n_rows, BLOCK_K), ru, DTYPE, OPERAND, PRECISION)
        elif MODE == 1:  # the loaded tile as the dot's accumulator
            dh = tl.dot(_left(dh_term, rows, n_rows, BLOCK_K).to(OPERAND), rh.to(OPERAND), dh, input_precision=PRECISION)
            g = tl.dot(_left(gate_term, rows, n_rows, BLOCK_K).to(OPERAND), rg.to(OPERAND), g, input_precision=PRECISION)
            u = tl.dot(_left(up_term, rows, n_rows, BLOCK_K).to(OPERAND), ru.to(OPERAND), u, input_precision=PRECISION)
        else:  # FMAs
            dh = _fma(dh_term, rows, cols, n_rows, n_cols, dh, BLOCK_K)
            g = _fma(gate_term, rows, cols, n_rows, n_cols, g, BLOCK_K)
            u = _fma(up_term, rows, cols, n_rows, n_cols, u, BLOCK_K)
        s = tl.sigmoid(g)
        dup = (dh * g * s).to(dup_ptr.dtype.element_ty)
        dgate = (dh * u * s * (1.0 + g * (1.0 - s))).to(dgate_ptr.dtype.element_ty)
        tl.store(dgate_ptr + offs, dgate, mask=mask)
        tl.store(dup_ptr + offs, dup, mask=mask)
        amax = tl.maximum(amax, tl.maximum(block_amax(dgate, mask), block_amax(dup, mask)),
                          propagate_nan=tl.PropagateNan.ALL)
        tl.store(dh_ptr + offs, (g * s * u).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(amax_ptr + tl.program_id(0), amax.to(amax_ptr.dtype.element_ty))

def variant(mode, br, bc, st, sg, w, g, u, dh):
    targs = tuple(glu._term(*t, I, N, "t") for t in terms)
    hterm = glu._term(*dh_term, I, N, "h")
    progs = triton.cdiv(I, br * st) * triton.cdiv(N, bc)
    am = amax.new_empty(progs)
    def f():
        _bwd[(progs,)](dh, g, u, g, u, am, I * N, N, targs, hterm, MODE=mode, BLOCK=1024, BLOCK_R=br, BLOCK_C=bc,
                       BLOCK_K=16, STEPS=st, STAGES=sg, **dot_constexprs(g), num_warps=w)
    return f

def rep(name, us):
    print(f"{name:44s} {us:8.1f} us  {bwd_bytes / max(us, 1e-9) / 1e6:5.2f} TB/s", flush=True)

rep("bwd as is", timeit(lambda: swiglu_backward(dh0, gu[:I], gu[I:], inplace=True, write_h=True, amax=amax, terms=terms, dh_term=dh_term)))
rep("bwd no terms (1-d)", timeit(lambda: swiglu_backward(dh0, gu[:I], gu[I:], inplace=True, write_h=True, amax=amax)))
for st, sg in ():
    glu.STEPS, glu.STAGES = st, sg
    rep(f"as is, STEPS {st} STAGES {sg}", timeit(lambda: swiglu_backward(dh0, gu[:I], gu[I:], inplace=True, write_h=True, amax=amax, terms=terms, dh_term=dh_term)))
glu.STEPS, glu.STAGES = 8, 3
cfgs = [(16, 256, 8, 3, 4), (16, 64, 1, 1, 4), (16, 128, 1, 1, 4), (16, 64, 4, 2, 4), (16, 128, 8, 3, 4), (16, 256, 16, 3, 4), (16, 512, 8, 3, 8), (16, 256, 8, 4, 4), (16, 128, 16, 4, 4), (16, 256, 8, 2, 4), (16, 64, 8, 3, 2), (16, 128, 8, 3, 2)]
if os.environ.get("QUICK"): cfgs = cfgs[:1]
for mode in (0,):
    for cfg in cfgs:
        try:
            rep(f"mode {mode} R{cfg[0]} C{cfg[1]} S{cfg[2]} stg{cfg[3]} w{cfg[4]}", timeit(variant(mode, *cfg, gu[:I], gu[I:], dh0), reps=10))
        except Exception as ex:
            print("fail", mode, cfg, repr(ex)[:200], flush=True)

# bits against the kernel as is
for mode in (0, 1, 2):
    gu1, dh1 = torch.randn_like(gu), torch.randn_like(dh0) * 0.01
    gu2, dh2 = gu1.clone(), dh1.clone()
    swiglu_backward(dh1, gu1[:I], gu1[I:], inplace=True, write_h=True, amax=amax, terms=terms, dh_term=dh_term)
    variant(mode, 32, 128, 8, 3, 4, gu2[:I], gu2[I:], dh2)()
    d = (gu1.float() - gu2.float()).abs().max().item()
    print(f"mode {mode}: bit-equal dG|dU {torch.equal(gu1, gu2)} h {torch.equal(dh1, dh2)}; max diff {d:.3g}", flush=True)

# the forward: terms hoisted, against as is
@triton.jit
def _fwd(gate_ptr, up_ptr, h_ptr, amax_ptr, n, n_cols, terms, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
         BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr, DTYPE: tl.constexpr,
         OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    amax = tl.zeros((), dtype=tl.float32)
    gate_term, up_term = terms
    col_tiles = tl.cdiv(n_cols, BLOCK_C)
    cols = (tl.program_id(0) % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    rg = _right(gate_term, cols, n_cols, BLOCK_K)
    ru = _right(up_term, cols, n_cols, BLOCK_K)
    n_rows = n // n_cols
    for step in tl.range(0, tile_steps(n, n_cols, True, BLOCK_R, BLOCK_C, STEPS), num_stages=STAGES):
        offs, mask, rows, cols_ = tile(step, n, n_cols, True, BLOCK, BLOCK_R, BLOCK_C, STEPS)
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g += _dot(_left(gate_term, rows, n_rows, BLOCK_K), rg, DTYPE, OPERAND, PRECISION)
        u += _dot(_left(up_term, rows, n_rows, BLOCK_K), ru, DTYPE, OPERAND, PRECISION)
        h = (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, h, mask=mask)
        amax = tl.maximum(amax, block_amax(h, mask), propagate_nan=tl.PropagateNan.ALL)
    tl.store(amax_ptr + tl.program_id(0), amax.to(amax_ptr.dtype.element_ty))

hout = torch.empty_like(dh0)
def fvariant(br, bc, st, sg, w):
    targs = tuple(glu._term(*t, I, N, "t") for t in terms)
    progs = triton.cdiv(I, br * st) * triton.cdiv(N, bc)
    am = amax.new_empty(progs)
    def f():
        _fwd[(progs,)](gu[:I], gu[I:], hout, am, I * N, N, targs, BLOCK=1024, BLOCK_R=br, BLOCK_C=bc, BLOCK_K=16,
                       STEPS=st, STAGES=sg, **dot_constexprs(gu), num_warps=w)
    return f
def frep(name, us):
    print(f"{name:44s} {us:8.1f} us  {fwd_bytes / max(us, 1e-9) / 1e6:5.2f} TB/s", flush=True)
frep("fwd as is", timeit(lambda: swiglu_forward(gu[:I], gu[I:], amax=amax, terms=terms)))
frep("fwd no terms", timeit(lambda: swiglu_forward(gu[:I], gu[I:], amax=amax)))
for cfg in [(32, 128, 8, 3, 4)] + cfgs:
    try:
        frep(f"fwd hoisted R{cfg[0]} C{cfg[1]} S{cfg[2]} stg{cfg[3]} w{cfg[4]}", timeit(fvariant(*cfg), reps=10))
    except Exception as ex:
        print("fail fwd", cfg, repr(ex)[:200], flush=True)
h_ref = swiglu_forward(gu[:I], gu[I:], amax=amax, terms=terms)
fvariant(16, 256, 8, 3, 4)()
print("fwd hoisted bit-equal", torch.equal(h_ref, hout))
