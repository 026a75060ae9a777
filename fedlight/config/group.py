"""``fedlight lockstep``: several ``fedlight fit`` runs in one process, advanced together round by round
(:mod:`fedlight.engine.lockstep`); each is an ordinary run in its own directory.

``fedlight lockstep FIT_FLAGS :: FIT_FLAGS ...`` runs each flag set (as ``fedlight fit`` takes it);
``fedlight lockstep FIT_FLAGS --seeds 0,1,2`` runs those seeds of one recipe (with ``--out_dir D``, in ``D/seed<k>``).
``fedlight reproduce --lockstep`` starts it for the seeds of a row and the rows with the same local rule.
``--streams auto|on|off`` (default: ``$FEDLIGHT_LOCKSTEP_STREAMS``, else auto): the unions that cannot share a chunk
trained interleaved on their own CUDA streams (on), one after another (off), or interleaved on CUDA only (auto).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError, check

SEPARATOR = "::"
STREAMS_ENV = "FEDLIGHT_LOCKSTEP_STREAMS"
"""The default of ``--streams`` (so ``fedlight reproduce``'s groups take it from the environment)."""


def member_argvs(argv: list[str]) -> list[list[str]]:
    """The ``fedlight fit`` flags of each member: ``::``-separated sets, or one set with ``--seeds a,b,c``."""
    sets, cur = [], []
    for a in argv:
        if a == SEPARATOR:
            sets.append(cur)
            cur = []
        else:
            cur.append(a)
    sets.append(cur)
    out = []
    for s in sets:
        seeds, rest = _take_flag(s, "--seeds")
        if seeds is None:
            out.append(rest)
            continue
        out.extend(_with_seed(rest, int(k)) for k in _seed_list(seeds))
    check(all(out), f"`fedlight lockstep`: an empty run between `{SEPARATOR}`s; give each run its `fedlight fit` flags")
    return out


def _seed_list(text: str) -> list[int]:
    """The seeds of ``--seeds a,b,c``: each a valid seed, at least one, none twice (one line otherwise, before
    anything is written)."""
    from fedlight.config.plan import SEED_MAX

    items = [k.strip() for k in text.split(",")]
    bad = [k for k in items if not (k.isascii() and k.isdigit() and int(k) <= SEED_MAX)]
    if bad:
        what = "no seed" if not text.strip() else f"{bad[0]!r} is not a seed" if bad[0] else "an empty item"
        raise ConfigError(f"`--seeds` takes seeds separated by commas, each a whole number from 0 to {SEED_MAX} "
                          f"(e.g. 0,1,2); got {text!r}: {what}")
    seeds = [int(k) for k in items]
    twice = sorted({k for k in seeds if seeds.count(k) > 1})
    check(not twice, f"`--seeds {text}` names seed {', '.join(map(str, twice))} more than once; each seed runs once")
    return seeds


def _take_flag(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """``argv`` without ``name VALUE`` (or ``name=VALUE``), and that value."""
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == name:  # the last argument: no value (an empty one, refused by the caller)
            value, i = argv[i + 1] if i + 1 < len(argv) else "", i + 2
            continue
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return value, out


def _with_seed(argv: list[str], seed: int) -> list[str]:
    out_dir, rest = _take_flag(argv, "--out_dir")
    check(out_dir != "", "`--out_dir` of a `--seeds` group needs a folder (its runs go to FOLDER/seed<k>)")
    return [*rest, "--seed", str(seed), *(["--out_dir", str(Path(out_dir) / f"seed{seed}")] if out_dir else [])]


def fit_group(argvs: list[list[str]], say=None, streams: str = "auto") -> dict[str, Any]:
    """Parse every member's ``fedlight fit`` flags (a bad one refuses the group before anything runs), then
    :func:`lockstep_fit`."""
    from fedlight.config.cli import _parse, cpu_threads

    members = [_parse("fedlight lockstep", argv) for argv in argvs]
    cpu_threads(members[0][0].get("accelerator", "auto"))
    return lockstep_fit([{**kwargs, "_config_text": text} for kwargs, text in members], say, streams)


def lockstep_fit(runs: list[dict[str, Any]], say=None, streams: str = "auto") -> dict[str, Any]:
    """Run ``runs`` (each the keyword arguments of :func:`fedlight.fit`, e.g. ``dict(model=..., data=..., seed=1,
    out_dir=...)``; each its own model and data objects) in lockstep on one Fabric: run directory → summary, or the
    exception the run ended with. ``streams``: :data:`fedlight.engine.lockstep.STREAMS`."""
    from fedlight.config import api, launch, plan
    from fedlight.engine.lockstep import Lockstep
    from fedlight.run import stops

    devices = {plan.resolve_device(k.get("accelerator", "auto"), k.get("precision"), k.get("algorithm")
                                   or plan.default_algorithm()) for k in runs}
    check(len(devices) == 1, f"`fedlight lockstep`: the runs of a group share one device and precision, got "
          f"{sorted(devices)}; run the others in another group")
    check(all(k.get("devices", 1) == 1 and k.get("num_nodes", 1) == 1 for k in runs),
          "`fedlight lockstep`: a group runs in one process; drop `--devices`/`--num_nodes` (or run the runs alone)")
    (accelerator, precision), = devices
    fabric = launch.fabric(accelerator, 1, 1, precision)
    steps = {}
    for i, kwargs in enumerate(runs):
        name = str(kwargs.get("out_dir") or f"run {i + 1} (seed {kwargs.get('seed', 0)})")
        check(name not in steps, f"`fedlight lockstep`: two runs write {name}; give each its own `--out_dir`")
        steps[name] = api.fit_steps({**kwargs, "precision": precision, "accelerator": accelerator}, fabric=fabric)
    with stops.stop_signals():  # the group's handlers outlive its members' (restored last)
        return Lockstep(steps, say, streams).run()


def cmd_lockstep(argv: list[str]) -> int:
    """Exit 0 when every run finished, 1 when one diverged or failed, 128 + signal when a signal stopped them."""
    from fedlight.run.stops import Stopped

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from fedlight.engine.lockstep import STREAMS

    streams, argv = _take_flag(argv, "--streams")
    if streams is None:
        streams = os.environ.get(STREAMS_ENV) or "auto"
    check(streams in STREAMS, f"`fedlight lockstep --streams` is one of {', '.join(STREAMS)}, got {streams!r}")
    results = fit_group(member_argvs(argv), streams=streams)
    status = 0
    for name, res in results.items():
        if isinstance(res, Stopped):
            line, status = f"stopped ({res})", max(status, res.status)
        elif isinstance(res, BaseException):  # a refusal (exit 2, as alone) or a failure
            code = getattr(res, "status", 2 if isinstance(res, ConfigError) else 1)
            line, status = f"failed: {type(res).__name__}: {res}", max(status, code)
        elif res.get("diverged_at_round") is not None:
            line, status = f"diverged at round {res['diverged_at_round']}", max(status, 1)
        else:
            line = "done" + "".join(f", {k} {v:.4f}" for k, v in res.items() if k.startswith("final_test_")
                                    and isinstance(v, float))
        print(f"fedlight lockstep: {name}: {line}", file=sys.stderr if status else sys.stdout, flush=True)
    return status
