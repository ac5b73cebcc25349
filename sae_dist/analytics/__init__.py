"""What the app, the reports and the CLIs show, without Streamlit: all of the project's presentation.

Reading: `queries` (training runs, benchmarks), `samples` (device readings, downsampled by the
database), `jobs` (the scheduler's jobs, read-only). Shaping, pure functions of plain data, with
numbers written through `sae_dist.format` (the one formatter of every layer): `tables` (the pages'
table rows), `bench_tables` (a benchmark's tables, shared with its report), `balance_view` (a
rebalanced run's periods), `devices`, `cards`, `events`, `units`, `downsample`. Drawing, with
Altair and pandas: `charts` (training runs), `bench_charts` (benchmarks), `evaluation_view` (an
SAE evaluation's cards and density chart). Writing: `bench_report` (a benchmark's md, csv or html
file).

It reads the pure figures of `sae_dist.bench` (summary, reliability, scaling), never the other
way round, and never imports Streamlit or the scheduler (the trainer must run without either).
The chart modules are imported on their own (`from sae_dist.analytics import charts`), not from
here.
"""
