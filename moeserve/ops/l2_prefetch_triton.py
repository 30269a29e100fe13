"""The device side of the L2 weight prefetch (``moeserve.ops.l2_prefetch``). Each program covers ``BLOCK`` bytes
of a weight (or of one of its rows, chosen by id) in one of three ways (``METHOD``):

- ``bulk``: its lanes each hand the TMA unit one ``cp.async.bulk.prefetch.L2`` of ``BLOCK / LANES`` bytes;
- ``lines``: its threads issue ``prefetch.global.L2`` for every 128-byte line (one each, 4 warps);
- ``loads``: its threads load the bytes (16 per thread and access) and drop them.

Small programs, many of them: a weight of a few MB spreads over most SMs.

The first two read nothing into the SM; none writes the weights (``loads`` may write one scratch word, so that
the compiler keeps its loads). ``bulk`` needs compute capability 9.0 or later.
"""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = {"bulk": 65536, "lines": 16384, "loads": 16384}  # bytes per program
LANES = 32  # bulk: prefetches per program (one warp), BLOCK / LANES bytes each
LOAD_WORDS = 4096  # loads: 32-bit words per iteration (4 warps, 16 bytes per thread and access)
METHODS = ("bulk", "lines", "loads")

_BULK = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")

_BULK_EVICT_LAST = tl.constexpr("""{
.reg .pred p;
.reg .b64 pol;
setp.gt.s32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.u32 $0, 0;
}""")

_LINE = tl.constexpr("""{
.reg .pred p;
setp.ne.s32 p, $2, 0;
@p prefetch.global.L2 [$1];
mov.u32 $0, 0;
}""")

_LINE_EVICT_LAST = tl.constexpr("""{
.reg .pred p;
setp.ne.s32 p, $2, 0;
@p prefetch.global.L2::evict_last [$1];
mov.u32 $0, 0;
}""")


@triton.jit(do_not_specialize=["n_ids", "n_bytes", "stride_bytes", "num_rows"])
def l2_prefetch_kernel(base_ptr, ids_ptr, sink_ptr, n_ids, n_bytes, stride_bytes, num_rows,
                       BY_ID: tl.constexpr, EVICT_LAST: tl.constexpr, METHOD: tl.constexpr, BLOCK: tl.constexpr,
                       LANES: tl.constexpr, LOAD_WORDS: tl.constexpr):
    """Prefetch ``n_bytes`` from ``base_ptr`` (bytes; 16-aligned) into L2; with ``BY_ID``, from
    ``base_ptr + ids[j] * stride_bytes`` for the program's ``j`` (axis 1), skipping ids outside
    ``[0, num_rows)``. Axis 0 walks the range, ``BLOCK`` bytes per program."""
    base = base_ptr.to(tl.pointer_type(tl.int8))
    start = tl.program_id(0).to(tl.int64) * BLOCK
    end = n_bytes.to(tl.int64)
    if BY_ID:
        j = tl.program_id(1)
        e = tl.load(ids_ptr + j, mask=j < n_ids, other=-1).to(tl.int64)
        valid = (e >= 0) & (e < num_rows)
        base += tl.where(valid, e, 0) * (stride_bytes // 16) * 16  # a multiple of 16 (the launcher checks)
        end = tl.where(valid, end, 0)  # an id of no row: nothing
    if METHOD == "bulk":
        offs = start + tl.arange(0, LANES).to(tl.int64) * (BLOCK // LANES)
        size = tl.minimum(end - offs, BLOCK // LANES)
        size = (tl.maximum(size, 0) + 15) // 16 * 16  # 0: no prefetch (past the end)
        if EVICT_LAST:
            tl.inline_asm_elementwise(_BULK_EVICT_LAST, "=r,l,r", [base + offs, size.to(tl.int32)], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_BULK, "=r,l,r", [base + offs, size.to(tl.int32)], dtype=tl.int32,
                                      is_pure=False, pack=1)
    elif METHOD == "lines":
        offs = start + tl.arange(0, BLOCK // 128).to(tl.int64) * 128
        live = (offs < end).to(tl.int32)
        if EVICT_LAST:
            tl.inline_asm_elementwise(_LINE_EVICT_LAST, "=r,l,r", [base + offs, live], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_LINE, "=r,l,r", [base + offs, live], dtype=tl.int32, is_pure=False, pack=1)
    else:
        words = base.to(tl.pointer_type(tl.int32))
        acc = tl.zeros((LOAD_WORDS,), dtype=tl.int32)
        for i in range(0, BLOCK // (4 * LOAD_WORDS)):
            offs = start // 4 + i * LOAD_WORDS + tl.arange(0, LOAD_WORDS).to(tl.int64)
            acc ^= tl.load(words + offs, mask=offs < end // 16 * 4, other=0,  # whole 16-byte pieces
                           eviction_policy="evict_last" if EVICT_LAST else "")
        x = tl.xor_sum(acc, axis=0)
        tl.store(sink_ptr, x, mask=x == 0x5EED5EED)  # a scratch word, written once in 2^32: keeps the loads
