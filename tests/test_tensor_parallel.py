"""The model side of tensor parallelism in the core: shard descriptions, the loader reading only a
rank's slices, strict errors under a split, one rank building today's layers, and the rank harness.

In-process tests build and load as one rank with `pretend_rank` (no process group: the loader
needs none); `run_on_ranks` tests spawn real gloo ranks. Whole-model parity on 2 ranks lives with
the plugins (plugins/qwen3, plugins/ssm tests/test_tensor_parallel.py).
"""

import json
import multiprocessing
import shutil

import pytest
import torch
from torch import nn

from layerzoo.distributed.sharding import Shard, parameter_shards
from layerzoo.errors import CheckpointError, ConfigError
from layerzoo.loading.loader import Checkpoint
from layerzoo.loading.model_loading import load_model
from layerzoo.testing.distributed import RankFailed, pretend_rank, run_on_ranks


def test_shard_ranges_split_each_section_and_pad_the_last_piece():
    fused = Shard(0, (8, 4, 4), index=1, count=2)  # [q | k | v]: each split by head
    assert fused.ranges() == [(4, 8), (10, 12), (14, 16)] and fused.local_size == 8
    vocab = Shard(0, (7,), index=1, count=2)
    assert vocab.ranges() == [(4, 7)] and vocab.local_size == 4  # one padding row
    assert vocab.full_shape((4, 3)) == (7, 3)


def test_one_rank_builds_exactly_todays_layers(tiny_qwen3_dir, monkeypatch):
    monkeypatch.setenv("LAYERZOO_CPU_PACKED_LINEAR", "0")  # the plain linears, not their packed method
    model = load_model(tiny_qwen3_dir).model
    assert parameter_shards(model) == {}
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear
    assert model.lm_head.out_features == 64
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)


def test_rank_loads_only_its_slices(tiny_qwen3_dir, monkeypatch):
    """Rank 1 of 2 holds rows [16, 32) of q_proj, KV head 1, the second half of the vocabulary,
    and never reads a split tensor whole."""
    monkeypatch.setenv("LAYERZOO_CPU_PACKED_LINEAR", "0")
    whole = []
    get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: whole.append(name) or get(self, name))
    with pretend_rank(1, 2):
        model = load_model(tiny_qwen3_dir).model
    read_whole = set(whole)  # what the load read whole
    ckpt = Checkpoint.open(tiny_qwen3_dir)
    attn = model.layers[0].self_attn
    torch.testing.assert_close(attn.q_proj.weight, ckpt.get("model.layers.0.self_attn.q_proj.weight")[16:32])
    torch.testing.assert_close(attn.k_proj.weight, ckpt.get("model.layers.0.self_attn.k_proj.weight")[8:16])
    torch.testing.assert_close(attn.o_proj.weight, ckpt.get("model.layers.0.self_attn.o_proj.weight")[:, 16:32])
    torch.testing.assert_close(model.model.embed_tokens.weight, ckpt.get("model.embed_tokens.weight")[32:])
    torch.testing.assert_close(model.layers[0].mlp.down_proj.weight, ckpt.get("model.layers.0.mlp.down_proj.weight")[:, 24:])
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1) and model.kv_cache_specs()[0].num_kv_heads == 1
    split = set(parameter_shards(model))
    assert split and not split & read_whole, sorted(split & read_whole)
    assert "model.norm.weight" in read_whole  # replicated tensors are read whole


def test_rank_shape_mismatch_names_key_and_full_shape(tiny_qwen3_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 64  # the checkpoint's MLP has 48
    (broken / "config.json").write_text(json.dumps(config))
    with pretend_rank(0, 2), pytest.raises(CheckpointError) as error:
        load_model(broken)
    message = str(error.value)
    assert "key 'model.layers.0.mlp.down_proj.weight' has shape (32, 48), expected (32, 64)" in message
    assert "split across tensor-parallel ranks" in message


def test_heads_that_do_not_split_are_refused(tiny_qwen3_dir, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(tiny_qwen3_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    config.update(num_attention_heads=3, num_key_value_heads=3)
    (odd / "config.json").write_text(json.dumps(config))
    with pretend_rank(0, 2), pytest.raises(ConfigError, match=r"attention of layer 0 has 3 heads.*2 ranks"):
        load_model(odd)


def test_experts_and_kv_heads_that_do_not_split_are_refused():
    from layerzoo.layers.moe import StackedExperts
    from layerzoo.layers.parallel_linear import kv_heads_shard

    with pretend_rank(0, 4):
        with pytest.raises(ConfigError, match=r"tensor_parallel_size=4: the MoE's routed experts \(6\) does not split into 4"):
            StackedExperts(6, 8, 4)
        with pytest.raises(ConfigError, match=r"3 KV heads cannot be replicated evenly over 4 ranks"):
            kv_heads_shard(3, 8)
        assert kv_heads_shard(2, 8)[0] == 1 and kv_heads_shard(2, 8)[1].index == 0  # ranks 0, 1 share KV head 0
    with pretend_rank(3, 4):
        assert kv_heads_shard(2, 8)[1].ranges() == [(8, 16)]  # ranks 2, 3 share KV head 1


def test_a_layer_class_that_does_not_split_is_refused_at_load(tiny_qwen3_dir, monkeypatch):
    """A plugin's layer that never declared ``tensor_parallel`` (here a Qwen3 layer subclass keeping
    its own state: the flag is not inherited) stops a 2-rank load, naming layer, kind and class."""
    from layerzoo.errors import UserError
    from layerzoo.testing import running_sum_layer
    from layerzoo_qwen3.model import Qwen3DecoderLayer, Qwen3ForCausalLM

    monkeypatch.setattr(Qwen3ForCausalLM, "decoder_layer", running_sum_layer(Qwen3DecoderLayer))
    load_model(tiny_qwen3_dir)  # one rank: nothing to split
    with pretend_rank(0, 2), pytest.raises(UserError, match=r"layer 0 of kind 'qwen3.decoder' \(RunningSum\w+\) cannot be sharded"):
        load_model(tiny_qwen3_dir)


def test_ranks_run_collectives_and_a_failure_names_the_rank():
    assert [r.tolist() for r in run_on_ranks("layerzoo.distributed.parallel_state:all_reduce", torch.ones(2))] == [[2.0, 2.0]] * 2
    with pytest.raises(RankFailed, match=r"rank \d failed:(.|\n)*does not split evenly"):
        run_on_ranks("layerzoo.distributed.parallel_state:divide", 3, 2)
    assert not multiprocessing.active_children()


def test_ranks_past_the_deadline_are_killed():
    with pytest.raises(RankFailed, match=r"did not finish within 1 s"):
        run_on_ranks("time:sleep", 600, timeout=1)
    assert not multiprocessing.active_children()
