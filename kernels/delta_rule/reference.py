"""The gated delta rule in plain torch (fp32): chunked (prefill), recurrent (short pieces) and the
one-token decode over pool slots. One family for Gated DeltaNet (Qwen3-Next, Qwen3.5: a decay per
head, ``g [T, H]``) and Kimi Delta Attention (Kimi Linear, Kimi K3, GLM-5.3-Flash: a decay per key
channel, ``g [T, H, K]``).

Per head, with the state ``S [K, V]`` (fp32) and ``g_t`` the log decay (``<= 0``; a scalar or a
``[K]`` vector)::

    S   <- diag(exp(g_t)) S
    u_t  = beta_t * (v_t - S^T k_t)
    S   <- S + k_t ⊗ u_t
    o_t  = S^T q_t

after ``q, k <- l2norm(q), l2norm(k)`` (optional, fp32, eps 1e-6) and ``q <- q * scale``. A
per-head decay is carried as a key dim of size 1 (``[..., 1]``) and broadcast: the same code,
without forming a ``[C, C, K]`` decay tile. The varlen functions pad the batch to ``[N, L, ...]``
with ``g = beta = 0`` rows, which leave the state unchanged.
"""

from __future__ import annotations

import torch

from layerzoo.kernels.varlen import check_state, from_padded, padded_len, seq_bounds, to_padded

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x²) + 1e-6)`` over the last dim (fp32 in, fp32 out)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def decay_kind(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, op: str) -> bool:
    """Check the shapes of one call; True when the decay is per key channel (``g [T, H, K]``),
    False when it is per head (``g [T, H]``). The leading dim ``T`` may be ``N`` (decode)."""
    T, H, K = k.shape
    per_key = g.dim() == 3
    if (
        q.shape != k.shape or v.dim() != 3 or v.shape[:2] != (T, H) or beta.shape != (T, H)
        or g.shape not in ((T, H), (T, H, K))
    ):
        raise ValueError(
            f"{op} expects q, k [T, H, K], v [T, H, V], g [T, H] (per head) or [T, H, K] (per key), "
            f"beta [T, H]; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, "
            f"beta {list(beta.shape)}"
        )
    return per_key


def _qk(q, k, scale, use_qk_l2norm):
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def _prepare(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, multiple, op):
    """Validated fp32 inputs padded per sequence: ``q, k [N, H, L, K]``, ``v [N, H, L, V]``,
    ``g [N, H, L, K or 1]``, ``beta [N, H, L]``, the state ``S [N, H, K, V]``, and ``(starts, lens)``."""
    per_key = decay_kind(q, k, v, g, beta, op)
    T, H, K = k.shape
    V = v.shape[-1]
    starts, lens = seq_bounds(cu_seqlens, T, v.device)
    N = lens.shape[0]
    check_state("initial_state", initial_state, (N, H, K, V))
    q, k = _qk(q, k, scale, use_qk_l2norm)
    g = g.float() if per_key else g.float()[..., None]  # [T, H, K or 1]
    Lp = padded_len(lens, multiple)
    # [T, H, ...] -> [N, Lp, H, ...] -> [N, H, Lp, ...]
    q, k, v, g = (to_padded(x.float(), starts, lens, Lp).transpose(1, 2) for x in (q, k, v, g))
    beta = to_padded(beta.float(), starts, lens, Lp).transpose(1, 2)
    if initial_state is None:
        S = torch.zeros(N, H, K, V, dtype=torch.float32, device=v.device)
    else:
        S = initial_state.float().clone()
    return q, k, v, g, beta, S, starts, lens


def _step(S, q, k, v, g, beta):
    """One token for every row: ``S [.., K, V]``, ``q, k [.., K]``, ``v [.., V]``, ``g [.., K or 1]``,
    ``beta [..]`` → ``(o [.., V], S)``."""
    S = S * g[..., None].exp()
    # what the state already predicts for k_t, and the correction written
    u = beta[..., None] * (v - torch.einsum("...k,...kv->...v", k, S))
    S = S + k[..., :, None] * u[..., None, :]
    return torch.einsum("...k,...kv->...v", q, S), S


def recurrent_delta_rule(
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
    """The gated delta rule one token at a time (short pieces).

    Args:
        q, k: ``[T, H, K]`` (GDN: key heads already repeated up to the ``H`` value heads).
        v: ``[T, H, V]``.
        g: log decay (``<= 0``): ``[T, H]`` per head or ``[T, H, K]`` per key channel.
        beta: ``[T, H]`` write strength.
        scale: multiplies ``q`` (after the l2norm), usually ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32, or None for zeros.
        cu_seqlens: ``[N + 1]`` int64 offsets into ``T``, or None for one sequence (``N = 1``).
        use_qk_l2norm: l2-normalise ``q`` and ``k`` in fp32 first.

    Returns:
        ``(o [T, H, V] in v.dtype, final_state [N, H, K, V] fp32)``.
    """
    T, dtype = v.shape[0], v.dtype
    q, k, v, g, beta, S, starts, lens = _prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, 1, "recurrent_delta_rule"
    )
    o = torch.empty_like(v)  # [N, H, Lp, V]
    for t in range(v.shape[2]):
        o[:, :, t], S = _step(S, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
    return from_padded(o.transpose(1, 2), starts, lens, T).to(dtype), S


def delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    state: torch.Tensor,
    slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token for each of ``N`` sequences, reading and writing their states in the pool in place;
    nothing is read on the host, so a captured decode step can hold it.

    Args:
        q, k: ``[N, H, K]``; v: ``[N, H, V]``; g: ``[N, H]`` or ``[N, H, K]``; beta: ``[N, H]``.
        state: the pool ``[P, H, K, V]`` fp32; row ``slots[n]`` is sequence ``n``'s state, replaced
            by its new state.
        slots: ``[N]`` int64 pool rows (distinct, except padding rows of a captured step, whose
            results nobody reads).

    Returns:
        ``o [N, H, V]`` in ``v.dtype``.
    """
    per_key = decay_kind(q, k, v, g, beta, "delta_rule_decode")
    H, K, V = *k.shape[1:], v.shape[-1]
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V):
        raise ValueError(f"state must be a pool [P, {H}, {K}, {V}], got {list(state.shape)}")
    q, k = _qk(q, k, scale, use_qk_l2norm)
    g = g.float() if per_key else g.float()[..., None]
    o, S = _step(state.index_select(0, slots).float(), q, k, v.float(), g, beta.float())
    state.index_copy_(0, slots, S.to(state.dtype))
    return o.to(v.dtype)


def _pair_products(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kk, qk) [N, H, n, C, C]``: ``Σ_d k_i,d k_j,d D_ij,d`` and ``Σ_d q_i,d k_j,d D_ij,d`` with
    ``D_ij = exp(G_i - G_j)`` for ``j <= i`` (0 above), from ``q, k [N, H, n, C, K]`` and the
    chunk-local ``G [N, H, n, C, K or 1]``. A per-head decay weights plain matmuls, all chunks at
    once; a per-key one needs the ``[C, C, K]`` tile, formed a chunk at a time to bound memory."""
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()

    def decay(Gc):  # [.., C, K or 1] -> [.., C, C, K or 1]
        return (Gc[..., :, None, :] - Gc[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf")).exp()

    if G.shape[-1] == 1:
        D = decay(G)[..., 0]
        return (k @ k.transpose(-1, -2)) * D, (q @ k.transpose(-1, -2)) * D
    kk = q.new_empty((*q.shape[:-1], C))
    qk = q.new_empty((*q.shape[:-1], C))
    for c in range(G.shape[2]):
        D, kc = decay(G[:, :, c]), k[:, :, c]
        kk[:, :, c] = torch.einsum("nhik,nhjk,nhijk->nhij", kc, kc, D)
        qk[:, :, c] = torch.einsum("nhik,nhjk,nhijk->nhij", q[:, :, c], kc, D)
    return kk, qk


def chunk_delta_rule(
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
    `recurrent_delta_rule`.

    Inside a chunk that starts from state ``S₀``, with ``G_i = Σ_{j<=i} g_j`` (chunk-local, per head
    or per key channel) and ``D_ij = exp(G_i - G_j)`` (``j <= i``, never above 1), the writes ``u``
    solve the unit lower-triangular system::

        (I + A) u = beta ⊙ v - beta ⊙ (exp(G) ⊙ k) S₀,   A_ij = beta_i Σ_d k_i,d k_j,d D_ij,d  (j < i)

    i.e. ``u = U - W S₀``. Then, chunk after chunk::

        o_i = (exp(G_i) ⊙ q_i) S₀ + Σ_{j<=i} (Σ_d q_i,d k_j,d D_ij,d) u_j
        S   = diag(exp(G_C)) S₀ + Σ_j (exp(G_C - G_j) ⊙ k_j) ⊗ u_j

    The pairwise decays are formed as differences (per key: ``[C, C, K]`` per chunk), never as
    ``exp(G) · exp(-G)``, which overflows for strong decays (K3's gate reaches -5 per token). With
    a per-head decay, ``D`` is ``[C, C]`` and the sums over ``d`` are plain matmuls.
    """
    T, dtype = v.shape[0], v.dtype
    C = int(chunk_size)
    q, k, v, g, beta, S, starts, lens = _prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, C, "chunk_delta_rule"
    )
    N, H, Lp, K = k.shape
    V, Kg = v.shape[-1], g.shape[-1]
    n = Lp // C
    q, k, v, g = (x.reshape(N, H, n, C, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(N, H, n, C)
    G = g.cumsum(-2)  # [N, H, n, C, K or 1]
    kk, qk = _pair_products(q, k, G)  # [N, H, n, C, C]
    A = (beta[..., None] * kk).tril(-1)
    eye = torch.eye(C, dtype=torch.float32, device=v.device)
    # forward substitution (unit lower triangular) for every chunk at once: U [.., V] | W [.., K]
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * (k * G.exp())], dim=-1)
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :V], UW[..., V:]
    q_decayed = q * G.exp()  # reads S₀
    last = G[..., -1:, :]  # [N, H, n, 1, K or 1]
    k_decayed = k * (last - G).exp()  # written into the end state
    chunk_decay = last.transpose(-1, -2).exp()  # [N, H, n, K or 1, 1]
    o = torch.empty_like(v)
    for c in range(n):
        u = U[:, :, c] - W[:, :, c] @ S  # [N, H, C, V]
        o[:, :, c] = q_decayed[:, :, c] @ S + qk[:, :, c] @ u
        S = S * chunk_decay[:, :, c] + k_decayed[:, :, c].transpose(-1, -2) @ u
    o = o.reshape(N, H, Lp, V).transpose(1, 2)
    return from_padded(o, starts, lens, T).to(dtype), S
