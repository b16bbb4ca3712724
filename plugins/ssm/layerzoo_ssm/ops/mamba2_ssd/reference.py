"""Mamba2 SSD in plain torch (fp32 inside): the chunked scan (prefill) and the state update (decode).

Per head ``h`` (group ``h // (H / G)`` for ``B, C``), with the state ``h_t [P, N]`` (fp32)::

    h_t = exp(dt_t · A) h_{t-1} + dt_t · x_t ⊗ B_t
    y_t = h_t · C_t  (+ D · x_t)

``dt`` arrives already softplus'ed and clamped; ``A = -exp(A_log) < 0``.
"""

from __future__ import annotations

import torch

from layerzoo.kernels.varlen import check_state, from_padded, padded_len, seq_bounds, to_padded


def _check(x, dt, A, B, C, D):
    T, H, P = x.shape
    G, N = B.shape[1:]
    if dt.shape != (T, H) or A.shape != (H,) or B.shape != (T, G, N) or C.shape != B.shape or H % max(G, 1):
        raise ValueError(
            f"mamba2 ssd expects x [T, H, P], dt [T, H], A [H], B, C [T, G, N] with H % G == 0; got x {list(x.shape)}, "
            f"dt {list(dt.shape)}, A {list(A.shape)}, B {list(B.shape)}, C {list(C.shape)}"
        )
    if D is not None and D.shape != (H,):
        raise ValueError(f"mamba2 ssd: D must be [H] = [{H}], got {list(D.shape)}")


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan in chunks of ``Q = chunk_size`` tokens, over one sequence or a varlen batch.

    Inside a chunk starting from state ``h₀``, with ``a_t = dt_t A`` and ``Λ_t = Σ_{s<=t} a_s``
    (chunk-local)::

        y_t = exp(Λ_t) C_t · h₀ + Σ_{s<=t} exp(Λ_t - Λ_s) dt_s (C_t · B_s) x_s
        h   = exp(Λ_Q) h₀ + Σ_s exp(Λ_Q - Λ_s) dt_s x_s ⊗ B_s

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]``; A: ``[H]``; B, C: ``[T, G, N]``; D: ``[H]`` or None.
        initial_state: ``[N_seq, H, P, N]`` fp32 or None (zeros).
        cu_seqlens: ``[N_seq + 1]`` int64 offsets into ``T``, or None for one sequence.

    Returns:
        ``(y [T, H, P] in x.dtype, final_state [N_seq, H, P, N] fp32)``.
    """
    _check(x, dt, A, B, C, D)
    T, H, P = x.shape
    G, N = B.shape[1:]
    Q = int(chunk_size)
    starts, lens = seq_bounds(cu_seqlens, T, x.device)
    S = lens.shape[0]
    check_state("initial_state", initial_state, (S, H, P, N))
    Lp = padded_len(lens, Q)
    # [S, H, Lp, ...], heads first; B and C repeated from their G groups up to the H heads
    xs = to_padded(x.float(), starts, lens, Lp).transpose(1, 2)
    dts = to_padded(dt.float(), starts, lens, Lp).transpose(1, 2)
    Bs, Cs = (to_padded(t.float(), starts, lens, Lp).repeat_interleave(H // G, dim=2).transpose(1, 2) for t in (B, C))
    h = torch.zeros(S, H, P, N, device=x.device) if initial_state is None else initial_state.float().clone()
    a = dts * A.float()[:, None]  # [S, H, Lp], <= 0
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    y = torch.empty_like(xs)
    for c0 in range(0, Lp, Q):
        xc, dtc, Bc, Cc = xs[:, :, c0 : c0 + Q], dts[:, :, c0 : c0 + Q], Bs[:, :, c0 : c0 + Q], Cs[:, :, c0 : c0 + Q]
        lam = a[:, :, c0 : c0 + Q].cumsum(-1)  # [S, H, Q]
        # [S, H, Q, Q]: exp(Λ_t - Λ_s) dt_s (C_t · B_s) for s <= t
        decay = (lam[..., :, None] - lam[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        M = (Cc @ Bc.transpose(-1, -2)) * decay * dtc[..., None, :]
        # [S, H, Q, P]: inside the chunk, plus the carried state read through C
        y[:, :, c0 : c0 + Q] = M @ xc + lam.exp()[..., None] * (Cc @ h.transpose(-1, -2))
        lam_end = lam[..., -1:]  # [S, H, 1]
        written = xc * (dtc * (lam_end - lam).exp())[..., None]  # [S, H, Q, P]
        h = h * lam_end.exp()[..., None] + written.transpose(-1, -2) @ Bc
    if D is not None:
        y = y + D.float()[:, None, None] * xs
    return from_padded(y.transpose(1, 2), starts, lens, T).to(x.dtype), h


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode); functional, ``state`` is not modified.

    Args:
        state: ``[Bt, H, P, N]`` fp32; x: ``[Bt, H, P]``; dt: ``[Bt, H]``; A: ``[H]``;
        B, C: ``[Bt, G, N]``; D: ``[H]`` or None.

    Returns:
        ``(y [Bt, H, P] in x.dtype, new_state [Bt, H, P, N] fp32)``.
    """
    _check(x, dt, A, B, C, D)
    Bt, H, P = x.shape
    G, N = B.shape[1:]
    check_state("state", state, (Bt, H, P, N))
    xf, dtf = x.float(), dt.float()
    Bh, Ch = (t.float().repeat_interleave(H // G, dim=1) for t in (B, C))  # [Bt, H, N]
    decay = (dtf * A.float()).exp()  # [Bt, H]
    new = state.float() * decay[..., None, None] + (dtf[..., None] * xf)[..., None] * Bh[:, :, None, :]
    y = (new * Ch[:, :, None, :]).sum(-1)  # [Bt, H, P]
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), new
