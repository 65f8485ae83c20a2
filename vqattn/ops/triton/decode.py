"""One decoding step as one Triton kernel (flash-linear-attention's ``fused_recurrent``): a new query scores its
raw window and the S codes (vq's shared codes, ovq's slot means) in one online softmax.

Per batch·head, the query q_w (its window query) and q_c (its code query, q_w unless RoPE or a separate memory
query) at the window's last position attend to

    window  the W keys of the decoding state plus its own            logit σ q_w·k_j                value v_j
    codes   s = 1..S of the state's cache                            logit σ q_c·c_s + log n_s      value C_s / n_s

which is the block kernel's softmax for one query (:mod:`vqattn.ops.triton.window_codes`, whose tile helpers it
runs): the query is row 0 of a 16-row tile (tl.dot's smallest; the other rows are zeros and dropped), the window is
read in tiles of ``WINDOW_TILE`` keys, the codes in tiles of ``CODE_TILE``. One program per batch·head, nothing but
the output written. Forward only (decoding is inference): a call that needs a gradient is refused.
"""

from __future__ import annotations

import torch

from ..utils import needs_grad, triton
from .utils import CODE_TILE, dot_dtype, register_width, stride_args, sum_dot, unit_last

if triton is not None:  # the kernel's helpers exist only where Triton does: the op library needs torch alone
    import triton.language as tl

    from .utils import LOG2E, code_tile, load_rows, online_softmax_step, store_rows, window_logits

# The query's tile: tl.dot's smallest row count.
ROWS = 16
# Window keys scored per inner step.
WINDOW_TILE = 64

if triton is not None:

    @triton.jit
    def _decode_kernel(QW, KW, V, QC, CB, CNT, SUM, O,
                       sqw_b, sqw_h, sqw_t, skw_b, skw_h, skw_t, sv_b, sv_h, sv_t, sqc_b, sqc_h, sqc_t,
                       so_b, so_h, so_t,
                       H, W, S, D, DC, DV, scale,
                       ROWS: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr,
                       BS: tl.constexpr, HAS_CODES: tl.constexpr, PER_SEQUENCE: tl.constexpr, DOT: tl.constexpr,
                       SUM_DOT: tl.constexpr, PREC: tl.constexpr):
        bh = tl.program_id(0)
        b, h = bh // H, bh % H
        rows = tl.arange(0, ROWS)
        scale2 = scale * LOG2E  # the softmax in base 2
        qw = load_rows(QW, sqw_b, sqw_h, sqw_t, b, h, rows, 1, D, BD, DOT)
        at_last = tl.zeros([ROWS], tl.int32) + W - 1  # every row scores as the query at the window's end
        m = tl.full([ROWS], float("-inf"), tl.float32)
        z = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BDV], tl.float32)
        for w0 in range(0, W, BW):
            cols = w0 + tl.arange(0, BW)
            kw = load_rows(KW, skw_b, skw_h, skw_t, b, h, cols, W, D, BD, DOT)
            v = load_rows(V, sv_b, sv_h, sv_t, b, h, cols, W, DV, BDV, DOT)
            m, z, acc = online_softmax_step(m, z, acc, window_logits(qw, kw, at_last, cols, W, scale2, PREC), v,
                                             tl.full([BW], 1.0, tl.float32), DOT, PREC)
        if HAS_CODES:
            qc = load_rows(QC, sqc_b, sqc_h, sqc_t, b, h, rows, 1, DC, BDC, DOT)
            book = bh if PER_SEQUENCE else h
            for s0 in range(0, S, BS):
                # a memory_cap weight comes in the counts and sums (one per step: weigh_memory), so no bias here
                code_logits, _, counts, sums = code_tile(CB, CNT, SUM, book, bh, 0.0, s0, S, DC, DV, qc, scale2,
                                                          BS, BDC, BDV, DOT, SUM_DOT, PREC)
                m, z, acc = online_softmax_step(m, z, acc, code_logits, sums, counts, SUM_DOT, PREC)
        store_rows(O, so_b, so_h, so_t, b, h, rows, 1, DV, acc / z[:, None], BDV)


@torch.compiler.disable  # a graph break: torch.compile runs the kernel as it is
def fused_decode_step(qw, kw, v, *, scale: float, qc=None, codebook=None, counts=None, sums=None) -> torch.Tensor:
    """One query per batch·head over its window and, given ``codebook``, the codes (see the module doc).

    qw (B, H, 1, D) the window query; kw (B, H, W, D), v (B, H, W, Dv) the window's keys and values, the query's own
    last (W ≥ 1). qc (B, H, 1, Dc) the code query (qw when None); codebook (H, S, Dc) shared by the sequences (vq)
    or (B, H, S, Dc) each sequence's own (ovq's slot means); counts (B, H, S) and sums (B, H, S, Dv) the cache
    (float32). Half-precision inputs accumulate in float32. Returns (B, H, 1, Dv) in v's dtype. Forward only:
    ValueError when a gradient would be needed.
    """
    if needs_grad(qw, kw, v, qc, codebook, counts, sums):
        raise ValueError("the fused decoding step is forward only: run it under torch.no_grad() (as generation "
                         "does), or use impl='recurrent' (or impl='triton' on more than RECURRENT_MAX_LEN tokens) for gradients")
    B, H, _, D = qw.shape
    W, DV = kw.shape[2], v.shape[-1]
    has_codes = codebook is not None
    S, DC = codebook.shape[-2:] if has_codes else (0, 0)
    qw, kw, v = unit_last(qw), unit_last(kw), unit_last(v)
    qc = unit_last(qc if qc is not None else qw) if has_codes else qw
    cb = codebook.contiguous() if has_codes else qw
    cnt = counts.contiguous() if has_codes else qw
    sm = sums.contiguous() if has_codes else qw
    out = torch.empty(B, H, 1, DV, device=v.device, dtype=v.dtype)
    dot, prec = dot_dtype(qw.dtype)
    _decode_kernel[(B * H,)](QW=qw, KW=kw, V=v, QC=qc, CB=cb, CNT=cnt, SUM=sm, O=out, **stride_args("qw", qw),
                             **stride_args("kw", kw), **stride_args("v", v), **stride_args("qc", qc),
                             **stride_args("o", out), H=H, W=W, S=S, D=D, DC=DC, DV=DV, scale=float(scale), ROWS=ROWS,
                             BW=WINDOW_TILE, BD=register_width(D), BDC=register_width(DC), BDV=register_width(DV), BS=CODE_TILE,
                             HAS_CODES=has_codes, PER_SEQUENCE=has_codes and codebook.dim() == 4, DOT=dot,
                             SUM_DOT=sum_dot(dot), PREC=prec)
    return out
