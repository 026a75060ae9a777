"""The command line and its settings as reference pages, generated from the parsers themselves (the documentation
site renders them while it builds, so they cannot drift from what ``fedlight`` accepts).

``cli_markdown()``: every subcommand with its ``--help``; ``settings_markdown()``: every key of a recipe (= every
``fedlight fit`` flag) with its type, default and help, marked defining or execution-only, the ``loop`` and
``privacy`` sections' keys included.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Iterable

HELP_COLUMNS = "100"
"""Width of the captured ``--help`` texts (argparse wraps at ``$COLUMNS``)."""

WITHOUT_HELP = {"ls": "fedlight ls [algorithms|models|datasets|partitioners|tasks|recipes]"}
"""Subcommands that take no ``--help``: their usage line."""


def command_help(name: str) -> str:
    """What ``fedlight NAME --help`` prints (``fedlight --help`` for ``help``)."""
    from fedlight.config import cli

    argv = ["--help"] if name == "help" else [name, "--help"]
    out = io.StringIO()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse's help action exits
                rc = e.code or 0
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    if rc != 0:
        raise RuntimeError(f"`fedlight {' '.join(argv)}` exited {rc}:\n{out.getvalue()}")
    return out.getvalue().rstrip() + "\n"


def _fence(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```\n"


def cli_markdown() -> str:
    """A section per ``fedlight`` subcommand: its one line and its ``--help`` text."""
    from fedlight.config.cli import COMMANDS

    parts = ["## `fedlight`\n\n", _fence(command_help("help"))]
    for name, (_, line) in COMMANDS.items():
        parts.append(f"\n## `fedlight {name}`\n\n{_md_text(line)}\n\n")
        parts.append(_fence(WITHOUT_HELP[name] if name in WITHOUT_HELP else command_help(name)))
    return "".join(parts)


# ------------------------------------------------------------------------------------------------ settings
_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|obj):`~?([^`]+)`")


def _md_text(text: str) -> str:
    """Help text (reStructuredText-flavoured docstrings) as one line of a Markdown table cell."""
    text = _ROLE.sub(r"``\1``", text or "")
    return re.sub(r"\s+", " ", text).strip()


def _type_name(action) -> str:
    hint = getattr(action, "_typehint", None)
    if hint is None:
        return ""
    name = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    text = name or str(hint)
    text = re.sub(r"\b(?:typing|builtins|collections\.abc)\.", "", text).replace("NoneType", "None")
    return re.sub(r"<class '([^']+)'>", r"\1", text)


def _default(action) -> str:
    d = action.default
    if d is None:
        return "null"
    if isinstance(d, str):
        return d
    return repr(d) if not isinstance(d, bool) else str(d).lower()


def setting_rows(parser) -> Iterable[tuple[str, str, str, str]]:
    """``(key, type, default, help)`` of each settable key of a jsonargparse parser (help actions and
    ``--config`` / ``--print_config`` left out)."""
    for a in parser._actions:
        flags = [o for o in a.option_strings if o.startswith("--")]
        if not flags or a.default == "==SUPPRESS==" or flags[0] in ("--config", "--print_config"):
            continue
        yield flags[0][2:], _type_name(a), _default(a), _md_text(a.help)


def fit_parser():
    """``fedlight fit``'s parser, with the field docstrings as help."""
    from fedlight.config.cli import _parser

    return _parser("fedlight fit", docs=True)


def privacy_parser():
    """The ``privacy`` section's keys, parsed from :class:`fedlight.privacy.settings.PrivacyConfig` as the
    ``fit`` parser does."""
    from jsonargparse import ArgumentParser, set_parsing_settings

    from fedlight.privacy.settings import PrivacyConfig

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    p = ArgumentParser(exit_on_error=False)
    p.add_class_arguments(PrivacyConfig, "privacy")
    return p


def _entries(rows: Iterable[tuple[str, str, str, str]], kind) -> str:
    """A definition list: per key its type, default and kind, then its help."""
    out = []
    for key, typ, default, help_text in rows:
        typ = f" · `{typ}`" if typ else ""
        out.append(f"`{key}`{typ} · default `{default}`\n: *{kind(key)}.* {help_text}\n")
    return "\n".join(out)


def settings_markdown() -> str:
    """Every recipe key / ``fedlight fit`` flag: the run's own keys, the ``loop`` keys, the ``privacy`` keys."""
    from fedlight.run.directory import EXECUTION_ONLY

    def kind(key: str) -> str:
        if not any(key == e or key.startswith(e + ".") for e in EXECUTION_ONLY):
            return "defining"
        return "execution-only (defining under the cosine schedule)" if key == "loop.rounds" else "execution-only"

    rows = list(setting_rows(fit_parser()))
    top = [r for r in rows if not r[0].startswith("loop.")]
    loop = [r for r in rows if r[0].startswith("loop.")]
    return (f"## The run\n\n{_entries(top, kind)}\n"
            f"## `loop`\n\nThe federated loop: rounds, sampling, local steps and optimizer, schedules, evaluation, "
            f"checkpoints and how clients are run.\n\n{_entries(loop, kind)}\n"
            f"## `privacy`\n\nThe keys of the `privacy` section (`--privacy.KEY`; setting any of them turns "
            f"differential privacy on).\n\n{_entries(setting_rows(privacy_parser()), kind)}")
