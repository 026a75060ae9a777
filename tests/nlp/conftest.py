"""Fixtures of the language-model tests (skipped without the nlp extra); the builders are in ``nlp_fixtures``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("tokenizers")

from nlp_fixtures import make_tokenizer, tiny_roberta, write_glue, write_shakespeare  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def glue_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue")
    write_glue(root)
    return root


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    """A local checkpoint directory (config, random weights, tokenizer): what a user hands over offline."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = tmp_path_factory.mktemp("tiny-roberta")
    cfg = dict(tiny_roberta(len(tokenizer)))
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def shakespeare_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("leaf")
    write_shakespeare(root)
    return root
