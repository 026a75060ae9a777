"""Draw who calls what in one federated round, as the SVG the documentation shows (docs/_static/round.svg).

    python tools/round_diagram.py [OUT.svg]

A sequence diagram: one lane per part (the driver, the loop, sampling, the server rule, the client rule, the task and
the run record), one arrow per call, top to bottom in the order a round makes them. ``CALLS`` is the picture's
content; ``tests/test_docs_site.py`` checks that every method it names exists, so the picture cannot name a call the
code no longer makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "_static" / "round.svg"

LANES = [
    ("FitDriver", "fedlight.engine.driver.FitDriver"),
    ("FederatedLoop", "fedlight.engine.loop.FederatedLoop"),
    ("sampling", "fedlight.core.sampling"),
    ("ServerRule", "fedlight.core.rules.ServerRule"),
    ("LocalUpdateRule\n(each sampled client)", "fedlight.core.rules.LocalUpdateRule"),
    ("Task · RunRecord", "fedlight.tasks.base.Task"),
]
"""(label, the object whose methods the lane's arrows name)."""

# (from lane, to lane, call: the method of the target lane's object, text beside the arrow, returned value or "")
CALLS = [
    (0, 1, "run_round", "run_round(r)", ""),
    (1, 2, "sample_clients", "sample_clients(N, S, seed, r)", "S_r"),
    (1, 3, "broadcast", "broadcast(x_r, info, i)   for each i in S_r", "Broadcast"),
    (1, 4, "start", "start(model, ctx)   ctx: LocalContext (broadcast, state_i, optimizer, η_r, K)", ""),
    (4, 4, "step", "step(model, batch, ctx)   × K   (ctx.forward_backward, ctx.apply)", ""),
    (1, 4, "finish", "finish(model, ctx)", "ClientResult (Δ_i, extras, metrics)"),
    (1, 3, "aggregate", "aggregate(results)   only if overridden; else float64 weighted mean", "ClientResult"),
    (1, 3, "update", "update(x_r, agg, info)   info: RoundInfo", "x_{r+1}"),
    (0, 5, "evaluate", "task.evaluate(x_{r+1})   every loop.eval_every rounds", "test metrics"),
    (0, 5, "", "checkpoint + metrics.jsonl row   every loop.save_every rounds", ""),
]


def draw(out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "fedlight", "font.size": 9,
                         "font.family": "DejaVu Sans"})
    xs = [0.6 + 2.1 * i for i in range(len(LANES))]
    rows = len(CALLS) + 1
    fig, ax = plt.subplots(figsize=(13.5, 0.7 * rows + 1.3))
    ax.set_xlim(0, xs[-1] + 0.9)
    ax.set_ylim(-rows - 0.2, 1.2)
    ax.axis("off")
    for (label, _), x in zip(LANES, xs):
        ax.text(x, 0.55, label, ha="center", va="center", fontsize=9.5, weight="bold",
                bbox=dict(boxstyle="round,pad=0.4", fc="#e8eef7", ec="#4a6fa5"))
        ax.plot([x, x], [0.05, -rows], color="#9aa9bd", lw=1, ls=(0, (4, 3)), zorder=0)
    for k, (a, b, _, text, back) in enumerate(CALLS):
        y = -(k + 0.75)
        if a == b:  # a call of the lane on itself: the K local steps
            ax.plot([xs[a], xs[a] + 0.35, xs[a] + 0.35], [y + 0.12, y + 0.12, y - 0.3], color="#b4462b", lw=1.3)
            ax.annotate("", xy=(xs[a], y - 0.3), xytext=(xs[a] + 0.35, y - 0.3),
                        arrowprops=dict(arrowstyle="-|>", color="#b4462b", lw=1.3))
            ax.text(xs[a] - 0.15, y - 0.09, text, ha="right", va="center", color="#b4462b")
            continue
        ax.annotate("", xy=(xs[b], y), xytext=(xs[a], y),
                    arrowprops=dict(arrowstyle="-|>", color="#1f3b63", lw=1.3))
        left = min(xs[a], xs[b])
        ax.text(left + 0.1, y + 0.13, text, ha="left", va="bottom", color="#1f3b63")
        if back:
            ax.annotate("", xy=(xs[a], y - 0.3), xytext=(xs[b], y - 0.3),
                        arrowprops=dict(arrowstyle="-|>", color="#6b7a8f", lw=0.9, ls="--"))
            ax.text(max(xs[a], xs[b]) - 0.1, y - 0.36, back, ha="right", va="top", color="#4b5563",
                    fontsize=8.5, style="italic")
    ax.text(xs[0] - 0.5, -rows + 0.05, "one round r; the loop repeats it for r = 0 … R−1, then writes summary.json "
            "and final_model.pt", ha="left", va="center", fontsize=8.5, color="#4b5563")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(f"wrote {draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)}")
