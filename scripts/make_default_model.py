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
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
