"""LEAF's Shakespeare: next-character prediction, one client per speaking role (the natural split).

Reads LEAF's JSON files ``{"users": [...], "user_data": {user: {"x": [80-char strings], "y": [next chars]}}}``:
``train/*.json`` and ``test/*.json`` when they exist, else ``all_data/*.json`` split per role in time order (the
last ``test_fraction`` of each role's samples is its test part, as LEAF's ``--sf``-free sample split does). Folders
looked in: ``<root>/shakespeare/data``, ``<root>/shakespeare``, ``<root>``.

A sample is the 80 characters ``x`` followed by ``y``; characters map to LEAF's 80-symbol vocabulary
(:data:`LETTERS`; anything else becomes the last id). Batches are ``(x, y)`` int64 ``[B, seq_len]``, ``y`` the next
character of every position of ``x``, for :class:`fedlight.tasks.LanguageModeling`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedlight.data.base import (
    SUBSET_TEST_TAG,
    SUBSET_TRAIN_TAG,
    FederatedDataModule,
    data_root,
    not_found,
    positive_int,
    seeded,
    select,
)
from fedlight.data.cache import cached, digest, file_digest
from fedlight.errors import ConfigError

LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
"""LEAF's character set (its ``language_utils.ALL_LETTERS``, 80 symbols); unknown characters map to id 79."""
VOCAB = len(LETTERS)


_TABLE = np.full(256, VOCAB - 1, dtype=np.uint8)
_TABLE[np.frombuffer(LETTERS.encode("latin-1"), dtype=np.uint8)] = np.arange(VOCAB, dtype=np.uint8)


def encode(text: str) -> np.ndarray:
    """Characters → ids in :data:`LETTERS` (unknown → ``VOCAB - 1``; characters outside Latin-1 read as ``?``)."""
    return _TABLE[np.frombuffer(text.encode("latin-1", errors="replace"), dtype=np.uint8)]


class Shakespeare(FederatedDataModule):
    """LEAF Shakespeare, one client per role.

    Args:
        root: data folder (default ``$FEDLIGHT_DATA``, else ``./data``); LEAF's files under ``shakespeare/data``.
        seq_len: characters per sample (LEAF: 80); longer samples keep their last ``seq_len``, shorter ones are
            refused.
        num_clients: keep this many roles, those with the most samples (ties: by name); None keeps every role.
        min_samples: drop roles with fewer training samples (LEAF's ``-k``).
        test_fraction: the test share of each role when only ``all_data`` exists.
        batch_size: client mini-batch size.
        subset, test_subset: keep this many random train / test samples (quick runs).
        eval_batch_size: batch size of the test batches.
    """

    _num_classes = None

    def __init__(self, root: str | None = None, seq_len: int = 80, num_clients: int | None = None,
                 min_samples: int = 2, test_fraction: float = 0.1, batch_size: int = 10, subset: int | None = None,
                 test_subset: int | None = None, eval_batch_size: int = 256) -> None:
        positive_int("seq_len", seq_len)
        positive_int("num_clients", num_clients, optional=True)
        positive_int("min_samples", min_samples)
        if not 0 < test_fraction < 1:
            raise ConfigError(f"`data.init_args.test_fraction` must be in (0, 1), got {test_fraction!r}")
        super().__init__(num_clients=num_clients or 1, batch_size=batch_size, root=root, subset=subset,
                         test_subset=test_subset, augment=False, eval_batch_size=eval_batch_size)
        self.seq_len, self.max_clients, self.min_samples = seq_len, num_clients, min_samples
        self.test_fraction = test_fraction
        self.vocab_size = VOCAB
        self.num_clients = num_clients  # None: every role, known after setup (fit checks clients_per_round then)

    def default_task(self):
        from fedlight.tasks import LanguageModeling

        return LanguageModeling()

    def _partition_desc(self) -> str:
        return "one client per speaking role (LEAF's natural split)"

    # ------------------------------------------------------------------ loading
    def _build(self, seed: int):
        roles = self._roles()
        names = sorted(roles, key=lambda r: (-len(roles[r][0]), r))
        names = [r for r in names if len(roles[r][0]) >= self.min_samples][: self.max_clients]
        if not names:
            raise ConfigError(f"no Shakespeare role has `data.init_args.min_samples`={self.min_samples} training "
                              "samples; lower it")
        train = [roles[r][0] for r in names]
        keep = select(sum(map(len, train)), self.subset, seeded(seed, SUBSET_TRAIN_TAG))
        owner = np.concatenate([np.full(len(t), i) for i, t in enumerate(train)])
        train_x = torch.from_numpy(np.concatenate(train))
        if keep is not None:
            owner, train_x = owner[keep], train_x[torch.from_numpy(keep)]
        parts = [np.flatnonzero(owner == i) for i in range(len(names))]
        names = [n for n, p in zip(names, parts) if len(p)]  # a subset may leave a role without samples
        parts = [p for p in parts if len(p)]
        unseen = [r for r in roles if len(roles[r][0]) == 0]  # roles of the test files only (LEAF's user split)
        test = torch.from_numpy(np.concatenate([roles[r][1] for r in names + unseen]))
        tkeep = select(len(test), self.test_subset, seeded(seed, SUBSET_TEST_TAG))
        test = test if tkeep is None else test[torch.from_numpy(tkeep)]
        self.num_clients, self.roles = len(parts), names
        dummy = lambda t: torch.zeros(len(t), 0, dtype=torch.int64)  # noqa: E731 - the targets live in x
        return train_x, dummy(train_x), test, dummy(test), parts

    def _roles(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """role → (train, test) uint8 ``[n, seq_len + 1]`` samples (cached by file content and ``seq_len``)."""
        train_files, test_files = self._files()
        key = digest("shakespeare", self.seq_len, self.test_fraction, file_digest(train_files),
                     file_digest(test_files))
        entry = cached("shakespeare", key, lambda: self._read(train_files, test_files))
        roles = [str(r) for r in json.loads(bytes(entry["roles"].numpy()).decode())]
        out, cut = {}, entry["bounds"].numpy()
        for i, r in enumerate(roles):
            a, b, c = cut[i]
            out[r] = (entry["samples"][a:b].numpy(), entry["samples"][b:c].numpy())
        return out

    def _files(self) -> tuple[list[Path], list[Path]]:
        root = data_root(self.root)
        dirs = [root / "shakespeare" / "data", root / "shakespeare", root]
        for d in dirs:
            train, test = sorted((d / "train").glob("*.json")), sorted((d / "test").glob("*.json"))
            if train and test:
                return train, test
            every = sorted((d / "all_data").glob("*.json"))
            if every:
                return every, []
        raise not_found("LEAF Shakespeare (train/*.json and test/*.json, or all_data/*.json)", dirs)

    def _read(self, train_files: list[Path], test_files: list[Path]) -> dict[str, Tensor]:
        train, test = _users(train_files, self.seq_len), _users(test_files, self.seq_len)
        roles, chunks, bounds, o = sorted(set(train) | set(test)), [], [], 0  # LEAF's user split: test-only roles
        for r in roles:
            tr, te = train.get(r, np.zeros((0, self.seq_len + 1), np.uint8)), test.get(r)
            if te is None and not test_files:  # all_data: the last test_fraction of the role, in time order
                cut = len(tr) - max(1, int(round(self.test_fraction * len(tr)))) if len(tr) > 1 else len(tr)
                tr, te = tr[:cut], tr[cut:]
            te = te if te is not None else np.zeros((0, self.seq_len + 1), np.uint8)
            chunks += [tr, te]
            bounds.append((o, o + len(tr), o + len(tr) + len(te)))
            o += len(tr) + len(te)
        return {"samples": torch.from_numpy(np.concatenate(chunks)), "bounds": torch.tensor(bounds),
                "roles": torch.frombuffer(bytearray(json.dumps(roles).encode()), dtype=torch.uint8)}

    # ------------------------------------------------------------------ batches
    def to_input(self, x: Tensor) -> Tensor:
        return x.long()

    def client_batches(self, client_id: int, num_steps: int, generator: torch.Generator) -> Iterator[tuple]:
        for s, _ in super().client_batches(client_id, num_steps, generator):
            yield s[:, :-1], s[:, 1:]

    def test_batches(self) -> Iterator[tuple]:
        for s, _ in super().test_batches():
            yield s[:, :-1], s[:, 1:]


def _users(files: list[Path], seq_len: int) -> dict[str, np.ndarray]:
    """user → uint8 ``[n, seq_len + 1]`` (the ``x`` string's last ``seq_len`` characters, then ``y``)."""
    out: dict[str, list[np.ndarray]] = {}
    for f in files:
        try:
            blob = json.loads(f.read_text(encoding="utf-8"))
            users, data = blob["users"], blob["user_data"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{f} is not a LEAF JSON file (needs `users` and `user_data`): {e}") from None
        for u in users:
            xs, ys = data[u]["x"], data[u]["y"]
            short = [s for s in xs if len(s) < seq_len]
            if short:
                raise ConfigError(f"{f}: role {u!r} has a sample of {len(short[0])} characters, fewer than "
                                  f"`data.init_args.seq_len`={seq_len}; lower seq_len")
            if xs:
                text = "".join(x[-seq_len:] + (y[:1] or " ") for x, y in zip(xs, ys))
                out.setdefault(str(u), []).append(encode(text).reshape(len(xs), seq_len + 1))
    return {u: np.concatenate(v) for u, v in out.items()}
