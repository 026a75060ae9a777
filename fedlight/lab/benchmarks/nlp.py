"""``tools/bench.py --lora``: RoBERTa + LoRA on GLUE-shaped batches (the ``nlp`` extra).

A RoBERTa of the chosen size (``tiny``: 2 layers of width 32, the test model; ``small``: 4 × 256; ``base``:
RoBERTa-Base's architecture, for a GPU), randomly initialised, LoRA r = 16 on query and value, fed random token ids
through fedlight's own :class:`~fedlight.data.GLUE` batch path. Reported: seconds and tokens per second per round
(padded tokens, what the model computes, and the non-padding ones), bytes up/down per round, and the per-client
state of ``stateful`` SCAFFOLD clients (its ``c_i``) — which must be adapter-sized, not model-sized — with the
process's peak RSS.
"""

from __future__ import annotations

import shutil
import statistics
import time
from typing import Any

import numpy as np
import torch

SIZES = {
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}


def _config(size: str, seq: int) -> dict[str, Any]:
    return {"model_type": "roberta", "vocab_size": 50265, "max_position_embeddings": seq + 2, "type_vocab_size": 1,
            "pad_token_id": 1, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **SIZES[size]}


def _data(n: int, seq: int, clients: int, batch: int, vocab: int):
    from fedlight.data import IID
    from fedlight.data.glue import GLUE

    class RandomTokens(GLUE):
        """GLUE's batch path over random token ids (lengths between seq/2 and seq, padded with id 1)."""

        vocab_size, pad_token_id = vocab, 1

        def _load(self, train, keep, rng):
            g = np.random.default_rng(1 if train else 2)
            lengths = g.integers(seq // 2, seq + 1, size=n)
            mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
            ids = np.where(mask == 1, g.integers(3, vocab, size=(n, seq)), 1)
            x = torch.from_numpy(np.stack([ids, mask], 1))
            return x, torch.from_numpy(g.integers(0, 2, size=n))

    return RandomTokens("sst2", tokenizer=None, num_clients=clients, batch_size=batch, partition=IID())


def _task():
    from fedlight.tasks import TextClassification

    return TextClassification(num_classes=2)


def _model(size: str, seq: int):
    from fedlight.models.hf import HFLoRA, HFSequenceClassifier

    torch.manual_seed(0)
    return HFSequenceClassifier(config=_config(size, seq), lora=HFLoRA(rank=16, alpha=32.0, dropout=0.0))


def lora(size: str = "tiny", clients: int = 4, steps: int = 10, batch: int = 32, seq: int = 128, reps: int = 3,
         warmup: int = 1, stateful: int = 20, accelerator: str = "cpu", precision: str = "32-true") -> dict[str, Any]:
    """Time FedAvg rounds of RoBERTa-LoRA and measure the state of ``stateful`` SCAFFOLD clients."""
    from fedlight.core import params as P
    from fedlight.lab.benchmarks.workload import Workload, fedlight_loop, peak_rss_mb, rss_now_mb, timed

    w = Workload("mlp", clients=clients, steps=steps, batch=batch, lr=0.1)
    model = _model(size, seq)
    trainable = sum(p.numel() for p in P.trainable(model).values())
    total = sum(p.numel() for p in model.parameters())
    data = _data(clients * steps * batch, seq, clients, batch, 50265)
    if accelerator == "cuda":
        torch.cuda.reset_peak_memory_stats()
    loop = fedlight_loop(model, None, w, accelerator, precision, data=data, task=_task())
    rows, times = [], []
    for r in range(warmup + reps):
        row: dict[str, Any] = {}
        t = timed(lambda: row.update(loop.run_round(r)), loop.device)  # noqa: B023 - called at once
        if r >= warmup:
            rows.append(row)
            times.append(t)
    s = statistics.median(t[0] for t in times)
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if accelerator == "cuda" else None
    padded = clients * steps * batch * data._train_x.shape[-1]
    real = float(data._train_x[:, 1].sum()) / len(data._train_x) * clients * steps * batch
    shutil.rmtree(loop.out_dir, ignore_errors=True)
    return {"size": size, "clients": clients, "steps": steps, "batch": batch, "seq": seq, "reps": reps,
            "trainable_params": trainable, "total_params": total, "s_per_round": s, "peak_gpu_mb": peak_gpu,
            "runner": f"{getattr(loop.runner, 'description', loop.runner.name)} ({loop.runner_reason})",
            "cpu_s_per_round": statistics.median(t[1] for t in times), "tokens_per_s_padded": padded / s,
            "tokens_per_s_real": real / s, "bytes_up_per_round": rows[-1]["bytes_up"],
            "bytes_down_per_round": rows[-1]["bytes_down"], **_stateful(size, seq, stateful, accelerator, precision),
            "peak_rss_mb": peak_rss_mb(), "rss_now_mb": rss_now_mb()}


def _stateful(size: str, seq: int, clients: int, accelerator: str, precision: str) -> dict[str, Any]:
    """One round of SCAFFOLD with ``clients`` clients, all sampled: every client then holds its ``c_i``."""
    from fedlight.lab.benchmarks.workload import Workload, fedlight_loop, rss_now_mb

    w = Workload("mlp", clients=clients, steps=1, batch=4, lr=0.1)
    before = rss_now_mb()
    t = time.perf_counter()
    loop = fedlight_loop(_model(size, seq), None, w, accelerator, precision, algorithm="scaffold",
                         data=_data(clients * 4, seq, clients, 4, 50265), task=_task())
    loop.run_round(0)
    out = {"stateful_clients": len(loop.store), "state_bytes": loop.store.mem_bytes,
           "state_bytes_per_client": loop.store.mem_bytes / max(len(loop.store), 1),
           "stateful_round_s": time.perf_counter() - t, "stateful_rss_growth_mb": rss_now_mb() - before}
    shutil.rmtree(loop.out_dir, ignore_errors=True)
    return out


def report_lines(r: dict[str, Any]) -> list[str]:
    return [f"roberta-lora {r['size']} ({r['total_params']:,} parameters, {r['trainable_params']:,} trainable: "
            f"LoRA r16 on query/value + classifier): {r['clients']} clients x {r['steps']} steps x batch {r['batch']}"
            f" x {r['seq']} tokens: {r['s_per_round']:.3f} s/round (CPU {r['cpu_s_per_round']:.3f}), "
            f"{r['tokens_per_s_padded']:,.0f} tokens/s ({r['tokens_per_s_real']:,.0f} non-padding), "
            f"{r['bytes_up_per_round']:,} bytes up / {r['bytes_down_per_round']:,} down per round; runner "
            f"{r.get('runner', '-')}; peak GPU memory "
            f"{'-' if r.get('peak_gpu_mb') is None else format(r['peak_gpu_mb'], ',.0f') + ' MB'}",
            f"  {r['stateful_clients']} stateful SCAFFOLD clients hold {r['state_bytes']:,} bytes of c_i "
            f"({r['state_bytes_per_client']:,.0f} per client; the adapters + head are {4 * r['trainable_params']:,} "
            f"bytes, the whole model {4 * r['total_params']:,}); RSS growth {r['stateful_rss_growth_mb']:.0f} MB, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB"]
