"""The batch builder's padded and fixed layouts, which the piecewise CUDA graphs of prefill and mixed steps read:
padding rows are one-token requests on the reserved page 0 after the real rows, and a fixed layout puts every
field at offsets that depend only on the padded size."""
import pytest
import torch

from moeserve.config import default_prefill_graph_sizes, make_config
from moeserve.engine.batch import BatchBuilder
from moeserve.engine.step import ScheduledRequest

PAGE = 4


def request(rid, start, tokens, pages, samples=True):
    return ScheduledRequest(rid, start, list(tokens), list(pages), samples)


def mixed_step():
    """A prompt chunk of 6 tokens at position 3 (pages 5, 6, 7), a decode at position 9 (pages 1, 2, 3) and a
    first chunk of 2 tokens that does not sample (page 4)."""
    return [request("a", 3, range(10, 16), [5, 6, 7]), request("b", 9, [42], [1, 2, 3]),
            request("c", 0, [7, 8], [4], samples=False)]


def fields(batch):
    a = batch.attn
    return {"ids": batch.input_ids.tolist(), "pos": batch.positions.tolist(), "slots": a.slot_mapping.tolist(),
            "bidx": a.batch_indices.tolist(), "qo": a.qo_indptr.tolist(), "kvp": a.kv_indptr.tolist(),
            "last": a.kv_last_page_len.tolist(), "indices": a.kv_indices.tolist(),
            "logits": batch.logits_indices.tolist(), "qo_host": a.qo_indptr_host.tolist(),
            "kvp_host": a.kv_indptr_host.tolist(), "indices_host": a.kv_indices_host.tolist(),
            "query_lens": a.query_lens, "seq_lens": a.seq_lens, "num_seqs": a.num_seqs, "decode": a.is_decode}


def test_padding_a_mixed_step_adds_one_token_requests_on_page_zero():
    builder = BatchBuilder(PAGE, 64, 8, 64, torch.device("cpu"))
    plain = fields(builder.build(mixed_step()))
    padded = fields(builder.build(mixed_step(), pad_to=12))
    assert plain["ids"] == list(range(10, 16)) + [42, 7, 8]
    assert plain["slots"] == [5 * PAGE + 3, 6 * PAGE, 6 * PAGE + 1, 6 * PAGE + 2, 6 * PAGE + 3, 7 * PAGE,
                              3 * PAGE + 1, 4 * PAGE, 4 * PAGE + 1]
    assert plain["logits"] == [5, 6]
    # the real rows first, unchanged; three padding requests of one token each at position 0 on page 0
    assert padded["ids"] == plain["ids"] + [0, 0, 0]
    assert padded["pos"] == plain["pos"] + [0, 0, 0]
    assert padded["slots"] == plain["slots"] + [0, 0, 0]
    assert padded["bidx"] == plain["bidx"] + [3, 4, 5]
    assert padded["qo"] == plain["qo"] + [10, 11, 12] and padded["qo_host"] == padded["qo"]
    n = plain["kvp"][-1]
    assert padded["kvp"] == plain["kvp"] + [n + 1, n + 2, n + 3] and padded["kvp_host"] == padded["kvp"]
    assert padded["indices"] == plain["indices"] + [0, 0, 0] == [5, 6, 7, 1, 2, 3, 4, 0, 0, 0]
    assert padded["last"] == plain["last"] + [1, 1, 1]
    assert padded["query_lens"] == [6, 1, 2, 1, 1, 1] and padded["seq_lens"] == [9, 10, 2, 1, 1, 1]
    assert padded["num_seqs"] == 6 and not padded["decode"]
    assert padded["logits"] == plain["logits"]


def test_a_fixed_layout_holds_the_same_values_at_offsets_of_the_padded_size():
    builder = BatchBuilder(PAGE, 64, 8, 64, torch.device("cpu"))
    loose = builder.build(mixed_step(), pad_to=16)
    fixed = builder.build(mixed_step(), pad_to=16, fixed=True)
    assert fields(fixed) == fields(loose)
    # another step of the same padded size: fewer tokens, more requests, other pages
    other = builder.build([request("d", 30, [1], [9, 10, 11, 12, 13, 14, 15, 16]), request("e", 0, range(5), [17, 18])],
                          pad_to=16, fixed=True)
    assert fields(other)["ids"] == [1, 0, 1, 2, 3, 4] + [0] * 10

    def offsets(b):
        a = b.attn
        return [t.storage_offset() for t in (b.input_ids, b.positions, a.batch_indices, a.token_positions,
                                             a.kv_indptr, a.kv_indices, a.qo_indptr, b.logits_indices)]
    assert offsets(other) == offsets(fixed) == [0, 16, 48, 16, 81, 162, 64, 114]
    assert offsets(loose) != offsets(fixed)
    # another padded size, other offsets
    assert offsets(builder.build(mixed_step(), pad_to=32, fixed=True))[1] == 32


def test_a_fixed_layout_is_refused_where_the_step_does_not_fit():
    builder = BatchBuilder(PAGE, 16, 8, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="pad_to of at most 16"):
        builder.build(mixed_step(), fixed=True)
    with pytest.raises(ValueError, match="pad_to of at most 16"):
        builder.build(mixed_step(), pad_to=32, fixed=True)
    with pytest.raises(ValueError, match="9 tokens does not fit a fixed layout of 8"):
        builder.build(mixed_step(), pad_to=8, fixed=True)


def test_a_full_fixed_layout_fits_the_builders_buffer():
    """The largest step the builder is made for, padded with one-token requests to its token bound, in a fixed
    layout: every page of the pool listed once (the device buffer's size is what a GPU builder copies into)."""
    builder = BatchBuilder(PAGE, 64, 8, 64, torch.device("cpu"))
    items = [request(f"r{i}", 0, range(8), [1 + 2 * i, 2 + 2 * i]) for i in range(7)]
    batch = builder.build(items, pad_to=64, fixed=True)
    a = batch.attn
    assert a.num_seqs == 7 + 8 and batch.input_ids.numel() == 64
    cap = 11 * 64 + 6 * 9 + 64 + 64
    assert a.kv_indices.storage_offset() + a.kv_indices.numel() <= cap


def test_piecewise_graph_sizes():
    assert default_prefill_graph_sizes(600) == [16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 320, 384, 448, 512]
    assert default_prefill_graph_sizes(4096)[-6:] == [1792, 2048, 2560, 3072, 3584, 4096]
    cfg = make_config()
    assert cfg.prefill_graph_sizes() == default_prefill_graph_sizes(2048)  # max_num_batched_tokens 8192
    # the step bound closes the list
    assert make_config(max_num_batched_tokens=600).prefill_graph_sizes()[-3:] == [448, 512, 600]
    assert make_config(prefill_graph_max_tokens=100).prefill_graph_sizes() == [16, 32, 48, 64, 80, 96, 100]
    assert make_config(prefill_graph_token_sizes=[300, 40, 5000]).prefill_graph_sizes() == [40, 300]
    for off in ({"prefill_graph_max_tokens": 0}, {"enforce_eager": True}, {"torch_compile": True}):
        assert make_config(**off).prefill_graph_sizes() == []


def test_pages_shared_by_many_requests_fit_the_device_buffer():
    """With prefix caching several requests list the same pages, so a step can list more page entries than the
    pool has pages. The runner sizes the device buffer for every request's pages; one too small for a step (here
    a CPU stand-in for the GPU's) is replaced by a larger one instead of failing the step."""
    builder = BatchBuilder(PAGE, 64, 8, 8, torch.device("cpu"))
    builder.dev = torch.zeros(200, dtype=torch.int32)  # a GPU builder's buffer, sized for fewer entries
    shared = list(range(1, 41))  # a 160-token prefix in 40 pages, more than max_pages
    items = [request(f"r{i}", 160, [5], shared + [41 + i]) for i in range(8)]
    batch = builder.build(items)
    assert batch.attn.kv_indices.tolist() == (shared + [41]) + sum(([*shared, 41 + i] for i in range(1, 8)), [])
    assert batch.attn.kv_indptr.tolist() == [41 * i for i in range(9)]
    assert builder.dev.numel() >= 8 * 41


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("side_copy", [True, False], ids=["side-copy", "step-stream"])
def test_steps_built_ahead_of_a_busy_gpu_read_their_own_values(monkeypatch, side_copy):
    """``batch.SIDE_COPY``: steps built one after another while the GPU is still busy with earlier work (a sleep
    queued first), each read on the step's stream right after its build (as a step's kernels do), read their own
    values: the copy stream's writes wait for the reads of the step two builds back (the buffer it reuses), and the
    step's stream waits for each copy. A fixed layout between them keeps its one buffer at one address. Against
    the builder without the side stream, which queues every copy on the step's stream."""
    from moeserve.engine import batch as batch_mod
    monkeypatch.setattr(batch_mod, "SIDE_COPY", side_copy)
    dev = torch.device("cuda")
    builder = BatchBuilder(PAGE, 64, 8, 256, dev)
    assert builder.side_copy == side_copy
    reads, expected, fixed_at = [], [], set()
    torch.cuda._sleep(50_000_000)  # tens of milliseconds: every build and copy below is queued long before it ends
    for i in range(9):
        items = [request(f"r{j}", 5 + i + j, [1000 * i + j], [1 + i, 2 + j]) for j in range(1 + i % 4)]
        b = builder.build(items)
        reads.append({"ids": b.input_ids.clone(), "pos": b.positions.clone(), "indices": b.attn.kv_indices.clone(),
                      "indices_host": b.attn.kv_indices_host.tolist()})  # (nothing here waits for the GPU)
        expected.append(([1000 * i + j for j in range(len(items))], [5 + i + j for j in range(len(items))]))
        if i % 3 == 2:
            f = builder.build(mixed_step(), pad_to=12, fixed=True)
            fixed_at.add(f.input_ids.data_ptr())
            reads.append({"fixed": f.input_ids.clone()})
    torch.cuda.synchronize()
    assert len(fixed_at) == 1
    for r in reads:
        if "fixed" in r:
            assert r["fixed"].tolist()[:9] == list(range(10, 16)) + [42, 7, 8]
            continue
        ids, pos = expected.pop(0)
        assert r["ids"].tolist() == ids and r["pos"].tolist() == pos, (r["ids"].tolist(), ids)
        assert r["indices"].tolist() == r["indices_host"]
