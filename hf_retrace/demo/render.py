"""The page's HTML: each answer coloured round by round (:func:`render_tokens`), the metric cards, the acceptance plot's
data, and the CSS and legend they use."""

from __future__ import annotations

import html

from .rounds import RoundInfo
from .snapshot import SideState, Snapshot

CSS = """
.hfr-tokens { white-space: pre-wrap; word-break: break-word; line-height: 1.9; font-size: 15px;
  min-height: 4em; padding: 10px 12px; border: 1px solid var(--border-color-primary, #ddd); border-radius: 8px; }
.hfr-tokens.hfr-running::after { content: "▌"; opacity: .5; }
.hfr-tokens span { border-radius: 3px; }
.hfr-acc { background: #c6f0c2; }
.hfr-cor { background: #ffd3a1; }
.hfr-bon { background: #c9defc; }
.hfr-tgt { background: #e6e6e6; }
.hfr-round.hfr-fused { border-bottom: 3px solid #9b59d0;
  box-decoration-break: clone; -webkit-box-decoration-break: clone; }
.hfr-nl::after { content: "↵"; opacity: .5; font-size: .85em; }
.hfr-rej::after { content: "✗" attr(data-n); font-size: 10px; vertical-align: super; color: #c0392b;
  margin-left: 1px; }
.hfr-legend { display: flex; flex-wrap: wrap; gap: 6px 14px; font-size: 13px; align-items: center; }
.hfr-legend span.sw { display: inline-block; padding: 0 6px; border-radius: 3px; }
.hfr-metrics { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 8px; }
.hfr-metric { border: 1px solid var(--border-color-primary, #ddd); border-radius: 8px; padding: 6px 10px; }
.hfr-metric b { display: block; font-size: 20px; }
.hfr-metric small { color: var(--body-text-color-subdued, #777); }
.hfr-empty { color: var(--body-text-color-subdued, #888); font-style: italic; }
"""

LEGEND_HTML = (
    '<div class="hfr-legend" id="hfr-legend">'
    '<span><span class="sw hfr-acc">drafted, accepted</span></span>'
    '<span><span class="sw hfr-cor">target\'s correction</span><span class="hfr-rej" data-n="n"></span> '
    "(after n drafts were rejected)</span>"
    '<span><span class="sw hfr-bon">target\'s bonus</span> (whole block accepted)</span>'
    '<span><span class="sw hfr-tgt">target alone</span> (no draft: first token)</span>'
    '<span><span class="hfr-round hfr-fused">ReTrace-fused round</span> (the block reused the kept rejected '
    "suffix of the round before)</span>"
    "</div>"
)


def _kind(info: RoundInfo, index: int) -> str:
    if index < info.accepted:
        return "hfr-acc"
    if info.drafted == 0:
        return "hfr-tgt"
    return "hfr-bon" if info.rejected == 0 else "hfr-cor"


def render_tokens(side: SideState | None, placeholder: str = "") -> str:
    """The answer as HTML; for a drafted side one span per round, coloured per token (see ``LEGEND_HTML``)."""
    if side is None:
        return f'<div class="hfr-tokens"><span class="hfr-empty">{html.escape(placeholder)}</span></div>'
    running = "" if side.done else " hfr-running"
    if side.method == "plain":
        text = "".join(p for pieces in side.pieces for p in pieces)
        return f'<div class="hfr-tokens{running}">{html.escape(text)}</div>'
    parts = [f'<div class="hfr-tokens{running}">']
    for n, (info, pieces) in enumerate(zip(side.rounds, side.pieces), start=1):
        if info.drafted:
            title = f"round {n}: {info.accepted}/{info.drafted} drafts accepted" + (
                ", block fused with the kept rejected suffix" if info.fused else "")
        else:
            title = f"round {n}: target token (no draft)"
        parts.append(f'<span class="hfr-round{" hfr-fused" if info.fused else ""}" title="{html.escape(title)}">')
        marker = f'<span class="hfr-rej" data-n="{info.rejected}"></span>' if info.rejected > 0 else ""
        last = max((i for i, piece in enumerate(pieces) if piece), default=-1)
        for i, piece in enumerate(pieces):
            if not piece:
                continue
            body = piece.rstrip("\n")
            newlines = piece[len(body) :]  # kept outside the coloured span, after the round's rejection marker
            kind = _kind(info, i) + (" hfr-nl" if newlines else "")
            parts.append(f'<span class="{kind}">{html.escape(body)}</span>')
            if i == last:
                parts.append(marker)
            parts.append(newlines)
        if last < 0:
            parts.append(marker)
        parts.append("</span>")
    parts.append("</div>")
    return "".join(parts)


def render_metrics(snap: Snapshot | None) -> str:
    if snap is None:
        return '<div class="hfr-metrics"></div>'

    def card(label: str, value: str, sub: str = "") -> str:
        return f'<div class="hfr-metric"><small>{html.escape(label)}</small><b>{html.escape(value)}</b>' \
               f'<small>{html.escape(sub)}</small></div>'

    p, d = snap.plain, snap.drafted
    cards = [card("plain decoding", f"{p.tokens_per_second:.1f} tok/s",
                  f"{len(p.token_ids)} tokens, {p.seconds:.2f} s")]
    if d is not None:
        cards.append(card(d.title, f"{d.tokens_per_second:.1f} tok/s", f"{len(d.token_ids)} tokens, {d.seconds:.2f} s"))
        rounds = d.drafted_rounds
        cards.append(card("τ (tokens per target forward)", f"{d.tau:.2f}" if rounds else "–",
                          f"{len(rounds)} drafting rounds"))
        cards.append(card("speed-up", f"{snap.speedup:.2f}×" if snap.speedup is not None else "–",
                          "drafted vs plain tokens/s"))
        if d.method == "retrace":
            fused = sum(r.fused for r in d.rounds)
            kept = (d.stats or {}).get("kept_token_commit_rate")
            cards.append(card("ReTrace-fused rounds", f"{fused}/{len(rounds)}" if rounds else "–",
                              f"kept rejected tokens later committed: {kept:.0%}" if kept is not None else ""))
        same = snap.identical
        if same is not None and snap.temperature == 0:
            cards.append(card("same text as plain?", "yes ✓" if same else "no ✗", "greedy: lossless"))
    return '<div class="hfr-metrics" id="hfr-metrics">' + "".join(cards) + "</div>"


def acceptance_frame(snap: Snapshot | None):
    """Per-position acceptance of the finished drafted side as a DataFrame (None when there is nothing to plot)."""
    import pandas as pd

    if snap is None or snap.drafted is None or not snap.drafted.done or not snap.drafted.stats:
        return None
    rates = snap.drafted.stats.get("per_position_acceptance") or []
    if not rates:
        return None
    slots = [str(i) for i in range(1, len(rates) + 1)]  # categories (a numeric x would be a continuous axis)
    return pd.DataFrame({"draft slot": slots, "acceptance rate": [float(r) for r in rates]})
