"""The fused block kernel: every query block attends, in one online softmax, to its window and to the codes.

Query i of block b = i // L scores (per batch·head, scale σ)

    window  the keys j ≤ i of blocks b−1 and b        logit σ qw_i·kw_j                 value v_j
    codes   s = 1..S, the cache of blocks ≤ b−2       logit σ qc_i·c_s + log n_bs + β_b   value C_bs / n_bs

with one running max, as flash attention does, so neither the (T, T) nor the (T, S) logits reach memory. n_b (S,)
and C_b (S, Dv) are every block's cache counts and value sums, formed beforehand by a per-block prefix (the state of
fla's chunk kernels), and β_b the block's memory bias (``memory_cap``'s log min(1, M / n_b), or 0); window attention
is the same kernel without codes. The forward kernel stores out and the per-query logsumexp; a small kernel forms
Δ_i = dO_i·out_i, and two backward kernels, the window's and the codes', recompute the probabilities from the
logsumexp and write, per block, the gradients of its queries, of its keys and values (as window keys, read by its
own query block and the next: the program recomputes the next block's (L, L) tile, as flash attention's backward
walks a key block's queries, so that each of their gradients is written once, by one program), of the codebook
(every block's own, or a shared one's added up atomically per sequence), and of its cache (dn_b, dC_b), which
autograd then carries back through the prefix to the values and the assignment.

One program per (query block, batch·head). Loads are cast to ``DOT`` (the input's half type on a GPU, so the
products run on tensor cores; float32 under the interpreter, whose half-precision products are wrong), every product
accumulates in float32, and float32 inputs multiply in IEEE float32, or in TF32 where PyTorch's own float32 matmuls
may (:func:`~vqattn.ops.triton.float32_tensor_cores`, :func:`~vqattn.ops.triton.utils.float32_dot`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..utils import empty_like_order, triton
from .utils import (
    CODE_TILE,
    MAX_DIM,
    SUPPORTED_DTYPES,
    aligned_code_dims,
    dot_dtype,
    register_width,
    stride_args,
    sum_dot,
    three_programs_per_sm,
    unit_last,
)

if triton is not None:
    import triton.language as tl

    from .utils import (
        LOG2E,
        add_codebook_grad,
        attend_window,
        block_bias,
        code_tile,
        code_tile_grads,
        load_rows,
        online_softmax_step,
        output_grads,
        store_rows,
        window_keys,
        window_logits,
    )



def unsupported(L: int, dims: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """Why the fused kernel cannot run these shapes, or None: L a power of two from 16 to 128, feature widths up to
    256, half or float32 inputs."""
    if L < 16 or L > 128 or L & (L - 1):
        return f"block_len must be a power of two from 16 to 128 for impl='triton', got {L}"
    if max(dims) > MAX_DIM:
        return f"impl='triton' takes feature dims up to {MAX_DIM}, got {max(dims)}"
    if dtype not in SUPPORTED_DTYPES:
        return f"impl='triton' takes float16, bfloat16 or float32 inputs, got {dtype}"
    return None


# The launch settings of the two kernels, as Triton's autotuner picked them on a GPU (docs/performance_notes.md,
# "Kernel resources"). It is not run per shape because one candidate setting made an illegal memory access in the
# backward at Dc = 30 (the layers' slow-pair code scores; benchmarks/kernel_launch.py). The kernels now see those
# code dims padded to 32 (CODE_DIM_ALIGN); the settings stay fixed until they are measured again.
FORWARD_LAUNCH = dict(num_warps=4, num_stages=1)
BACKWARD_LAUNCH = dict(num_warps=4, num_stages=3)
def _code_backward_launch(meta: dict, codebook_grad: bool, device: torch.device) -> dict:
    """The launch settings of the backward's code part: capped at :data:`~.utils.THREE_PROGRAMS_REGISTERS`
    (:func:`three_programs_per_sm`, three programs per SM instead of two) as the vq_hard layer runs it (bfloat16,
    code dims up to 32, no codebook gradient), where it fits without spilling and three programs' shared memory
    fits too. Elsewhere the cap would spill (64 code dims, float16's float32 sums, a codebook's gradient) or shared
    memory would still hold the SM to two programs (docs/performance_notes.md, "Kernel resources")."""
    capped = meta["DOT"] == tl.bfloat16 and meta["BDC"] <= 32 and not codebook_grad
    return dict(BACKWARD_LAUNCH, **three_programs_per_sm(device)) if capped else BACKWARD_LAUNCH


if triton is not None:
    @triton.jit
    def _window_code_forward_kernel(QW, KW, V, QC, CB, CNT, SUM, BIAS, BAD, O, LSE,
                        sqw_b, sqw_h, sqw_t, skw_b, skw_h, skw_t, sv_b, sv_h, sv_t, sqc_b, sqc_h, sqc_t,
                        so_b, so_h, so_t,
                        H, T, S, D, DC, DV, scale,
                        L: tl.constexpr, BD: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr,
                        BS: tl.constexpr, HAS_CODES: tl.constexpr, PER_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                        DOT: tl.constexpr, SUM_DOT: tl.constexpr, PREC: tl.constexpr, HAS_BAD: tl.constexpr):
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        nb = tl.cdiv(T, L)
        rows = blk * L + tl.arange(0, L)
        scale2 = scale * LOG2E
        m, z, acc = attend_window(QW, KW, V, BAD, sqw_b, sqw_h, sqw_t, skw_b, skw_h, skw_t, sv_b, sv_h, sv_t, b, h, bh,
                                  rows, T, D, DV, scale2, L, BD, BDV, DOT, PREC, HAS_BAD)
        if HAS_CODES:
            qc = load_rows(QC, sqc_b, sqc_h, sqc_t, b, h, rows, T, DC, BDC, DOT)
            cache = bh * nb + blk
            book = cache if PER_BLOCK else h
            bias = block_bias(BIAS, blk, HAS_BIAS)
            for s0 in range(0, S, BS):
                code_logits, _, counts, sums = code_tile(CB, CNT, SUM, book, cache, bias, s0, S, DC, DV, qc,
                                                          scale2, BS, BDC, BDV, DOT, SUM_DOT, PREC)
                m, z, acc = online_softmax_step(m, z, acc, code_logits, sums, counts, SUM_DOT, PREC)
        store_rows(O, so_b, so_h, so_t, b, h, rows, T, DV, acc / z[:, None], BDV)
        tl.store(LSE + bh * T + rows, m + tl.log2(z), mask=rows < T)  # base 2

    @triton.jit
    def _output_delta_kernel(O, DO, DELTA, so_b, so_h, so_t, sdo_b, sdo_h, sdo_t, H, T, DV, L: tl.constexpr,
                      BDV: tl.constexpr):
        """Δ_i = dO_i·out_i (B·H, T) in float32, once per query, before the backward kernel (flash attention's
        preprocessing): its programs read Δ of two query blocks each, and would otherwise hold both blocks'
        outputs in float32 registers, which spill."""
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = blk * L + tl.arange(0, L)
        do = load_rows(DO, sdo_b, sdo_h, sdo_t, b, h, rows, T, DV, BDV, tl.float32)
        out = load_rows(O, so_b, so_h, so_t, b, h, rows, T, DV, BDV, tl.float32)
        tl.store(DELTA + bh * T + rows, tl.sum(do * out, 1), mask=rows < T)

    @triton.jit
    def _window_grads(qw, kw, v, do, lse, delta, rows, cols, T, scale2, DOT: tl.constexpr, PREC: tl.constexpr):
        """The probabilities p (rows, cols) of one window tile from the stored logsumexp (base 2), and the logits'
        gradient ds = p (dO·vᵀ − Δ), both as DOT (ds without the scale σ)."""
        p = tl.exp2(window_logits(qw, kw, rows, cols, T, scale2, PREC) - lse[:, None])
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
        return p.to(DOT), ds.to(DOT)

    @triton.jit
    def _window_backward_kernel(QW, KW, V, DO, LSE, DELTA, BAD, DQW, DKW, DV_,
                                sqw_b, sqw_h, sqw_t, skw_b, skw_h, skw_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                                sdqw_b, sdqw_h, sdqw_t, sdkw_b, sdkw_h, sdkw_t, sdv_b, sdv_h, sdv_t,
                                H, T, D, DV, scale, L: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                                DOT: tl.constexpr, PREC: tl.constexpr, HAS_BAD: tl.constexpr):
        """The window's gradients: of query block blk (dqw), and of key block blk's window keys and values (dkw,
        dv), each written once, in its input's dtype, by its own strides (the inputs' memory order). Key block blk
        is read by query blocks blk and blk + 1, so the program recomputes the next block's probabilities over it
        (one (L, L) tile more, as flash attention's backward walks a key block's queries) instead of writing two
        shares to be added."""
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = blk * L + tl.arange(0, L)
        scale2 = scale * LOG2E
        do_dot, lse, delta = output_grads(DO, LSE, DELTA, sdo_b, sdo_h, sdo_t, b, h, bh, rows, T, DV, BDV, DOT)
        qw = load_rows(QW, sqw_b, sqw_h, sqw_t, b, h, rows, T, D, BD, DOT)
        # the next query block, and both key blocks, loaded before any is used: one trip to memory, not three
        next_rows = rows + L
        qn = load_rows(QW, sqw_b, sqw_h, sqw_t, b, h, next_rows, T, D, BD, DOT)
        do_n, lse_n, delta_n = output_grads(DO, LSE, DELTA, sdo_b, sdo_h, sdo_t, b, h, bh, next_rows, T, DV, BDV,
                                             DOT)
        cols = rows - L
        kw_prev, bad_prev = window_keys(KW, BAD, skw_b, skw_h, skw_t, b, h, bh, cols, T, D, L, BD, DOT, HAS_BAD)
        v_prev = load_rows(V, sv_b, sv_h, sv_t, b, h, cols, T, DV, BDV, DOT)
        kw, bad = window_keys(KW, BAD, skw_b, skw_h, skw_t, b, h, bh, rows, T, D, L, BD, DOT, HAS_BAD)
        v = load_rows(V, sv_b, sv_h, sv_t, b, h, rows, T, DV, BDV, DOT)
        # the previous key block: its share of dq (its own dk and dv are the previous program's)
        p, ds = _window_grads(qw, kw_prev, v_prev, do_dot, lse, delta, rows, cols, T, scale2, DOT, PREC)
        dqw = tl.dot(ds, kw_prev, input_precision=PREC)  # the sums accumulate in the products, σ after
        # this key block, from its own queries: dq, and the first share of its dk and dv
        p, ds = _window_grads(qw, kw, v, do_dot, lse, delta, rows, rows, T, scale2, DOT, PREC)
        dqw = tl.dot(ds, kw, dqw, input_precision=PREC)
        dk = tl.dot(tl.trans(ds), qw, input_precision=PREC)
        dv = tl.dot(tl.trans(p), do_dot, input_precision=PREC)
        store_rows(DQW, sdqw_b, sdqw_h, sdqw_t, b, h, rows, T, D, dqw * scale, BD)
        # ... and from the next query block (absent past the last block: zero rows add nothing)
        p, ds = _window_grads(qn, kw, v, do_n, lse_n, delta_n, next_rows, rows, T, scale2, DOT, PREC)
        dk = tl.dot(tl.trans(ds), qn, dk, input_precision=PREC)
        dv = tl.dot(tl.trans(p), do_n, dv, input_precision=PREC)
        store_rows(DKW, sdkw_b, sdkw_h, sdkw_t, b, h, rows, T, D, tl.where(bad[:, None], 0.0, dk * scale), BD)
        store_rows(DV_, sdv_b, sdv_h, sdv_t, b, h, rows, T, DV, dv, BDV)

    @triton.jit
    def _code_backward_kernel(QC, CB, CNT, SUM, BIAS, DO, LSE, DELTA, DQC, DCB, DCNT, DSUM,
                              sqc_b, sqc_h, sqc_t, sdo_b, sdo_h, sdo_t, sdqc_b, sdqc_h, sdqc_t,
                              H, T, S, DC, DV, scale, L: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr,
                              BS: tl.constexpr, PER_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                              SUM_DOT: tl.constexpr, PREC: tl.constexpr, CODEBOOK_GRAD: tl.constexpr,
                              COUNTS_GRAD: tl.constexpr):
        """The codes' gradients of query block blk: of its code queries (dqc), of the codebook (DCB: stored at
        (B·H, nb, S, DC) for every block's own codebook, added atomically into its sequence's (B·H, S, DC) (zeroed)
        for a shared one), and of its cache, DSUM (B·H, nb, S, DV) in the sums' dtype and, with COUNTS_GRAD, DCNT
        (B·H, nb, S) float32 (hard counts carry no gradient unless the initial cache's do), which the reverse cache
        walk reads (block_caches.py). A kernel of its own,
        apart from the window's: its loop holds fewer registers than the window's ten (L, ·) tiles, so more of its
        programs share an SM."""
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        nb = tl.cdiv(T, L)
        rows = blk * L + tl.arange(0, L)
        scale2 = scale * LOG2E
        do_dot, lse, delta = output_grads(DO, LSE, DELTA, sdo_b, sdo_h, sdo_t, b, h, bh, rows, T, DV, BDV, DOT)
        qc = load_rows(QC, sqc_b, sqc_h, sqc_t, b, h, rows, T, DC, BDC, DOT)
        dqc = tl.zeros([L, BDC], tl.float32)
        dv_cols = tl.arange(0, BDV)
        cache = bh * nb + blk
        book = cache if PER_BLOCK else h
        bias = block_bias(BIAS, blk, HAS_BIAS)
        do_sums = do_dot.to(SUM_DOT)
        for s0 in range(0, S, BS):
            dqc, ds_codes, w_n = code_tile_grads(CB, CNT, SUM, book, cache, bias, s0, S, DC, DV, qc, do_sums, lse,
                                                 delta, rows, T, dqc, scale2, BS, BDC, BDV, DOT, SUM_DOT, PREC)
            codes = s0 + tl.arange(0, BS)
            present = codes < S
            if CODEBOOK_GRAD:
                # every block's own codebook stores its gradient; nb programs of a sequence add into a shared one's
                # row: not an (nb, S, DC) share per block
                add_codebook_grad(DCB, cache if PER_BLOCK else bh, codes, present, ds_codes, qc, scale, S, DC, BDC,
                                  DOT, PREC, PER_BLOCK)
            # out_i = (Σ_s exp(l_is) C_s + window) / (Σ_s exp(l_is) n_s + window): by C_s w_n dO_i, by n_s −w_n Δ_i
            d_sums = tl.dot(tl.trans(w_n.to(SUM_DOT)), do_sums, input_precision=PREC)  # (BS, BDV), float32
            tl.store(DSUM + (cache * S + codes[:, None]) * DV + dv_cols[None, :],
                     d_sums.to(DSUM.dtype.element_ty), mask=present[:, None] & (dv_cols[None, :] < DV))
            if COUNTS_GRAD:
                tl.store(DCNT + cache * S + codes, -tl.sum(w_n * delta[:, None], 0), mask=present)
        store_rows(DQC, sdqc_b, sdqc_h, sdqc_t, b, h, rows, T, DC, dqc * scale, BDC)

@dataclasses.dataclass
class WindowCodes:
    """What the forward pass keeps for the backward: the kernels' inputs as they read them (unit last stride, code
    dims padded), the output and its logsumexp (B·H, T), and the launch's constexprs."""

    qw: torch.Tensor
    kw: torch.Tensor
    v: torch.Tensor
    qc: torch.Tensor  # (B, H, T, DC) padded; qw without codes (unread)
    cb: torch.Tensor  # (H, S, DC) or (B, H, nb, S, DC) padded; qw without codes
    cnt: torch.Tensor
    sm: torch.Tensor
    bias: torch.Tensor
    bad: torch.Tensor  # (B·H, T) uint8: window keys read as zeros (non-finite); qw without any (unread)
    out: torch.Tensor
    lse: torch.Tensor
    meta: dict
    scale: float
    code_dims: int  # the codes' width before padding

    @property
    def has_codes(self) -> bool:
        return self.meta["HAS_CODES"]


def window_code_forward(qw, kw, v, qc, codebook, counts, sums, code_bias, scale: float, L: int,
                        bad=None) -> WindowCodes:
    """The forward kernel's launch (see :func:`fused_window_code_attention`); ``.out`` holds the output. ``bad``
    (B, H, T) bool: rows of kw the kernels read as zeros, or None."""
    B, H, T, D = qw.shape
    has_codes = codebook is not None
    S, code_dims = codebook.shape[-2:] if has_codes else (0, 0)
    DV = v.shape[-1]
    qw, kw, v = unit_last(qw), unit_last(kw), unit_last(v)
    qc = aligned_code_dims(unit_last(qc)) if has_codes else qw
    cb = aligned_code_dims(codebook).contiguous() if has_codes else qw
    cnt = counts.contiguous() if has_codes else qw
    sm = sums.contiguous() if has_codes else qw
    bias = code_bias.float().contiguous() if code_bias is not None else qw
    bad_rows = bad.contiguous().view(torch.uint8) if bad is not None else qw
    # in v's memory order, token-major in a layer: its (B, T, H·Dv) reshape for the output projection is a view
    out = empty_like_order(v)
    lse = torch.empty(B * H, T, device=qw.device, dtype=torch.float32)
    dot, prec = dot_dtype(qw.dtype)
    DC = cb.shape[-1] if has_codes else 0  # the kernels see the padded width
    meta = dict(L=L, BD=register_width(D), BDC=register_width(DC), BDV=register_width(DV), BS=CODE_TILE, HAS_CODES=has_codes,
                PER_BLOCK=has_codes and codebook.dim() == 5, HAS_BIAS=has_codes and code_bias is not None,
                DOT=dot, SUM_DOT=sum_dot(dot), PREC=prec, HAS_BAD=bad is not None)
    grid = (triton.cdiv(T, L), B * H)
    _window_code_forward_kernel[grid](
        QW=qw, KW=kw, V=v, QC=qc, CB=cb, CNT=cnt, SUM=sm, BIAS=bias, BAD=bad_rows, O=out, LSE=lse,
        **stride_args("qw", qw),
        **stride_args("kw", kw), **stride_args("v", v), **stride_args("qc", qc), **stride_args("o", out),
        H=H, T=T, S=S, D=D, DC=DC, DV=DV, scale=float(scale), **meta, **FORWARD_LAUNCH)
    return WindowCodes(qw, kw, v, qc, cb, cnt, sm, bias, bad_rows, out, lse, meta, float(scale), code_dims)


def output_delta(f: WindowCodes, grad_out: torch.Tensor) -> torch.Tensor:
    """Δ_i = dO_i·out_i (B·H, T) float32."""
    B, H, T, DV = f.v.shape
    delta = torch.empty(B * H, T, device=f.v.device, dtype=torch.float32)
    _output_delta_kernel[(triton.cdiv(T, f.meta["L"]), B * H)](
        O=f.out, DO=grad_out, DELTA=delta, **stride_args("o", f.out), **stride_args("do", grad_out), H=H, T=T,
        DV=DV, L=f.meta["L"], BDV=f.meta["BDV"])
    return delta


def window_backward(f: WindowCodes, grad_out: torch.Tensor, delta: torch.Tensor):
    """The window's gradients dqw, dkw, dv, each in its input's dtype and memory order (ops/utils.py)."""
    B, H, T, D = f.qw.shape
    dqw, dkw, dv = empty_like_order(f.qw), empty_like_order(f.kw), empty_like_order(f.v)
    _window_backward_kernel[(triton.cdiv(T, f.meta["L"]), B * H)](
        QW=f.qw, KW=f.kw, V=f.v, DO=grad_out, LSE=f.lse, DELTA=delta, BAD=f.bad, DQW=dqw, DKW=dkw, DV_=dv,
        **stride_args("qw", f.qw), **stride_args("kw", f.kw), **stride_args("v", f.v),
        **stride_args("do", grad_out), **stride_args("dqw", dqw), **stride_args("dkw", dkw),
        **stride_args("dv", dv), H=H, T=T, D=D, DV=f.v.shape[-1], scale=f.scale, L=f.meta["L"], BD=f.meta["BD"],
        BDV=f.meta["BDV"], DOT=f.meta["DOT"], PREC=f.meta["PREC"], HAS_BAD=f.meta["HAS_BAD"], **BACKWARD_LAUNCH)
    return dqw, dkw, dv


def code_backward(f: WindowCodes, grad_out: torch.Tensor, delta: torch.Tensor, *, codebook_grad: bool,
                  counts_grad: bool):
    """The codes' gradients: dqc (padded), the codebook's (float32: (B·H, nb, S, DC) for every block's own,
    (B·H, S, DC) summed over a sequence's blocks for a shared one; None without ``codebook_grad``), and every block's
    cache's, dcnt (B·H, nb, S) float32 (with ``counts_grad``, else None) and dsum (B·H, nb, S, DV) in the sums'
    dtype."""
    B, H, T, _ = f.qw.shape
    S, DC = f.cb.shape[-2:]
    DV, L = f.v.shape[-1], f.meta["L"]
    nb = triton.cdiv(T, L)
    f32 = dict(device=f.qw.device, dtype=torch.float32)
    dqc = empty_like_order(f.qc)
    if not codebook_grad:
        dcb = None
    elif f.meta["PER_BLOCK"]:
        dcb = torch.empty(B * H, nb, S, DC, **f32)
    else:  # the blocks' shares add up atomically in the kernel, per sequence
        dcb = torch.zeros(B * H, S, DC, **f32)
    dcnt = torch.empty(B * H, nb, S, **f32) if counts_grad else None
    dsum = torch.empty(B * H, nb, S, DV, device=f.qw.device, dtype=f.sm.dtype)
    meta = {key: f.meta[key] for key in ("L", "BDC", "BDV", "BS", "PER_BLOCK", "HAS_BIAS", "DOT", "SUM_DOT", "PREC")}
    meta.update(CODEBOOK_GRAD=codebook_grad, COUNTS_GRAD=counts_grad)
    unused = dqc  # a pointer the kernel does not read under its constexprs
    _code_backward_kernel[(nb, B * H)](
        QC=f.qc, CB=f.cb, CNT=f.cnt, SUM=f.sm, BIAS=f.bias, DO=grad_out, LSE=f.lse, DELTA=delta, DQC=dqc,
        DCB=unused if dcb is None else dcb, DCNT=unused if dcnt is None else dcnt,
        DSUM=dsum, **stride_args("qc", f.qc), **stride_args("do", grad_out),
        **stride_args("dqc", dqc), H=H, T=T, S=S, DC=DC, DV=DV, scale=f.scale, **meta,
        **_code_backward_launch(meta, codebook_grad, f.qw.device))
    return dqc, dcb, dcnt, dsum


def codebook_gradient(f: WindowCodes, dcb: torch.Tensor | None) -> torch.Tensor | None:
    """The codebook's gradient in its input's shape from :func:`code_backward`'s: every block's own, or a shared
    codebook's summed over the sequences; the padded dims dropped (a view)."""
    if dcb is None:
        return None
    B, H, T, _ = f.qw.shape
    S, DC = f.cb.shape[-2:]
    grad = dcb.view(B, H, -1, S, DC) if f.meta["PER_BLOCK"] else dcb.view(B, H, S, DC).sum(0)
    return grad[..., :f.code_dims]


class FusedWindowCodes(torch.autograd.Function):
    """out (B, H, T, Dv) of the module's attention; see :func:`fused_window_code_attention`."""

    @staticmethod
    def forward(ctx, qw, kw, v, qc, codebook, counts, sums, code_bias, scale: float, L: int, bad):
        f = window_code_forward(qw, kw, v, qc, codebook, counts, sums, code_bias, scale, L, bad=bad)
        ctx.save_for_backward(*(getattr(f, name) for name in TENSORS))
        ctx.forward = dataclasses.replace(f, **dict.fromkeys(TENSORS))  # the tensors are saved, not held
        return f.out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        f = dataclasses.replace(ctx.forward, **dict(zip(TENSORS, ctx.saved_tensors)))
        grad_out = unit_last(grad_out)
        delta = output_delta(f, grad_out)
        dqw, dkw, dv = window_backward(f, grad_out, delta)
        grads = [dqw, dkw, dv, None, None, None, None]
        if f.has_codes:
            dqc, dcb, dcnt, dsum = code_backward(f, grad_out, delta, codebook_grad=ctx.needs_input_grad[4],
                                                 counts_grad=ctx.needs_input_grad[5])
            B, H, T, _ = f.qw.shape
            S, DV = f.cb.shape[-2], f.v.shape[-1]
            grads[3:] = [dqc[..., :f.code_dims], codebook_gradient(f, dcb),
                         None if dcnt is None else dcnt.view(B, H, -1, S), dsum.view(B, H, -1, S, DV)]
        return (*(None if g is None else g.to(x.dtype) for g, x in zip(grads, (f.qw, f.kw, f.v, f.qc, f.cb, f.cnt,
                                                                               f.sm))),
                None, None, None, None)


# WindowCodes' tensor fields, in the order FusedWindowCodes saves them
TENSORS = ("qw", "kw", "v", "qc", "cb", "cnt", "sm", "bias", "bad", "out", "lse")


@torch.compiler.disable  # a graph break: torch.compile runs the kernels as they are
def fused_window_code_attention(qw, kw, v, *, scale: float, block_len: int, qc=None, codebook=None, counts=None,
                                sums=None, code_bias=None, bad=None):
    """Softmax attention of every query over its window (the keys of its block and the one before, causally) and,
    given ``codebook``, the codes (see the module doc).

    qw, kw: (B, H, T, D) the window's queries and keys; v (B, H, T, Dv). qc (B, H, T, Dc) the code queries (qw when
    None), codebook (H, S, Dc) shared by the blocks or (B, H, nb, S, Dc) every block's own (ovq's slot means),
    counts (B, H, nb, S) and sums (B, H, nb, S, Dv) every block's cache (nb = ⌈T/L⌉, float32); code_bias (nb,)
    a bias on every code logit of a query block (``memory_cap``'s log min(1, M / n_b), the same as weighing the
    block's counts and sums by its exponential) or None; bad (B, H, T) bool the rows of kw read as zeros (non-finite
    keys; their gradient is 0) or None. Differentiable in every tensor but code_bias and bad. Returns out
    (B, H, T, Dv) in the inputs' dtype.
    """
    if codebook is not None and qc is None:
        qc = qw
    return FusedWindowCodes.apply(qw, kw, v, qc, codebook, counts, sums, code_bias, scale, block_len, bad)
