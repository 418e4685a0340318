"""DoRA's scales of every layer in one launch a forward.

DoRA scales each output row of a packed projection group (q|k|v, o, gate|up, down) by g = m / ‖W + s·B·A‖
(model/lora.py, `_dora_scales`), four groups a layer. `LayerScales` computes the scales of every group of every
layer in one launch (kernels/dora_norm.py, `NormsTable`), not one a group, before the first layer runs, and hands
each layer a `store` that holds them, which `_dora_scales` reads (as the recompute of a checkpointed layer reads
what its first run stored). The values are the same kernel's, per row.

A group is left out, for `_dora_scales` to compute as before, unless its projections run through the fused Functions
with DoRA on each, one rank and one scale, their fp32 masters and magnitudes stored stacked (`pack_adapters_`) and
their base weights stored as one view in the compute dtype (not NF4, not fp8 only, not merged).
"""
import torch

from model.lora import _dora_norms_args, _magnitudes, _rows_view, fusable


def layer_groups(layer):
    """A decoder layer's projections grouped by the input they read: (q, k, v), (o,), (gate, up), (down,)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)


def norms_args(projs, dtype):
    """(W, A, B, m, ends, s) of a group for `NormsTable`, or None where the group is left out (module docstring)."""
    if not fusable(projs) or any(p.nf4 is not None or p.weight is None for p in projs) or \
            len({p.scale for p in projs}) > 1 or not all(p.r for p in projs):  # merged: r is 0
        return None
    w = _rows_view([p.weight for p in projs])
    masters = [p.lora_A for p in projs], [p.lora_B for p in projs]
    args = _dora_norms_args(projs, [list(range(len(projs)))], _magnitudes(projs), masters)
    if w is None or w.dtype != dtype or args is None:
        return None
    return w, *args


class LayerScales:
    """The stores of a forward's layers, with the scales of the groups `norms_args` takes computed in one launch.
    Keeps the last `NormsTable` while the tensors it reads stay where they are."""

    def __init__(self):
        self.table, self.key = None, None

    def __call__(self, layers, ops, dtype):
        """One dict a layer: (g, inv) under the first projection of each group that the table computes; empty dicts
        without the kernels, the fused Functions or DoRA. ops: the model's `Ops` (model/transformer.py)."""
        stores = [{} for _ in layers]
        if ops.dora.norms_table is None or not ops.fused_lora:
            return stores
        groups = [(store, projs, args) for store, layer in zip(stores, layers) for projs in layer_groups(layer)
                  if (args := norms_args(projs, dtype)) is not None]
        if not groups:
            return stores
        key = [(*(t.data_ptr() for t in args[:4]), *(t.shape for t in args[:4]), *args[4:], dtype)
               for _, _, args in groups]
        if key != self.key:
            if args[0].is_cuda and torch.cuda.is_current_stream_capturing():
                return stores  # a table is copied from host memory, which a capture cannot hold: one launch a group
            self.table, self.key = ops.dora.norms_table([args for _, _, args in groups]), key
        for (store, projs, _), scales in zip(groups, self.table()):
            store[projs[0]] = scales
        return stores
