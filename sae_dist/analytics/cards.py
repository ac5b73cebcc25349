"""What a metric card beside a chart shows: the chart's last plotted value, in the chart's unit.

A card used to read the run's latest row while its chart dropped the missing values (the
trainer writes feature recovery only at checkpoints, so the latest row had none): the card
said "—" beside a chart at 25 %. Here a card's value comes from the very data frame the
chart draws (`charts.Panel.frame`), after the same bucketing and downsampling, with the
missing values left out as the chart leaves them out; "—" only when the chart has no point.

Pure functions on plain data; nothing here imports Streamlit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from sae_dist.analytics.units import Unit


@dataclass(frozen=True)
class Card:
    """One st.metric: its label, its text, and a help line saying what the figure is."""

    label: str
    value: str
    help: str | None = None


def _present(value: Any) -> bool:
    if value is None or value is pd.NA or value is pd.NaT:
        return False
    return not (isinstance(value, float) and math.isnan(value))


def last_plotted_row(frame: pd.DataFrame | None, column: str = "value") -> dict[str, Any] | None:
    """The last row (in the frame's order, which is the chart's x order) whose `column` the
    chart draws, as a dict; None when the chart has no point."""
    if frame is None or column not in frame or not len(frame):
        return None
    for i in range(len(frame) - 1, -1, -1):
        value = frame[column].iloc[i]
        if _present(value):
            row = frame.iloc[i].to_dict()
            return {k: (v if _present(v) else None) for k, v in row.items()}
    return None


def last_plotted(frame: pd.DataFrame | None, column: str = "value") -> float | None:
    """The value a card beside the chart of `frame` shows: its last plotted `column` value
    (None when the chart has no point)."""
    row = last_plotted_row(frame, column)
    return None if row is None else float(row[column])


def card_text(frame: pd.DataFrame | None, unit: Unit, column: str = "value") -> str:
    """The card's text: the chart's last plotted value in the chart's unit and rounding
    (`unit.value`, as the chart's tooltip writes it); "—" when the chart has no point."""
    return unit.text(last_plotted(frame, column))


def memory_text(frame: pd.DataFrame | None, unit: Unit) -> str:
    """Memory used "of" the devices' total at the chart's last point: "3.0 GiB of 32.0 GiB"
    (the total only where the chart has it at that point); "—" when the chart has no point."""
    row = last_plotted_row(frame)
    if row is None:
        return unit.text(None)
    total = row.get("total")
    return unit.text(row["value"]) + ("" if total is None else f" of {unit.text(total)}")


def sparkline(values: list[float | None], factor: float = 1.0) -> list[float] | None:
    """The points a card's sparkline draws (missing ones left out, in the plotted unit); None
    without any."""
    points = [v * factor for v in values if _present(v)]
    return points or None


def sparkline_text(values: list[float | None], unit: Unit) -> str:
    """A sparkline card's text: the last point its sparkline (`sparkline`) draws, "—" without
    one."""
    points = sparkline(values, unit.factor)
    return unit.text(points[-1] if points else None)


TRAINING_CARDS = {"loss": "loss", "fvu": "FVU", "l0": "L0", "dead_fraction": "dead latents",
                  "samples_per_s": "samples/s", "recovery_frac": "features recovered",
                  "recovery_mean_cos": "mean best cosine"}
"""A step metric's card label after "Latest " or "Final "."""


def training_cards(panels: dict[str, Any], final: bool) -> list[Card]:
    """The cards of a run's curves (`charts.Panel`s by metric), in the panels' order: "Final"
    when the run completed and recorded its final figures (its last logged step, which is
    the charts' last point), else "Latest"."""
    which = "Final" if final else "Latest"
    return [panel.card(f"{which} {TRAINING_CARDS.get(metric, metric)}")
            for metric, panel in panels.items()]


def last_present(values: list[Any]) -> tuple[int, Any] | tuple[None, None]:
    """The index and value of the last present (not None, not NaN) item; (None, None)."""
    for i in range(len(values) - 1, -1, -1):
        if _present(values[i]):
            return i, values[i]
    return None, None


def recovery_ceiling(config: dict) -> str | None:
    """What feature recovery can reach at most, in words: a latent matches one planted feature,
    so an SAE with fewer latents than the synthetic source's planted features recovers at most
    d_sae / features of them (384 latents for 4,096: 9.4%). None when it has enough latents, or
    the config does not say (another source, a run from before the config was stored)."""
    features = config.get("synthetic_features") if config.get("source") == "synthetic" else None
    d_in, factor = config.get("d_in"), config.get("expansion_factor")
    d_sae = config.get("d_sae") or (d_in * factor if d_in and factor else None)
    if not features or not d_sae or d_sae >= features:
        return None
    return (f"{d_sae:,} latents for {features:,} planted features: at most {d_sae / features:.1%} of them "
            "can be recovered, whatever the training.")
