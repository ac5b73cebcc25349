"""What the app, the reports and the CLIs show, without Streamlit: all of the project's presentation.

Reading: `queries` (training runs, benchmarks), `samples` (device readings, downsampled by
the database), `jobs` (the scheduler's jobs, read-only). Shaping, pure functions of plain
data: `format` (the one duration, byte and percent formatter, and every other number's text),
`tables` (the pages' table rows), `bench_tables` (a benchmark's tables, shared with its
report), `devices`, `cards`, `events`, `units`, `downsample`. Drawing, with Altair and
pandas: `charts` (training runs), `bench_charts` (benchmarks), `evaluation_view` (an SAE
evaluation's cards and density chart).

This package never imports Streamlit or the scheduler (the trainer must run without either),
and `format` imports the standard library only, so that torch-free callers can use it. The chart
modules are imported on their own (`from sae_dist.analytics import charts`), not from here.
"""
