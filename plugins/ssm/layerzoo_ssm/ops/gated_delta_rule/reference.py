"""Gated delta rule in plain torch (fp32): the chunked (UT/WY) form and the plain recurrence.

Per value head, with the state ``S [K, V]`` (fp32)::

    S   <- S * exp(g_t)
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
    """Validated fp32 inputs padded per sequence: ``q, k [N, H, L, K]``, ``v [N, H, L, V]``,
    ``g, beta [N, H, L]``, the state ``S [N, H, K, V]``, and ``(starts, lens)``."""
    T, H, K = k.shape
    V = v.shape[-1]
    if q.shape != k.shape or v.shape[:2] != (T, H) or g.shape != (T, H) or beta.shape != (T, H):
        raise ValueError(
            f"gated delta rule expects q, k [T, H, K], v [T, H, V], g, beta [T, H]; got q {list(q.shape)}, "
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
    q, k, v = (to_padded(x.float(), starts, lens, Lp).transpose(1, 2) for x in (q, k, v))
    g, beta = (to_padded(x.float(), starts, lens, Lp).transpose(1, 2) for x in (g, beta))
    if initial_state is None:
        S = torch.zeros(N, H, K, V, dtype=torch.float32, device=v.device)
    else:
        S = initial_state.float().clone()
    return q, k, v, g, beta, S, starts, lens


def recurrent_gated_delta_rule(
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
    """The gated delta rule one token at a time (decode, short chunks).

    Args:
        q, k: ``[T, H, K]`` (key heads already repeated up to the ``H`` value heads).
        v: ``[T, H, V]``.
        g: ``[T, H]`` log decay (``<= 0``); beta: ``[T, H]`` write strength.
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
        S = S * g[:, :, t, None, None].exp()
        # [N, H, V]: what the state already predicts for k_t, and the correction written
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("nhk,nhkv->nhv", k[:, :, t], S))
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        o[:, :, t] = torch.einsum("nhk,nhkv->nhv", q[:, :, t], S)
    return from_padded(o.transpose(1, 2), starts, lens, T).to(dtype), S


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of ``N`` sequences: `recurrent_gated_delta_rule` with ``cu_seqlens =
    arange(N + 1)``, without reading anything on the host (a captured decode step runs it).

    Args:
        q, k: ``[N, H, K]``; v: ``[N, H, V]``; g, beta: ``[N, H]``; initial_state: ``[N, H, K, V]`` fp32.
    Returns:
        ``(o [N, H, V] in v.dtype, final_state [N, H, K, V] fp32)``.
    """
    check_state("initial_state", initial_state, (*v.shape[:2], k.shape[-1], v.shape[-1]))
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    S = initial_state.float() * g.float().exp()[:, :, None, None]
    u = beta.float()[:, :, None] * (v.float() - torch.einsum("nhk,nhkv->nhv", k, S))
    S = S + k[:, :, :, None] * u[:, :, None, :]
    return torch.einsum("nhk,nhkv->nhv", q, S).to(v.dtype), S


def chunk_gated_delta_rule(
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
    """The gated delta rule in chunks of ``C = chunk_size`` tokens (prefill). Same contract as
    `recurrent_gated_delta_rule`.

    Inside a chunk that starts from state ``S₀``, with ``G_i = Σ_{j<=i} g_j`` (chunk-local) and
    ``γ_i = exp(G_i)``, the writes ``u`` solve the unit lower-triangular system::

        (I + A) u = beta ⊙ v - (beta γ ⊙ k) S₀,    A_ij = beta_i (k_i · k_j) exp(G_i - G_j)  (j < i)

    i.e. ``u = U - W S₀`` with ``U = (I+A)⁻¹ (beta ⊙ v)`` and ``W = (I+A)⁻¹ (beta γ ⊙ k)``, both
    found by forward substitution for all chunks at once. Then, chunk after chunk::

        o_i = γ_i q_i S₀ + Σ_{j<=i} exp(G_i - G_j) (q_i · k_j) u_j
        S   = γ_C S₀ + Σ_j exp(G_C - G_j) k_j ⊗ u_j
    """
    T, dtype = v.shape[0], v.dtype
    C = int(chunk_size)
    q, k, v, g, beta, S, starts, lens = _prepare(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, C)
    N, H, Lp, K = k.shape
    V = v.shape[-1]
    n = Lp // C
    # [N, H, n, C, ...]: chunks in their own dim
    q, k, v = (x.reshape(N, H, n, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(N, H, n, C), beta.reshape(N, H, n, C)

    G = g.cumsum(-1)  # [N, H, n, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    # [N, H, n, C, C]: exp(G_i - G_j) for j <= i (never above 1), 0 above the diagonal
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(C, dtype=torch.float32, device=v.device)
    # forward substitution (unit lower triangular): [N, H, n, C, V] and [N, H, n, C, K]
    U = torch.linalg.solve_triangular(eye + A, beta[..., None] * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(eye + A, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)

    attn = (q @ k.transpose(-1, -2)) * decay  # [N, H, n, C, C], causal with the diagonal
    q_decayed = q * G.exp()[..., None]  # reads S₀
    k_decayed = k * (G[..., -1:] - G).exp()[..., None]  # written into the end state
    chunk_decay = G[..., -1].exp()  # [N, H, n]

    o = torch.empty_like(v)
    for c in range(n):
        u = U[:, :, c] - W[:, :, c] @ S  # [N, H, C, V]
        o[:, :, c] = q_decayed[:, :, c] @ S + attn[:, :, c] @ u
        S = S * chunk_decay[:, :, c, None, None] + k_decayed[:, :, c].transpose(-1, -2) @ u
    o = o.reshape(N, H, Lp, V).transpose(1, 2)
    return from_padded(o, starts, lens, T).to(dtype), S
