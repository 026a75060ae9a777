"""GLUE (CoLA, RTE, SST-2, QQP, MRPC, QNLI, MNLI) as federated text classification (``pip install fedlight[nlp]``).

Sources, in order: a local folder under ``root`` — GLUE's own TSV files (``train.tsv``, ``dev.tsv``; MNLI
``dev_matched.tsv``) or the Hub's parquet files (``train-*.parquet``, ``validation-*.parquet``; MNLI
``validation_matched-*``) in ``<root>/glue/<Task>`` or ``<root>/<Task>`` — else, when online, the Hugging Face
``datasets`` copy (``nyu-mll/glue``). Evaluation is on the validation split (GLUE's test labels are hidden).

Text is tokenized once with the model's tokenizer (truncated to ``max_length``, padded to the longest sequence of
the split) and cached under ``$FEDLIGHT_CACHE/glue`` keyed by the split's content, the tokenizer's content and
``max_length``. A batch is ``{"input_ids", "attention_mask", "labels"}``, all int64, on the device.
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlight.data.base import FederatedDataModule, data_root, select
from fedlight.data.cache import cached, digest, file_digest
from fedlight.data.partition import Dirichlet, Partitioner
from fedlight.errors import ConfigError
from fedlight.models import hub


@dataclass(frozen=True)
class GlueTask:
    folder: str  # GLUE's own folder name; the Hub's is the key of TASKS
    text: tuple[str, ...]  # the Hub's text columns
    tsv_text: tuple[str | int, ...]  # the TSV's text columns (header names, or indices when there is no header)
    tsv_label: str | int
    labels: tuple[str, ...] = ()  # TSV label strings in label-id order (empty: the TSV holds the ids)
    validation: str = "validation"
    dev_tsv: str = "dev.tsv"


NLI2 = ("entailment", "not_entailment")
TASKS: dict[str, GlueTask] = {
    "cola": GlueTask("CoLA", ("sentence",), (3,), 1),
    "sst2": GlueTask("SST-2", ("sentence",), ("sentence",), "label"),
    "mrpc": GlueTask("MRPC", ("sentence1", "sentence2"), ("#1 String", "#2 String"), "Quality"),
    "qqp": GlueTask("QQP", ("question1", "question2"), ("question1", "question2"), "is_duplicate"),
    "qnli": GlueTask("QNLI", ("question", "sentence"), ("question", "sentence"), "label", NLI2),
    "rte": GlueTask("RTE", ("sentence1", "sentence2"), ("sentence1", "sentence2"), "label", NLI2),
    "mnli": GlueTask("MNLI", ("premise", "hypothesis"), ("sentence1", "sentence2"), "gold_label",
                     ("entailment", "neutral", "contradiction"), "validation_matched", "dev_matched.tsv"),
}


def task_key(task: str) -> str:
    """``"SST-2"`` / ``"sst2"`` / ``"CoLA"`` → the key of :data:`TASKS`; a ConfigError listing them otherwise."""
    key = str(task).lower().replace("-", "").replace("_", "")
    if key not in TASKS:
        raise ConfigError(f"`data.init_args.task` {task!r} is not a GLUE task fedlight knows; use one of "
                          f"{', '.join(TASKS)} (or GLUE's spelling: {', '.join(t.folder for t in TASKS.values())})")
    return key


class GLUE(FederatedDataModule):
    """A GLUE task split over clients (default: the FedAdamW paper's 20 clients, Dir(0.8) over labels, batch 32).

    Args:
        task: cola, rte, sst2, qqp, mrpc, qnli or mnli (GLUE's spellings ``CoLA``, ``SST-2`` ... also work).
        tokenizer: the model's tokenizer: a local directory or Hub name (``roberta-base``), or a ``transformers``
            tokenizer object (Python API).
        root: data folder holding ``glue/<Task>`` (or ``<Task>``); default ``$FEDLIGHT_DATA``, else ``./data``.
        max_length: truncate each example to this many tokens (special tokens included).
        num_clients: number of clients the training split is spread over.
        batch_size: client mini-batch size.
        partition: how the training split is spread (default ``Dirichlet(0.8)`` over labels, the paper's).
        subset, test_subset: keep this many random training / validation examples (quick runs).
        eval_batch_size: batch size of the evaluation batches.
    """

    def __init__(self, task: str = "sst2", tokenizer: Any = "roberta-base", root: str | None = None,
                 max_length: int = 128, num_clients: int = 20, batch_size: int = 32,
                 partition: Partitioner | None = None, subset: int | None = None, test_subset: int | None = None,
                 eval_batch_size: int = 256) -> None:
        self.task = task_key(task)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 8:
            raise ConfigError(f"`data.init_args.max_length` must be an integer >= 8, got {max_length!r}")
        super().__init__(num_clients=num_clients, batch_size=batch_size,
                         partition=partition if partition is not None else Dirichlet(0.8), root=root, subset=subset,
                         test_subset=test_subset, augment=False, eval_batch_size=eval_batch_size)
        self.tokenizer, self.max_length = tokenizer, max_length
        self._num_classes = max(2, len(TASKS[self.task].labels))
        self._tok: Any = None

    def default_task(self):
        """GLUE's metric: Matthews correlation for CoLA, accuracy for the others (F1 and MCC are reported too)."""
        from fedlight.tasks import TextClassification

        return TextClassification(headline="mcc" if self.task == "cola" else "acc")

    # ------------------------------------------------------------------ tokenizer
    def get_tokenizer(self) -> Any:
        """The tokenizer object (loaded once from a local directory, the cache or the Hub)."""
        if self._tok is None:
            self._tok = self.tokenizer if not isinstance(self.tokenizer, str) else load_tokenizer(self.tokenizer)
        return self._tok

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (ids are below it); checked against the model before round 1."""
        return len(self.get_tokenizer())

    @property
    def pad_token_id(self) -> int | None:
        return self.get_tokenizer().pad_token_id

    # ------------------------------------------------------------------ loading
    def _load(self, train: bool, keep: int | None, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        texts, labels, key = read_split(self.task, train, data_root(self.root))
        tok = self.get_tokenizer()
        if tok.pad_token_id is None:
            raise ConfigError(f"`data.init_args.tokenizer` {_tok_name(self.tokenizer)} has no padding token; set one "
                              "(e.g. tokenizer.pad_token = tokenizer.eos_token) or use the model's own tokenizer")
        name = f"{self.task}-{'train' if train else 'validation'}"
        entry = cached("glue", digest(name, key, tokenizer_key(tok), self.max_length),
                       lambda: tokenize(tok, texts, labels, self.max_length))
        x, y = torch.stack([entry["input_ids"], entry["attention_mask"]], 1), entry["labels"]
        idx = select(len(y), keep, rng)
        if idx is not None:
            x, y = x[torch.from_numpy(idx)], y[torch.from_numpy(idx)]
        return trim(x).to(torch.int32), y  # stored as int32 (QQP: 0.37 GB instead of 0.75 GB at length 128)

    def to_input(self, x: Tensor) -> Tensor:
        return x.long()  # the model gets int64 ids and masks

    def client_batches(self, client_id: int, num_steps: int, generator: torch.Generator) -> Iterator[dict]:
        for x, y in super().client_batches(client_id, num_steps, generator):
            yield as_batch(x, y)

    def test_batches(self) -> Iterator[dict]:
        for x, y in super().test_batches():
            yield as_batch(x, y)


def as_batch(x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Stored ``[B, 2, L]`` (ids, mask) and labels → the model's keyword batch."""
    return {"input_ids": x[:, 0], "attention_mask": x[:, 1], "labels": y}


def trim(x: Tensor) -> Tensor:
    """Drop the padding columns no example of the split uses (a subset is often shorter than its longest)."""
    used = int(x[:, 1].sum(1).max()) if len(x) else 1
    return x[:, :, :max(used, 1)].contiguous()


def _tok_name(tok: Any) -> str:
    return repr(tok) if isinstance(tok, str) else type(tok).__name__


def load_tokenizer(name: str) -> Any:
    """``AutoTokenizer`` from a local directory, the cache, or (online) the Hub; never downloads offline."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError("GLUE needs the nlp extra: pip install 'fedlight[nlp]'") from e
    local = os.path.isdir(name)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local or not hub.available())
    except (OSError, ValueError) as e:
        if local:
            raise ConfigError(f"`data.init_args.tokenizer` {name!r} holds no tokenizer files ({e}); save the model's "
                              "tokenizer there with `save_pretrained`") from None
        raise ConfigError(f"`data.init_args.tokenizer` {name!r} is a Hugging Face Hub name, but the Hub cannot be "
                          f"used ({hub.why_not()}) and it is not in the local cache; give a local directory holding "
                          "the model's tokenizer files (saved with `save_pretrained`), e.g. fetched where the Hub is "
                          f"reachable with `{hub.download_command(name, '--local-dir', 'DIR')}`") from None


def tokenizer_key(tok: Any) -> str:
    """The tokenizer's identity for the cache: its class, vocabulary and rules (a fast tokenizer's JSON)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # without the call-time truncation/padding state a fast tokenizer keeps in its JSON
        body = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    else:
        body = sorted(tok.get_vocab().items())
    return digest(type(tok).__name__, body, tok.pad_token_id, getattr(tok, "padding_side", "right"))


def tokenize(tok: Any, texts: list[tuple[str, ...]], labels: np.ndarray, max_length: int) -> dict[str, Tensor]:
    """Token ids, attention masks (int64 ``[n, L]``, L = the longest example, at most ``max_length``) and labels."""
    cols = list(zip(*texts))
    enc = tok(*[list(c) for c in cols], truncation=True, max_length=max_length, padding="longest",
              return_tensors="pt")
    return {"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long(),
            "labels": torch.as_tensor(labels, dtype=torch.int64)}


# ---------------------------------------------------------------------------------------------- reading files
def read_split(task: str, train: bool, root: Path) -> tuple[list[tuple[str, ...]], np.ndarray, str]:
    """``(texts, labels, content key)`` of a split: local TSV/parquet files, else (online) Hugging Face ``datasets``."""
    for folder in _folders(task, root):
        if folder.is_dir():
            return _read_folder(task, train, folder)
    if not hub.available() and not (hub.offline() and importlib.util.find_spec("datasets")):  # its cache, offline
        raise ConfigError(_missing(task, root, hub.why_not()))
    try:
        return _read_hub(task, train)
    except ConfigError:
        raise
    except (OSError, ValueError, RuntimeError) as e:  # datasets' network, cache and not-found errors: one message
        raise ConfigError(_missing(task, root, f"{type(e).__name__}: {(str(e) or '-').splitlines()[0]}")) from None


def _missing(task: str, root: Path, why: str) -> str:
    """A missing GLUE folder that the Hub cannot supply: where fedlight looked and the local alternatives."""
    looked, name = "\n".join(f"  - {f}" for f in _folders(task, root)), TASKS[task].folder
    fetch = hub.download_command("nyu-mll/glue", f"--repo-type dataset --include '{task}/*' --local-dir {root}/glue")
    return (f"GLUE {name} not found locally and not from the Hub ({why}). Looked in:\n{looked}\nFix: put GLUE's {name} "
            f"TSV files (train.tsv, {TASKS[task].dev_tsv}) or the Hub's parquet files in one of those folders (where "
            f"the Hub is reachable: `{fetch}`), or set `data.init_args.root` / FEDLIGHT_DATA to the folder holding "
            "them; a `datasets` cache of nyu-mll/glue is read with HF_HUB_OFFLINE=1")


def _folders(task: str, root: Path) -> list[Path]:
    names = dict.fromkeys([TASKS[task].folder, task])
    return [root / sub / n for sub in ("glue", "GLUE", ".") for n in names]


def _read_folder(task: str, train: bool, folder: Path) -> tuple[list[tuple[str, ...]], np.ndarray, str]:
    spec = TASKS[task]
    split = "train" if train else spec.validation
    tsv = folder / ("train.tsv" if train else spec.dev_tsv)
    parquet = sorted(glob.glob(str(folder / f"{split}-*.parquet")) + glob.glob(str(folder / f"{split}.parquet")))
    if tsv.is_file():
        texts, labels = _read_tsv(spec, tsv)
        files = [tsv]
    elif parquet:
        texts, labels = _read_parquet(spec, parquet)
        files = [Path(p) for p in parquet]
    else:
        raise ConfigError(f"GLUE {spec.folder}: the folder {folder} lacks the {split} split; expected "
                          f"{tsv.name} (GLUE's TSV) or {split}-*.parquet (the Hub's files) there")
    return texts, labels, file_digest(files)


def _read_tsv(spec: GlueTask, path: Path) -> tuple[list[tuple[str, ...]], np.ndarray]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header = isinstance(spec.tsv_label, str)
    head, body = (rows[0], rows[1:]) if header else ([], rows)
    col = {c: (head.index(c) if isinstance(c, str) and c in head else c) for c in (*spec.tsv_text, spec.tsv_label)}
    missing = [c for c, i in col.items() if isinstance(i, str)]
    if missing:
        raise ConfigError(f"GLUE {spec.folder}: {path} lacks the column(s) {missing} (its header: {head}); is it "
                          f"GLUE's {spec.folder} file?")
    width = max(col.values()) + 1
    body = [r for r in body if len(r) >= width]
    texts = [tuple(r[col[c]] for c in spec.tsv_text) for r in body]
    return texts, _label_ids(spec, [r[col[spec.tsv_label]] for r in body], path)


def _read_parquet(spec: GlueTask, files: list[str]) -> tuple[list[tuple[str, ...]], np.ndarray]:
    import pyarrow.parquet as pq

    table = pq.read_table(files[0]) if len(files) == 1 else __import__("pyarrow").concat_tables(
        [pq.read_table(f) for f in files])
    missing = [c for c in (*spec.text, "label") if c not in table.column_names]
    if missing:
        raise ConfigError(f"GLUE {spec.folder}: {files[0]} lacks the column(s) {missing} (it has "
                          f"{table.column_names})")
    cols = [table.column(c).to_pylist() for c in spec.text]
    return list(zip(*cols)), np.asarray(table.column("label").to_pylist(), dtype=np.int64)


def _read_hub(task: str, train: bool) -> tuple[list[tuple[str, ...]], np.ndarray, str]:
    spec = TASKS[task]
    try:
        from datasets import load_dataset
    except ImportError as e:
        raise ConfigError("GLUE from the Hub needs the nlp extra: pip install 'fedlight[nlp]'") from e
    ds = load_dataset("nyu-mll/glue", task, split="train" if train else spec.validation)
    texts = list(zip(*[ds[c] for c in spec.text]))
    return texts, np.asarray(ds["label"], dtype=np.int64), f"hub:{ds._fingerprint}"


def _label_ids(spec: GlueTask, raw: list[str], path: Path) -> np.ndarray:
    if spec.labels:
        where = {name: i for i, name in enumerate(spec.labels)}
        bad = sorted({v for v in raw if v not in where})
        if bad:
            raise ConfigError(f"GLUE {spec.folder}: {path} has labels {bad[:5]} outside {list(spec.labels)}")
        return np.asarray([where[v] for v in raw], dtype=np.int64)
    try:
        return np.asarray([int(v) for v in raw], dtype=np.int64)
    except ValueError:
        raise ConfigError(f"GLUE {spec.folder}: {path} has non-integer labels (e.g. {raw[:3]})") from None
