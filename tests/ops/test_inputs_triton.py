"""The decode graphs' input feed (``moeserve.ops.inputs_triton``) against its torch reference: on the CPU under
Triton's interpreter (one subprocess), on a GPU (``-m gpu``; the previous step's tokens copied out into pinned host
memory by the kernel); and the batch builder's deferred feed, whose rows the
feed fills as the builder's own gather does. Inputs are fresh random each run; the seed is in failure messages
(``MOESERVE_TEST_SEED`` replays one)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
# (rows, fed rows, previous step's tokens, other copies (entries, buffer size)): one row fed, a padded step, more rows
# than one pass, none fed; with the attention's index lists as a decode graph's replay copies them (positions,
# kv_indptr, kv_indices), the page list longer than one pass of the copy
CASES = {"one": (1, 1, 1, ()), "padded": (4, 3, 5, ()), "long": (150, 70, 90, ()), "none": (5, 0, 0, ()),
         "copies": (4, 4, 4, ((4, 4), (5, 5), (37, 64))),
         "copies-long": (32, 20, 32, ((32, 32), (33, 33), (2500, 2600))),
         "copy-only": (3, 0, 0, ((3, 3),)),
         # the previous step's tokens copied out as well (``tokens_out``): with fed rows, and more than one pass of
         # tokens without
         "out": (3, 2, 6, ()), "out-unfed": (2, 0, 70, ())}


def make_case(rows: int, fed: int, prev_n: int, copy_lens, gen: torch.Generator, device="cpu"):
    """``(ids, pos, dst, src, prev, copies)`` as a step's packed buffer holds them: int32 slices of one buffer (ids 0
    where fed), distinct ``dst``, the previous step's tokens int64; ``copies``: ``(source, buffer size)`` pairs,
    the sources more slices of the buffer."""
    ids = torch.randint(0, 150_000, (rows,), generator=gen, dtype=torch.int32)
    pos = torch.randint(0, 4096, (rows,), generator=gen, dtype=torch.int32)
    dst = torch.randperm(rows, generator=gen)[:fed].to(torch.int32)
    ids[dst.long()] = 0
    src = torch.randint(0, max(1, prev_n), (fed,), generator=gen, dtype=torch.int32)
    prev = torch.randint(0, 150_000, (max(1, prev_n),), generator=gen, dtype=torch.int64)
    others = [torch.randint(-5, 100_000, (n,), generator=gen, dtype=torch.int32) for n, _ in copy_lens]
    packed = torch.cat([torch.zeros(3, dtype=torch.int32), ids, pos, dst, src, *others])  # slices at odd offsets
    o = 3
    views = []
    for n in (rows, rows, fed, fed, *(n for n, _ in copy_lens)):
        views.append(packed[o:o + n].to(device))
        o += n
    return (*views[:4], prev.to(device), [(a, size) for a, (_, size) in zip(views[4:], copy_lens)])


def run(fn, case, tokens_out=False, out=None):
    """The feed's outputs: ids, positions, and each other copy's buffer (-7 where nothing was copied); with
    ``tokens_out`` the previous step's tokens copied out too, into ``out`` (else a new tensor), last."""
    ids, pos, dst, src, prev, others = case
    ids_out = torch.full_like(ids, -7)
    pos_out = torch.full_like(pos, -7)
    copies = [(a, torch.full((size,), -7, dtype=torch.int32, device=a.device)) for a, size in others]
    tok = None
    if tokens_out:
        tok = (prev, out if out is not None else torch.full_like(prev, -7))
    if dst.numel():
        fn(ids_out, pos_out, ids, pos, dst, src, prev, copies=copies, tokens_out=tok)
    else:
        fn(ids_out, pos_out, ids, pos, copies=copies, tokens_out=tok)
    return ids_out, pos_out, [b for _, b in copies], None if tok is None else tok[1]


def _interpreter_worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.inputs_triton import feed_step_inputs
    torch.save({name: run(feed_step_inputs, case, name.startswith("out"))
                for name, case in torch.load(in_path).items()}, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {name: make_case(*spec, gen) for name, spec in CASES.items()}
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("feed"), SEED)


@pytest.mark.parametrize("name", list(CASES))
def test_feed_matches_the_torch_gather_under_the_interpreter(interpreted, name):
    from moeserve.ops.inputs_triton import feed_step_inputs_reference
    inputs, outputs = interpreted
    case = inputs[name]
    ids_out, pos_out, bufs, tokens = outputs[name]
    ref_ids, ref_pos, ref_bufs, ref_tokens = run(feed_step_inputs_reference, case, name.startswith("out"))
    assert (tokens is None) == (ref_tokens is None) == (not name.startswith("out"))
    if tokens is not None:  # every one of the previous step's tokens, in order
        assert torch.equal(tokens, case[4]) and torch.equal(ref_tokens, case[4]), f"seed {SEED}, {name}: tokens out"
    assert torch.equal(ids_out, ref_ids), f"seed {SEED}, {name}: ids"
    assert torch.equal(pos_out, ref_pos), f"seed {SEED}, {name}: positions"
    assert len(bufs) == len(ref_bufs) == len(case[5])
    for (a, size), b, ref in zip(case[5], bufs, ref_bufs):  # the source in front, the rest untouched
        assert torch.equal(b, ref), f"seed {SEED}, {name}: a copy of {a.shape[0]} entries"
        assert torch.equal(b[:a.shape[0]], a) and bool((b[a.shape[0]:] == -7).all())
    fed = case[2].long()
    if fed.numel():  # the fed rows hold the previous step's tokens, the others the step's own ids
        assert torch.equal(ids_out[fed], case[4][case[3].long()].to(torch.int32))
    rest = torch.ones(case[0].shape[0], dtype=torch.bool)
    rest[fed] = False
    assert torch.equal(ids_out[rest], case[0][rest])


def test_feed_refuses_mismatched_shapes():
    from moeserve.ops.inputs_triton import feed_step_inputs_reference
    ids = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="4 ids into 3"):
        feed_step_inputs_reference(torch.zeros(3, dtype=torch.int32), ids.clone(), ids, ids)
    with pytest.raises(ValueError, match="one per dst"):
        feed_step_inputs_reference(ids.clone(), ids.clone(), ids, ids, ids[:2], ids[:1], torch.zeros(2))
    with pytest.raises(ValueError, match="a copy of 4 torch.int32 entries into 3"):
        feed_step_inputs_reference(ids.clone(), ids.clone(), ids, ids, copies=[(ids, ids[:3].clone())])
    with pytest.raises(ValueError, match="int32 into at least as many"):
        feed_step_inputs_reference(ids.clone(), ids.clone(), ids, ids, copies=[(ids.long(), ids.clone())])
    with pytest.raises(ValueError, match="4 other copies, at most 3"):
        feed_step_inputs_reference(ids.clone(), ids.clone(), ids, ids, copies=[(ids, ids.clone())] * 4)
    with pytest.raises(ValueError, match="tokens out: .* as many"):
        feed_step_inputs_reference(ids.clone(), ids.clone(), ids, ids, tokens_out=(ids.long(), ids[:3].long()))


def test_deferred_feed_fills_the_rows_the_builder_would():
    """A decode step with two tokens in flight, built with and without ``defer_feed``: the deferred batch leaves
    its ids unfed and names the rows; the feed fills them as the builder's gather did."""
    from moeserve.engine.batch import BatchBuilder
    from moeserve.engine.step import ScheduledRequest
    from moeserve.ops.inputs_triton import feed_step_inputs_reference
    items = [ScheduledRequest(f"r{i}", token_ids=[0 if row >= 0 else 11 + i], start=5 + i, pages=[1 + i],
                              samples=True, inflight_row=row) for i, row in enumerate([1, -1, 0])]
    prev = torch.tensor([901, 902], dtype=torch.int64)
    b = BatchBuilder(16, 8, 8, 64, torch.device("cpu"))
    eager = b.build(items, pad_to=4, prev_tokens=prev)
    assert eager.feed is None and eager.input_ids.tolist() == [902, 12, 901, 0]
    deferred = b.build(items, pad_to=4, prev_tokens=prev, defer_feed=True)
    dst, src, fed_prev = deferred.feed
    assert dst.tolist() == [0, 2] and src.tolist() == [1, 0] and fed_prev is prev
    assert deferred.input_ids.tolist()[1] == 12
    ids, pos = torch.full((4,), -1, dtype=torch.int32), torch.full((4,), -1, dtype=torch.int32)
    feed_step_inputs_reference(ids, pos, deferred.input_ids, deferred.positions, *deferred.feed)
    assert torch.equal(ids, eager.input_ids) and torch.equal(pos, eager.positions)


@pytest.mark.gpu
def test_feed_matches_the_torch_gather_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moeserve.ops.inputs_triton import feed_step_inputs, feed_step_inputs_reference
    gen = torch.Generator().manual_seed(SEED)
    for name, spec in CASES.items():
        case = make_case(*spec, gen, device="cuda")
        out = name.startswith("out")
        host = torch.full((case[4].shape[0],), -7, dtype=torch.int64, pin_memory=True) if out else None
        ids, pos, bufs, tokens = run(feed_step_inputs, case, out, host)
        done = torch.cuda.Event()
        done.record()
        ref_ids, ref_pos, ref_bufs, _ = run(feed_step_inputs_reference, case)
        assert torch.equal(ids, ref_ids) and torch.equal(pos, ref_pos), f"seed {SEED}, {name}"
        assert len(bufs) == len(case[5]), f"seed {SEED}, {name}"
        assert all(torch.equal(a, b) for a, b in zip(bufs, ref_bufs)), f"seed {SEED}, {name}"
        if out:  # written into pinned host memory by the kernel itself, there once its event is
            done.synchronize()
            assert tokens is host and torch.equal(host, case[4].cpu()), f"seed {SEED}, {name}: tokens out"


if __name__ == "__main__" and is_worker(sys.argv):
    _interpreter_worker(sys.argv[2], sys.argv[3])
