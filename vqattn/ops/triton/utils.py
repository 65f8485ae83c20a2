"""What the Triton kernels share, in one place (as flash-linear-attention's ``ops/utils``): the host side's widths,
strides and product types, the launch caps per GPU, and the ``@triton.jit`` helpers the kernels call (row loads and
stores, TF32 splits, the online softmax step, a tile of codes with its cache), and the one kernel several launch:
the exclusive scan of chunked prefixes (:func:`exclusive_scan`).

Loads are cast to a product type ``DOT``: the input's half type on a GPU, so that products run on tensor cores;
float32 under the interpreter, whose half-precision products are wrong. Every product accumulates in float32, and
float32 inputs multiply in IEEE float32, or in TF32 where PyTorch's own float32 matmuls may
(:func:`~vqattn.ops.triton.float32_tensor_cores`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils import INTERPRET, triton
from . import float32_tensor_cores

if triton is not None:
    import triton.language as tl

# Codes scored per inner step of the kernels (a (L, CODE_TILE) logit tile).
CODE_TILE = 64
# The largest feature width a program holds in registers.
MAX_DIM = 256
# Code dims are zero-padded to a multiple of this many elements (32 bytes of a half type): rows whose width and
# stride are not let Triton load and store them only one element per instruction, and keep them out of the
# asynchronous copies that pipeline the code tiles. A layer's slow-pair code scores have Dc = 30.
CODE_DIM_ALIGN = 16
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether the one-pass helper kernels (the nearest-code and soft assignments, the non-finite rows) take x in
    place of PyTorch's form: CUDA tensors of a supported dtype and width, Triton installed, outside torch.compile
    (whose graphs keep the PyTorch form, which inductor fuses)."""
    return (triton is not None and x.is_cuda and x.dtype in SUPPORTED_DTYPES and x.shape[-1] <= MAX_DIM
            and not torch.compiler.is_compiling())
# The most registers per thread at which three programs of 4 warps share an SM (65536 registers, allocated to a
# thread in units of 8): Triton's ``maxnreg`` caps a kernel there where the compiler would take a few more.
THREE_PROGRAMS_REGISTERS = 168


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device``; (0, 0) elsewhere (the interpreter's CPU)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def three_programs_per_sm(device: torch.device) -> dict:
    """``maxnreg`` at :data:`THREE_PROGRAMS_REGISTERS` on a Hopper GPU (sm_90), where the capped kernels fit without
    spilling; nothing elsewhere, where they would spill (docs/performance_notes.md, "Kernel resources")."""
    return dict(maxnreg=THREE_PROGRAMS_REGISTERS) if capability(device)[0] == 9 else {}


def register_width(n: int) -> int:
    """The register width of a feature dim: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def row_strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def stride_args(name: str, x: torch.Tensor) -> dict:
    """x's batch, head and token strides as a keyed launch's ``s{name}_b``, ``s{name}_h``, ``s{name}_t``."""
    return {f"s{name}_{axis}": stride for axis, stride in zip("bht", row_strides(x))}


def aligned_code_dims(x: torch.Tensor) -> torch.Tensor:
    """x (..., Dc) zero-padded to a multiple of ``CODE_DIM_ALIGN`` dims: zeros add nothing to q·c, and the padded
    dims' gradients are dropped (sliced off as views)."""
    return F.pad(x, (0, -x.shape[-1] % CODE_DIM_ALIGN)) if x.shape[-1] % CODE_DIM_ALIGN else x


def dot_dtype(dtype: torch.dtype):
    """The products' operand type and precision: the input's half type in TF32-exact products on a GPU; float32 in
    :func:`float32_dot`'s precision for float32 inputs, and under the interpreter (whose half-precision products are
    wrong) in IEEE float32."""
    if INTERPRET:
        return tl.float32, "ieee"
    if dtype == torch.float32:
        return tl.float32, float32_dot()
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


def cache_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the per-block value sums (and their gradient) beside values of ``dtype``: bfloat16 for bfloat16,
    float32 otherwise (a sum of many float16 values passes float16's largest value, 65504)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def float32_dot() -> str:
    """How float32 inputs multiply on a GPU: in TF32 where PyTorch's float32 matmuls may
    (:func:`~vqattn.ops.triton.float32_tensor_cores`), else in IEEE float32, which Triton forms on the CUDA cores,
    many times the instructions of the bfloat16 kernels (docs/performance_notes.md, "Kernel resources")."""
    return "tf32" if float32_tensor_cores() else "ieee"


def sum_dot(dot):
    """The operand type of the products with the codes' value sums beside operands of type ``dot``: float32 (TF32
    products, float16's 10 mantissa bits) for float16, whose largest value (65504) a sum of many values passes;
    ``dot`` itself otherwise (bfloat16 has float32's range)."""
    return tl.float32 if dot == tl.float16 else dot


def float32_precision(dtype: torch.dtype) -> str:
    """How float32 operands multiply beside inputs of ``dtype``: three TF32 products on a GPU for half inputs (about
    float32's accuracy at tensor-core speed), :func:`float32_dot`'s precision for float32 inputs, IEEE float32 under
    the interpreter."""
    if INTERPRET:
        return "ieee"
    return float32_dot() if dtype == torch.float32 else "tf32x3"


def exact_precision(dtype: torch.dtype) -> str:
    """How float32 operands that hold values of half type ``dtype`` multiply with operands exact in TF32 (other half
    values, one-hot rows, :func:`dot_half_rows`'s parts): one TF32 product on a GPU, exact there (a float16 or
    bfloat16 value has at most TF32's 10 mantissa bits, and the sums accumulate in float32); as the other float32
    products for float32 inputs (:func:`float32_precision`)."""
    return "ieee" if float32_precision(dtype) == "ieee" else "tf32"


def tf32_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_tf32` of a float32 tensor on the host, bit for bit: a codebook split once per call, where each
    program of a kernel would split every tile it reads."""
    hi = (x.view(torch.int32) & -0x2000).view(torch.float32)
    return hi, (((x - hi).view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def code_parts(codebook: torch.Tensor, key_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The (C, C_LO) of :func:`dot_code_parts` for a float32 codebook beside keys of ``key_dtype``: its TF32 parts
    for half keys, else the codebook itself (C_LO unread)."""
    return tf32_parts(codebook) if float32_products(key_dtype)["HALF_ROWS"] else (codebook, codebook)


def float32_products(dtype: torch.dtype) -> dict:
    """The constexprs of :func:`dot_half_rows` for rows loaded into float32 from a tensor of ``dtype``: PREC,
    EXACT_PREC, and HALF_ROWS, whether they hold half-typed values (exact in TF32)."""
    return dict(PREC=float32_precision(dtype), EXACT_PREC=exact_precision(dtype),
                HALF_ROWS=dtype in (torch.float16, torch.bfloat16))


if triton is not None:
    # The softmax runs in base 2, as flash attention's does: logits scaled by σ log2(e) (and biases by log2(e)),
    # probabilities 2^(l − m), and the logsumexp stored in base 2: tl.exp2 is one instruction per element, tl.exp
    # adds a range fix-up (docs/performance_notes.md, "Kernel resources").
    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def load_rows(ptr, sb, sh, st, b, h, rows, T, width, BW: tl.constexpr, DOT: tl.constexpr):
        """x[b, h, rows, :width] of a (B, H, T, width) tensor with unit last stride, zero outside, as DOT."""
        cols = tl.arange(0, BW)
        mask = (rows[:, None] >= 0) & (rows[:, None] < T) & (cols[None, :] < width)
        x = tl.load(ptr + b * sb + h * sh + rows[:, None] * st + cols[None, :], mask=mask, other=0.0)
        return x.to(DOT)

    @triton.jit
    def store_rows(ptr, sb, sh, st, b, h, rows, T, width, x, BW: tl.constexpr):
        cols = tl.arange(0, BW)
        mask = (rows[:, None] >= 0) & (rows[:, None] < T) & (cols[None, :] < width)
        tl.store(ptr + b * sb + h * sh + rows[:, None] * st + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def split_tf32(x):
        """float32 x as hi + lo, both exact in TF32 (10 mantissa bits): hi is x with its 13 low mantissa bits
        cleared, lo the rest (x − hi, exact) rounded to TF32 to nearest, so hi + lo is within 2⁻²² of x."""
        hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        lo = ((x - hi).to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000
        return hi, lo.to(tl.float32, bitcast=True)

    @triton.jit
    def dot_parts(a, hi, lo, EXACT_PREC: tl.constexpr):
        """a·hiᵀ + a·loᵀ (M, N) in float32, two products of operands exact in TF32, the second added in the first's
        accumulator."""
        return tl.dot(a, tl.trans(lo), tl.dot(a, tl.trans(hi), input_precision=EXACT_PREC), input_precision=EXACT_PREC)

    @triton.jit
    def dot_half_rows(a, b, HALF_ROWS: tl.constexpr, PREC: tl.constexpr, EXACT_PREC: tl.constexpr):
        """a·bᵀ (M, N) in float32 of float32 a (M, K) and b (N, K). With HALF_ROWS (a holds half-typed values,
        exact in TF32) b splits into :func:`split_tf32` b_hi + b_lo, so two products of exact operands,
        a·b_hiᵀ + a·b_loᵀ in EXACT_PREC, give about float32's accuracy (b off by 2⁻²²) where PREC's three TF32
        products (tf32x3) would also split a, which has no low part; otherwise one product in PREC."""
        if HALF_ROWS:
            hi, lo = split_tf32(b)
            return dot_parts(a, hi, lo, EXACT_PREC)
        return tl.dot(a, tl.trans(b), input_precision=PREC)

    @triton.jit
    def dot_code_parts(k, C, C_LO, at, inside, HALF_ROWS: tl.constexpr, PREC: tl.constexpr,
                        EXACT_PREC: tl.constexpr):
        """k·cᵀ (M, N) in float32 of float32 rows k (M, K) and a tile of codes read at offsets ``at`` (mask
        ``inside``). With HALF_ROWS (k holds half values, exact in TF32) C and C_LO hold the codes' leading and
        trailing TF32 parts (:func:`code_parts`, split once per call), multiplied as :func:`dot_half_rows` does;
        otherwise C holds the codes, one product in PREC."""
        c = tl.load(C + at, mask=inside, other=0.0)
        if HALF_ROWS:
            return dot_parts(k, c, tl.load(C_LO + at, mask=inside, other=0.0), EXACT_PREC)
        return tl.dot(k, tl.trans(c), input_precision=PREC)

    @triton.jit
    def window_logits(qw, kw, rows, cols, T, scale2, PREC: tl.constexpr):
        """σ qw·kwᵀ (L, L) in base 2 (``scale2`` = σ log2 e), −inf where a key is after the query or outside the
        sequence."""
        s = tl.dot(qw, tl.trans(kw), input_precision=PREC) * scale2
        visible = (cols[None, :] >= 0) & (cols[None, :] < T) & (cols[None, :] <= rows[:, None])
        return tl.where(visible, s, float("-inf"))

    @triton.jit
    def code_tile(CB, CNT, SUM, book, cache, bias, s0, S, DC, DV, qc, scale2, BS: tl.constexpr, BDC: tl.constexpr,
                   BDV: tl.constexpr, DOT: tl.constexpr, SUM_DOT: tl.constexpr, PREC: tl.constexpr):
        """Codes s0..s0+BS of codebook ``book`` (a row of the (·, S, DC) codebook: the head's, or the block's own)
        read with cache ``cache`` (a row of the (·, S) counts and (·, S, DV) sums): their logits without the counts,
        l_s = σ qc·c_s + bias (rows, BS) in base 2 (``scale2`` = σ log2 e; −inf for empty and absent codes; ``bias``
        the block's memory bias, natural), the codes (BS, BDC) as DOT, their counts n_s (BS,) (0 for absent codes)
        and value sums C_s (BS, BDV) as SUM_DOT.

        A code's softmax weight is exp(l_s + log n_s) and its value the mean C_s / n_s; their product is
        exp(l_s)·C_s, so the counts only weigh the normaliser (Σ exp(l_s)·n_s) and no tile takes a logarithm or
        divides (a precise log of the counts would be a large share of the forward's code loop)."""
        codes = s0 + tl.arange(0, BS)
        present = codes < S
        dc, dv = tl.arange(0, BDC), tl.arange(0, BDV)
        c = tl.load(CB + (book * S + codes[:, None]) * DC + dc[None, :],
                    mask=present[:, None] & (dc[None, :] < DC), other=0.0).to(DOT)
        n = tl.load(CNT + cache * S + codes, mask=present, other=0.0)
        sums = tl.load(SUM + (cache * S + codes[:, None]) * DV + dv[None, :],
                       mask=present[:, None] & (dv[None, :] < DV), other=0.0).to(SUM_DOT)
        offset = tl.where(n > 0, bias * LOG2E, float("-inf"))
        logits = tl.dot(qc, tl.trans(c), input_precision=PREC) * scale2 + offset[None, :]
        return logits, c, n, sums

    @triton.jit
    def block_bias(BIAS, blk, HAS_BIAS: tl.constexpr):
        """The memory bias of query block ``blk`` on its code logits (``memory_cap``), 0 without one."""
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(BIAS + blk)
        return bias

    @triton.jit
    def online_softmax_step(m, z, acc, logits, values, weights, VALUE_DOT: tl.constexpr, PREC: tl.constexpr):
        """Flash attention's update of the running max m (L,), normaliser z (L,) and numerator acc (L, Dv) by one
        tile of base-2 logits (L, n) over its values (n, Dv), each value of weight ``weights`` (n,) in the normaliser: 1
        for the window's keys, the counts for the codes' sums (:func:`code_tile`). The tile's temporaries stay
        local: the window's tiles are (L, L), the codes' (L, CODE_TILE), and a loop-carried name must keep one
        shape."""
        m_new = tl.maximum(m, tl.max(logits, 1))
        rescale = tl.exp2(m - m_new)
        p = tl.exp2(logits - m_new[:, None])
        z = z * rescale + tl.sum(p * weights[None, :], 1)
        acc = tl.dot(p.to(VALUE_DOT), values, acc * rescale[:, None], input_precision=PREC)  # added in the product
        return m_new, z, acc

    @triton.jit
    def window_keys(KW, BAD, skw_b, skw_h, skw_t, b, h, bh, rows, T, D, L: tl.constexpr, BD: tl.constexpr,
                    DOT: tl.constexpr, HAS_BAD: tl.constexpr):
        """The window's keys of ``rows`` (L, BD) as DOT, and with HAS_BAD which of them are bad (L,) (non-finite:
        read as zeros, as the unfused impls zero them beforehand; their gradient is 0)."""
        kw = load_rows(KW, skw_b, skw_h, skw_t, b, h, rows, T, D, BD, DOT)
        bad = tl.zeros([L], tl.int1)
        if HAS_BAD:
            bad = tl.load(BAD + bh * T + rows, mask=(rows >= 0) & (rows < T), other=0) != 0
            kw = tl.where(bad[:, None], tl.zeros_like(kw), kw)
        return kw, bad

    @triton.jit
    def hard_index(IDX, bh, rows, T):
        """The codes (L,) of the keys ``rows`` of a hard index (BH, T), −1 outside the sequence, in 32 bits (a long
        index compares with a tile's codes as two 32-bit halves per element)."""
        return tl.load(IDX + bh * T + rows, mask=(rows >= 0) & (rows < T), other=-1).to(tl.int32)

    @triton.jit
    def code_tile_layout(S, DV, BS: tl.constexpr, BDV: tl.constexpr):
        """This program's tile of codes: their indices (BS,), which of them exist, and the (BS, BDV) mask and
        offsets of the tile in one (S, DV) matrix of value sums."""
        codes = tl.program_id(0) * BS + tl.arange(0, BS)
        present = codes < S
        dv = tl.arange(0, BDV)
        return codes, present, present[:, None] & (dv[None, :] < DV), codes[:, None] * DV + dv[None, :]

    @triton.jit
    def load_cache(N, C, row, S, DV, codes, offsets, mask, tile_mask):
        """The tile of cache ``row`` of counts N (·, S) and sums C (·, S, DV) (of any float type), 0 where ``mask``
        (BS,) is off, as float32."""
        n = tl.load(N + row * S + codes, mask=mask, other=0.0).to(tl.float32)
        sums = tl.load(C + row * S * DV + offsets, mask=tile_mask & mask[:, None], other=0.0).to(tl.float32)
        return n, sums

    @triton.jit
    def store_cache(N, C, row, S, DV, codes, offsets, n, sums, mask, tile_mask):
        tl.store(N + row * S + codes, n, mask=mask)
        tl.store(C + row * S * DV + offsets, sums.to(C.dtype.element_ty), mask=tile_mask & mask[:, None])

    @triton.jit
    def output_grads(DO, LSE, DELTA, sdo_b, sdo_h, sdo_t, b, h, bh, rows, T, DV, BDV: tl.constexpr,
                     DOT: tl.constexpr):
        """What the backward pass reads of the outputs of rows ``rows``: their gradients dO as DOT, their
        logsumexp and Δ_i = dO_i·out_i (zeros past T)."""
        do = load_rows(DO, sdo_b, sdo_h, sdo_t, b, h, rows, T, DV, BDV, DOT)
        lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=0.0)
        delta = tl.load(DELTA + bh * T + rows, mask=rows < T, other=0.0)
        return do, lse, delta

    @triton.jit
    def cache_grad_of_queries(QC, c, present, bias, DO, LSE, DELTA, sqc_b, sqc_h, sqc_t, sdo_b, sdo_h, sdo_t, b, h, bh,
                              rows, T, DC, DV, scale2, BDC: tl.constexpr, BDV: tl.constexpr,
                              COUNTS_GRAD: tl.constexpr, DOT: tl.constexpr, SUM_DOT: tl.constexpr,
                              PREC: tl.constexpr):
        """The gradient of a cache for a tile of its codes c (BS, BDC) from the queries ``rows`` that read it with
        memory bias ``bias`` (natural): with w_n = exp2(σ qc·c + β − lse) the codes' probabilities per count (0
        past T, and for codes not ``present`` (BS,): those the queries read as empty), dC = w_nᵀ dO (BS, BDV)
        float32 and dn = −w_nᵀ Δ (BS,) (with COUNTS_GRAD, else 0): out_i = (Σ_s exp(l_is) C_s + window) /
        (Σ_s exp(l_is) n_s + window)."""
        inside = rows < T
        qc = load_rows(QC, sqc_b, sqc_h, sqc_t, b, h, rows, T, DC, BDC, DOT)
        do = load_rows(DO, sdo_b, sdo_h, sdo_t, b, h, rows, T, DV, BDV, SUM_DOT)
        lse = tl.load(LSE + bh * T + rows, mask=inside, other=0.0)
        offset = tl.where(present, bias * LOG2E, float("-inf"))
        logits = tl.dot(qc, tl.trans(c), input_precision=PREC) * scale2 + offset[None, :]
        w_n = tl.where(inside[:, None], tl.exp2(logits - lse[:, None]), 0.0)
        d_sums = tl.dot(tl.trans(w_n.to(SUM_DOT)), do, input_precision=PREC)
        d_n = tl.zeros([c.shape[0]], tl.float32)
        if COUNTS_GRAD:
            delta = tl.load(DELTA + bh * T + rows, mask=inside, other=0.0)
            d_n = -tl.sum(w_n * delta[:, None], 0)
        return d_n, d_sums

    @triton.jit
    def code_tile_grads(CB, CNT, SUM, book, cache, bias, s0, S, DC, DV, qc, do_sums, lse, delta, rows, T, dqc, scale2,
                        BS: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr, DOT: tl.constexpr,
                        SUM_DOT: tl.constexpr, PREC: tl.constexpr):
        """The backward of one :func:`code_tile` read by the queries ``rows``: dqc plus this tile's share (without
        the scale σ), the logits' gradient ds (rows, BS) and w_n = exp2(l − lse), the codes' probabilities per
        count (0 past T). With means C / n the logits' gradient w (dO·C / n − Δ) is w_n (dO·C − n Δ)."""
        code_logits, c, n, sums = code_tile(CB, CNT, SUM, book, cache, bias, s0, S, DC, DV, qc, scale2, BS, BDC, BDV,
                                            DOT, SUM_DOT, PREC)
        w_n = tl.exp2(code_logits - lse[:, None])
        w_n = tl.where(rows[:, None] < T, w_n, 0.0)
        ds = w_n * (tl.dot(do_sums, tl.trans(sums), input_precision=PREC) - delta[:, None] * n[None, :])
        return tl.dot(ds.to(DOT), c, dqc, input_precision=PREC), ds, w_n

    @triton.jit
    def add_codebook_grad(DCB, row, codes, present, ds, qc, scale, S, DC, BDC: tl.constexpr, DOT: tl.constexpr,
                          PREC: tl.constexpr, OWN: tl.constexpr):
        """σ dsᵀ qc (BS, BDC), the gradient of the codes ``codes`` (BS,) from the logits' gradient ds (rows, BS), in
        row ``row`` of DCB (·, S, DC) float32: stored with OWN (the program's own codebook), else added atomically
        (several programs' shares of one codebook)."""
        dc_cols = tl.arange(0, BDC)
        dc = tl.dot(tl.trans(ds.to(DOT)), qc, input_precision=PREC) * scale
        at = DCB + (row * S + codes[:, None]) * DC + dc_cols[None, :]
        inside = present[:, None] & (dc_cols[None, :] < DC)
        if OWN:
            tl.store(at, dc, mask=inside)
        else:
            tl.atomic_add(at, dc, mask=inside)

    @triton.jit
    def attend_window(QW, KW, V, BAD, sqw_b, sqw_h, sqw_t, skw_b, skw_h, skw_t, sv_b, sv_h, sv_t, b, h, bh, rows, T, D,
                      DV, scale2, L: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, DOT: tl.constexpr,
                      PREC: tl.constexpr, HAS_BAD: tl.constexpr):
        """The online softmax's running max m (L,), normaliser z (L,) and numerator acc (L, BDV) of the queries
        ``rows`` over their window: the keys j ≤ i of their block and of the block before (:func:`window_keys`),
        base 2 (``scale2`` = σ log2 e)."""
        qw = load_rows(QW, sqw_b, sqw_h, sqw_t, b, h, rows, T, D, BD, DOT)
        m = tl.full([L], float("-inf"), tl.float32)
        z = tl.zeros([L], tl.float32)
        acc = tl.zeros([L, BDV], tl.float32)
        # both blocks' keys and values loaded before either is scored: one trip to memory, not two
        cols = rows - L
        kw_prev, bad_prev = window_keys(KW, BAD, skw_b, skw_h, skw_t, b, h, bh, cols, T, D, L, BD, DOT, HAS_BAD)
        v_prev = load_rows(V, sv_b, sv_h, sv_t, b, h, cols, T, DV, BDV, DOT)
        kw, bad = window_keys(KW, BAD, skw_b, skw_h, skw_t, b, h, bh, rows, T, D, L, BD, DOT, HAS_BAD)
        v = load_rows(V, sv_b, sv_h, sv_t, b, h, rows, T, DV, BDV, DOT)
        ones = tl.full([L], 1.0, tl.float32)
        # the current block first: its diagonal keeps every row's max finite from the start
        m, z, acc = online_softmax_step(m, z, acc, window_logits(qw, kw, rows, rows, T, scale2, PREC), v, ones,
                                         DOT, PREC)
        m, z, acc = online_softmax_step(m, z, acc, window_logits(qw, kw_prev, rows, cols, T, scale2, PREC), v_prev,
                                         ones, DOT, PREC)
        return m, z, acc


# The short scan of chunked prefixes (fla's ``chunk_h_split`` pattern): n pieces' sums of codes' counts (S,) and
# value sums (S, Dv), formed in parallel, become every piece's running sum in one short sequential pass per tile of
# codes and sequence. The superblock caches (superblock.py) and the soft caches (soft.py) scan with it.
if triton is not None:

    @triton.jit
    def exclusive_scan_kernel(TN, TC, N0, C0, NT, CT, S, DV, nseg, BS: tl.constexpr, BDV: tl.constexpr,
                            REVERSE: tl.constexpr, HAS_BASE: tl.constexpr, HAS_TOTAL: tl.constexpr):
        """The pieces' sums TN (B·H, nseg, S), TC (B·H, nseg, S, DV) float32 replaced in place by their exclusive
        prefix sums from the base N0 (B·H, S), C0 (B·H, S, DV) (with HAS_BASE, else 0), or with REVERSE by their
        exclusive suffix sums; with HAS_TOTAL the base plus every piece's sum stored at NT (B·H, S), CT
        (B·H, S, DV). One program per (tile of codes, batch·head)."""
        bh = tl.program_id(1)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        n = tl.zeros([BS], tl.float32)
        sums = tl.zeros([BS, BDV], tl.float32)
        if HAS_BASE:
            n, sums = load_cache(N0, C0, bh, S, DV, codes, offsets, present, tile_mask)
        for i in range(0, nseg):
            seg = i
            if REVERSE:
                seg = nseg - 1 - i
            t_n, t_sums = load_cache(TN, TC, bh * nseg + seg, S, DV, codes, offsets, present, tile_mask)
            store_cache(TN, TC, bh * nseg + seg, S, DV, codes, offsets, n, sums, present, tile_mask)
            n += t_n
            sums += t_sums
        if HAS_TOTAL:
            store_cache(NT, CT, bh, S, DV, codes, offsets, n, sums, present, tile_mask)


def exclusive_scan(tn: torch.Tensor, tc: torch.Tensor, *, code_tile: int, base=None, reverse: bool = False,
                   total: bool = False):
    """tn (B·H, n, S), tc (B·H, n, S, Dv) float32 contiguous, the n pieces' sums, replaced in place by their
    exclusive prefix sums from ``base`` (a pair (B·H, S), (B·H, S, Dv) float32, or None: 0), or by their exclusive
    suffix sums with ``reverse``. Returns the base plus all n pieces, (B·H, S) and (B·H, S, Dv), with ``total``
    (else None)."""
    BH, n, S = tn.shape
    DV = tc.shape[-1]
    BDV = max(16, triton.next_power_of_2(DV))
    totals = (torch.empty(BH, S, device=tn.device, dtype=torch.float32),
              torch.empty(BH, S, DV, device=tn.device, dtype=torch.float32)) if total else (tn, tc)
    n0, c0 = base if base is not None else (tn, tc)
    exclusive_scan_kernel[(triton.cdiv(S, code_tile), BH)](
        TN=tn, TC=tc, N0=n0, C0=c0, NT=totals[0], CT=totals[1], S=S, DV=DV, nseg=n, BS=code_tile, BDV=BDV,
        REVERSE=reverse, HAS_BASE=base is not None, HAS_TOTAL=total)
    return totals if total else None
