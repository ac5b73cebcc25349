"""Benchmarks: how training scaled with the device count, measured; and a projection, drawn apart.
Then heterogeneous runs: each rank's share and times before and after rebalancing.

`?bench=<id>` opens one benchmark. The figures come from `sae_dist.bench` (summary,
reliability, balance), their tables and charts from `sae_dist.analytics` (bench_tables,
bench_charts): the same code as `python -m sae_dist report` and `scripts/bench_balance.py`;
this page only lays them out.
"""

import streamlit as st

from sae_dist import format as fmt
from sae_dist.analytics import balance_view as balance
from sae_dist.analytics import bench_charts, queries
from sae_dist.analytics import bench_tables as T
from sae_dist.analytics.tables import drop_quiet_columns
from sae_dist.bench import reliability, scaling
from sae_dist.bench import summary as S
from webui.sidebar import page_frame
from webui.widgets import command_hint, text_widths

engine = page_frame("Benchmarks", ":material/bar_chart:")
LINK_CHOICES = ["here", *scaling.LINKS, "measured"]


def bench_label(bench_id: int) -> str:
    b = by_id[bench_id]
    return (f"{bench_id} · {b['name']} · {b['mode']} · {'virtual ' if b['virtual'] else ''}"
            f"{b['device_kind']} {b['device_counts']} · {b['status']}")


st.title("Benchmarks", anchor=False)
st.header("Scaling", anchor=False)
st.caption("Throughput, speedup and efficiency on 1 and N devices, measured by "
           "`python -m sae_dist bench`; efficiency against ideal (N x) and against the ceiling "
           "(the same per-device work as N independent processes, no communication). Points that "
           "fail the reliability checks are drawn hollow and grey and never counted as results.")
benches = queries.list_benchmarks(engine)
by_id = {b["id"]: b for b in benches}


def scaling_section() -> None:
    if not benches:
        st.info("Run one from a terminal; it appears here as its points finish.",
                title="No benchmark yet")
        command_hint("python -m sae_dist bench --devices 1,2 --mode strong --steps 30")
        return
    requested = st.query_params.get("bench", "")
    if requested.isdigit() and int(requested) in by_id:
        st.session_state.setdefault("bench_id", int(requested))
    with st.container(horizontal=True, vertical_alignment="bottom"):
        bench_id = st.selectbox("Benchmark", list(by_id), key="bench_id", format_func=bench_label, width=520)
        other = st.selectbox("Side by side with", [None, *[i for i in by_id if i != bench_id]], key="bench_other",
                             format_func=lambda i: "—" if i is None else bench_label(i), width=420)
        link = st.segmented_control("Projection link", LINK_CHOICES, default="pcie4", key="bench_link",
                                    format_func=lambda k: scaling.LINKS[k][0].split(" (")[0] if k in scaling.LINKS
                                    else {"here": "Measured here", "measured": "Your GB/s"}[k],
                                    help="Measured here: the all-reduce bandwidth the benchmark timed between "
                                         "its devices") or "pcie4"
        if link == "measured":
            gbps = st.number_input("All-reduce GB/s", min_value=0.01, value=10.0, key="bench_gbps", width=150,
                                   help="An all-reduce bandwidth measured on your machine (e.g. nccl-tests' busbw)")
            link = str(gbps)
    st.query_params["bench"] = str(bench_id)
    if other is None:
        show(bench_id, compact=False, link=link)
    else:
        left, right = st.columns(2, gap="large")
        with left:
            st.subheader(f"Benchmark {bench_id}", anchor=False)
            show(bench_id, compact=True, link=link)
        with right:
            st.subheader(f"Benchmark {other}", anchor=False)
            show(other, compact=True, link=link)
    st.caption(f"The same report as a file: `python -m sae_dist report {bench_id} --format md|csv|html`.")


def show(bench_id: int, compact: bool, link: str) -> None:
    run, points = queries.load_benchmark(engine, bench_id)
    rows = S.summarize(points)
    for line in T.environment_lines(run):
        st.caption(line)
    if run["virtual"]:
        st.badge("virtual devices: CPU-backed figures", color="violet", icon=":material/memory:")
    if run["status"] == "FAILED":
        st.error(run["error"] or "no error recorded", title="The benchmark failed")
    if not rows:
        st.info("No point measured yet.")
        return
    try:
        link_label, bandwidth = S.link_bandwidth(link, rows)
    except ValueError as error:
        st.warning(str(error), title="Projected for PCIe 4 instead")
        link_label, bandwidth = S.link_bandwidth("pcie4")
    projection = S.projection_rows(rows, run["mode"], bandwidth)
    warning = reliability.warning_text(rows)
    if warning:
        st.warning("\n".join(f"- {line}" for line in reliability.unreliable_lines(rows)),
                   title="Unreliable points: left out of the best speedup and the projection",
                   icon=":material/warning:")
    best = S.best_speedup(rows)
    with st.container(horizontal=True):
        st.metric("Best speedup", "—" if best is None else f"{best['speedup']:.2f}× on {best['devices']}",
                  border=True, help="The highest speedup among reliable multi-device points only")
        st.metric("Reliable device counts", f"{sum(r['reliable'] for r in rows)} of {len(rows)}", border=True,
                  help=reliability.RULES_TEXT)
    st.altair_chart(bench_charts.speedup_chart(rows, projection, title=f"Speedup ({run['mode']} scaling)"),
                    alt="Measured speedup against device count, with the ideal line, targets and projection")
    if not compact:
        st.altair_chart(bench_charts.efficiency_chart(rows), alt="Efficiency against ideal and against the ceiling")
    st.markdown("**Measured**")
    st.caption(T.headline_text(rows) + ". Samples/s: median over repeats ± spread (half the range "
               "over the median).")
    for part, table in T.measured_parts(T.measured_table(rows)):
        st.caption(part)
        st.dataframe(table, hide_index=True, column_config=text_widths(T.TEXT_WIDTHS))
    with st.expander("Other load, point by point (in the order measured)", expanded=bool(warning) and not compact):
        st.caption("CPU of other processes in percent of one core (100% = one core kept busy): the "
                   "machine's busy time minus the point's own processes, just before it and while it ran. "
                   + reliability.RULES_TEXT)
        st.dataframe(drop_quiet_columns(T.other_load_table(points), T.OTHER_LOAD_QUIET), hide_index=True,
                     column_config=text_widths(T.TEXT_WIDTHS))
    comm = [r for r in rows if r["comm_share"] is not None]
    if comm:
        st.caption("Communication: the share of a DDP step spent in the gradient all-reduce, from the "
                   "same steps timed with and without it (DDP's no_sync): "
                   + ", ".join(f"{r['devices']} devices {r['comm_share']:.0%}" for r in comm) + ".")
    st.markdown(f"**Projected for {link_label}** · a model, not a measurement")
    st.caption(T.MODEL_TEXT)
    if projection:
        st.dataframe(T.projection_table(projection), hide_index=True)
        one = next(r for r in rows if r["devices"] == 1)
        worst = projection[-1]
        st.caption(f"Break-even: below {T.fmt_batch(worst['break_even_batch'])} samples per device on "
                   f"{worst['devices']} devices, the all-reduce of {fmt.fmt_bytes(one['grad_bytes'])} "
                   f"takes longer than the compute (measured batch {one['per_device_batch']:,}).")
    else:
        st.caption(T.projection_note(rows) or "No projection.")


def run_label(run: dict) -> str:
    times = f"rebalanced {run['rebalances']}×" if run["rebalances"] else "unequal shares"
    return f"{run['id']} · {run['name']} · {run['world_size']} ranks · {times} · {run['status']}"


def heterogeneous_section() -> None:
    st.header("Heterogeneous runs", anchor=False)
    st.caption("Training runs whose devices got unequal shares of each step's batch (`--balance "
               "memory|speed`, or rebalanced while one rank stayed slower). Before: the report "
               "windows up to the first rebalance, the one that triggered it included; after: "
               "those past the last rebalance. Each figure is a median over its windows.")
    runs = {r["id"]: r for r in queries.balanced_runs(engine)}
    if not runs:
        st.info("No training run has rebalanced its ranks or given them unequal shares yet.",
                title="No heterogeneous run yet")
        command_hint("python -m sae_dist train --devices cpu:2 --balance speed --steps 200")
        return
    run_id = st.selectbox("Training run", list(runs), key="balance_run",
                          format_func=lambda i: run_label(runs[i]), width=520)
    windows = queries.rank_windows(engine, run_id)
    events = queries.run_events(engine, run_id)
    metrics = balance.rows_from_columns(queries.run_step_metrics(engine, run_id, ("samples_per_s",)))
    summary = balance.balance_summary(windows, events, metrics)
    steps = summary["rebalance_steps"]
    st.caption(f"Rebalanced at step{'s' if len(steps) > 1 else ''} {', '.join(f'{s:,}' for s in steps)}"
               f": {summary['before_windows']} report windows before, {summary['after_windows']} after."
               if steps else "Never rebalanced: the shares were set at the start, so every report "
                             "window counts as before.")
    with st.container(horizontal=True):
        before, after = summary["samples_per_s_before"], summary["samples_per_s_after"]
        st.metric("Samples/s before", fmt.fmt_number(before, 3), border=True)
        st.metric("Samples/s after", fmt.fmt_number(after, 3), border=True)
        st.metric("After / before", balance.ratio_text(before, after), border=True)
        st.metric("Imbalance before", fmt.fmt_ratio(summary["imbalance_before"]), border=True,
                  help="The slowest rank's compute time over the fastest's; 1.00× is even")
        st.metric("Imbalance after", fmt.fmt_ratio(summary["imbalance_after"]), border=True)
    st.dataframe(balance.summary_table(summary), hide_index=True, key="balance_table")
    field = st.segmented_control("Time", ["compute_time_s", "step_time_s"], default="compute_time_s",
                                 key="balance_time_field", label_visibility="collapsed",
                                 format_func={"compute_time_s": "Compute time",
                                              "step_time_s": "Step time"}.get)
    chart = bench_charts.rank_time_chart(windows, events, field or "compute_time_s")
    if chart is not None:
        st.altair_chart(chart, alt="Each rank's time per step against step, rebalances marked")
    if events:
        st.markdown("**Run events**")
        st.markdown("\n".join(fmt.event_lines(events)))


scaling_section()
heterogeneous_section()
