"""A plain-torch Kimi K3 text model for tests: no engine part, no cache, the whole sequence per call.

Written from the public K3 code as vLLM and SGLang transcribe it (``kimi-k3-facts.md`` gathers the
formulas): the AttnRes stream (§1-2), KDA with the lower-bounded gate and the full-rank output gate
(§3), gated NoPE MLA (§4), SiTU (§5) and the latent MoE (§6). Weights are a dict under the
checkpoint's names (``language_model.model.layers.N...``); `random_checkpoint` makes one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

P = "language_model.model."


def text_config(**overrides) -> dict:
    """A tiny K3 ``text_config``: 6 layers (MLA at 3 and 6, 1-indexed), AttnRes blocks of 2."""
    config = dict(
        model_type="kimi_linear", vocab_size=97, hidden_size=32, num_hidden_layers=6, rms_norm_eps=1e-5,
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        intermediate_size=40, first_k_dense_replace=1, num_experts=6, num_experts_per_token=2, num_shared_experts=2,
        moe_intermediate_size=12, routed_expert_hidden_size=16, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
        num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=1.5,
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=20, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, mla_use_nope=True, mla_use_output_gate=True, attn_res_block_size=2,
        max_position_embeddings=4096, tie_word_embeddings=False,
        linear_attn_config=dict(num_heads=3, head_dim=8, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True, kda_layers=[1, 2, 4, 5], full_attn_layers=[3, 6]),
    )
    config.update(overrides)
    return config


def shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of the text model and its shape."""
    D, V = c["hidden_size"], c["vocab_size"]
    la = c["linear_attn_config"]
    H, K = la["num_heads"], la["head_dim"]
    mh, dn, dr, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    out = {P + "embed_tokens.weight": (V, D), P + "norm.weight": (D,), "language_model.lm_head.weight": (V, D),
           P + "output_attn_res_norm.weight": (D,), P + "output_attn_res_proj.weight": (1, D)}
    for i in range(c["num_hidden_layers"]):
        L = f"{P}layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            out[L + name + ".weight"] = (D,)
        out[L + "self_attention_res_proj.weight"] = out[L + "mlp_res_proj.weight"] = (1, D)
        a = L + "self_attn."
        if i + 1 in la["kda_layers"]:
            for n in ("q", "k", "v"):
                out[a + f"{n}_proj.weight"] = (H * K, D)
                out[a + f"{n}_conv1d.weight"] = (H * K, 1, la["short_conv_kernel_size"])
            out.update({a + "f_a_proj.weight": (K, D), a + "f_b_proj.weight": (H * K, K), a + "b_proj.weight": (H, D),
                        a + "g_proj.weight": (H * K, D), a + "dt_bias": (H * K,), a + "A_log": (max(H, K),),
                        a + "o_norm.weight": (K,), a + "o_proj.weight": (D, H * K)})
        else:
            qr, kr = c["q_lora_rank"], c["kv_lora_rank"]
            if qr is None:
                out[a + "q_proj.weight"] = (mh * (dn + dr), D)
            else:
                out.update({a + "q_a_proj.weight": (qr, D), a + "q_a_layernorm.weight": (qr,), a + "q_b_proj.weight": (mh * (dn + dr), qr)})
            out.update({a + "kv_a_proj_with_mqa.weight": (kr + dr, D), a + "kv_a_layernorm.weight": (kr,),
                        a + "kv_b_proj.weight": (mh * (dn + dv), kr), a + "g_proj.weight": (mh * dv, D), a + "o_proj.weight": (D, mh * dv)})
        m = L + ("mlp." if i < c["first_k_dense_replace"] else "block_sparse_moe.")
        if i < c["first_k_dense_replace"]:
            I = c["intermediate_size"]
            out.update({m + "gate_proj.weight": (I, D), m + "up_proj.weight": (I, D), m + "down_proj.weight": (D, I)})
        else:
            E, I, Lt, S = c["num_experts"], c["moe_intermediate_size"], c["routed_expert_hidden_size"], c["num_shared_experts"]
            out.update({m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,),
                        m + "routed_expert_down_proj.weight": (Lt, D), m + "routed_expert_norm.weight": (Lt,),
                        m + "routed_expert_up_proj.weight": (D, Lt), m + "shared_experts.gate_proj.weight": (S * I, D),
                        m + "shared_experts.up_proj.weight": (S * I, D), m + "shared_experts.down_proj.weight": (D, S * I)})
            for e in range(E):
                out.update({m + f"experts.{e}.w1.weight": (I, Lt), m + f"experts.{e}.w3.weight": (I, Lt), m + f"experts.{e}.w2.weight": (Lt, I)})
    return out


def random_checkpoint(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes(c).items():
        t = torch.randn(shape, generator=gen)
        if name.endswith(("norm.weight", "layernorm.weight")):
            t = 1.0 + 0.2 * t
        elif name.endswith("res_proj.weight"):
            t = 0.5 * t
        elif name.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
            t = 0.3 * t
        else:
            t = 0.25 * t
        weights[name] = t
    return weights


def rmsnorm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def situ(gate, up, beta, linear_beta):
    g, u = gate.float(), up.float()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)).to(gate.dtype)


def l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class K3Reference:
    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        self.c, self.w = config, weights

    def logits(self, ids: list[int]) -> torch.Tensor:
        """``[T, vocab]`` for the whole sequence ``ids``."""
        c, w = self.c, self.w
        eps, B = c["rms_norm_eps"], c["attn_res_block_size"]
        x = w[P + "embed_tokens.weight"][torch.tensor(ids)]
        prefix, bank = x, []
        for i in range(c["num_hidden_layers"]):
            L = f"{P}layers.{i}."
            h = prefix if not bank else self.attn_res(bank, prefix, L + "self_attention_res_")
            if i % B == 0:
                bank, prefix = bank + [prefix], None
            xn = rmsnorm(h, w[L + "input_layernorm.weight"], eps)
            a = self.kda(xn, L + "self_attn.") if i + 1 in c["linear_attn_config"]["kda_layers"] else self.mla(xn, L + "self_attn.")
            prefix = a if prefix is None else prefix + a
            h = self.attn_res(bank, prefix, L + "mlp_res_")
            hn = rmsnorm(h, w[L + "post_attention_layernorm.weight"], eps)
            prefix = prefix + (self.dense(hn, L + "mlp.") if i < c["first_k_dense_replace"] else self.moe(hn, L + "block_sparse_moe."))
        h = self.attn_res(bank, prefix, P + "output_attn_res_")
        return rmsnorm(h, w[P + "norm.weight"], eps) @ w["language_model.lm_head.weight"].T

    def attn_res(self, bank, prefix, name):
        V = torch.stack(bank + [prefix], 1).float()  # [T, n, D]
        r = torch.rsqrt(V.pow(2).mean(-1) + self.c["rms_norm_eps"])
        w_eff = self.w[name + "norm.weight"].float() * self.w[name + "proj.weight"][0].float()
        p = ((V * r[..., None]) @ w_eff).softmax(-1)
        return (p[..., None] * V).sum(1).to(prefix.dtype)

    def kda(self, x, a):
        w, la = self.w, self.c["linear_attn_config"]
        T, H, K = x.shape[0], la["num_heads"], la["head_dim"]
        W = la["short_conv_kernel_size"]

        def conv(t, name):  # depthwise causal, tap W-1 is the current token, then SiLU
            y = F.conv1d(F.pad(t.T[None], (W - 1, 0)), w[a + name], groups=t.shape[1])[0].T
            return F.silu(y)

        q = conv(x @ w[a + "q_proj.weight"].T, "q_conv1d.weight").view(T, H, K)
        k = conv(x @ w[a + "k_proj.weight"].T, "k_conv1d.weight").view(T, H, K)
        v = conv(x @ w[a + "v_proj.weight"].T, "v_conv1d.weight").view(T, H, K)
        f = (x @ w[a + "f_a_proj.weight"].T @ w[a + "f_b_proj.weight"].T).float() + w[a + "dt_bias"].float()
        g = la["gate_lower_bound"] * torch.sigmoid(w[a + "A_log"][:H].float().exp()[:, None] * f.view(T, H, K))
        beta = torch.sigmoid((x @ w[a + "b_proj.weight"].T).float())
        q, k = l2(q.float()) * K**-0.5, l2(k.float())
        S = torch.zeros(H, K, K)  # [H, K, V]
        out = torch.empty(T, H, K)
        for t in range(T):
            S = S * g[t].exp()[:, :, None]
            u = (v[t].float() - torch.einsum("hk,hkv->hv", k[t], S)) * beta[t][:, None]
            S = S + k[t][:, :, None] * u[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t], S)
        gate = (x @ w[a + "g_proj.weight"].T).view(T, H, K)
        o = rmsnorm(out, w[a + "o_norm.weight"], self.c["rms_norm_eps"]) * torch.sigmoid(gate)
        return o.reshape(T, H * K) @ w[a + "o_proj.weight"].T

    def mla(self, x, a):
        w, c = self.w, self.c
        T, H = x.shape[0], c["num_attention_heads"]
        dn, dr, dv, kr = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        if c["q_lora_rank"] is None:
            q = (x @ w[a + "q_proj.weight"].T).view(T, H, dn + dr)
        else:
            q = (rmsnorm(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6) @ w[a + "q_b_proj.weight"].T).view(T, H, dn + dr)
        ckv = x @ w[a + "kv_a_proj_with_mqa.weight"].T
        kv = (rmsnorm(ckv[:, :kr], w[a + "kv_a_layernorm.weight"], 1e-6) @ w[a + "kv_b_proj.weight"].T).view(T, H, dn + dv)
        k = torch.cat([kv[..., :dn], ckv[:, None, kr:].expand(T, H, dr)], -1)  # NoPE: k_pe unrotated
        scores = torch.einsum("ihd,jhd->hij", q, k) * (dn + dr) ** -0.5
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hij,jhd->ihd", scores.softmax(-1), kv[..., dn:]).reshape(T, H * dv)
        return (o * torch.sigmoid(x @ w[a + "g_proj.weight"].T)) @ w[a + "o_proj.weight"].T

    def dense(self, x, m, w=None):
        w = w or self.w
        c = self.c
        return situ(x @ w[m + "gate_proj.weight"].T, x @ w[m + "up_proj.weight"].T,
                    c["activation_situ_beta"], c["activation_situ_linear_beta"]) @ w[m + "down_proj.weight"].T

    def moe(self, x, m):
        w, c = self.w, self.c
        s = torch.sigmoid(x.float() @ w[m + "gate.weight"].float().T)
        idx = (s + w[m + "gate.e_score_correction_bias"].float()).topk(c["num_experts_per_token"], dim=-1).indices
        weights = s.gather(1, idx)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
        z = x @ w[m + "routed_expert_down_proj.weight"].T
        y = torch.zeros_like(z)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = f"{m}experts.{int(idx[t, j])}."
                h = situ(z[t] @ w[e + "w1.weight"].T, z[t] @ w[e + "w3.weight"].T, c["activation_situ_beta"], c["activation_situ_linear_beta"])
                y[t] += weights[t, j] * (h @ w[e + "w2.weight"].T)
        y = rmsnorm(y, w[m + "routed_expert_norm.weight"], c["rms_norm_eps"]) @ w[m + "routed_expert_up_proj.weight"].T
        return y + self.dense(x, m + "shared_experts.")

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(steps):
                ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):]
