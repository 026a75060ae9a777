"""A finished ``fedlight tune`` study read back, for ``fedlight reproduce --tuned``: its Optuna storage, the study
of each row (``<name>/<row>``) and its best values. The tables read it; the tuning builds on it (one arrow).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError, check


def need_optuna() -> None:
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError("`fedlight tune` and `--tuned` need Optuna: pip install 'fedlight[tune]' (or pip install "
                          "optuna)") from None


BUSY_TIMEOUT_S = 60
"""How long an SQLite storage that another process holds locked is waited for."""


def open_storage(url: str, create: bool = True):
    """Optuna's RDB storage at ``url``; one that cannot be opened is one line (exit 2) naming it and why.
    ``create=False`` (a read-only command): an SQLite file that does not exist is refused, not made."""
    import optuna

    db = Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None
    check(create or db is None or db.is_file(), f"`--storage` {url}: there is no study storage there ({db} does not "
          "exist); run `fedlight tune` first, or pass its --out (or --storage)")
    try:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": BUSY_TIMEOUT_S}}
                                          if url.startswith("sqlite") else None)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's errors vary by driver; each is the same answer here
        if "database is locked" in str(e):  # a good storage another process holds: storage_faults says so
            raise
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"`--storage` {url}: cannot be opened ({why}); give an SQLAlchemy URL Optuna can use, e.g. "
                          "sqlite:///runs/tune/study.db or postgresql://user@host/db") from None


class StorageFault(ConfigError):
    """The study storage (or the output folder) could not be written or read: one line, exit 74 (``EX_IOERR``)."""

    status = 74


@contextlib.contextmanager
def storage_faults(url: str, out: Path):
    """A study storage that cannot be written (read-only, locked, gone) or an output folder that cannot be written is
    one line naming it and the cause (exit 74), not SQLAlchemy's and Optuna's tracebacks."""
    import optuna
    import sqlalchemy.exc

    try:
        yield
    except (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError) as e:
        raise StorageFault(f"the study storage {url} cannot be used ({_cause(e)}); make it writable, or wait until "
                           "the process that holds it ends, then run the same command again (finished trials "
                           "stay)") from None
    except OSError as e:
        raise StorageFault(f"cannot write {e.filename or out}: {e.strerror or e}; fix the folder (or pass another "
                           "--out), then run the same command again (finished trials stay)") from None


def _cause(e: BaseException) -> str:
    """The innermost error's first line (SQLite's own: ``attempt to write a readonly database``, ...)."""
    while e.__cause__ is not None or getattr(e, "orig", None) is not None:
        e = getattr(e, "orig", None) or e.__cause__
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def study_name(name: str, row: str) -> str:
    return f"{name}/{row}"


def best(storage_or_url, name: str):
    """The best finished trial of study ``name`` (its ``params`` and ``value``); a study without one is refused."""
    import optuna

    try:
        study = optuna.load_study(study_name=name, storage=storage_or_url)
    except KeyError:
        raise ConfigError(f"`--tuned`: the storage has no study {name!r}; run `fedlight tune` first (studies there: "
                          f"{', '.join(optuna.get_all_study_names(storage_or_url)) or 'none'})") from None
    try:
        return study.best_trial
    except ValueError:
        raise ConfigError(f"`--tuned`: study {name!r} has no finished trial yet; finish `fedlight tune` "
                          "first") from None


def tuned_values(spec_path: Path, rows: list[str], tuned: str) -> dict[str, dict[str, Any]]:
    """``fedlight reproduce --tuned``: row -> the best values of its study. ``tuned``: a ``fedlight tune`` output
    folder (its ``tune.json`` names the storage and the study) or a storage URL (studies ``<spec name>/<row>``)."""
    need_optuna()
    folder = Path(tuned)
    if "://" in tuned:
        url, name = tuned, spec_path.stem
    else:
        made = folder / "tune.json"
        check(made.is_file(), f"`--tuned {tuned}`: not a `fedlight tune` output folder (no tune.json there) nor a "
              "storage URL; pass the --out of `fedlight tune` or its --storage")
        record = json.loads(made.read_text())
        url, name = record["storage"], record["study"]
    storage = open_storage(url, create=False)
    import optuna

    names = set(optuna.get_all_study_names(storage))
    out = {row: best(storage, study_name(name, row)).params for row in rows if study_name(name, row) in names}
    check(bool(out), f"`--tuned {tuned}`: no study of these rows there ({', '.join(study_name(name, r) for r in rows)};"
          f" it has {', '.join(sorted(names)) or 'none'}); run `fedlight tune` first")
    return out
