"""Kimi Delta Attention (KDA) in plain torch (fp32): the chunked form and the plain recurrence.

KDA is the gated delta rule with a decay per key channel instead of per head. Per head, with
the state ``S [K, V]`` (fp32) and ``g_t [K]`` (log decay, ``<= 0``)::

    S   <- diag(exp(g_t)) S
    u_t  = beta_t * (v_t - S^T k_t)
    S   <- S + k_t ⊗ u_t
    o_t  = S^T q_t

after ``q, k <- l2norm(q), l2norm(k)`` (optional) and ``q <- q * scale``. Both functions take a
single sequence or a varlen batch (``cu_seqlens``); the batch is padded to ``[N, L, ...]`` with
``g = beta = 0`` rows, which leave the state unchanged.
"""

from __future__ import annotations

import torch

from layerzoo.kernels.varlen import check_state, from_padded, padded_len, seq_bounds, to_padded

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x²) + 1e-6)`` over the last dim (fp32 in, fp32 out)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, multiple):
    """Validated fp32 inputs padded per sequence: ``q, k, g [N, H, L, K]``, ``v [N, H, L, V]``,
    ``beta [N, H, L]``, the state ``S [N, H, K, V]``, and ``(starts, lens)``."""
    T, H, K = k.shape
    V = v.shape[-1]
    if q.shape != k.shape or g.shape != k.shape or v.shape[:2] != (T, H) or beta.shape != (T, H):
        raise ValueError(
            f"KDA expects q, k, g [T, H, K], v [T, H, V], beta [T, H]; got q {list(q.shape)}, "
            f"k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, beta {list(beta.shape)}"
        )
    starts, lens = seq_bounds(cu_seqlens, T, v.device)
    N = lens.shape[0]
    check_state("initial_state", initial_state, (N, H, K, V))
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    Lp = padded_len(lens, multiple)
    # [T, H, ...] -> [N, Lp, H, ...] -> [N, H, Lp, ...]
    q, k, v, g = (to_padded(x.float(), starts, lens, Lp).transpose(1, 2) for x in (q, k, v, g))
    beta = to_padded(beta.float(), starts, lens, Lp).transpose(1, 2)
    if initial_state is None:
        S = torch.zeros(N, H, K, V, dtype=torch.float32, device=v.device)
    else:
        S = initial_state.float().clone()
    return q, k, v, g, beta, S, starts, lens


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA one token at a time (decode, short chunks).

    Args:
        q, k: ``[T, H, K]``; v: ``[T, H, V]``.
        g: ``[T, H, K]`` log decay per key channel (``<= 0``); beta: ``[T, H]`` write strength.
        scale: multiplies ``q`` (after the l2norm), usually ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32, or None for zeros.
        cu_seqlens: ``[N + 1]`` int64 offsets into ``T``, or None for one sequence (``N = 1``).
        use_qk_l2norm: l2-normalise ``q`` and ``k`` in fp32 first.

    Returns:
        ``(o [T, H, V] in v.dtype, final_state [N, H, K, V] fp32)``.
    """
    T, dtype = v.shape[0], v.dtype
    q, k, v, g, beta, S, starts, lens = _prepare(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, 1)
    o = torch.empty_like(v)  # [N, H, Lp, V]
    for t in range(v.shape[2]):
        S = S * g[:, :, t, :, None].exp()
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("nhk,nhkv->nhv", k[:, :, t], S))
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        o[:, :, t] = torch.einsum("nhk,nhkv->nhv", q[:, :, t], S)
    return from_padded(o.transpose(1, 2), starts, lens, T).to(dtype), S


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA in chunks of ``C = chunk_size`` tokens (prefill). Same contract as `recurrent_kda`.

    Inside a chunk that starts from state ``S₀``, with ``G_i = Σ_{j<=i} g_j`` (chunk-local, per key
    channel) and ``D_ij = exp(G_i - G_j)`` (per channel, ``j <= i``, never above 1), the writes
    ``u`` solve the unit lower-triangular system::

        (I + A) u = beta ⊙ v - beta ⊙ (exp(G) ⊙ k) S₀,   A_ij = beta_i Σ_d k_i,d k_j,d D_ij,d  (j < i)

    i.e. ``u = U - W S₀``. Then, chunk after chunk::

        o_i = (exp(G_i) ⊙ q_i) S₀ + Σ_{j<=i} (Σ_d q_i,d k_j,d D_ij,d) u_j
        S   = diag(exp(G_C)) S₀ + Σ_j (exp(G_C - G_j) ⊙ k_j) ⊗ u_j

    The pairwise decays are formed per chunk as differences (``[C, C, K]``), never as
    ``exp(G) · exp(-G)``, which would overflow for strong decays.
    """
    T, dtype = v.shape[0], v.dtype
    C = int(chunk_size)
    q, k, v, g, beta, S, starts, lens = _prepare(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, C)
    N, H, Lp, K = k.shape
    V = v.shape[-1]
    n = Lp // C
    q, k, v, g = (x.reshape(N, H, n, C, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(N, H, n, C)
    G = g.cumsum(-2)  # [N, H, n, C, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    strict = causal.tril(-1)
    eye = torch.eye(C, dtype=torch.float32, device=v.device)
    o = torch.empty_like(v)
    for c in range(n):
        Gc, qc, kc, vc, bc = G[:, :, c], q[:, :, c], k[:, :, c], v[:, :, c], beta[:, :, c]
        # [N, H, C, C, K]: exp(G_i - G_j) on and below the diagonal, 0 above
        diff = (Gc[..., :, None, :] - Gc[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
        decay = diff.exp()
        A = bc[..., None] * torch.einsum("nhik,nhjk,nhijk->nhij", kc, kc, decay) * strict
        U = torch.linalg.solve_triangular(eye + A, bc[..., None] * vc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(eye + A, bc[..., None] * (kc * Gc.exp()), upper=False, unitriangular=True)
        u = U - W @ S  # [N, H, C, V]
        attn = torch.einsum("nhik,nhjk,nhijk->nhij", qc, kc, decay)
        o[:, :, c] = (qc * Gc.exp()) @ S + attn @ u
        last = Gc[..., -1:, :]  # [N, H, 1, K]
        S = S * last.transpose(-1, -2).exp() + (kc * (last - Gc).exp()).transpose(-1, -2) @ u
    o = o.reshape(N, H, Lp, V).transpose(1, 2)
    return from_padded(o, starts, lens, T).to(dtype), S
