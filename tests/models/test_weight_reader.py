"""The byte reader behind checkpoint loading: header offsets, copies cut across buffer boundaries and read in
pieces, non-adjacent ranges, a file shorter than its header says; on the GPU, the same bytes through pinned
buffers and the copy stream."""
import pytest
import torch
from safetensors.torch import save_file

from hf_models import make_checkpoint, plan_model
from moeserve.weight_reader import ByteReader, ReadError, read_header
from moeserve.weights import load_checkpoint


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(37, 11, generator=g),
        "b": torch.randn(5, 300, generator=g).to(torch.bfloat16),
        "c": torch.randint(-100, 100, (999,), generator=g, dtype=torch.int64),
        "d": torch.randn(3, 7, 2, generator=g).to(torch.float16),
        "e": torch.randn(1, generator=g),
    }


def test_header_offsets_are_the_tensors_bytes(tmp_path):
    sd = tensors()
    save_file(sd, tmp_path / "t.safetensors", metadata={"format": "pt"})
    spans = read_header(tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    assert set(spans) == set(sd)
    for name, t in sd.items():
        s = spans[name]
        assert s.dtype == t.dtype and s.shape == tuple(t.shape)
        got = torch.frombuffer(bytearray(raw[s.begin:s.end]), dtype=torch.uint8).view(t.dtype).view(t.shape)
        assert torch.equal(got, t), name


@pytest.mark.parametrize("chunk,piece", [(64, 16), (1000, 300), (1 << 20, 1 << 20)])
def test_copies_cut_across_buffers_and_pieces_are_exact(tmp_path, chunk, piece):
    sd = tensors(1)
    path = tmp_path / "t.safetensors"
    save_file(sd, path)
    spans = read_header(path)
    wanted = ["e", "a", "c", "d"]  # "b" skipped: the ranges around it are not adjacent
    out = {n: torch.zeros_like(sd[n]) for n in wanted}
    reader = ByteReader(torch.device("cpu"), chunk_bytes=chunk, threads=3, piece_bytes=piece)
    for n in wanted:
        reader.add(n, spans[n].begin, spans[n].end, out[n])
    reader.read_file(path)
    reader.finish()
    for n in wanted:
        assert torch.equal(out[n], sd[n]), n
    assert reader.bytes_read == sum(sd[n].numel() * sd[n].element_size() for n in wanted)


def test_a_byte_count_that_does_not_fit_the_parameter_is_refused():
    reader = ByteReader(torch.device("cpu"))
    with pytest.raises(ValueError, match="tensor 'x': 12 bytes in the file for a parameter of 16"):
        reader.add("x", 100, 112, torch.zeros(4))
    reader.finish()


def test_a_file_shorter_than_its_header_is_named(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file(tensors(), path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ReadError, match=r"t\.safetensors: tensor '.' ends at byte \d+ but the file has \d+"):
        read_header(path)
    path.write_bytes(data[:5])
    with pytest.raises(ReadError, match="too short"):
        read_header(path)


def build(path):
    from moeserve.config import EngineConfig
    from moeserve.plan import resolve_plan
    return plan_model(resolve_plan(EngineConfig(model=str(path), device="cpu", dtype="float32")))


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_byte_copies_load_what_safetensors_reads(tmp_path, monkeypatch, family):
    """Every parameter after loading (byte copies for the tensors stored in the model's dtype) equals, bit for
    bit, the load that reads every tensor through safetensors."""
    import moeserve.weights as weights_mod
    make_checkpoint(family, tmp_path)
    fast = build(tmp_path)
    copied = []
    real = weights_mod.ByteReader.add
    monkeypatch.setattr(weights_mod.ByteReader, "add", lambda self, name, *a: (copied.append(name), real(self, name, *a)))
    load_checkpoint(fast, tmp_path)
    assert len(copied) > 10 and "model.embed_tokens.weight" in copied  # the byte path did the work
    monkeypatch.setattr(weights_mod, "_plain_copy", lambda *a: False)
    slow = build(tmp_path)
    load_checkpoint(slow, tmp_path)
    fast_p, slow_p = dict(fast.named_parameters()), dict(slow.named_parameters())
    assert fast_p.keys() == slow_p.keys()
    for name, p in fast_p.items():
        assert torch.equal(p, slow_p[name]), name


@pytest.mark.gpu
def test_gpu_copies_through_pinned_buffers_are_exact(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sd = {f"t{i}": torch.randn(1000 + 37 * i, 129) for i in range(12)}
    path = tmp_path / "t.safetensors"
    save_file(sd, path)
    spans = read_header(path)
    dev = torch.device("cuda")
    out = {n: torch.full_like(t, float("nan"), device=dev) for n, t in sd.items()}
    reader = ByteReader(dev, chunk_bytes=1 << 20, threads=4, piece_bytes=1 << 16)  # many buffer turns
    for n in sd:
        reader.add(n, spans[n].begin, spans[n].end, out[n])
    reader.read_file(path)
    reader.finish()
    for n, t in sd.items():
        assert torch.equal(out[n].cpu(), t), n
