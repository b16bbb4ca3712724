#!/usr/bin/env python
"""Build the small checkpoint embedded in layerzoo (core/embedded/tiny-qwen3-stdlib/).

Dev-only (needs transformers). It:

1. collects the *.py files of the running interpreter's standard library (the PSF license allows
   redistributing derived works), skipping test suites, idlelib, lib2to3 and site-packages, in
   sorted order;
2. trains a byte-level BPE tokenizer on them (vocab 2048; <|endoftext|> (also pad), <|im_start|>,
   <|im_end|>);
3. trains a ~4M-parameter `Qwen3ForCausalLM` from scratch on random 256-token windows of that text
   (AdamW, linear warmup + cosine decay, fixed seeds, one CPU thread) until `--steps` steps are done
   or `--minutes` have passed;
4. saves the model in bfloat16 safetensors with config.json, generation_config.json, the tokenizer
   with a Qwen-style chat template in tokenizer_config.json, and a README.md holding the final loss
   and a greedy sample.

The run is deterministic for a given `--steps` (and Python/torch versions); with only `--minutes`
the step count is fixed from the measured speed of the first steps, and the README records it so
`--steps N` reproduces it.

    python scripts/make_default_model.py                 # ~12 minutes, one thread
    python scripts/make_default_model.py --steps 600     # exact re-run
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' thread pool
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "core" / "embedded" / "tiny-qwen3-stdlib"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}

# Qwen2.5's chat template (system default, tools, tool calls and tool responses).
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in EXCLUDED_DIRS for part in parts[:-1]):
            continue
        files.append(path)
    return files


def read_corpus(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    return tok


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# -------------------------------------------------------------- the MTP head (--mtp-only)

MTP_FILE = "mtp.safetensors"
MTP_README_MARK = "\n## MTP head\n"


def corpus_tokens(backend: Tokenizer, texts: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token stream of the corpus (each file then <|endoftext|>) split as the base's training
    split it: ``(train, held-out)``, the held-out part the stream's last ``max(len / 50, 16 windows)``."""
    eot = backend.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in backend.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    data = torch.tensor(ids, dtype=torch.long)
    n_val = max(len(data) // 50, seq_len * 16)
    return data[:-n_val], data[-n_val:]


class TrainableMtpHead(torch.nn.Module):
    """The head as Qwen3-Next lays it out (``mtp.*``: pre_fc_norm_embedding, pre_fc_norm_hidden,
    fc [H, 2H], layers.0 (a Qwen3 decoder block), norm), in transformers' modules, for training.

    Row ``p`` reads the base's final (normed) hidden state at ``p`` and the embedding of token
    ``p + 1`` and predicts token ``p + 2``, at RoPE position ``p`` and causal over the head's own
    rows, as `layerzoo.layers.mtp.MtpHead` runs it (Qwen's convention: position 0 not masked).
    """

    def __init__(self, base):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

        config = base.config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = Qwen3RMSNorm(hidden, eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        torch.nn.init.normal_(self.fc.weight, std=config.initializer_range)
        block = Qwen3DecoderLayer(config, layer_idx=config.num_hidden_layers - 1)  # the index picks only the layer type (no cache here)
        block.load_state_dict(base.model.layers[-1].state_dict())  # start from the base's last block
        self.layers = torch.nn.ModuleList([block])
        self.norm = Qwen3RMSNorm(hidden, eps)
        # Shared with the frozen base (not the head's tensors).
        self._base = [base]

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """``hidden [B, T, H]`` (the base's at rows 0..T-1), ``next_ids [B, T]`` (the token after
        each row) -> logits ``[B, T, vocab]`` of the token two past each row."""
        base = self._base[0]
        embeds = base.model.embed_tokens(next_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        rope = base.model.rotary_emb(x, positions)
        y = self.layers[0](x, attention_mask=None, position_ids=positions, position_embeddings=rope)  # causal (sdpa)
        return base.lm_head(self.norm(y))


def mtp_losses(base, head, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A window ``x [B, T]`` -> (distillation loss, cross-entropy on the true token two ahead, how
    often the head's argmax equals the base's greedy next token: what a greedy verify accepts).

    The head is trained on the base's own next-token distribution at ``p + 1`` (soft targets): a
    greedy verify accepts a draft when it equals the base's argmax there, not the text's token."""
    with torch.no_grad():
        out = base.model(input_ids=x)
        hidden = out.last_hidden_state  # after the final norm, as layerzoo's drafter records it
        teacher = base.lm_head(hidden[:, 1:-1]).float()
    logits = head(hidden[:, :-2], x[:, 1:-1]).float()
    logp = torch.log_softmax(logits, dim=-1)
    distill = -(torch.softmax(teacher, dim=-1) * logp).sum(-1).mean()
    hard = torch.nn.functional.nll_loss(logp.flatten(0, 1), x[:, 2:].flatten())
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
    return distill, hard, agree


def train_mtp_head(args) -> None:
    """Train the MTP head of the model in ``args.out`` with the model frozen, and save it beside it:
    ``mtp.safetensors`` (bfloat16), ``model.safetensors.index.json`` naming both files,
    ``mtp_num_hidden_layers: 1`` in config.json and a section of the README. model.safetensors is
    left as it is."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out: Path = args.out
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    texts = read_corpus(stdlib_files())
    backend = Tokenizer.from_file(str(out / "tokenizer.json"))  # the one the model was trained with
    train_data, val_data = corpus_tokens(backend, texts, args.seq_len)
    log(f"tokens: train {len(train_data):,}, held-out {len(val_data):,}")

    base = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    base.eval().requires_grad_(False)
    head = TrainableMtpHead(base)
    head.train()
    params = [p for p in head.parameters()]
    n_params = sum(p.numel() for p in params)
    log(f"MTP head: {n_params / 1e6:.2f}M parameters (block from the base's last layer)")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.mtp_lr, betas=(0.9, 0.95)
    )
    gen = torch.Generator().manual_seed(args.seed + 1)

    def batch(source, generator, size):
        starts = torch.randint(0, len(source) - args.seq_len - 1, (size,), generator=generator)
        return torch.stack([source[s : s + args.seq_len] for s in starts.tolist()])

    start = time.perf_counter()
    recent: list[tuple[float, float, float]] = []
    steps = args.mtp_steps
    for step in range(steps):
        lr = lr_at(step, steps, args.mtp_lr, args.warmup, args.mtp_lr * 0.1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        distill, hard, agree = mtp_losses(base, head, batch(train_data, gen, args.batch_size))
        optimizer.zero_grad(set_to_none=True)
        distill.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        recent.append((distill.item(), hard.item(), agree.item()))
        if (step + 1) % args.log_every == 0 or step == 0:
            window = recent[-args.log_every :]
            means = [sum(v) / len(window) for v in zip(*window)]
            log(f"mtp step {step + 1}/{steps} distill {means[0]:.3f} ce(t+2) {means[1]:.3f} agree {means[2]:.1%} "
                f"lr {lr:.2e} elapsed {time.perf_counter() - start:.0f}s")
    minutes = (time.perf_counter() - start) / 60
    final = [sum(v) / len(recent[-50:]) for v in zip(*recent[-50:])]
    head.eval()
    with torch.no_grad():
        vgen = torch.Generator().manual_seed(1234)
        held = [mtp_losses(base, head, batch(val_data, vgen, 8)) for _ in range(8)]
    held_out = [sum(float(h[i]) for h in held) / len(held) for i in range(3)]
    log(f"done: {steps} steps, {minutes:.1f} min; train distill {final[0]:.3f} ce(t+2) {final[1]:.3f}; held-out "
        f"ce(t+2) {held_out[1]:.3f}, greedy agreement {held_out[2]:.1%}")

    # -------------------------------------------------------------- save beside the model
    tensors = {f"mtp.{name}": t.detach().to(torch.bfloat16).contiguous() for name, t in head.state_dict().items()}
    save_file(tensors, str(out / MTP_FILE), metadata={"format": "pt"})
    os.chmod(out / MTP_FILE, 0o644)  # safetensors writes 0600; the package ships it readable
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        base_keys = list(f.keys())
    weight_map = {key: "model.safetensors" for key in base_keys} | {key: MTP_FILE for key in tensors}
    total = (out / "model.safetensors").stat().st_size + (out / MTP_FILE).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    summary = {"params": n_params, "steps": steps, "minutes": minutes, "train": final, "held_out": held_out,
               "bytes": (out / MTP_FILE).stat().st_size}
    acceptance = measure_mtp(out, val_data, backend) if not args.no_measure else None
    write_mtp_readme(out, args, summary, acceptance)
    log(f"saved {out / MTP_FILE} ({summary['bytes'] / 1e6:.1f} MB) and the index")


def held_out_prompts(val_data: torch.Tensor, backend: Tokenizer, count: int = 6, length: int = 48) -> list[list[int]]:
    """The first ``length`` tokens of the first ``count`` held-out files (the held-out split's
    text after each <|endoftext|>)."""
    eot = backend.token_to_id("<|endoftext|>")
    ends = (val_data == eot).nonzero().flatten().tolist()
    prompts = []
    for end in ends:
        piece = val_data[end + 1 : end + 1 + length].tolist()
        if len(piece) == length and eot not in piece:
            prompts.append(piece)
        if len(prompts) == count:
            break
    return prompts


def measure_mtp(out: Path, val_data: torch.Tensor, backend: Tokenizer, max_tokens: int = 128) -> dict:
    """Greedy decoding with and without the head in layerzoo on held-out prompts: acceptance of the
    drafted tokens per k, outputs identical to plain decoding."""
    from layerzoo import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in held_out_prompts(val_data, backend)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(out), dtype="float32").generate(prompts, params)]
    result = {}
    for k in (1, 2, 3):
        llm = LLM(str(out), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": k, "adaptive": False})
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        st = llm.engine.stats
        rate = st.spec_accepted_tokens / max(1, st.spec_draft_tokens)
        result[k] = (rate, 1 + st.spec_accepted_tokens / max(1, st.spec_verify_steps), outs == plain)
        log(f"mtp k={k}: acceptance {rate:.1%}, {result[k][1]:.2f} tokens per verify, identical to plain: {outs == plain}")
    return result


def write_mtp_readme(out: Path, args, summary: dict, acceptance: dict | None) -> None:
    readme = (out / "README.md").read_text(encoding="utf-8").split(MTP_README_MARK)[0].rstrip("\n") + "\n"
    rows = "\n".join(
        f"| {k} | {rate:.1%} | {per:.2f} | {same} |" for k, (rate, per, same) in (acceptance or {}).items()
    )
    table = f"""
Greedy decoding in layerzoo (float32, fixed k, not adaptive) of 128 tokens from the first 48 tokens of
6 held-out files:

| k | drafts accepted | tokens per verify | identical to plain |
|---|---|---|---|
{rows}
""" if acceptance else ""
    section = f"""{MTP_README_MARK}
A multi-token-prediction head in Qwen3-Next's layout (`mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.fc` [256, 512], `mtp.layers.0.*` a Qwen3 decoder block, `mtp.norm`;
`mtp_num_hidden_layers: 1` in config.json), in `mtp.safetensors` beside `model.safetensors`
(`model.safetensors.index.json` names both; model.safetensors is the base's file unchanged). layerzoo
loads it only for `speculative_config={{"method": "mtp", ...}}`. Row p reads the base's final normed
hidden state at p and the embedding of token p + 1 and predicts token p + 2.

- {summary['params'] / 1e6:.2f}M parameters ({summary['bytes'] / 1e6:.1f} MB bfloat16); block initialised from the base's
  last layer, the base frozen
- trained by `scripts/make_default_model.py --mtp-only --mtp-steps {summary['steps']}` (seed {args.seed}) for
  {summary['minutes']:.1f} minutes ({summary['steps']} steps of {args.batch_size} x {args.seq_len} tokens, one CPU thread) on the
  base's training split, distilled from the base's own next-token distribution at p + 1 (what a
  greedy verify accepts)
- final training loss (last 50 steps): distillation {summary['train'][0]:.3f}, cross-entropy on the true token
  two ahead {summary['train'][1]:.3f}; held-out: cross-entropy {summary['held_out'][1]:.3f}, head argmax = base argmax on
  {summary['held_out'][2]:.1%} of the rows (teacher-forced)
{table}"""
    (out / "README.md").write_text(readme + section, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--minutes", type=float, default=12.0, help="training time budget")
    parser.add_argument("--steps", type=int, default=None, help="exact number of steps (default: from --minutes)")
    parser.add_argument(
        "--schedule-steps", type=int, default=None, help="length of the LR schedule (default: --steps)"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp-only", action="store_true", help="train only the MTP head of the model in --out (frozen)")
    parser.add_argument("--mtp-steps", type=int, default=600, help="MTP head training steps")
    parser.add_argument("--mtp-lr", type=float, default=2e-3)
    parser.add_argument("--no-mtp", action="store_true", help="build the model without its MTP head")
    parser.add_argument("--no-measure", action="store_true", help="skip measuring the head's acceptance in layerzoo")
    args = parser.parse_args()
    if args.mtp_only:
        train_mtp_head(args)
        return

    import transformers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    # -------------------------------------------------------------- corpus + tokenizer
    files = stdlib_files()
    texts = read_corpus(files)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    log(f"corpus: {len(texts)} files, {n_bytes / 1e6:.1f} MB from {sysconfig.get_paths()['stdlib']}")
    backend = train_tokenizer(texts, vocab_size=2048)
    vocab = backend.get_vocab_size()
    log(f"tokenizer: vocab {vocab}")

    eot = backend.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in backend.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    data = torch.tensor(ids, dtype=torch.long)
    n_val = max(len(data) // 50, args.seq_len * 16)
    train_data, val_data = data[:-n_val], data[-n_val:]
    log(f"tokens: {len(data):,} ({n_bytes / len(data):.2f} bytes/token), train {len(train_data):,}, val {len(val_data):,}")

    # -------------------------------------------------------------- model
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        attention_dropout=0.0,
    )
    if getattr(config, "rope_parameters", None) is not None:  # transformers 5 keeps rope_theta here
        config.rope_parameters["rope_theta"] = 10000.0
    model = Qwen3ForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: Qwen3ForCausalLM, {n_params / 1e6:.2f}M parameters")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)

    def batch(source: torch.Tensor, generator: torch.Generator, size: int | None = None) -> torch.Tensor:
        size = size or args.batch_size
        starts = torch.randint(0, len(source) - args.seq_len - 1, (size,), generator=generator)
        return torch.stack([source[s : s + args.seq_len] for s in starts.tolist()])

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        vgen = torch.Generator().manual_seed(1234)
        losses = [model(input_ids=(x := batch(val_data, vgen, 8)), labels=x).loss.item() for _ in range(8)]
        model.train()
        return sum(losses) / len(losses)

    # -------------------------------------------------------------- training
    budget_s = args.minutes * 60.0
    total = args.schedule_steps or args.steps
    stop_at = args.steps or total
    probe = 10
    start = time.perf_counter()
    step = 0
    recent: list[float] = []
    loss_value = float("nan")
    while True:
        if total is None and step == probe:
            per_step = (time.perf_counter() - start) / probe
            total = stop_at = max(probe + 1, int(budget_s / per_step * 0.97))
            log(f"{per_step:.2f} s/step -> {total} steps in {args.minutes:g} minutes")
        if stop_at is not None and step >= stop_at:
            break
        if args.steps is None and time.perf_counter() - start > budget_s * 1.1:
            # Well over budget (the machine slowed down): stop here, off the end of the schedule.
            log(f"time budget reached at step {step} of {total}")
            break
        lr = lr_at(step, total or 10**9, args.lr, args.warmup, args.lr * 0.1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x = batch(train_data, gen)
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = loss.item()
        recent.append(loss_value)
        step += 1
        if step % args.log_every == 0 or step == 1:
            avg = sum(recent[-args.log_every :]) / len(recent[-args.log_every :])
            log(f"step {step}/{total or '?'} loss {avg:.3f} lr {lr:.2e} elapsed {time.perf_counter() - start:.0f}s")
    train_minutes = (time.perf_counter() - start) / 60
    final_train = sum(recent[-50:]) / len(recent[-50:])
    final_val = val_loss()
    log(f"done: {step} steps, {train_minutes:.1f} min, train loss (last 50) {final_train:.3f}, val loss {final_val:.3f}")

    # -------------------------------------------------------------- save
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.eval()
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    save_kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4; 5 always writes safetensors
    model.save_pretrained(str(out), **save_kwargs)
    assert (out / "model.safetensors").is_file()

    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=config.max_position_embeddings,
    )
    fast.save_pretrained(str(out), save_jinja_files=False)  # template stays in tokenizer_config.json

    # -------------------------------------------------------------- check + README
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_tok = AutoTokenizer.from_pretrained(str(out))
    ref_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref_model.eval()
    samples = []
    for prompt in ["import os\n", "def main", "class Foo"]:
        inputs = ref_tok(prompt, return_tensors="pt")
        with torch.no_grad():
            output = ref_model.generate(**inputs, max_new_tokens=64, do_sample=False)
        text = ref_tok.decode(output[0], skip_special_tokens=False)
        samples.append((prompt, text))
        log(f"greedy sample from {prompt!r}:\n{text}")

    reproduce = f"--steps {step}" if step == total else f"--steps {step} --schedule-steps {total}"
    size_mb = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    stdlib_version = ".".join(map(str, sys.version_info[:3]))
    sample_md = "\n\n".join(
        f"Prompt `{json.dumps(prompt)}`:\n\n```python\n{text}\n```" for prompt, text in samples
    )
    readme = f"""# tiny-qwen3-stdlib

The default model layerzoo ships inside the package, so that `layerzoo generate --prompt ...` works
on a fresh machine with no download.

It is a ~{n_params / 1e6:.1f}M-parameter model with the Qwen3 architecture (`Qwen3ForCausalLM`: hidden
size 256, 4 layers, 4 attention heads, 2 KV heads, head_dim 64, MLP 768, vocab {vocab}, tied
embeddings, RoPE theta 10000), trained from scratch by `scripts/make_default_model.py` for
{train_minutes:.1f} minutes ({step} steps of {args.batch_size} x {args.seq_len} tokens, one CPU thread) on the
Python source of the CPython {stdlib_version} standard library ({len(texts)} files, {n_bytes / 1e6:.1f} MB; test suites,
idlelib and lib2to3 left out; PSF license). Its tokenizer is a byte-level BPE with {vocab} tokens trained on
the same text; special tokens `<|endoftext|>` (end of text and padding, id {eot}), `<|im_start|>`,
`<|im_end|>`; the chat template is Qwen2.5's.

It writes Python-looking text. It is a demo and a test fixture, not a useful model.

- final training loss: {final_train:.3f} (mean of the last 50 steps); held-out loss: {final_val:.3f}
- weights: bfloat16 safetensors ({size_mb:.1f} MB for the whole folder)
- reproduce: `python scripts/make_default_model.py {reproduce}` (seed {args.seed}; same Python and torch
  versions; built with torch {torch.__version__}, transformers {transformers.__version__})

Greedy samples (transformers `generate`, `do_sample=False`, 64 new tokens):

{sample_md}
"""
    (out / "README.md").write_text(readme, encoding="utf-8")
    log(f"saved to {out} ({size_mb:.1f} MB): {sorted(p.name for p in out.iterdir())}")
    if not args.no_mtp:
        train_mtp_head(args)


if __name__ == "__main__":
    main()
