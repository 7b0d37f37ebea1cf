"""Triton kernels of moe.py's `triton-fused-moe` variant (a helper module, not a suite).

vLLM's fused_moe design, written anew for this benchmark (bf16 in, f32 accumulation):

  align  the token slots (slot = token * top_k + j) sorted by expert, each expert's segment
         padded to a multiple of BM with the sentinel `slots`: sorted [rows], the expert of
         each BM-row block block_expert [rows / BM], and the padded length num_post [1].
         One program per expert: each counts every expert's slots (a histogram over all
         slots, so no program waits on another), takes its segment's start from the padded
         counts of the experts before it, then writes its own slots in slot order (a prefix
         sum of the matches), its padding and its blocks' expert id. Nothing is read back to
         the host; the buffers have worst-case sizes (moe.padded_slots).
  up     one program per (M-block, N-block): x rows gathered through sorted slot // top_k,
         times the block's expert's gate and up rows of w13 [E, 2I, H] (BN / 2 columns of
         each), two f32 accumulators, SiLU(gate) * up in the epilogue, stored at the sorted
         row positions of h [rows, I] (padding rows get zeros).
  down   the same tiling over h @ w2[e]^T (w2 [E, H, I]), times the slot's routing weight in
         f32, stored at the slot's row of y [slots, H]; moe.py then sums y viewed as
         [tokens, top_k, H] over top_k.

Programs whose M-block starts at or past num_post return at once, so the grids can be sized
without reading the routing back (the layer fits in a CUDA graph). Blocks are walked in
grouped order (GM M-blocks sweep the N-blocks together, for L2 reuse of weight tiles).
DOT_F32 casts the dot operands to f32: only for Triton's interpreter, whose dot mishandles
bf16 (moe.py --self-test).

Importing this module imports Triton, which reads TRITON_INTERPRET then: set it first.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["slots", "experts"])
def align(ids_ptr, sorted_ptr, block_expert_ptr, num_post_ptr, slots, experts,
          BM: tl.constexpr, NBINS: tl.constexpr, CHUNK: tl.constexpr):
    e = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    hist = tl.zeros([NBINS], dtype=tl.int32)
    for s0 in range(0, slots, CHUNK):
        slot = s0 + lane
        # slots past the end count in bin `experts`, which no expert owns (NBINS > experts)
        eid = tl.load(ids_ptr + slot, mask=slot < slots, other=experts).to(tl.int32)
        hist += tl.histogram(eid, NBINS)
    bins = tl.arange(0, NBINS)
    padded = tl.where(bins < experts, (hist + (BM - 1)) // BM * BM, 0)
    start = tl.sum(tl.where(bins < e, padded, 0), axis=0)
    count = tl.sum(tl.where(bins == e, hist, 0), axis=0)
    span = tl.sum(tl.where(bins == e, padded, 0), axis=0)
    if e == 0:
        tl.store(num_post_ptr, tl.sum(padded, axis=0))
    if count > 0:
        pos = start
        for s0 in range(0, slots, CHUNK):
            slot = s0 + lane
            eid = tl.load(ids_ptr + slot, mask=slot < slots, other=experts).to(tl.int32)
            hit = eid == e
            rank = tl.cumsum(hit.to(tl.int32), axis=0)  # inclusive
            tl.store(sorted_ptr + pos + rank - 1, slot, mask=hit)
            pos += tl.sum(hit.to(tl.int32), axis=0)
        pad = tl.arange(0, BM)
        tl.store(sorted_ptr + start + count + pad, tl.zeros([BM], dtype=tl.int32) + slots,
                 mask=pad < span - count)
        blocks = span // BM
        for b0 in range(0, blocks, CHUNK):
            b = b0 + lane
            tl.store(block_expert_ptr + start // BM + b, tl.zeros([CHUNK], dtype=tl.int32) + e,
                     mask=b < blocks)


@triton.jit
def tile(pid, n_pid_m, n_pid_n, GM: tl.constexpr):
    """(pid_m, pid_n) of program pid in grouped order."""
    in_group = GM * n_pid_n
    first_m = (pid // in_group) * GM
    size_m = tl.minimum(n_pid_m - first_m, GM)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit(do_not_specialize=["slots", "top_k"])
def up(x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_post_ptr,
       inter, hidden, rows_padded, slots, top_k, stride_x, stride_we, stride_wn, stride_h,
       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr,
       EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    HALF: tl.constexpr = BN // 2
    pid_m, pid_n = tile(tl.program_id(0), tl.cdiv(rows_padded, BM), tl.cdiv(inter, HALF), GM)
    if pid_m * BM >= tl.load(num_post_ptr):
        return
    rows = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(sorted_ptr + rows)
    live = slot < slots
    tok = (slot // top_k).to(tl.int64)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    # columns past `inter` wrap round: the loads stay in bounds, their results are not stored
    cols = ((pid_n * HALF + tl.arange(0, HALF)) % inter).to(tl.int64)
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_x + ks[None, :]
    g_ptrs = w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros([BM, HALF], dtype=tl.float32)
    acc_u = tl.zeros([BM, HALF], dtype=tl.float32)
    for kk in range(0, tl.cdiv(hidden, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_in = ks < hidden - kk * BK
            a = tl.load(a_ptrs, mask=live[:, None] & k_in[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_in[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_in[:, None], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g += tl.dot(a, g)
        acc_u += tl.dot(a, u)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out_cols = pid_n * HALF + tl.arange(0, HALF)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + out_cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=out_cols[None, :] < inter)


@triton.jit(do_not_specialize=["slots"])
def down(h_ptr, w_ptr, y_ptr, weight_ptr, sorted_ptr, block_expert_ptr, num_post_ptr,
         hidden, inter, rows_padded, slots, stride_h, stride_we, stride_wn, stride_y,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr,
         EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_n = tile(tl.program_id(0), tl.cdiv(rows_padded, BM), tl.cdiv(hidden, BN), GM)
    if pid_m * BM >= tl.load(num_post_ptr):
        return
    rows = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(sorted_ptr + rows)
    live = slot < slots
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = ((pid_n * BN + tl.arange(0, BN)) % hidden).to(tl.int64)
    ks = tl.arange(0, BK)
    # every row of a live block of h was written by `up` (padding rows as zeros)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
    b_ptrs = w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kk in range(0, tl.cdiv(inter, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_in = ks < inter - kk * BK
            a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_in[:, None], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b)
        a_ptrs += BK
        b_ptrs += BK
    acc = acc * tl.load(weight_ptr + slot, mask=live, other=0.0).to(tl.float32)[:, None]
    out_cols = pid_n * BN + tl.arange(0, BN)
    y_ptrs = y_ptr + slot[:, None].to(tl.int64) * stride_y + out_cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & (out_cols[None, :] < hidden))
