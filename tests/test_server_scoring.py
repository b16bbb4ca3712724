"""Scoring through `layerzoo serve`: completions ``echo`` with ``logprobs`` (the prompt's tokens
scored, as OpenAI's legacy API and vLLM do), ``max_tokens: 0`` scoring the prompt alone (what
lm-eval-harness's loglikelihood requests send), checked against the offline engine's
``prompt_logprobs`` on the embedded model.
"""

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


MODEL = "layerzoo"
TOL = 1e-4


def scored(offline, prompt, k=1):
    """The offline engine's prompt logprobs of ``prompt`` (text or ids): (ids, entries)."""
    from layerzoo.sampling import SamplingParams

    given = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    out = offline.generate(given, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k))[0]
    return out.prompt_token_ids, out.prompt_logprobs


def check_prompt_logprobs(offline, lp, ids, entries, k):
    """The first ``len(ids)`` positions of an OpenAI ``logprobs`` object score the prompt as the
    offline engine does: the first token null, then each token's logprob and the top-k."""
    n = len(ids)
    assert lp.tokens[:n] == [offline.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(entries[i][ids[i]], abs=TOL), i
        want = sorted(entries[i].items(), key=lambda kv: -kv[1])[:k]
        got = lp.top_logprobs[i]
        assert len(got) == k
        assert sorted(got.values(), reverse=True) == pytest.approx([v for _, v in want], abs=TOL)
    assert lp.text_offset[0] == 0
    for i in range(1, len(lp.tokens)):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


def test_echo_max_tokens_0_scores_the_prompt_alone(client, offline):
    prompt = "import os\nimport sys\n"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    (choice,) = r.choices
    ids, entries = scored(offline, prompt, k=2)
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)  # nothing generated is returned
    check_prompt_logprobs(offline, choice.logprobs, ids, entries, 2)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0


def test_echo_of_token_id_prompts_in_a_batch(client, offline):
    prompts = [[1, 2, 3, 4, 5], [40, 41, 42]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt in zip(r.choices, prompts):
        ids, entries = scored(offline, prompt)
        assert ids == prompt
        assert choice.text == offline.tokenizer.decode(prompt, skip_special_tokens=False)
        check_prompt_logprobs(offline, choice.logprobs, ids, entries, 1)


def test_echo_with_generation_puts_the_prompt_first(client, offline):
    from layerzoo.sampling import SamplingParams

    prompt = "def add(a, b):\n"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=1)
    (choice,) = r.choices
    out = offline.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=1))[0]
    gen = out.outputs[0]
    assert choice.text == prompt + gen.text
    ids, entries = scored(offline, prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + len(gen.token_ids)
    check_prompt_logprobs(offline, lp, ids, entries, 1)
    for got, tid, entry in zip(lp.token_logprobs[len(ids):], gen.token_ids, gen.logprobs):
        assert got == pytest.approx(entry[tid], abs=TOL)
    # echo without logprobs: the text only
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert plain.choices[0].text == prompt + gen.text and plain.choices[0].logprobs is None


def test_streamed_echo_equals_the_plain_answer(server, client):
    body = {"model": MODEL, "prompt": "class Point:\n", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    plain = client.completions.create(**body).choices[0]
    for max_tokens in (4, 0):
        want = plain if max_tokens else client.completions.create(**{**body, "max_tokens": 0}).choices[0]
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "max_tokens": max_tokens, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks]
        assert "".join(c["text"] for c in choices) == want.text
        joined = {key: sum((c["logprobs"][key] for c in choices), []) for key in ("tokens", "token_logprobs", "text_offset")}
        assert joined["tokens"] == want.logprobs.tokens and joined["text_offset"] == want.logprobs.text_offset
        assert joined["token_logprobs"][0] is None
        assert joined["token_logprobs"][1:] == pytest.approx(want.logprobs.token_logprobs[1:], abs=TOL)
        assert choices[-1]["finish_reason"] == "length"


def test_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert exc.value.body["param"] == "max_tokens" and "echo" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    assert exc.value.body["param"] == "suffix"
