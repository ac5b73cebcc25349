"""Streamlit pieces more than one page draws."""

import streamlit as st

from sae_dist.analytics.cards import Card
from sae_dist.analytics.events import events_summary


def card_row(cards: list[Card]) -> None:
    """Metric cards in a row; each one's value comes from the chart it belongs to
    (`charts.Panel.card`), so a card never disagrees with its chart."""
    with st.container(horizontal=True):
        for card in cards:
            st.metric(card.label, card.value, border=True, help=card.help)


def events_toggle(key: str, events: list[dict]) -> bool:
    """The opt-in for run events on the training charts (off by default; disabled for a run
    without events): whether to draw them."""
    summary = events_summary(events)
    return st.toggle(
        "Show run events on the charts", key=key, value=False, disabled=not events,
        help=(f"{summary}. Close ones are drawn as one dashed mark (thicker the more it holds; "
              "its tooltip lists them)." if summary else "This run recorded no event."))
