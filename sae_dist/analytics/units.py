"""How each plotted quantity reads: its title, its axis' tick format, the format of one value.

One table for charts and cards alike: a chart's axis ticks use `axis`, its tooltip `value`,
and the card beside it `value` too (through `format.fmt_d3`, which writes numbers as d3-format
does), so a card reads exactly as the chart's last point does in its tooltip. The formats
are d3-format specifiers (what Vega-Lite takes).

Axis formats give a type and no precision ("~r", "~%"): Vega then works the precision out
from the tick step (d3-scale's tickFormat), so ticks 3.9998, 3.9999, 4 stay apart and ticks
0, 50, 100 read so, where a fixed precision writes "200.000000" or an exponent "1e+2" ("~g"
with an inferred precision does that). "r" never turns exponential, "~" trims zeros, ","
separates thousands where values run large.
"""

from __future__ import annotations

from dataclasses import dataclass

from sae_dist.format import MISSING, fmt_d3


@dataclass(frozen=True)
class Unit:
    """A plotted quantity: `title` (the chart's), `axis` (tick format), `value` (tooltip and
    card format), `suffix` written after a value on a card (" GiB"), `axis_title` (the value
    axis' title, None for none) and `factor` (from the stored unit to the plotted one)."""

    title: str
    axis: str
    value: str
    suffix: str = ""
    axis_title: str | None = None
    factor: float = 1.0

    def text(self, value: float | None) -> str:
        """One plotted value as a card shows it: "25.0%", "3.0 GiB"; "—" when missing."""
        return MISSING if value is None else fmt_d3(value, self.value) + self.suffix


STEP_AXIS_FORMAT = ",d"
"""Steps on an x axis: whole numbers, thousands separated ("12,000", never "12000.000")."""

TRAINING = {
    "loss": Unit("Loss", "~r", ".4~g"),
    "mse": Unit("MSE", "~r", ".4~g"),
    "fvu": Unit("FVU (fraction of variance unexplained)", "~r", ".4~g"),
    "explained_variance": Unit("Explained variance", "~r", ".3f"),
    "l0": Unit("L0 (active latents per sample)", "~r", ".3~g"),
    "dead_fraction": Unit("Dead latents (fraction)", "~%", ".1%"),
    "auxk_loss": Unit("AuxK loss", "~r", ".4~g"),
    "lr": Unit("Learning rate", "~e", ".2e"),
    "grad_norm": Unit("Gradient norm", "~r", ".4~g"),
    "samples_per_s": Unit("Throughput (samples/s)", ",~r", ",.0f"),
    "recovery_frac": Unit("Planted features recovered (cosine > 0.9)", "~%", ".1%"),
    "recovery_mean_cos": Unit("Mean best cosine to a planted feature", "~r", ".3f"),
    "imbalance": Unit("Imbalance (slowest / fastest rank)", "~r", ".2f", suffix="×"),
}
"""The step metrics (step_metrics columns) drawn against step."""

RANK_TIME = Unit("Time per rank", "~r", ".2f", suffix=" ms", axis_title="ms", factor=1000.0)
"""Per-rank step or compute times, stored in seconds, drawn in milliseconds."""

PEAK_MEMORY = Unit("Peak memory per rank", ",~r", ",.1f", suffix=" MiB", axis_title="MiB",
                   factor=1 / 2**20)

DEVICE = {
    "memory_used": Unit("Memory used", "~r", ".1f", suffix=" GiB", axis_title="GiB",
                        factor=1 / 2**30),
    "utilization_pct": Unit("Utilisation", "~r", ".0f", suffix="%", axis_title="%"),
    "power_w": Unit("Power", ",~r", ".0f", suffix=" W", axis_title="W"),
    "temperature_c": Unit("Temperature", "~r", ".0f", suffix=" °C", axis_title="°C"),
}
"""Device readings (gpu_samples columns) against time."""


def training_unit(metric: str) -> Unit:
    """The unit of a step metric; an unknown one (a newer trainer's) reads as itself."""
    return TRAINING.get(metric, Unit(metric, "~r", ".4~g"))
