"""model/gguf_file.py: GGUF's layout read as gguf-py's GGUFReader reads it (the oracle), and bad files refused."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from model.gguf import _open  # noqa: E402
from model.gguf_file import GGUFFile  # noqa: E402
from model.weights import CheckpointError  # noqa: E402

Q = gguf.GGMLQuantizationType


def _write(path, alignment=None):
    """A GGUF with a value of every type, arrays of numbers, strings, bools and arrays, and tensors of five types
    and ranks 1-3, through gguf-py's writer."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    for add, key, value in ((w.add_uint8, "t.u8", 200), (w.add_int8, "t.i8", -100), (w.add_uint16, "t.u16", 60000),
                            (w.add_int16, "t.i16", -30000), (w.add_uint32, "t.u32", 4_000_000_000),
                            (w.add_int32, "t.i32", -2_000_000_000), (w.add_float32, "t.f32", 0.1),
                            (w.add_uint64, "t.u64", 2**63 + 5), (w.add_int64, "t.i64", -2**62),
                            (w.add_float64, "t.f64", 1 / 3), (w.add_bool, "t.bool", True),
                            (w.add_string, "t.str", "héllo · 世界"), (w.add_string, "t.empty", "")):
        add(key, value)
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25, 1e-3])
    w.add_array("t.strs", ["a", "", "Ġthe", "<0x0A>", "▁x"])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3, 4]])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    for name, shape, qtype in (("a", (64,), Q.F32), ("b", (3, 64), Q.F16), ("c", (2, 3, 64), Q.F32),
                               ("d", (4, 64), Q.Q8_0), ("e", (5, 64), Q.Q4_1), ("f", (2, 256), Q.Q4_0)):
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, x.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("alignment", [None, 64], ids=["default alignment", "aligned to 64"])
def test_the_file_reads_as_gguf_py_reads_it(tmp_path, alignment):
    """Every metadata value (and its types), every tensor's name, shape and type, and its values once dequantized,
    equal GGUFReader's (which also lists the header's counts as GGUF.* fields, and flattens nested arrays)."""
    path = _write(tmp_path / "all.gguf", alignment)
    got, want = GGUFFile(path), gguf.GGUFReader(path)
    assert list(got.fields) == [k for k in want.fields if not k.startswith("GGUF.")]
    for key, field in got.fields.items():
        if key != "t.nested":  # GGUFReader's contents() flattens an array of arrays
            assert field.contents() == want.fields[key].contents(), key
        assert list(map(int, field.types)) == list(map(int, want.fields[key].types)), key
    assert got.fields["t.nested"].contents() == [[1, 2], [3, 4]]
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors] == list("abcdef")
    for t, r in zip(got.tensors, want.tensors):
        assert t.shape == tuple(map(int, r.shape)) and t.tensor_type == r.tensor_type, t.name
        assert np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type),
                              gguf.quants.dequantize(r.data, r.tensor_type)), t.name


def test_a_cut_short_or_foreign_file_is_one_clear_error(tmp_path):
    """A file cut anywhere (in the header, the metadata, the tensor infos or the data), one without GGUF's magic and
    one of another version are each refused with the loader's one-line error, before any tensor is read."""
    whole = open(_write(tmp_path / "all.gguf"), "rb").read()
    cases = {"header": whole[:10], "metadata": whole[:200], "infos": whole[:len(whole) // 2 + 100],
             "data": whole[:-10], "magic": b"GGUX" + whole[4:], "version": whole[:4] + (1).to_bytes(4, "little")
             + whole[8:]}
    for what, data in cases.items():
        path = tmp_path / f"{what}.gguf"
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match="as GGUF .*download it again") as e:
            _open(str(path))
        assert "\n" not in str(e.value), what
