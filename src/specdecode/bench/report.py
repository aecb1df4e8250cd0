"""Benchmark output: a terminal table, a Markdown report and PNG plots.

Glossary: *x* after a ratio means "times the baseline's tokens per second".
"""

from __future__ import annotations

from pathlib import Path


def _ratio(r: dict | None) -> str:
    return "-" if not r else f"{r['geomean']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]"


def _num(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


COLUMNS = ("method", "tok/s", "vs ar (geo [min-max])", "vs hf-assisted", "accept", "tok/fwd", "mismatches", "same text as ar")


def table_rows(result: dict) -> list[tuple[str, ...]]:
    rows = []
    for name, m in result["methods"].items():
        rows.append((
            name,
            f"{m['tokens_per_second']:.2f}",
            _ratio(m["speedup_vs_ar"]),
            _ratio(m["speedup_vs_hf_assisted"]),
            _num(m["acceptance_rate"]),
            _num(m["tokens_per_target_forward"]),
            "-" if m["mismatches"] is None else str(m["mismatches"]),
            "-" if m.get("same_text_as_ar") is None else f"{m['same_text_as_ar']}/{m['prompts']}",
        ))
    return rows


def format_table(result: dict) -> str:
    rows = [COLUMNS, *table_rows(result)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    cm = result.get("cost_model")
    if cm:
        lines.append("")
        lines.append(
            f"cost model: alpha={cm['alpha']:.3f}, c={cm['c']:.3f}, target k=1 {cm['target_seconds_by_k']['1'] * 1e3:.0f} ms, "
            f"k={result['config']['gamma'] + 1} {cm['target_seconds_by_k'][str(result['config']['gamma'] + 1)] * 1e3:.0f} ms; "
            f"predicted speedup at gamma={result['config']['gamma']}: {cm['predicted_at_gamma']:.2f}x "
            f"(measured {cm['measured_speedup']:.2f}x); best gamma {cm['best_gamma']} -> {cm['best_predicted_speedup']:.2f}x"
        )
    if cm and cm.get("in_run"):
        r = cm["in_run"]
        lines.append(
            f"in-run costs: ar {r['ar_seconds_per_forward'] * 1e3:.0f} ms/forward, draft {r['draft_seconds_per_drafted_token'] * 1e3:.0f} ms/drafted token, "
            f"verify {r['verify_seconds_per_forward'] * 1e3:.0f} ms/forward, {r['tokens_per_target_forward']:.2f} tokens/forward -> decode-only speedup "
            f"{r['decode_only_speedup']:.2f}x; prefill share of wall time: ar {r['prefill_share_ar']:.0%}, draft {r['prefill_share_draft']:.0%}"
        )
    return "\n".join(lines)


def markdown(result: dict) -> str:
    cfg = result["config"]
    out = [
        "# specdecode bench report",
        "",
        f"- command: `{cfg['command']}`",
        f"- target `{cfg['target']}`, draft `{cfg['draft']}`, gamma {cfg['gamma']}, device {cfg['device']}, dtype {cfg['dtype']}",
        f"- suite `{cfg['suite']}` ({cfg['prompts']} prompts from offset {cfg['offset']}), max_new_tokens {cfg['max_new_tokens']}, "
        f"temperature {cfg['temperature']}, top_k {cfg['top_k']}, top_p {cfg['top_p']}"
        + (", ignore_eos (every answer max_new_tokens long)" if cfg.get("ignore_eos") else ""),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    out += ["| " + " | ".join(r) + " |" for r in table_rows(result)]
    cm = result.get("cost_model")
    if cm:
        out += ["", "## Cost model", ""] + [l for l in format_table(result).splitlines() if l.startswith(("cost model", "in-run"))] + ["",
                "| gamma | predicted tokens/forward | predicted step (ms) | predicted speedup |", "|---|---|---|---|"]
        out += [f"| {r['gamma']} | {r['tokens_per_target_forward']:.2f} | {r['step_seconds'] * 1e3:.0f} | {r['predicted_speedup']:.2f}x |"
                for r in cm["by_gamma"]]
        out += ["", "Target pass time by new tokens k: " + ", ".join(f"k={k}: {v * 1e3:.0f} ms" for k, v in cm["target_seconds_by_k"].items())]
    return "\n".join(out) + "\n"


def plots(result: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def figure(name: str, xlabel: str | None, ylabel: str, draw) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        draw(ax)
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        written.append(folder / name)
        fig.savefig(written[-1])
        plt.close(fig)

    names = [n for n, m in result["methods"].items() if m["speedup_vs_ar"]]

    def speedups(ax):
        ax.bar(names, [result["methods"][n]["speedup_vs_ar"]["geomean"] for n in names])
        ax.axhline(1.0, color="grey", lw=1)

    figure("speedup.png", None, "speedup vs ar (geomean)", speedups)
    with_pos = {n: m["accepted_by_position"] for n, m in result["methods"].items() if m.get("accepted_by_position")}
    if with_pos:
        def by_position(ax):
            for n, rates in with_pos.items():
                ax.plot(range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates], marker="o", label=n)

        figure("acceptance_by_position.png", "draft position", "P(accepted | drafted)", by_position)
    cm = result.get("cost_model")
    if cm:
        def predicted(ax):
            ax.plot([r["gamma"] for r in cm["by_gamma"]], [r["predicted_speedup"] for r in cm["by_gamma"]], marker="o", label="predicted")
            if cm.get("measured_speedup") is not None:
                ax.scatter([result["config"]["gamma"]], [cm["measured_speedup"]], color="red", zorder=3, label="measured")

        figure("cost_model.png", "gamma", "speedup vs ar", predicted)
    return written
