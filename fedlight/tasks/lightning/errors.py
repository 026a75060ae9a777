"""An exception raised by the user's own code mid-run: the user's frames (fedlight's, torch's and Lightning's
trimmed), then which rounds are kept and how to continue. The command line exits with status 1."""

from __future__ import annotations

import functools
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError

LIBRARIES = ("fedlight", "torch", "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "jsonargparse")


class UserCodeError(ConfigError):
    """The module's own code raised during training; the message shows its frames and what is kept."""

    status = 1


def user_code_error(e: BaseException, record: Any) -> UserCodeError | None:
    """``e`` as a :class:`UserCodeError` when the traceback passes through the user's code (not a fedlight,
    library or standard-library file), else ``None``."""
    if not isinstance(e, Exception) or type(e).__module__.split(".")[0] in LIBRARIES:
        return None
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _users(f.filename)]
    if not frames:
        return None
    try:
        record.flush()  # the last checkpoint written in the background is on disk before saying it is kept
    except Exception:  # noqa: BLE001 - the message below still holds for what reached the disk
        pass
    kept = getattr(record, "saved_round", 0)
    where, what = _frames(frames), _what(e)
    rounds = (f"rounds 1-{kept} are kept in {record.out}/checkpoints/last.ckpt; fix the code and rerun the same "
              f"command with `--resume auto` to continue exactly from round {kept + 1}" if kept else
              "no round had finished, so nothing is kept; fix the code and rerun")
    return UserCodeError(f"your code raised during training:\n{where}\n{what}\nfedlight: {rounds}")


def passes_user_code(e: BaseException) -> bool:
    """Whether ``e``'s traceback passes through the user's code."""
    return any(_users(f.filename) for f in traceback.extract_tb(e.__traceback__))


def internal_error_line(e: BaseException, record: Any) -> str:
    """The fedlight line said with a failure that passed through no code of the user's (a bug of fedlight's, or of a
    library it calls): what failed, which rounds are kept and that the traceback is fedlight's to fix."""
    try:
        record.flush()
    except Exception:  # noqa: BLE001 - the line below still holds for what reached the disk
        pass
    kept = getattr(record, "saved_round", 0)
    rounds = (f"rounds 1-{kept} are kept in {record.out}/checkpoints/last.ckpt (`--resume auto` continues from round "
              f"{kept + 1})" if kept else "no round had finished, so nothing is kept")
    return (f"fedlight: the run failed inside fedlight or a library it calls, not in your code ({_what(e)}); {rounds}. "
            "Please report it with the traceback below")


def guard_user(what: str, fn: Any, batch: Any = None) -> Any:
    """Run ``fn`` (the module's own step before round 1); an exception raised in the user's code becomes a
    :class:`ConfigError` showing the user's frames (string labels in ``batch`` named as the cause)."""
    from fedlight.tasks.base import guard

    try:
        return fn()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - shown with the user's frames, or judged by the generic guard
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _users(f.filename)]
        if not frames:
            return guard(what, functools.partial(_reraise, e), batch)
        raise ConfigError(f"{what} raised on the first batch, before round 1:\n{_frames(frames)}\n{_what(e)}\n"
                          f"fedlight: {_cause(e, frames, batch)}") from None


def _cause(e: BaseException, frames: list, batch: Any) -> str:
    """What to do about an error of the module's own step on the first batch: string labels (passed as the loader
    yields them), ``self.logger`` with no logger asked for, or the user's own bug."""
    from fedlight.tasks.base import _strings

    strings = _strings(batch)
    if strings:
        return (f"the data's labels are strings ({', '.join(map(repr, strings[:3]))}, ...), passed to your module as "
                "your loader yields them (as Lightning passes them); where your code needs class indices, map them "
                "in your dataset as torchvision's ImageFolder does (`class_to_idx = {name: i for i, name in "
                "enumerate(sorted(names))}`, then return `class_to_idx[label]`)")
    if isinstance(e, AttributeError) and str(e).startswith("'NoneType'") and "logger" in (frames[-1].line or ""):
        return ("`self.logger` is None because the run writes no TensorBoard (`--loggers` without tensorboard), "
                "as with Trainer(logger=False); add tensorboard to `--loggers`")
    return "fix it in your code and rerun"


def _reraise(e: BaseException) -> Any:
    raise e


def _frames(frames: list) -> str:
    return "".join(traceback.format_list(frames)).rstrip()


def _what(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def _users(filename: str) -> bool:
    path = Path(filename)
    if filename.startswith("<") or not path.suffix == ".py":
        return False
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if any(str(path).startswith(r) for r in roots if r):
        return False
    package = Path(sys.modules["fedlight"].__file__).resolve().parent
    return package not in path.resolve().parents
