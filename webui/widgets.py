"""Streamlit pieces more than one page draws."""

import streamlit as st

from sae_dist.analytics import format as fmt


def run_metrics(run: dict) -> None:
    """A training run's latest (or final) loss, FVU, L0, dead latents and throughput as metrics."""
    which = "Final" if run["final"] else "Latest"
    with st.container(horizontal=True):
        st.metric(f"{which} loss", fmt.fmt_number(run["loss"]), border=True)
        st.metric(f"{which} FVU", fmt.fmt_number(run["fvu"]), border=True)
        st.metric(f"{which} L0", fmt.fmt_number(run["l0"], 3), border=True)
        st.metric(f"{which} dead latents", fmt.fmt_percent(run["dead_fraction"]), border=True)
        st.metric(f"{which} samples/s", fmt.fmt_number(run["samples_per_s"], 3), border=True)
