"""The loop watchdog: detection, re-steering a looping generation, and each reason to decline."""

import pytest

from layerzoo import LLM, SamplingParams, hookimpl
from layerzoo.plugins.manager import get_registry
from layerzoo.runtime.watchdog import WatchdogConfig, loop_start

CONFIG = WatchdogConfig(min_repeats=3, max_period=4, min_loop_tokens=6)

# The embedded demo model, greedy from this prompt, falls into "self._w, self._w, self._w, ...".
LOOPING = "import os\n"
PARAMS = SamplingParams(temperature=0, max_tokens=80)


@pytest.mark.parametrize(
    "tokens,start",
    [
        ([1, 2, 3, 4, 5, 6, 7, 8], None),
        ([9, 1, 2, 1, 2, 1, 2], 1),  # period 2, three times
        ([9, 8, 1, 2, 3, 1, 2, 3, 1, 2, 3], 2),
        ([5, 5, 5, 5, 5, 5], 0),
        ([5, 5, 5], None),  # shorter than min_loop_tokens
        ([3, 1, 2, 1, 2, 7], None),  # the tail is not the repeat
        ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], 0),
        ([2, 1, 2, 1, 2, 1, 2], 0),  # extended back over a partial repeat
    ],
)
def test_loop_start(tokens, start):
    assert loop_start(tokens, CONFIG) == start


@pytest.fixture(scope="module")
def demo():
    return LLM(dtype="float32")


def text_of(llm, params):
    return llm.generate(LOOPING, params)[0]


def test_resteers_a_looping_generation(demo):
    plain = text_of(demo, PARAMS).outputs[0].text
    assert loop_start(demo.tokenizer.encode(plain), WatchdogConfig()) is not None  # it does loop
    before = dict(demo.stats.watchdog)
    out = text_of(demo, SamplingParams(temperature=0, max_tokens=80, loop_watchdog=True))
    assert demo.stats.watchdog.get("resteered", 0) > before.get("resteered", 0)
    assert out.metrics["rollbacks"] >= 1
    assert out.outputs[0].text != plain
    # The kept part is the plain text up to the boundary the rewind went back to.
    common = next(i for i, (a, b) in enumerate(zip(plain, out.outputs[0].text)) if a != b)
    assert plain[:common].rstrip(" ").endswith(("\n", ".", "!", "?")) or common == 0
    assert len(out.outputs[0].token_ids) == 80  # rewound tokens were generated again


def test_leaves_a_normal_generation_alone(demo):
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = text_of(demo, params)
    watched = text_of(demo, SamplingParams(temperature=0, max_tokens=12, loop_watchdog=True))
    assert watched.outputs[0].token_ids == plain.outputs[0].token_ids
    assert watched.metrics["rollbacks"] == 0


def test_declines_once_the_text_was_streamed(demo):
    before = demo.stats.watchdog.get("declined_streamed", 0)
    streamed = "".join(demo.stream(LOOPING, SamplingParams(temperature=0, max_tokens=80, loop_watchdog=True)))
    assert demo.stats.watchdog["declined_streamed"] > before
    assert streamed == text_of(demo, PARAMS).outputs[0].text  # nothing was rewound


def test_cap_per_request(demo):
    before = demo.stats.watchdog.get("resteered", 0)
    out = text_of(demo, SamplingParams(temperature=0, max_tokens=200, loop_watchdog=True))
    assert out.metrics["rollbacks"] <= WatchdogConfig().max_rollbacks
    assert demo.stats.watchdog["resteered"] - before == out.metrics["rollbacks"]


def test_declines_when_a_layer_cannot_rewind(caplog):
    class Unrewindable:
        @hookimpl(tryfirst=True)
        def decode_rollback_unsupported(self, layer_kind):
            return True if layer_kind == "qwen3.decoder" else None

    registry = get_registry()
    registry.add_plugin(Unrewindable(), name="unrewindable")
    try:
        llm = LLM(dtype="float32")
    finally:
        registry.remove_plugin("unrewindable")
    out = llm.generate(LOOPING, SamplingParams(temperature=0, max_tokens=80, loop_watchdog=True))[0]
    assert llm.stats.watchdog.get("declined_not_rewindable", 0) >= 1
    assert out.metrics["rollbacks"] == 0
    assert "layer 0 (Qwen3DecoderLayer, answered by unrewindable)" in caplog.text
