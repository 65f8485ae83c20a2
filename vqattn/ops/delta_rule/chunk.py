"""The delta rule in chunks (Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence Length",
and "Gated Delta Networks"): the WY / UT-transform form, O(T·C·(Dk + Dv) + T·Dk·Dv), the CPU default.

Inside a chunk of C tokens with chunk-local cumulative log decays b_t = Σ_{j ≤ t} g_j (Γ_t = e^{b_t}), the state the
chunk starts from, S, and the new values u_t (S_t = e^{g_t} S_{t−1} + u_t k_tᵀ, u_t = β_t (v_t − e^{g_t} S_{t−1} k_t))
satisfy one lower-triangular system:

    (I + A) U = diag(β) V − diag(β Γ) K Sᵀ,   A_tj = β_t e^{b_t − b_j} k_t·k_j  (j < t),

so U = Ũ − W Sᵀ with Ũ = (I + A)⁻¹ diag(β) V and W = (I + A)⁻¹ diag(βΓ) K (the UT transform: one triangular solve
per chunk, all chunks at once). Then, per chunk,

    out = diag(Γ) (σQ) Sᵀ + ((σQ Kᵀ) ⊙ e^{b_t − b_j} [j ≤ t]) U,    S_next = Γ_C S + Uᵀ diag(e^{b_C − b}) K.

Everything but the walk from chunk to chunk (S → U → S_next, :func:`delta_rule_scan`) runs for all chunks at once
and is differentiated by autograd; the walk is one operator with its own backward (a reverse walk), opaque to
``torch.compile``, so a compiled graph holds it whatever the number of chunks (packed sequences in their block
layout, :func:`segmented_forward`, restart it at each sequence's first block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..blocks import block_groups
from ..common.segments import BlockLayout
from ..utils import size_min


def chunk_forward(q, k, v, beta, log_decay, scale: float, S0, chunk: int, keep: torch.Tensor | None = None):
    """q, k (B, H, T, Dk), v (B, H, T, Dv), beta, log_decay (B, H, T) (None: no decay), S0 (B, H, Dv, Dk) or None,
    chunks of ``chunk`` tokens (T need not be a multiple: zero pads after the end change neither the outputs nor the
    state, a key of 0 writing nothing) -> (out (B, H, T, Dv), the state after the last token). ``keep`` (N,): the
    state entering chunk n is multiplied by keep_n (0 where a packed sequence starts; :func:`segmented_forward`).

    In eager mode the chunks run in groups (:func:`~vqattn.ops.blocks.block_groups`: on a CPU, of about 8 MiB of
    (C, C) matrices), each from the state the one before leaves: the same arithmetic, but temporaries small enough for
    glibc to reuse rather than fresh pages for each (at 32768 tokens one (C, C) tensor of every chunk is 33 MB)."""
    B, H, T, Dk = k.shape
    C = size_min(chunk, T)
    N = -(-T // C)
    # a compiled graph keeps one group: its shape guards would otherwise tie the graph to the number of groups
    groups = [(0, N)] if torch.compiler.is_compiling() else block_groups(N, B * H * C * C * q.element_size(), q.device)
    if len(groups) == 1:
        return _chunk_group(q, k, v, beta, log_decay, scale, S0, C, keep)
    # split, not sliced: the pieces' gradients are concatenated once, where each slice's would fill a zero tensor of
    # the whole length
    sizes = [size_min(n1 * C, T) - n0 * C for n0, n1 in groups]
    pieces = [x.split(sizes, 2) if x is not None else [None] * len(groups) for x in (q, k, v, beta, log_decay)]
    outs, S = [], S0
    for (n0, n1), *group in zip(groups, *pieces):
        out, S = _chunk_group(*group, scale, S, C, None if keep is None else keep[n0:n1])
        outs.append(out)
    return torch.cat(outs, 2), S


def _chunk_group(q, k, v, beta, log_decay, scale: float, S0, C: int, keep: torch.Tensor | None):
    """:func:`chunk_forward` on chunks of C tokens run all at once (but the walk)."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    N = -(-T // C)
    pad = N * C - T
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    beta = F.pad(beta, (0, pad)).view(B, H, N, C)
    qs = q * scale
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    kk = k @ k.transpose(-1, -2)  # (B, H, N, C, C)
    qk = qs @ k.transpose(-1, -2)
    if log_decay is None:
        A = beta.unsqueeze(-1) * kk.masked_fill(~strict, 0)
        bk = beta.unsqueeze(-1) * k
        k_end, gamma, q_in, P = k, beta.new_ones(B, H, N), qs, qk.masked_fill(~incl, 0)
    else:
        b = F.pad(log_decay, (0, pad)).view(B, H, N, C).cumsum(-1)  # chunk-local: the exponents stay small
        diff = b.unsqueeze(-1) - b.unsqueeze(-2)  # (B, H, N, C, C): b_t − b_j
        # masked before exp: above the diagonal b_t − b_j > 0 and could overflow
        A = beta.unsqueeze(-1) * kk * torch.exp(diff.masked_fill(~strict, float("-inf")))
        P = qk * torch.exp(diff.masked_fill(~incl, float("-inf")))
        Gamma = torch.exp(b)  # (B, H, N, C), ≤ 1
        bk = (beta * Gamma).unsqueeze(-1) * k
        k_end = k * torch.exp(b[..., -1:] - b).unsqueeze(-1)  # each key decayed to the chunk's end
        gamma, q_in = Gamma[..., -1], qs * Gamma.unsqueeze(-1)
    # the UT transform: (I + A)⁻¹ by one unit-lower-triangular solve (A's diagonal is not read), then applied to βV and
    # βΓK by two products (faster than solving for both at once: no concatenated copy, and a C-wide solve)
    inverse = torch.linalg.solve_triangular(A, torch.eye(C, dtype=A.dtype, device=A.device), upper=False,
                                            unitriangular=True)
    u_tilde, w = inverse @ (beta.unsqueeze(-1) * v), inverse @ bk
    S0 = q.new_zeros(B, H, Dv, Dk) if S0 is None else S0
    keep = q.new_empty(0) if keep is None else keep
    states, u, final = delta_rule_scan(u_tilde, w, k_end, gamma, S0, keep)
    out = q_in @ states.transpose(-1, -2) + P @ u  # (B, H, N, C, Dv)
    return out.reshape(B, H, N * C, Dv)[:, :, :T], final


def segmented_forward(q, k, v, beta, log_decay, scale: float, layout: BlockLayout) -> torch.Tensor:
    """Packed sequences in their block layout (:mod:`vqattn.ops.common.segments`; inputs (1, H, T', ·) with zeros at
    the pads): the chunk form with chunk = block, the state restarting from zero at each sequence's first block.
    A pad (k = 0, β = 0, g = 0) changes nothing. Returns out (1, H, T', Dv)."""
    first = layout.first_blocks()
    keep = (first != torch.arange(first.shape[0], device=first.device)).to(q.dtype)
    return chunk_forward(q, k, v, beta, log_decay, scale, None, layout.block_len, keep)[0]


def delta_rule_scan(u_tilde, w, k_end, gamma, S0, keep):
    """The walk over the chunks: with S_0 = S0 (times keep_0), for n = 0 … N−1

        U_n = Ũ_n − W_n S_nᵀ,   S_{n+1} = keep_{n+1} · (γ_n S_n + U_nᵀ K_n)

    (keep empty: all ones). u_tilde (B, H, N, C, Dv), w, k_end (B, H, N, C, Dk), gamma (B, H, N), S0 (B, H, Dv, Dk),
    keep (N,) or (0,) -> (the states S_0 … S_{N−1} (B, H, N, Dv, Dk), U (B, H, N, C, Dv), the state after the last
    chunk γ_{N−1} S_{N−1} + U_{N−1}ᵀ K_{N−1})."""
    return _scan_op(u_tilde, w, k_end, gamma, S0, keep)


@torch.library.custom_op("vqattn::delta_rule_scan", mutates_args=())
def _scan_op(u_tilde: torch.Tensor, w: torch.Tensor, k_end: torch.Tensor, gamma: torch.Tensor, S0: torch.Tensor,
             keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, N, C, Dv = u_tilde.shape
    states = u_tilde.new_empty(B, H, N, Dv, w.shape[-1])
    u = torch.empty_like(u_tilde)
    S = S0
    for n in range(N):
        if keep.numel():
            S = S * keep[n]
        states[:, :, n] = S
        u_n = u_tilde[:, :, n] - w[:, :, n] @ S.transpose(-1, -2)  # (B, H, C, Dv)
        u[:, :, n] = u_n
        S = gamma[:, :, n, None, None] * S + u_n.transpose(-1, -2) @ k_end[:, :, n]
    return states, u, S.clone() if S is S0 else S


@_scan_op.register_fake
def _(u_tilde, w, k_end, gamma, S0, keep):
    B, H, N, C, Dv = u_tilde.shape
    return u_tilde.new_empty(B, H, N, Dv, w.shape[-1]), torch.empty_like(u_tilde), torch.empty_like(S0)


@torch.library.custom_op("vqattn::delta_rule_scan_backward", mutates_args=())
def _scan_backward_op(g_states: torch.Tensor, g_u: torch.Tensor, g_final: torch.Tensor, w: torch.Tensor,
                      k_end: torch.Tensor, gamma: torch.Tensor, keep: torch.Tensor, states: torch.Tensor,
                      u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reverse walk. G holds dL/dP_{n+1}, P_{n+1} = γ_n S_n + U_nᵀ K_n the state before its keep factor; then
    dL/dU_n = g_U + K_n Gᵀ (Ũ_n's gradient, and −(…) S_n is W_n's), dL/dK_n = U_n G, dL/dγ_n = ⟨G, S_n⟩, and
    dL/dS_n = g_S + γ_n G − (dL/dU_n)ᵀ W_n, which times keep_n is the next G."""
    N = w.shape[2]
    g_u_tilde, g_w, g_k = torch.empty_like(g_u), torch.empty_like(w), torch.empty_like(k_end)
    g_gamma = torch.empty_like(gamma)
    G = g_final
    for n in range(N - 1, -1, -1):
        S = states[:, :, n]
        gU = g_u[:, :, n] + k_end[:, :, n] @ G.transpose(-1, -2)  # (B, H, C, Dv)
        g_u_tilde[:, :, n] = gU
        g_w[:, :, n] = -(gU @ S)
        g_k[:, :, n] = u[:, :, n] @ G
        g_gamma[:, :, n] = (G * S).sum((-1, -2))
        G = g_states[:, :, n] + gamma[:, :, n, None, None] * G - gU.transpose(-1, -2) @ w[:, :, n]
        if keep.numel():
            G = G * keep[n]
    return g_u_tilde, g_w, g_k, g_gamma, G.clone() if G is g_final else G


@_scan_backward_op.register_fake
def _(g_states, g_u, g_final, w, k_end, gamma, keep, states, u):
    return (torch.empty_like(g_u), torch.empty_like(w), torch.empty_like(k_end), torch.empty_like(gamma),
            torch.empty_like(g_final))


def _setup(ctx, inputs, output):
    _, w, k_end, gamma, _, keep = inputs
    states, u, _ = output
    ctx.save_for_backward(w, k_end, gamma, keep, states, u)


def _backward(ctx, g_states, g_u, g_final):
    w, k_end, gamma, keep, states, u = ctx.saved_tensors
    g_states = torch.zeros_like(states) if g_states is None else g_states.contiguous()
    g_u = torch.zeros_like(u) if g_u is None else g_u.contiguous()
    g_final = torch.zeros_like(states[:, :, 0]) if g_final is None else g_final.contiguous()
    g_u_tilde, g_w, g_k, g_gamma, g_S0 = _scan_backward_op(g_states, g_u, g_final, w, k_end, gamma, keep, states, u)
    return g_u_tilde, g_w, g_k, g_gamma, g_S0, None


torch.library.register_autograd("vqattn::delta_rule_scan", _backward, setup_context=_setup)
