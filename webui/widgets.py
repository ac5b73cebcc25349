"""Streamlit pieces more than one page draws."""

import streamlit as st

from sae_dist.analytics.cards import Card
from sae_dist.analytics.events import events_summary
from sae_dist.analytics.monitor_views import View, stack_view


def card_row(cards: list[Card]) -> None:
    """Metric cards in a row; each one's value comes from the chart it belongs to
    (`charts.Panel.card`), so a card never disagrees with its chart."""
    with st.container(horizontal=True):
        for card in cards:
            st.metric(card.label, card.value, border=True, help=card.help)


def chart_columns(charts: list[tuple], columns: int = 2) -> None:
    """`charts` as (chart or None, its alt text, what to say without it), read left to right
    then down in `columns` columns, each column's charts stacked (`stacked_charts`)."""
    for i, column in enumerate(st.columns(columns)):
        with column:
            stacked_charts(charts[i::columns])


def stacked_charts(charts: list[tuple]) -> None:
    """`charts` as (chart or None, its alt text, what to say without it) one above another,
    sent to the browser as one Vega view (`chart_stack`: each view costs the browser 0.15-0.25 s
    to draw; its spec is written without Altair's costly composition); a chart not drawn
    (nothing measured) is said in words under the others."""
    draw_view(stack_view(charts))


def view_columns(views: list[View]) -> None:
    """Views (`monitor_views`) side by side, one a column."""
    for view, column in zip(views, st.columns(len(views))):
        with column:
            draw_view(view)


def draw_view(view: View) -> None:
    """A view built ahead (`monitor_views`): its chart element, then in words each chart it
    could not draw."""
    if view.spec is not None:
        st.vega_lite_chart(spec=view.spec, alt=view.alt)
    for missing in view.missing:
        st.caption(missing)


def text_widths(widths: dict[str, int]) -> dict:
    """A dataframe's column_config giving these text columns a fixed width in px (a column the
    table lacks is ignored): free text otherwise widens its column past the page."""
    return {name: st.column_config.TextColumn(width=px) for name, px in widths.items()}


def command_hint(command: str) -> None:
    """A terminal command an empty state suggests, as inline code. Not `st.code`: its syntax
    highlighter is a script of its own that every page load showing one fetches and runs (0.1 to
    0.2 s of the browser's main thread, scripts/bench_app.py)."""
    st.markdown(f"`{command}`")


def events_toggle(key: str, events: list[dict]) -> bool:
    """The opt-in for run events on the training charts (off by default; disabled for a run
    without events): whether to draw them."""
    summary = events_summary(events)
    return st.toggle(
        "Show run events on the charts", key=key, value=False, disabled=not events,
        help=(f"{summary}. Close ones are drawn as one dashed mark (thicker the more it holds; "
              "its tooltip lists them)." if summary else "This run recorded no event."))


def log_tail(job: dict, lines: int) -> None:
    """The last `lines` lines of each of a job's log files (stdout, then stderr when separate),
    newest at the end; what is not there yet says so."""
    from sae_dist.analytics import jobs

    paths = jobs.log_paths(job)
    if not paths:
        st.caption("No log yet: it is written once the job starts." if job["state"] == "PENDING"
                   else "It never started: no log." if job["started_at"] is None
                   else "This job's output files were not recorded.")
        return
    for label, path in paths:
        tail = jobs.tail_lines(path, lines)
        st.markdown(f"**{label}** · `{path}`" + (f" · last {lines:,} lines"
                                                  if tail and len(tail) >= lines else ""))
        if tail is None:
            st.caption("The file cannot be read (not written yet, or removed).")
        elif not tail:
            st.caption("Empty so far.")
        else:  # no height: the newest line, at the end, is in view without scrolling the box
            st.code("\n".join(tail), language=None)
