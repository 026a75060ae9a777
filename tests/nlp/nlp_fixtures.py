"""Offline builders for the language-model tests: generated GLUE-format TSVs, a word-level tokenizer trained on
them, a tiny random RoBERTa (2 layers, hidden 32) and a LEAF-format Shakespeare JSON (``conftest.py`` turns them
into fixtures)."""

from __future__ import annotations

import json

import numpy as np

GOOD = ["good", "fine", "great", "nice"]
BAD = ["bad", "poor", "awful", "grim"]
NOUNS = ["cat", "dog", "play", "film", "song", "book"]
FILLER = ["the", "a", "was", "very", "really", "quite", "today"]


def sentences(n: int, seed: int) -> tuple[list[str], list[int]]:
    """``n`` short sentences; label 1 when the sentiment word is a good one."""
    rng = np.random.default_rng(seed)
    out, labels = [], []
    for _ in range(n):
        y = int(rng.integers(2))
        words = [str(rng.choice(FILLER)), str(rng.choice(NOUNS)), "was", str(rng.choice(GOOD if y else BAD))]
        words += [str(w) for w in rng.choice(FILLER, size=int(rng.integers(0, 5)))]
        out.append(" ".join(words))
        labels.append(y)
    return out, labels


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))


def write_glue(root, n_train: int = 48, n_dev: int = 16) -> None:
    """CoLA (no header), SST-2, RTE (pairs, string labels) and MNLI (3 labels, dev_matched.tsv) in GLUE's layout."""
    for split, n, seed in (("train", n_train, 1), ("dev", n_dev, 2)):
        s, y = sentences(n, seed)
        _write(root / "CoLA" / f"{split}.tsv", [("src", yi, "*" if not yi else "", si) for si, yi in zip(s, y)])
        _write(root / "SST-2" / f"{split}.tsv", [("sentence", "label"), *zip(s, y)])
        nli = ["entailment" if yi else "not_entailment" for yi in y]
        _write(root / "RTE" / f"{split}.tsv", [("index", "sentence1", "sentence2", "label"),
                                               *[(i, si, s[-1 - i], li) for i, (si, li) in enumerate(zip(s, nli))]])
        three = ["entailment", "neutral", "contradiction"]
        name = "dev_matched.tsv" if split == "dev" else "train.tsv"
        _write(root / "MNLI" / name, [("index", "sentence1", "sentence2", "gold_label"),
                                      *[(i, si, s[-1 - i], three[(yi + i) % 3]) for i, (si, yi) in
                                        enumerate(zip(s, y))]])


def make_tokenizer():
    """A word-level tokenizer over the fixture words, RoBERTa's special ids (<s> 0, <pad> 1, </s> 2, <unk> 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(GOOD + BAD + NOUNS + FILLER)],
                            trainers.WordLevelTrainer(special_tokens=["<s>", "<pad>", "</s>", "<unk>"]))
    tok.post_processor = TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                            special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def tiny_roberta(vocab_size: int, dropout: float = 0.0) -> dict:
    return {"model_type": "roberta", "vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 66, "type_vocab_size": 1,
            "pad_token_id": 1, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}


PLAY = ("To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune, or to take arms against a sea of troubles. ")


def write_shakespeare(root, roles: int = 3, per_role: int = 12, seq_len: int = 80) -> None:
    """LEAF's all_data layout: one JSON with ``roles`` speaking roles, ``per_role`` 80-char samples each."""
    text = PLAY * 4
    users, data = [], {}
    for r in range(roles):
        name = f"THE_PLAY_ROLE{r}"
        users.append(name)
        starts = [7 * r + 3 * i for i in range(per_role + r)]
        data[name] = {"x": [text[s:s + seq_len] for s in starts], "y": [text[s + seq_len] for s in starts]}
    path = root / "shakespeare" / "data" / "all_data" / "all_data.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"users": users, "num_samples": [len(data[u]["x"]) for u in users],
                                "user_data": data}))
