"""Bad input is one ConfigError naming the fix (exit 2 from the CLI), before round 1; the GLUE recipe and the Table 3
spec run end to end on the offline fixtures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from nlp_fixtures import make_tokenizer, tiny_roberta

import fedlight
from fedlight.config import cli
from fedlight.core.loop_config import LoopConfig
from fedlight.data import GLUE, IID
from fedlight.errors import ConfigError
from fedlight.models import HFLoRA, HFSequenceClassifier

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "fedadamw_robertalora_glue_dir0.8.yaml")


def fit(model, data, tmp_path):
    loop = LoopConfig(rounds=1, clients_per_round=2, local_steps=1, lr=1e-3, progress=False)
    return fedlight.fit(model, data, loop=loop, out_dir=str(tmp_path / "run"))


def test_unknown_glue_task_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="cola, sst2, mrpc, qqp, qnli, rte, mnli"):
        GLUE("sst-5", tokenizer="unused")


def test_a_local_folder_missing_a_split_is_named(tmp_path, tokenizer, glue_root):
    (tmp_path / "RTE").mkdir()
    (tmp_path / "RTE" / "train.tsv").write_bytes((glue_root / "RTE" / "train.tsv").read_bytes())
    model = HFSequenceClassifier(config=tiny_roberta(len(tokenizer)))
    with pytest.raises(ConfigError, match=r"lacks the validation split; expected dev.tsv"):
        fit(model, GLUE("rte", tokenizer=tokenizer, root=str(tmp_path), num_clients=2, partition=IID()), tmp_path)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tokenizer_of_another_model_is_refused(tmp_path, tokenizer, glue_root):
    small = HFSequenceClassifier(config={**tiny_roberta(len(tokenizer)), "vocab_size": len(tokenizer) - 5})
    with pytest.raises(ConfigError, match=r"vocabulary \(25 tokens\) is larger than the model's embedding \(20"):
        fit(small, GLUE("sst2", tokenizer=tokenizer, root=str(glue_root), num_clients=2, partition=IID()), tmp_path)
    other_pad = HFSequenceClassifier(config={**tiny_roberta(len(tokenizer)), "pad_token_id": 0})
    with pytest.raises(ConfigError, match="pads with id 1 but the model's padding id is 0"):
        fit(other_pad, GLUE("sst2", tokenizer=tokenizer, root=str(glue_root), num_clients=2, partition=IID()),
            tmp_path)


def test_a_head_of_the_wrong_size_names_num_labels(tmp_path, tokenizer, glue_root):
    two = HFSequenceClassifier(config=tiny_roberta(len(tokenizer)), num_labels=2)
    with pytest.raises(ConfigError, match="outputs 2 scores per sample but the data has 3 classes; set "
                                          "`--model.init_args.num_labels 3`"):
        fit(two, GLUE("mnli", tokenizer=tokenizer, root=str(glue_root), num_clients=2, partition=IID()), tmp_path)


def test_lora_targets_absent_from_the_model_list_the_names(tokenizer):
    with pytest.raises(ConfigError, match=r"\['q_proj'\] match no module.*named dense, key, out_proj, query, value"):
        HFSequenceClassifier(config=tiny_roberta(len(tokenizer)), lora=HFLoRA(target_modules=["query", "q_proj"]))


def test_hub_names_offline_ask_for_a_local_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-cache"))
    with pytest.raises(ConfigError, match="give a local directory"):
        HFSequenceClassifier(name="roberta-base")
    data = GLUE("rte", tokenizer="roberta-base", root=str(tmp_path))
    with pytest.raises(ConfigError, match="give a local directory"):
        data.get_tokenizer()
    with torch.device("meta"):  # shape-only instantiation (the recipe tests) needs no weights and no network
        m = HFSequenceClassifier(name="roberta-base", lora=HFLoRA())
    trained = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert m.vocab_size == 50265 and trained == 12 * 2 * (2 * 16 * 768) + 592_130  # q/v adapters + classifier


def test_cli_exit_2_for_a_bad_task(capsys, model_dir):
    assert cli.main(["fit", "--config", RECIPE, "--model.init_args.name", str(model_dir), "--data.init_args.task",
                     "stsb"]) == 2
    assert "is not a GLUE task" in capsys.readouterr().err


def test_the_glue_recipe_runs_end_to_end_on_local_folders(model_dir, glue_root, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["fit", "--config", RECIPE, "--model.init_args.name", str(model_dir), "--data.init_args.tokenizer",
            str(model_dir), "--data.init_args.root", str(glue_root), "--data.init_args.num_clients", "4",
            "--data.init_args.batch_size", "8", "--loop.rounds", "1", "--loop.clients_per_round", "2",
            "--loop.local_steps", "2", "--loop.progress", "false", "--out_dir", str(out)]
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["headline"]["metric"] == "test_acc" and 0 <= summary["final_test_acc"] <= 1
    assert cli.main([*argv[:-2], "--data.init_args.task", "cola", "--out_dir", str(tmp_path / "cola")]) == 0
    assert json.loads((tmp_path / "cola" / "summary.json").read_text())["headline"]["metric"] == "test_mcc"
    bad = make_tokenizer()
    bad.add_tokens([f"extra{i}" for i in range(30)])
    bad.save_pretrained(tmp_path / "bad-tok")
    assert cli.main([*argv[:-2], "--data.init_args.tokenizer", str(tmp_path / "bad-tok"), "--out_dir",
                     str(tmp_path / "bad")]) == 2
    assert "larger than the model's embedding" in capsys.readouterr().err


def test_table3_reproduces_a_shrunk_cell_offline(model_dir, glue_root, tmp_path):
    from fedlight.lab.tables.reproduce import cmd_reproduce

    shrink = (f"rounds=1,loop.local_steps=2,loop.clients_per_round=2,data.init_args.num_clients=4,"
              f"data.init_args.batch_size=8,model.init_args.name={model_dir},data.init_args.tokenizer={model_dir},"
              f"data.init_args.root={glue_root}")
    out = tmp_path / "table"
    assert cmd_reproduce([str(ROOT / "recipes/tables/fedadamw_table3.yaml"), "--cells", "fedadamw/cola",
                          "--shrink", shrink, "--out", str(out), "--seeds", "1"]) == 0
    table = (out / "table.md").read_text()
    # CoLA's MCC ×100 beside the paper's value
    assert re.search(r"\| fedadamw \| -?\d+\.\d\d / 58\.21 ± 0\.15 \|", table), table[-400:]
