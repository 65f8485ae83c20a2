"""The chunked form of the scalar-decay recurrence (flash-linear-attention's ``chunk`` mode), in PyTorch.

Chunk n holds tokens nC … nC + C − 1; b_c is the inclusive cumulative log decay within the chunk (b_c = Σ_{u ≤ c} g_u,
≤ 0 and decreasing). With S_n the state before the chunk, token c's output and the state after the chunk are

    out_c = Σ_{s ≤ c} exp(b_c − b_s) (σ q_c·k_s) v_s + exp(b_c) S_n (σ q_c),
    S_{n+1} = exp(b_{C−1}) S_n + Σ_s exp(b_{C−1} − b_s) v_s k_sᵀ.

Every factor is exp of a non-positive number (the C × C differences are masked to s ≤ c before the exp, so the
future's positive differences never overflow), and the differences are taken within one chunk, so the cumulative
sums stay small enough for float32. The intra-chunk part is batched over all chunks; the states S_n follow each other
in one pass over the chunks, an (Dv × Dk) update each: O(T·C·(Dk + Dv) + T·Dk·Dv) in all.

Packed sequences (``starts``, True at each sequence's first token) drop the state before a start: S_t =
v_t k_tᵀ there. Within a chunk a token then sees only the keys of its own sequence (the same count of starts up to
it), the state before the chunk only while no start came, and the state passes a chunk only if no sequence starts
in it; each chunk's sum keeps the keys of its last sequence. All masks: one call, no padding, nothing read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils import size_min


def chunk_forward(q, k, v, g, scale: float, S0, C: int, starts: torch.Tensor | None = None):
    """q, k (B, H, T, Dk), v (B, H, T, Dv), g (B, H, T) log decays, all in the compute dtype; S0 (B, H, Dv, Dk) or
    None (zeros); C the chunk length; ``starts`` (T,) bool or None -> (out (B, H, T, Dv), S_T (B, H, Dv, Dk))."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    C = size_min(C, T)
    N = -(-T // C)
    pad = N * C - T
    # zeros after the end: padded keys come after every real query and add nothing to the state (v = 0), and their
    # log decay 0 leaves the final state as the last real token left it
    qc = F.pad(q * scale, (0, 0, 0, pad)).view(B, H, N, C, Dk)
    kc = F.pad(k, (0, 0, 0, pad)).view(B, H, N, C, Dk)
    vc = F.pad(v, (0, 0, 0, pad)).view(B, H, N, C, Dv)
    b = F.pad(g, (0, pad)).view(B, H, N, C).cumsum(-1)  # (B, H, N, C)
    visible = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # (C, C): key s ≤ query c
    sees_state = to_end = passes = None
    if starts is not None:
        seq = F.pad(starts, (0, pad)).view(N, C).cumsum(-1)  # (N, C): the starts up to each token in its chunk
        visible = visible & (seq.unsqueeze(-1) == seq.unsqueeze(-2))  # (N, C, C): the same sequence
        sees_state = seq == 0  # (N, C): no start since the chunk began
        to_end = seq == seq[:, -1:]  # (N, C): the key is in the sequence that ends the chunk
        passes = sees_state[:, -1]  # (N,): no start in the chunk
    decay = (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~visible, float("-inf")).exp()  # (B, H, N, C, C)
    out = ((qc @ kc.transpose(-1, -2)) * decay) @ vc  # (B, H, N, C, Dv)
    to_last = torch.exp(b[..., -1:] - b)  # (B, H, N, C): each key's decay to the chunk's end
    if to_end is not None:
        to_last = to_last * to_end
    sums = (vc * to_last.unsqueeze(-1)).transpose(-1, -2) @ kc  # (B, H, N, Dv, Dk): each chunk's own keys
    through = b[..., -1].exp()  # (B, H, N): the chunk's decay of the state before it
    if passes is not None:
        through = through * passes
    S = q.new_zeros(B, H, Dv, Dk) if S0 is None else S0
    before = []
    # unbound once: indexing chunk n would give each step's backward a zero-filled gradient of all N chunks
    for through_n, sums_n in zip(through.unbind(2), sums.unbind(2)):
        before.append(S)
        S = through_n[..., None, None] * S + sums_n
    read = b.exp()  # (B, H, N, C): the state's decay to each token
    if sees_state is not None:
        read = read * sees_state
    prefix = torch.stack(before, 2)  # (B, H, N, Dv, Dk)
    out = out + (qc * read.unsqueeze(-1)) @ prefix.transpose(-1, -2)
    return out.reshape(B, H, N * C, Dv)[:, :, :T], S
