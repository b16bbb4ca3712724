"""Greedy parity of random Qwen3-Next / Qwen3.5 / Mamba2 shapes beyond the test suite, with a prefix-cache
hit on every one: two requests sharing part of a prompt, chunked at odd budgets, against transformers.

    python scripts/ssm_parity_sweep.py

Uses the ssm plugin test suite's checkpoint builders (transformers is needed, as for the tests).
"""
import importlib.util, random, tempfile, sys, torch, transformers
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
c = load("c", "plugins/ssm/tests/conftest.py")
t = load("t", "plugins/ssm/tests/test_gdn_parity.py")
import types
ssm = types.SimpleNamespace(save_tiny=c.save_tiny, next_config=c.next_config, qwen3_5_text_config=c.qwen3_5_text_config)
from layerzoo import LLM, SamplingParams
sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ok = 0; total = 0
def check(model_cls, config, seed, label):
    global ok, total
    d = tempfile.mkdtemp()
    hf = c.save_tiny(d, model_cls, config, seed=seed)
    V = config.vocab_size
    rng = random.Random(seed)
    A = [rng.randrange(V) for _ in range(rng.randrange(66, 140))]
    B = A[: rng.randrange(33, len(A))] + [rng.randrange(V) for _ in range(rng.randrange(5, 30))]
    short = [rng.randrange(V) for _ in range(5)]
    llm = LLM(d, dtype="float32", max_num_batched_tokens=rng.choice([24, 37, 50]), block_size=rng.choice([8, 16]), max_model_len=512, ssm_snapshot_interval=1)
    o1 = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": A}, {"prompt_token_ids": short}], sp)]
    o2 = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": B}, {"prompt_token_ids": short}], sp)]
    exp = [t.hf_greedy(hf, p, 10) for p in (A, short, B, short)]
    good = o1 + o2 == exp
    st = llm.engine.stats
    total += 1; ok += good
    print(label, seed, "identical" if good else "DIFF", "snapshot hits", st.state_snapshot_hits, "prefix hits", st.prefix_cache_hits, flush=True)
for seed in range(3, 13):
    cls, cfg = t.random_config(seed, ssm)
    check(cls, cfg, seed, cls.__name__)
for seed in range(6):
    rng = random.Random(seed)
    hd = rng.choice([8, 12, 16]); heads = rng.choice([4, 6, 8]); groups = rng.choice([g for g in (1, 2) if heads % g == 0])
    cfg = transformers.Mamba2Config(vocab_size=rng.randrange(100, 200), hidden_size=hd * heads // 2, num_hidden_layers=rng.randrange(1, 4),
        state_size=rng.choice([4, 8, 16]), head_dim=hd, num_heads=heads, expand=2, n_groups=groups, conv_kernel=rng.choice([2, 3, 4]),
        chunk_size=rng.choice([16, 32, 64]), tie_word_embeddings=rng.random() < 0.5, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    check(transformers.Mamba2ForCausalLM, cfg, seed, "Mamba2")
print(f"{ok}/{total} identical")
