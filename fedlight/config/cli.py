"""The ``fedlight`` command line: ``fit``, ``ls``, ``partition`` (and more as they land).

``fedlight fit`` is generated from :func:`fedlight.config.api.fit`'s signature (jsonargparse): every
parameter is a YAML key and a dotted flag (``--loop.rounds 3``); field docstrings are the help text.
Bad input ends with one readable line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

from fedlight.config.explain import explain as _explain
from fedlight.core.registry import closest
from fedlight.errors import ConfigError
from fedlight.run import stops
from fedlight.run.stops import EXIT_STATUSES, STOP_STATUSES, Stopped

# name -> ("module:function", one help line). Resolved on use, so `fedlight ls` imports no research tooling.
COMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("fedlight.config.cli:cmd_fit",
            "train one recipe:  fedlight fit --config recipes/X.yaml [--loop.rounds 3 ...]"),
    "lockstep": ("fedlight.config.group:cmd_lockstep", "train several runs in one process, round by round together: "
                 "fedlight lockstep FIT_FLAGS --seeds 0,1,2"),
    "ls": ("fedlight.config.cli:cmd_ls", "list algorithms, models, datasets, partitioners, tasks, recipes and "
           "tables"),
    "cp": ("fedlight.config.cli:cmd_cp", "copy a bundled recipe or table spec out to edit: fedlight cp NAME [DEST]"),
    "partition": ("fedlight.config.cli:cmd_partition",
                  "print per-client sizes and class histograms of a recipe's split"),
    "reproduce": ("fedlight.lab.tables.reproduce:cmd_reproduce", "run a paper table: fedlight reproduce TABLE.yaml"),
    "tune": ("fedlight.lab.tuning.cli:cmd_tune", "tune each row of a table with Optuna: fedlight tune TABLE.yaml"),
    "report": ("fedlight.lab.tables.report_plot:cmd_report",
               "compare finished runs (table + curves.png): fedlight report RUN..."),
    "landscape": ("fedlight.lab.flatness.cli:cmd_landscape",
                  "loss along random directions around a run's model (1-D/2-D plots)"),
    "sharpness": ("fedlight.lab.flatness.cli:cmd_sharpness", "top Hessian eigenvalue, SAM sharpness of a run's model"),
    "verify": ("fedlight.run.verify:cmd_verify", "check a run directory's files: what is intact, which file is "
               "damaged (exit 0 / 2)"),
    "bench": ("fedlight.lab.benchmarks.cli:cmd_bench",
              "time fedlight against a minimal PyTorch loop (and at scale; --peers: and pfl-research)"),
}
USAGE = "usage: fedlight <command> [options]\n\ncommands:\n" + "".join(
    f"  {name:<10} {line}\n" for name, (_, line) in COMMANDS.items()) + \
    "  help       this message (or: fedlight <command> --help)\n" + \
    "  --version  fedlight's version\n\n" + \
    textwrap.fill(f"fedlight fit {EXIT_STATUSES}", 100)


def command(name: str) -> Callable[[list[str]], int]:
    """The function behind subcommand ``name`` (imports its module now)."""

    module, _, fn = COMMANDS[name][0].partition(":")
    return getattr(importlib.import_module(module), fn)


SCHEMA = """\
A recipe is a YAML file of these keys; every key is also a flag (--loop.rounds 3, --algorithm.rho 0.05):

  model:                          a torch.nn.Module             list them: fedlight ls models
    class_path: fedlight.models.MLP                             its arguments: fedlight fit --model.help MLP
    init_args: {in_features: 60, hidden: [32], num_classes: 10}
  data:                           a federated data module       list them: fedlight ls datasets
    class_path: fedlight.data.Synthetic                         its arguments: fedlight fit --data.help Synthetic
    init_args:
      num_clients: 30
      partition: {class_path: fedlight.data.Dirichlet, init_args: {alpha: 0.1}}   fedlight ls partitioners
  algorithm:                      default FedAvg                list them: fedlight ls algorithms
    class_path: fedlight.algorithms.FedSAM                      its arguments: fedlight fit --algorithm.help fedsam
    init_args: {rho: 0.05}
  task: Classification            default: the model's (a LightningModule) or the data's   fedlight ls tasks
  loop: {rounds: 100, clients_per_round: 10, local_steps: 5, lr: 0.1}             every loop key: below
  seed, out_dir, accelerator, devices, num_nodes, precision, resume, overwrite, loggers, privacy:   below

--model, --data, --task and --algorithm also take a class name or (algorithms) a registry name: --algorithm fedsam.
Recipes to start from: fedlight ls recipes."""


def _parser(prog: str, docs: bool = True):
    """The ``fit`` parser; ``docs``: read field docstrings for the help text (a second of parsing source code, so
    only when help is asked for). The schema names no Lightning class (a data module is ``DataModuleLike``, a
    duck type), so building it imports no Lightning."""

    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter, set_parsing_settings

    from fedlight.config import api

    class Formatter(DefaultHelpFormatter):
        """The recipe schema verbatim; `fedlight ls X` instead of every importable subclass of nn.Module."""

        def _fill_text(self, text, width, indent):
            return text if text == SCHEMA else super()._fill_text(text, width, indent)

        def _get_help_string(self, action):
            text = super()._get_help_string(action)
            section = {"model": "models", "data": "datasets", "algorithm": "algorithms"}.get(action.dest)
            if section is None:
                return text
            return re.sub(r", known subclasses: [^)]*", f"; list them: fedlight ls {section}", text)

    set_parsing_settings(docstring_parse_attribute_docstrings=docs)
    p = ArgumentParser(prog=prog, exit_on_error=False, description=SCHEMA, allow_abbrev=False,
                       usage=f"{prog} --config RECIPE.yaml [--KEY VALUE ...]", formatter_class=Formatter,
                       epilog=EXIT_STATUSES[0].upper() + EXIT_STATUSES[1:])
    p.add_argument("--config", action=ActionConfigFile, help="recipe YAML file")
    p.add_function_arguments(api.fit, skip={"_config_text"}, fail_untyped=False)
    return p


def _parse(prog: str, argv: list[str]):
    """Parse and instantiate a recipe + overrides; returns (init kwargs, resolved config YAML)."""
    from jsonargparse import ArgumentError

    from fedlight.config import advice, flags, locate

    argv = flags.resolve_names(locate.config_args(argv))  # --config quickstart: a bundled recipe by name
    flags.check_keys(argv)
    helps = any(a in ("-h", "--help") for a in argv)
    asks = helps or any(a.split("=")[0].endswith(".help") for a in argv)  # --algorithm.help NAME needs no recipe
    if not asks and not any(a.split("=")[0] in ("--config", "--model") for a in argv):
        raise ConfigError("a recipe is needed: `--config quickstart` (a bundled recipe by name; `fedlight ls "
                          "recipes` lists them), `--config path/to/recipe.yaml`, or `--model ... --data ...`")
    parser = _parser(prog, docs=helps or any(a.startswith("--print_config") for a in argv))
    try:
        plain = [a for a in argv if not a.startswith("--print_config")]  # printed below, with the paper's values
        cfg = parser.parse_args(plain)
        paper = advice.paper_defaults(cfg, argv)  # an adaptive rule's lr where the user did not choose one
        cfg = parser.parse_args(argv + paper) if paper or plain != argv else cfg
        text = parser.dump(cfg)
        import torch

        from fedlight.config.plan import check_seed

        check_seed(cfg.seed)  # before it seeds anything
        torch.manual_seed(cfg.seed)  # model initialisation is part of the seeded run
        init = parser.instantiate(cfg)
    except ConfigError:
        raise
    except (ArgumentError, ValueError, TypeError, ImportError, AttributeError) as e:
        raise ConfigError(_explain(e, parser)) from None
    kwargs = {k: v for k, v in init.items() if k != "config"}
    return kwargs, text


def cpu_threads(accelerator: str) -> None:
    """On CPU, one intra-op thread per process unless ``OMP_NUM_THREADS`` says otherwise.

    fedlight's CPU work is many small steps, where extra threads mostly wait on each other (and on other programs: the
    quickstart measured in results/test_suite.md ran 5–25 times slower with torch's default thread count on a busy
    machine). Processes launched for ``--devices N`` inherit the setting, so 1 and N processes compute alike.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def cmd_fit(argv: list[str]) -> int:
    from fedlight.config import api
    from fedlight.config import resume as resumes

    kwargs, text = _parse("fedlight fit", argv)
    cpu_threads(kwargs.get("accelerator", "auto"))
    summary = api.fit(**kwargs, _config_text=text)
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) != 0 or isinstance(summary, resumes.Finished):  # said in one line
        return 0
    _print_summary(summary)
    if summary.get("diverged_at_round") is not None:
        print(f"fedlight fit: diverged at round {summary['diverged_at_round']}", file=sys.stderr)
        return 1
    return 0


def _print_summary(s: dict) -> None:
    from fedlight.run.files import format_metric

    key = s.get("headline", {}).get("metric", "test_acc")
    name = key.removeprefix("test_").replace("_", " ")
    rows = [("rounds", s["rounds_completed"]), (f"final test {name}", format_metric(key, s.get(f"final_{key}"))),
            (f"best test {name}", f"{format_metric(key, s.get(f'best_{key}'))} (round {s['best_round']})"),
            ("s / round (training)", f"{s['seconds_per_round']:.3f}" if s["seconds_per_round"] else "-"),
            ("s / round (with eval)", f"{s['seconds_per_round_with_eval']:.3f}"
             if s.get("seconds_per_round_with_eval") else "-"),
            ("MB down / up", f"{s['bytes_down'] / 1e6:.1f} / {s['bytes_up'] / 1e6:.1f}"),
            ("wall time (s)", f"{s['wall_time_s']:.1f}")]
    rows += [(f"rounds to {format_metric(key, float(t))}", v if v is not None else "not reached")
             for t, v in s["rounds_to_target"].items()]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def cmd_partition(argv: list[str]) -> int:
    from fedlight.config.plan import data_or_own
    from fedlight.data import as_federated

    kwargs, _ = _parse("fedlight partition", argv)
    data = as_federated(data_or_own(kwargs["data"], kwargs["model"]))
    data.setup("cpu", kwargs.get("seed", 0))
    print(data.partition_report())
    return 0


def cmd_ls(argv: list[str]) -> int:
    from fedlight.config.catalog import listing

    what = argv[0] if argv else "all"
    print(listing(what))
    return 0


def cmd_cp(argv: list[str]) -> int:
    """``fedlight cp NAME [DEST]``: a recipe or table spec (found as ``--config`` finds one) copied to ``DEST`` (a
    folder, default the working directory, or a file name); an existing file is never overwritten."""
    import argparse

    from fedlight.config import locate

    p = argparse.ArgumentParser(prog="fedlight cp", description="Copy a recipe or table spec (found as --config "
                                "finds one: a path, ./recipes/, the installed ones) to DEST, to edit it. An existing "
                                "file is never overwritten.")
    p.add_argument("name", help="a recipe or table spec: its name (fedlight ls recipes / tables) or path")
    p.add_argument("dest", nargs="?", default=".", help="folder or file name to copy to (default: .)")
    a = p.parse_args(argv)
    src = locate.find(a.name, "recipe", "table")
    dest = Path(a.dest)
    if a.dest.endswith(("/", os.sep)) or dest.is_dir():
        dest = dest / src.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with dest.open("xb") as f:
            f.write(src.read_bytes())
    except FileExistsError:
        raise ConfigError(f"{dest} exists; not overwritten (remove it, or give another DEST: fedlight cp {a.name} "
                          "DEST)") from None
    table = src.parent.name == "tables"
    run = f"fedlight reproduce {dest} --dry-run" if table else f"fedlight fit --config {dest}"
    print(f"copied {src} to {dest}; edit it, then: {run}")
    return 0



def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """fedlight's own warnings as one ``fedlight: warning: ...`` line; others as Python prints them."""
    if type(message).__module__.startswith("fedlight") or category.__module__.startswith("fedlight"):
        print(f"fedlight: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def main(argv: list[str] | None = None) -> int:
    previous = stops.from_start()  # the first instruction: a stop signal during imports or set-up is a clean stop
    stops.LEAVING = argv is None  # the program: it exits right after a stop (a call from Python returns instead)
    if argv is None:
        stops.die_with_parent()
    try:
        status = _main(argv)
    except stops.StoppedAtStart as e:  # during start-up (the rounds raise Stopped inside _main)
        print(f"fedlight: {e.stopped}", file=sys.stderr, flush=True)
        status = e.stopped.status
    if argv is None and (status in STOP_STATUSES or sys.argv[1:2] in (["fit"], ["lockstep"])):
        leave(status)
    stops.restore(previous)  # called from Python: the caller's handlers again
    return status


def leave(status: int) -> None:
    """The program's exit once its work is done: every file of the run is closed and the summary (or the stop line)
    printed, so what is left is the interpreter's teardown, which after a compiled run takes seconds (issue 42). Two
    parts of it, found in torch 2.14's code and on the 2-core CPU: inductor's exit handler ``shutdown_compile_workers``
    sends the sidecar process of its Triton compile workers (``SubprocPool``, ``compile_threads`` = min(32, CPUs)
    workers: 16 on the GPU machine) the shutdown message and waits up to 300 s for it to take its pool down; and
    after the last exit handler, finalizing the interpreter after one inductor compilation took 5.5 s on the CPU
    (no worker pool there), against 0.2 s with ``os._exit``. Leaving with ``os._exit`` skips both; the sidecar and
    its workers see their parent gone and exit by themselves. Stop signals stay ignored until then (a stop)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("--version", "-V"):
        from fedlight import __version__

        print(f"fedlight {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"fedlight: error: unknown command {cmd!r}{closest(cmd, COMMANDS)} (commands: {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return command(cmd)(rest)
    except ConfigError as e:
        print(f"fedlight {cmd}: error: {e}", file=sys.stderr)
        return getattr(e, "status", 2)  # 74: a write to the run directory failed during the run
    except Stopped as e:  # a signal stopped the run after a finished round (its checkpoint is on disk)
        if _rank() == 0:
            print(f"fedlight: {e}", file=sys.stderr, flush=True)
        return e.status
    except KeyboardInterrupt:
        print("fedlight: interrupted; finished rounds are kept (resume with --resume auto)", file=sys.stderr)
        return 130
    except RuntimeError as e:  # a collective whose peer died (rank 0 killed): one line, not gloo's traceback
        why = _peer_lost(e)
        if why is None:
            raise
        print(f"fedlight {cmd}: error: process {_rank()} of the run lost another one ({why}); it stops too. The run "
              "directory keeps the last checkpoint: `--resume auto` continues it", file=sys.stderr, flush=True)
        return 1


def _peer_lost(e: RuntimeError) -> str | None:
    """What a collective's error says, when it is that another process of the run is gone (``None``: another)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if not re.search(r"gloo|nccl|connection (closed|reset) by peer|remote worker", text, re.IGNORECASE):
        return None
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0][:160]  # gloo: [file:line] Connection closed by ...


def _rank() -> int:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0)


if __name__ == "__main__":
    sys.exit(main())
