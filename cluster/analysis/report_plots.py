"""The report's figures: one PNG per question, every configuration in each, the same colour
for a configuration in every figure. A line is the mean over the configuration's runs (seeds)
at each step; the band is their min-max. Per-step training metrics are smoothed by a centred
moving average (ReportConfig.smooth, shortened on short runs: `effective_window`) drawn over the
raw values, which stay visible, faintly; evaluations are plotted as they are. Steps are whole
numbers on every axis.

Every figure is sized for a paper: a one-panel figure for a column (COLUMN_WIDTH_IN), one of
several panels for the page's text width (PAGE_WIDTH_IN), its legend under the panels and its
text laid out inside the canvas by matplotlib's constrained layout (tests/test_report.py checks
every figure a report writes)."""
from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from cluster.analysis.labels import SET_LABELS, configuration_keys, label_value
from rewards.config import EVAL_SETS

COLUMN_WIDTH_IN = 3.4   # one column of a two-column paper
PAGE_WIDTH_IN = 7.0     # the text width of a two-column paper (a one-column page is narrower
                        # than 7 in only in its margins)
DPI = 120               # 840 px across a page-wide figure: what a docs page shows
PNG_COLOURS = 256       # plots are saved as palette PNGs (save_png): about 4x smaller
FONT = {"font.size": 7.5, "axes.titlesize": 8, "axes.labelsize": 7.5, "xtick.labelsize": 7,
         "ytick.labelsize": 7, "legend.fontsize": 7, "legend.title_fontsize": 7,
         "figure.titlesize": 9.5}
_CHAR_IN = 0.55 * 7 / 72  # the width of an average character of the legend's 7-point text


@dataclass(frozen=True)
class Panel:
    key: str                    # metric in metrics.jsonl
    title: str
    ylabel: str
    log: bool | str = False     # log y axis (ratios, norms); "auto": symlog if a blow-up
                                # would flatten everything else into a line at 0
    per_step: bool = True       # logged every step rather than at evaluations (markers)
    smooth: bool = True         # moving average of a per-step metric (not of a setting like lag)
    ref: float | None = None    # a horizontal reference line (ratio 1 = on-policy)
    y_from_0: float | None = None  # a share: the y axis starts at 0 and reaches at least this


@dataclass(frozen=True)
class Figure:
    file: str
    title: str
    caption: str
    panels: tuple[Panel, ...]
    ref_key: str | None = None  # a config value drawn as a dashed line (the gradient clip)


_ACC = "fraction of problems solved"
_TOK = "fraction of tokens"
# Accuracy axes span at least 0-0.1, so that a few lucky problems out of 0 do not fill a panel.
_EVAL = {"per_step": False, "smooth": False, "y_from_0": 0.1}
FIGURES = (
    Figure("reward.png", "Training reward", "Mean task reward of each step's rollouts (what the "
           "policy is trained on, sampled by the behaviour policy).",
           (Panel("reward/mean", "Mean reward of the training batch", "mean reward"),)),
    Figure("accuracy.png", "Evaluation accuracy", "Greedy pass@1 on the in-domain and "
           "out-of-domain sets (and the far one when evaluated), and (when logged) accuracy of "
           "samples at temperature 1.",
           tuple(Panel(f"eval/{name}/{key}", f"{SET_LABELS[name].capitalize()}, {kind}", _ACC,
                       **_EVAL) for key, kind in (("accuracy", "greedy"),
                                                   ("sampled_accuracy", "sampled (T=1)"))
                 for name in EVAL_SETS)),
    Figure("kl.png", "KL to the reference policy", "Per-sequence KL(pi || pi_ref) of the "
           "learner's policy, estimated from the training batch with prefix importance weights "
           "(K1: unbiased, noisy, can be negative; K3: lower variance), and the sampler's own "
           "KL(mu || pi_ref), which differs from it off-policy.",
           (Panel("kl/pi_ref", "KL(pi || ref), K1 estimate", "KL per sequence (nats)", log="auto"),
            Panel("kl/pi_ref_k3", "KL(pi || ref), K3 estimate", "KL per sequence (nats)",
                  log="auto"),
            Panel("kl/mu_ref", "Sampler's KL(mu || ref)", "KL per sequence (nats)", log="auto"))),
    Figure("importance_ratio.png", "How off-policy the training data was", "Extremes of the "
           "per-token ratio pi/mu of the learner's policy to the sampler's (1 = on-policy), "
           "the fraction of tokens whose importance weight was clipped or truncated (and of "
           "tokens and samples a mask dropped), and the "
           "batch's mean lag in policy versions.",
           (Panel("is/ratio_max", "Largest token ratio pi/mu", "ratio (log scale)", log=True,
                  ref=1.0),
            Panel("is/ratio_min", "Smallest token ratio pi/mu", "ratio (log scale)", log=True,
                  ref=1.0),
            Panel("is/tis_clipped_frac", "Task term: tokens with rho > tis_cap", _TOK,
                  y_from_0=0.0),
            Panel("is/ppo_clip_clipped_frac", "Task term: PPO-clipped tokens", _TOK, y_from_0=0.0),
            # learner.task_off_policy icepop, mis, seq_mask_*: what the band dropped
            Panel("is/masked_token_frac", "Task term: tokens a mask dropped", _TOK,
                  y_from_0=0.0),
            Panel("is/masked_sample_frac", "Task term: samples with a masked token",
                  "fraction of samples", y_from_0=0.0),
            Panel("is/truncated_frac", "KL term: truncated prefix weights", _TOK, y_from_0=0.0),
            Panel("lag/mean", "Mean lag of the batch", "policy versions", smooth=False))),
    Figure("grad_norm.png", "Gradient norm", "Global L2 norm of the gradient before clipping; "
           "the dashed line is learner.grad_clip, above which updates are scaled down.",
           (Panel("grad/norm", "Gradient norm before clipping", "L2 norm (log scale)", log=True),),
           ref_key="learner.grad_clip"),
    # Runs with task.environment only (drawn where its metrics were logged: docs/multi-turn.md).
    Figure("episodes.png", "Multi-turn episodes", "Policy turns per sample, the share of samples "
           "that called the environment (tool calls), the shares cut by the turn limit and by "
           "the episode's token budget, the environment's seconds per sample and the run's "
           "share of samples it failed.",
           (Panel("env/turns_mean", "Policy turns per sample", "turns"),
            Panel("env/tool_call_rate", "Samples with a tool call", "fraction of samples",
                  y_from_0=0.1),
            Panel("env/truncated_turns_frac", "Cut by the turn limit", "fraction of samples",
                  y_from_0=0.1),
            Panel("env/truncated_length_frac", "Cut by the token budget", "fraction of samples",
                  y_from_0=0.1),
            Panel("env/seconds_mean", "Time in the environment", "seconds per sample"),
            Panel("env/failure_share", "Samples the environment failed (run)",
                  "fraction of samples", smooth=False, y_from_0=0.0))),
)


def pass_at_k_figure(runs: list) -> Figure:
    """pass@k at each evaluation, a panel per set and logged k above 1 (pass@1 is the sampled
    accuracy of accuracy.png): how much a policy solves given k tries, the measure RL on
    verifiable rewards is said to trade for pass@1 (rewards/pass_at_k.py)."""
    logged = {key for r in runs for row in r.rows.values() for key in row
              if key.startswith("eval/") and "/pass@" in key}

    def order(key: str) -> tuple:
        _, name, measure = key.split("/")
        return EVAL_SETS.index(name) if name in EVAL_SETS else 99, int(measure[len("pass@"):])

    keys = sorted((k for k in logged if not k.endswith("/pass@1")), key=order)
    return Figure("pass_at_k.png", "pass@k", "Unbiased pass@k from the samples of each "
                  "evaluation (eval.pass_k): the share of problems that k tries would solve.",
                  tuple(Panel(k, f"{SET_LABELS[k.split('/')[1]].capitalize()}, "
                                 f"{k.split('/')[2]}", _ACC, **_EVAL) for k in keys))


# Not a per-step figure: one point per run (report.py draws it with plot_accuracy_against_kl).
ACCURACY_AGAINST_KL = Figure(
    "accuracy_vs_kl.png", "Accuracy against the distance to the reference",
    "Each run's final greedy accuracy (the final checkpoint's evaluation where there is one) "
    "against its KL(pi || pi_ref) at the end (mean over the last steps; a log scale where the "
    "runs span a decade or more): a "
    "configuration that scores higher out-of-domain only because it moved further from the "
    "reference lies to the right of the others, one that generalises lies above them at the "
    "same distance.", ())


def plot_accuracy_against_kl(measures, groups: dict, out_dir: Path) -> str | None:
    """One point per finished run: final accuracy (in-domain, out-of-domain) against the KL to
    the reference at the end; the colours and markers of the other figures' configurations.
    None when no run has both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [(name, SET_LABELS[name]) for name in ("in_domain", "out_of_domain")]
    points = [m for m in measures if m.finished and math.isfinite(m.kl_end) and m.kl_end > 0
              and any(math.isfinite(m.accuracy.get(n, math.nan)) for n, _ in sets)]
    if not points:
        return None
    styles = _styles(groups, plt)
    markers = {"-": "o", "--": "s", ":": "^", "-.": "D"}
    kls = [m.kl_end for m in points]
    with plt.rc_context(FONT):
        fig, axes = new_figure(plt, len(sets), list(groups))
        for ax, (name, label) in zip(axes.flat, sets):
            for config in groups:
                ms = [m for m in points if m.configuration == config
                      and math.isfinite(m.accuracy.get(name, math.nan))]
                if ms:
                    color, linestyle = styles[config]
                    ax.scatter([m.kl_end for m in ms], [m.accuracy[name] for m in ms], s=16,
                               color=color, marker=markers.get(linestyle, "o"), label=config,
                               alpha=0.85)
            log = log_or_linear(ax.xaxis, ax.set_xscale, min(kls), max(kls))
            ax.set_xlabel("KL(pi || ref) at the end (nats per sequence"
                          + (", log scale)" if log else ")"))
            ax.set_ylabel("final greedy accuracy")
            ax.set_title(f"{label.capitalize()}")
            ax.grid(True, alpha=0.3)
        finish_figure(fig, axes, ACCURACY_AGAINST_KL.title + " (one point per run)", "",
                out_dir / ACCURACY_AGAINST_KL.file, plt)
    return ACCURACY_AGAINST_KL.file


def new_figure(plt, panels: int, labels: list[str]):
    """A figure of `panels` panels (two or three across) for a column (one panel) or the page,
    tall enough for its title, its panels and a legend of `labels` under them."""
    ncols = 1 if panels == 1 else 2 if panels in (2, 4) else 3
    nrows = math.ceil(panels / ncols)
    width = COLUMN_WIDTH_IN if ncols == 1 else PAGE_WIDTH_IN
    columns, lines = _legend_shape(labels, width)
    legend_rows = math.ceil(len(labels) / columns) * lines + 3  # + the note above the entries
    height = 0.35 + nrows * (2.3 if ncols > 1 else 2.1) + 0.13 * legend_rows
    fig = plt.figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _legend_shape(labels: list[str], width: float) -> tuple[int, int]:
    """(columns, lines per label) of a legend of `labels` across `width` inches: as many
    columns as the longest label allows, a label too long for the width wrapped at its '-'."""
    per_line = int((width - 0.5) / _CHAR_IN)
    wrapped = [_wrap_label(label, per_line) for label in labels] or [""]
    longest = max(len(line) for w in wrapped for line in w.split("\n"))
    columns = max(1, min(len(labels), int(width / (longest * _CHAR_IN + 0.45))))
    return columns, max(w.count("\n") + 1 for w in wrapped)


def _wrap_label(label: str, chars: int) -> str:
    """A configuration label broken after a '-' into lines of at most `chars` characters
    (a part longer than that stays whole)."""
    lines = [""]
    for part in label.split("-"):
        piece = part if not lines[-1] else "-" + part
        if lines[-1] and len(lines[-1]) + len(piece) > chars:
            lines[-1] += "-"
            lines.append(part)
        else:
            lines[-1] += piece
    return "\n".join(lines)


def _fit_axis_text(fig, axes) -> None:
    """Each panel's title and axis labels wrapped to the panel's width (height for the y
    label): a panel two inches wide holds about thirty characters of its title."""
    nrows, ncols = axes.shape
    across = fig.get_figwidth() / ncols - 0.45
    down = (fig.get_figheight() - 1.0) / nrows - 0.5
    for ax in axes.flat:
        if not ax.get_visible():
            continue
        for text, room in ((ax.title, across), (ax.xaxis.label, across), (ax.yaxis.label, down)):
            chars = max(12, int(room / (0.55 * text.get_fontsize() / 72)))
            text.set_text("\n".join(textwrap.wrap(text.get_text(), chars)))


def finish_figure(fig, axes, title: str, note: str, path: Path, plt, bands: dict | None = None
            ) -> None:
    """Title above the panels; the legend under them (each configuration's line over its
    band), with the note (what lines and bands are) as its heading, both wrapped to the
    figure's width; then save and close."""
    width = fig.get_figwidth()
    lines = {}
    for ax in axes.flat:  # a configuration may be missing from the first panel
        lines |= dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    labels = [label for label in lines if not label.startswith("_")]
    handles = [(bands[label], lines[label]) if label in (bands or {}) else lines[label]
               for label in labels]
    columns, _ = _legend_shape(labels, width)
    per_line = int((width - 0.5) / _CHAR_IN)
    heading = "\n".join(textwrap.wrap("configuration" + (f" ({note})" if note else ""),
                                      per_line))
    _fit_axis_text(fig, axes)
    fig.suptitle(title)
    fig.legend(handles, [_wrap_label(label, per_line) for label in labels],
               loc="outside lower center", ncols=columns, title=heading, frameon=False,
               alignment="left")
    save_png(fig, path)
    plt.close(fig)


def save_png(fig, path) -> None:
    """The figure as a palette PNG (PNG_COLOURS colours, Pillow's median cut): a plot of a few
    line colours loses nothing visible and takes a quarter of the bytes of true colour, which
    keeps the committed reports' plots small (tests/test_tree_size.py)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()  # drawn once in memory, written once as the palette PNG
    fig.savefig(buffer, dpi=DPI, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(PNG_COLOURS).save(path, optimize=True)


def _smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average ignoring non-finite values (NaN where a window has none)."""
    if window <= 1:
        return values
    half, out = window // 2, []
    for i in range(len(values)):
        win = [v for v in values[max(0, i - half):i + half + 1] if math.isfinite(v)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out


def effective_window(smooth: int, steps: int) -> int:
    """The centred moving-average window drawn for runs of `steps` logged steps: the
    configured one, but at most a fifth of the run, so that a short run is not averaged into
    a flat line (a 3-step run is drawn unsmoothed), and odd (a centred window is: an even one
    is drawn as the odd one below it), so that the window the report states is the one drawn."""
    window = max(1, min(smooth, steps // 5))
    return window if window % 2 else window - 1


def report_window(runs, smooth: int) -> int:
    """The one window of a report's per-step curves: effective_window of its longest run."""
    return effective_window(smooth, max((sum(s > 0 for s in r.rows) for r in runs), default=0))


def _aggregate(runs, panel: Panel, window: int, x_axis: str = "step"):
    """(x, mean, min, max) over the runs at each x any of them logged (x: ReportConfig.x_axis
    for per-step metrics, the step for evaluations), per-step metrics smoothed over `window`
    (an odd number of steps: report_window)."""
    by_step: dict[float, list[float]] = {}
    for run in runs:
        steps, values = run.series(panel.key, x_axis if panel.per_step else "step")
        if panel.smooth:
            values = _smooth(values, window)
        for s, v in zip(steps, values):
            if math.isfinite(v):
                by_step.setdefault(s, []).append(v)
    steps = sorted(by_step)
    return (steps, [sum(by_step[s]) / len(by_step[s]) for s in steps],
            [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps])


def plot_figure(fig_spec: Figure, groups: dict, runs: list, cfg, out_dir: Path) -> str | None:
    """Draw one figure into out_dir; returns its file name, or None when no run logged any of
    its metrics (for example no off-policy clip fraction in an on-policy run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in fig_spec.panels
              if any(p.key in row for r in runs for row in r.rows.values())]
    if not panels:
        return None
    window = report_window(runs, cfg.smooth)
    styles = _styles(groups, plt)
    with plt.rc_context(FONT):
        fig, axes = new_figure(plt, len(panels), list(groups))
        bands: dict[str, object] = {}  # label -> its band, shown beside its line in the legend
        for ax, panel in zip(axes.flat, panels):
            top, bottom, typical = 0.0, math.inf, []
            for index, (label, group) in enumerate(groups.items()):
                steps, mean, lo, hi = _aggregate(group, panel, window, cfg.x_axis)
                if not steps:
                    continue
                top, bottom = max(top, *hi), min(bottom, *lo)
                typical += [abs(v) for v in mean]
                color, linestyle = styles[label]
                if panel.smooth and window > 1:  # the raw values, faintly, behind the average
                    raw_steps, raw, _, _ = _aggregate(group, panel, 1, cfg.x_axis)
                    ax.plot(raw_steps, raw, color=color, ls=linestyle, lw=0.6, alpha=0.3)
                ax.plot(steps, mean, color=color, ls=linestyle, lw=1.2, label=label,
                        marker=None if panel.per_step else "o", ms=2.5)
                if len(group) > 1:  # a hatch of its own: overlapping bands stay apart
                    bands[label] = ax.fill_between(steps, lo, hi, facecolor=(*color[:3], 0.12),
                                                   edgecolor=(*color[:3], 0.5), lw=0,
                                                   hatch=_HATCHES[index % len(_HATCHES)])
            refs = {r.config.get(fig_spec.ref_key) for r in runs} if fig_spec.ref_key else set()
            _style_axis(ax, panel, (bottom, top), typical, fig_spec.ref_key, refs - {None, 0})
            if panel.per_step and cfg.x_axis == "policy_version":
                ax.set_xlabel("policy version that sampled the batch")
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        finish_figure(fig, axes, fig_spec.title, _spread_note(groups, window, panels),
                out_dir / fig_spec.file, plt, bands)
    return fig_spec.file


_HATCHES = ("////", "\\\\\\\\", "....", "xxxx", "||||", "----", "++++", "oo")


def _styles(groups: dict, plt) -> dict[str, tuple]:
    """label -> (colour, line style). When configurations differ in max_lag and in something
    else (the paper's grid), a colour is the configuration apart from its lag and the line
    style is the lag (solid: the smallest), so each KL configuration reads across lags."""
    first = {label: group[0].config for label, group in groups.items()}
    keys = configuration_keys([g[0] for g in groups.values()])
    lags = sorted({c.get("max_lag", 0) for c in first.values()})
    by_lag = "max_lag" in keys and len(keys) > 1 and len(lags) <= len(_LAG_STYLES)
    colour_keys = [k for k in keys if not (by_lag and k == "max_lag")]

    def colour_of(config) -> str:
        return json.dumps([label_value(config, k) for k in colour_keys], sort_keys=True)

    colour_index: dict[str, int] = {}
    for config in first.values():
        colour_index.setdefault(colour_of(config), len(colour_index))
    colours = plt.get_cmap("tab10" if len(colour_index) <= 10 else "tab20").colors
    return {label: (colours[colour_index[colour_of(c)] % len(colours)],
                    _LAG_STYLES[lags.index(c.get("max_lag", 0))] if by_lag else "-")
            for label, c in first.items()}


_LAG_STYLES = ("-", "--", ":", "-.")


def _style_axis(ax, panel: Panel, span: tuple[float, float], typical: list[float], ref_key,
                refs) -> None:
    """Scale, limits, reference lines and labels of one panel. `span`: (lowest, highest) value
    drawn (min and max of the bands)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    plain = FuncFormatter(lambda y, _: f"{y:g}")  # 1000 rather than 10^3
    bottom, top = span
    ylabel = panel.ylabel
    if panel.ref is not None:
        ax.axhline(panel.ref, color="0.4", lw=0.8, ls=":")
    for value in refs:
        ax.axhline(value, color="0.3", lw=1, ls="--")
        ax.annotate(ref_key, (0.01, value), xycoords=("axes fraction", "data"), xytext=(0, 3),
                    textcoords="offset points", fontsize=6.5, color="0.3")
    if panel.log is True and not log_or_linear(ax.yaxis, ax.set_yscale, bottom, top):
        ylabel = ylabel.replace(" (log scale)", "")
    elif panel.log == "auto" and typical:
        usual = sorted(typical)[int(0.75 * (len(typical) - 1))]
        if top > 30 * max(usual, 1e-6):  # linear up to the usual range, log beyond it
            decade = 10.0 ** math.ceil(math.log10(max(usual, 1e-3)))  # ticks 0, 1, 10, ...
            ax.set_yscale("symlog", linthresh=decade)
            ax.yaxis.set_major_formatter(plain)
            ylabel += ", symlog scale"
    if panel.y_from_0 is not None:
        ax.set_ylim(0, max(top * 1.08, panel.y_from_0) or 0.05)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions are whole
    ax.set_title(panel.title)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def log_or_linear(axis, set_scale, low: float, high: float) -> bool:
    """A log scale for values from `low` to `high` when they span a decade or more, labelled
    with plain numbers (2, 0.5, not 2x10^0); else a linear one with plain full-precision
    labels and no offset (a log axis over 0.0101-0.0105 prints 1.01x10^-2 at every tick, and
    one near 1 labels each "1"). True when the scale is log."""
    from matplotlib.ticker import FuncFormatter, LogFormatter

    class _PlainLog(LogFormatter):  # LogFormatter picks which ticks to label; print them as %g
        def _num_to_string(self, x, vmin, vmax):
            return f"{x:g}"

    if 0 < low and high < 10 * low:
        axis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.10g}"))
        return False
    set_scale("log")
    axis.set_major_formatter(_PlainLog())  # minor ticks labelled only on short ranges
    axis.set_minor_formatter(_PlainLog(minor_thresholds=(1, 0.5)))
    return True


def _spread_note(groups: dict, window: int, panels) -> str:
    """What a line and a band are, and the moving-average window drawn (report_window)."""
    seeds = max(len(g) for g in groups.values())
    parts = [f"line: mean over its runs (up to {seeds}), band: min to max"
             if seeds > 1 else "one run each"]
    if window > 1 and any(p.smooth for p in panels):
        parts.append(f"per-step values: {window}-step centred moving average over the raw "
                     "values (faint)")
    return "; ".join(parts)
