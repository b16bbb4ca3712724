"""For every architecture the installed plugins serve, what transformers' own ``save_pretrained``
writes loads, and prefills to transformers' logits (issue 34).

The plugins' test configs (the conformance kit's) may spell a key as released checkpoints do (Kimi
Linear's nested ``linear_attn_config``); transformers reads such a key and writes it back beside
its own, which hid that its own layout did not load. Here each test config is first built into
transformers' config class and reduced to the fields that class declares, so the checkpoint's
``config.json`` is exactly what a model built and saved with transformers holds.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from layerzoo.engine_args import EngineArgs  # noqa: E402
from layerzoo.loading.model_loading import load_model  # noqa: E402
from layerzoo.plugins.manager import get_registry  # noqa: E402
from layerzoo.testing import prefill_logits  # noqa: E402
from layerzoo.testing.checkpoints import random_transformers_model  # noqa: E402
from layerzoo.testing.conformance import collect_test_configs  # noqa: E402

# Served architectures with no transformers class to write their checkpoints, and why.
NO_TRANSFORMERS_CLASS = {
    "KimiK3ForConditionalGeneration": "Kimi K3 has no transformers implementation (its tests compare "
    "against the plugin's own reference, plugins/kimi_k3/tests/k3_reference.py)",
}


# Served embedding-only architectures (no LM head, so no logits to compare here), and where their
# pooled hidden states are compared with transformers' instead.
EMBEDDING_ONLY = {
    "Qwen3Model": "tests/test_embeddings.py (bare Qwen3Model saves, Qwen3-Embedding's layout)",
}


def served() -> list[str]:
    return sorted(get_registry().architectures.entries)


def kit_config(architecture: str) -> dict:
    (tc,) = [tc for tc in collect_test_configs() if tc.architecture == architecture]
    return {**tc.config, "architectures": [architecture]}


def declared(config_class) -> set[str]:
    """The keys transformers' config class owns: its dataclass fields and what PreTrainedConfig
    always writes (architectures, model_type and the like are fields of the base class)."""
    return {f.name for f in dataclasses.fields(config_class)} | {"model_type"}


def own_layout(hf_config) -> dict:
    """``hf_config`` as a dict of only the fields its class declares (sub-configs likewise): the
    arguments a user of transformers would build this config from."""
    data = hf_config.to_dict()
    out = {}
    for key in declared(type(hf_config)):
        if key not in data:
            continue
        value = getattr(hf_config, key, None)
        out[key] = own_layout(value) if isinstance(value, transformers.PreTrainedConfig) else data[key]
    return out


def write_with_transformers(path, architecture: str):
    """Build the architecture's tiny config in transformers' own layout, a random model of it
    (identity-started parameters perturbed, as the conformance kit's writer does), save it."""
    config = kit_config(architecture)
    model_type = config.pop("model_type")
    built = transformers.AutoConfig.for_model(model_type, **config)
    model = random_transformers_model(type(built)(**own_layout(built)), architecture)
    model.save_pretrained(path)
    return model


def test_every_served_architecture_has_a_transformers_checkpoint_or_a_reason():
    configs = {tc.architecture for tc in collect_test_configs()}
    for architecture in served():
        if architecture in NO_TRANSFORMERS_CLASS:
            continue
        if architecture in EMBEDDING_ONLY:
            assert not get_registry().model_class(architecture).has_lm_head, f"{architecture}: has an LM head"
            assert hasattr(transformers, architecture), f"{architecture}: transformers has no such class"
            continue
        assert architecture in configs, f"{architecture}: no test config to write a checkpoint from"
        assert hasattr(transformers, architecture), f"{architecture}: transformers {transformers.__version__} has no such class"


@pytest.mark.parametrize("architecture", [a for a in served() if a not in NO_TRANSFORMERS_CLASS and a not in EMBEDDING_ONLY])
def test_what_transformers_writes_loads_and_matches(architecture, tmp_path):
    hf_model = write_with_transformers(tmp_path, architecture)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [architecture]
    model = load_model(tmp_path, EngineArgs(dtype="float32")).model
    vocab = saved.get("text_config", saved).get("vocab_size") or saved["vocab_size"]
    ids = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0].float()
    got = prefill_logits(model, ids, [24])
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, atol=1e-4 * max(scale, 1.0), rtol=0)
