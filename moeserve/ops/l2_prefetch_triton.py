"""The device side of the L2 weight prefetch (``moeserve.ops.l2_prefetch``): a kernel whose lanes each hand the
TMA unit one ``cp.async.bulk.prefetch.L2`` of up to ``CHUNK`` bytes and exit. Nothing is read into the SM and
nothing is written: the lines arrive in L2 while the kernels on the main stream run, and a later kernel that
reads them finds them there. Compute capability 9.0 or later."""
from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 4096  # bytes per bulk prefetch (a multiple of 16)
LANES = 32  # prefetches per program (one warp)

_PREFETCH = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")

_PREFETCH_EVICT_LAST = tl.constexpr("""{
.reg .pred p;
.reg .b64 pol;
setp.gt.s32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.u32 $0, 0;
}""")


@triton.jit(do_not_specialize=["n_ids", "n_bytes", "stride_bytes", "num_rows"])
def l2_prefetch_kernel(base_ptr, ids_ptr, n_ids, n_bytes, stride_bytes, num_rows,
                       BY_ID: tl.constexpr, EVICT_LAST: tl.constexpr, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Prefetch ``n_bytes`` from ``base_ptr`` (bytes; 16-aligned) into L2; with ``BY_ID``, from
    ``base_ptr + ids[j] * stride_bytes`` for the program's ``j`` (axis 1), skipping ids outside
    ``[0, num_rows)``. Axis 0 walks the range ``LANES * CHUNK`` bytes per program."""
    base = base_ptr.to(tl.pointer_type(tl.int8))
    offs = tl.program_id(0).to(tl.int64) * (LANES * CHUNK) + tl.arange(0, LANES).to(tl.int64) * CHUNK
    size = tl.minimum(n_bytes - offs, CHUNK)
    if BY_ID:
        j = tl.program_id(1)
        e = tl.load(ids_ptr + j, mask=j < n_ids, other=-1).to(tl.int64)
        valid = (e >= 0) & (e < num_rows)
        base += tl.where(valid, e, 0) * stride_bytes
        size = tl.where(valid, size, 0)
    size = (tl.maximum(size, 0) + 15) // 16 * 16  # 0: no prefetch (past the end, or an id of no row)
    ptrs = base + offs
    if EVICT_LAST:
        tl.inline_asm_elementwise(_PREFETCH_EVICT_LAST, "=r,l,r", [ptrs, size.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_PREFETCH, "=r,l,r", [ptrs, size.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)
