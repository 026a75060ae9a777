"""RoBERTa-LoRA and GPT-2 through ``fedlight.fit``: every rule of FedAdamW's Table 3 runs a round, only adapters and
the head move, the bytes are the adapters', stacked equals sequential, FedAdamW's RoBERTa blocks."""

from __future__ import annotations

import math

import pytest
import torch
from nlp_fixtures import tiny_roberta

import fedlight
from fedlight.algorithms import FedAdamW
from fedlight.algorithms.fedadamw import make_partition
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.registry import get_algorithm
from fedlight.data import GLUE, IID, Shakespeare
from fedlight.errors import ConfigError
from fedlight.models import HFCausalLM, HFLoRA, HFSequenceClassifier
from fedlight.runners import guard

TABLE3 = ("fedavg", "scaffold", "fedcm", "local_adam", "fedadam", "fedlada", "local_adamw", "fedadamw")
R = 4  # LoRA rank of the tests


def model(tokenizer, dropout=0.0, **kw):
    torch.manual_seed(0)
    return HFSequenceClassifier(config=tiny_roberta(len(tokenizer), dropout), lora=HFLoRA(rank=R, alpha=8.0,
                                dropout=0.0), **kw)


def glue(root, tokenizer, task="sst2", clients=4):
    return GLUE(task, tokenizer=tokenizer, root=str(root), num_clients=clients, batch_size=8, partition=IID())


def fit(m, data, algorithm, tmp_path, name, **loop):
    cfg = dict(rounds=1, clients_per_round=2, local_steps=2, lr=1e-3, progress=False, eval_every=1)
    return fedlight.fit(m, data, algorithm, loop=LoopConfig(**{**cfg, **loop}), out_dir=str(tmp_path / name))


def test_lora_trains_adapters_and_classifier_only(tokenizer):
    m = model(tokenizer)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert all(".lora_" in n or n.startswith("model.classifier.") for n in names)
    # per layer: query and value each get A [r, 32] and B [32, r]; the head: dense 32×32 + 32, out_proj 2×32 + 2
    assert sum(p.numel() for p in P.trainable(m).values()) == 2 * 2 * (2 * R * 32) + (32 * 32 + 32) + (2 * 32 + 2)
    assert len(names) == 2 * 2 * 2 + 4


@pytest.mark.parametrize("rule", TABLE3)
def test_every_table3_rule_runs_a_round_and_moves_only_adapters_and_head(rule, glue_root, tokenizer, tmp_path):
    m = model(tokenizer)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    summary = fit(m, glue(glue_root, tokenizer), get_algorithm(rule).cls(), tmp_path, rule,
                  lr=0.1 if rule in ("fedavg", "scaffold", "fedcm", "fedadam") else 1e-3)
    assert math.isfinite(summary["final_train_loss"]) and 0 <= summary["final_test_acc"] <= 1
    assert {"final_test_f1", "final_test_mcc"} <= set(summary)
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert moved and not moved & frozen, sorted(moved & frozen)[:3]
    assert any("lora_B" in n for n in moved) and any("classifier" in n for n in moved)


def test_bytes_per_round_are_the_adapters(glue_root, tokenizer, tmp_path):
    m = model(tokenizer)
    n = sum(p.numel() for p in P.trainable(m).values())
    backbone = sum(p.numel() for p in m.parameters())
    s = fit(m, glue(glue_root, tokenizer), get_algorithm("fedavg").cls(), tmp_path, "bytes", rounds=2)
    assert s["bytes_up"] == 4 * n * 2 * 2 and s["bytes_down"] == 4 * n * 2 * 2  # float32 × clients × rounds
    assert s["bytes_up"] < 4 * backbone * 2 * 2 / 10


@pytest.mark.parametrize("rule", TABLE3)
def test_stacked_clients_equal_sequential_ones(rule, glue_root, tokenizer, tmp_path):
    """The two runners compute the same function, so they agree to float64 rounding. In float32 they do not agree to
    any tolerance that means something: under vmap SDPA has no batching rule and runs another kernel than one client's
    call, and Adam-type rules turn those float32 rounding differences in near-zero gradient elements into steps of
    ``lr`` (transformers 5.24 / torch 2.14: 2.9e-5 against 1e-6 for Local AdamW). So both run in ``64-true``."""
    out = {}
    for mode in ("sequential", "vmap"):
        m = model(tokenizer)
        fedlight.fit(m, glue(glue_root, tokenizer), get_algorithm(rule).cls(), precision="64-true",
                     loop=LoopConfig(rounds=2, clients_per_round=2, local_steps=2, lr=1e-3, progress=False,
                                     eval_every=1, client_parallelism=mode), out_dir=str(tmp_path / f"{rule}-{mode}"))
        out[mode] = P.clone(P.trainable(m))
    for k, v in out["sequential"].items():
        assert v.dtype == torch.float64
        torch.testing.assert_close(out["vmap"][k], v, rtol=0, atol=1e-12)


def test_vmap_chunk_auto_sizes_glue_dict_batches_with_the_task(glue_root, tokenizer, tmp_path, monkeypatch, capsys):
    """``vmap_chunk: auto`` measures one client's footprint with the run's task (TextClassification on dict batches;
    it used to unpack ``x, y = batch`` from a cross-entropy default and fail) and trains the chunks it chose: the
    same numbers as one client after another."""
    from fedtest import spy_auto_chunk

    seen = spy_auto_chunk(monkeypatch, chunk=2)
    out = {}
    for mode, chunk in (("sequential", None), ("vmap", "auto")):
        m = model(tokenizer)
        fit(m, glue(glue_root, tokenizer), get_algorithm("fedavg").cls(), tmp_path, mode, client_parallelism=mode,
            vmap_chunk=chunk, clients_per_round=3, lr=0.1)
        out[mode] = P.clone(P.trainable(m))
    (batch, objective, nbytes), = seen
    assert isinstance(batch, dict) and {"input_ids", "labels"} <= set(batch)
    assert objective.args[1].__self__.__class__.__name__ == "TextClassification"
    assert nbytes > guard.PARAM_COPIES * 4 * sum(v.numel() for v in out["vmap"].values())  # activations counted
    assert "loop.vmap_chunk auto: 2 clients per chunk" in capsys.readouterr().err
    for k, v in out["sequential"].items():
        torch.testing.assert_close(out["vmap"][k], v, rtol=1e-4, atol=1e-6)


def test_gpt2_stacked_equals_sequential(shakespeare_root, tmp_path):
    out = {}
    for mode in ("sequential", "vmap"):
        m = gpt2()
        fit(m, Shakespeare(root=str(shakespeare_root), batch_size=4), FedAdamW(), tmp_path, mode, rounds=2,
            client_parallelism=mode)
        out[mode] = P.clone(P.trainable(m))
    for k, v in out["sequential"].items():
        torch.testing.assert_close(out["vmap"][k], v, rtol=1e-4, atol=1e-6)


def test_fedadamw_hessian_blocks_follow_appendix_d_on_roberta(tokenizer):
    full = HFSequenceClassifier(config=tiny_roberta(len(tokenizer)))
    shapes = {k: tuple(v.shape) for k, v in P.trainable(full).items()}
    part = make_partition(shapes, "hessian", head_dim=16, min_block_size=1)
    layer = "model.roberta.encoder.layer.0."
    assert part[layer + "attention.self.query.weight"] == [(2, 16 * 32)]  # per head (2 heads of 16 rows)
    assert part[layer + "attention.self.key.weight"] == [(2, 16 * 32)]
    assert part[layer + "attention.self.value.weight"] == [(32, 32)]  # per output neuron
    assert part[layer + "attention.output.dense.weight"] == [(32, 32)]
    assert part[layer + "intermediate.dense.weight"] == [(64, 32)] and part[layer + "output.dense.weight"] == [(32, 64)]
    assert part["model.roberta.embeddings.word_embeddings.weight"] == [(len(tokenizer), 32)]  # per token
    assert part["model.classifier.out_proj.weight"] == [(2, 32)]  # per class
    assert part[layer + "attention.self.query.bias"] == [(1, 32)]  # everything else: one block
    lora = {k: tuple(v.shape) for k, v in P.trainable(model(tokenizer)).items()}
    part = make_partition(lora, "hessian", head_dim=16, min_block_size=1)
    q = layer + "attention.self.query.lora_"
    assert part[q + "B.default.weight"] == [(2, 16 * R)] and part[q + "A.default.weight"] == [(1, R * 32)]
    assert part[layer + "attention.self.value.lora_B.default.weight"] == [(32, R)]
    assert make_partition(lora, "tensor")[q + "B.default.weight"] == [(1, 32 * R)]  # Appendix D.3: per matrix


def test_fedadamw_hessian_refuses_a_wrong_head_dim(glue_root, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="head_dim"):
        fit(model(tokenizer), glue(glue_root, tokenizer), FedAdamW(blocks="hessian", head_dim=64), tmp_path, "hd")
    s = fit(model(tokenizer), glue(glue_root, tokenizer), FedAdamW(blocks="hessian", head_dim=16, min_block_size=1),
            tmp_path, "hd16")
    assert math.isfinite(s["final_train_loss"])


def gpt2():
    torch.manual_seed(0)
    return HFCausalLM(config={"model_type": "gpt2", "vocab_size": 80, "n_positions": 80, "n_embd": 16, "n_layer": 1,
                              "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}, dropout=0.0)


@pytest.mark.parametrize("rule", ["fedavg", "local_adamw", "fedadamw"])
def test_gpt2_on_shakespeare_runs_figure1_rules(rule, shakespeare_root, tmp_path):
    data = Shakespeare(root=str(shakespeare_root), batch_size=4)
    s = fit(gpt2(), data, get_algorithm(rule).cls(), tmp_path, rule, lr=0.1 if rule == "fedavg" else 1e-3)
    assert s["headline"]["metric"] == "test_perplexity"
    assert 1 < s["final_test_perplexity"] < 200 and 0 <= s["final_test_token_acc"] <= 1  # random init: ≈ 80
    assert abs(math.log(s["final_test_perplexity"]) - s["final_test_loss"]) < 1e-4


def test_bench_lora_row_counts_adapter_bytes_and_adapter_sized_client_state(capsys):
    from fedlight.lab.benchmarks import cli as bench

    assert bench.main(["--lora", "--tiny", "--no-vmap"]) == 0
    out = capsys.readouterr().out
    assert "roberta-lora tiny" in out and "stateful SCAFFOLD clients" in out
    from fedlight.lab.benchmarks.nlp import lora

    r = lora("tiny", clients=2, steps=1, batch=4, seq=16, reps=1, warmup=0, stateful=4)
    n = r["trainable_params"]  # 2 layers × (q, v) × (A + B) at r 16, width 32; head 32·32 + 32 + 2·32 + 2
    assert n == 2 * 2 * 2 * 16 * 32 + 1122 and r["total_params"] > 300 * n
    assert r["bytes_up_per_round"] == r["bytes_down_per_round"] == 4 * n * 2
    assert r["stateful_clients"] == 4 and r["state_bytes"] == 4 * 4 * n  # SCAFFOLD's c_i: adapter-sized
