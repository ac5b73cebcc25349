"""Benchmarks: how training scaled with the device count, measured; and a projection, drawn apart.

`?bench=<id>` opens one benchmark. Tables and charts come from `sae_dist.bench` (summary,
report, charts), the same code as `python -m sae_dist report`; this page only lays them out.
"""

import streamlit as st

from sae_dist.bench import charts, report, scaling
from sae_dist.bench import summary as S
from webui.sidebar import page_frame

engine = page_frame("Benchmarks", ":material/bar_chart:")
LINK_CHOICES = ["here", *scaling.LINKS, "measured"]


def bench_label(bench_id: int) -> str:
    b = by_id[bench_id]
    return (f"{bench_id} · {b['name']} · {b['mode']} · {'virtual ' if b['virtual'] else ''}"
            f"{b['device_kind']} {b['device_counts']} · {b['status']}")


st.title("Benchmarks", anchor=False)
st.caption("Throughput, speedup and efficiency on 1 and N devices, measured by "
           "`python -m sae_dist bench`; efficiency against ideal (N x) and against the ceiling "
           "(the same per-device work as N independent processes, no communication).")
benches = report.list_benchmarks(engine)
if not benches:
    st.info("Run one from a terminal; it appears here as its points finish.", title="No benchmark yet")
    st.code("python -m sae_dist bench --devices 1,2 --mode strong --steps 30", language="bash")
    st.stop()
by_id = {b["id"]: b for b in benches}
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


def show(bench_id: int, compact: bool) -> None:
    run, points = report.load_benchmark(bench_id, engine)
    rows = S.summarize(points)
    for line in report.environment_lines(run):
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
    st.altair_chart(charts.speedup_chart(rows, projection, title=f"Speedup ({run['mode']} scaling)"),
                    alt="Measured speedup against device count, with the ideal line, targets and projection")
    if not compact:
        st.altair_chart(charts.efficiency_chart(rows), alt="Efficiency against ideal and against the ceiling")
    st.markdown("**Measured**")
    st.dataframe(report.measured_table(rows), hide_index=True)
    comm = [r for r in rows if r["comm_share"] is not None]
    if comm:
        st.caption("Communication: the share of a DDP step spent in the gradient all-reduce, from the "
                   "same steps timed with and without it (DDP's no_sync): "
                   + ", ".join(f"{r['devices']} devices {r['comm_share']:.0%}" for r in comm) + ".")
    st.markdown(f"**Projected for {link_label}** · a model, not a measurement")
    st.caption(S.MODEL_TEXT)
    if projection:
        st.dataframe(report.projection_table(projection), hide_index=True)
        one = next(r for r in rows if r["devices"] == 1)
        worst = projection[-1]
        st.caption(f"Break-even: below {report.fmt_batch(worst['break_even_batch'])} samples per device on "
                   f"{worst['devices']} devices, the all-reduce of {report.fmt_bytes(one['grad_bytes'])} "
                   f"takes longer than the compute (measured batch {one['per_device_batch']:,}).")
    else:
        st.caption("No 1-device point to project from.")


if other is None:
    show(bench_id, compact=False)
else:
    left, right = st.columns(2, gap="large")
    with left:
        st.subheader(f"Benchmark {bench_id}", anchor=False)
        show(bench_id, compact=True)
    with right:
        st.subheader(f"Benchmark {other}", anchor=False)
        show(other, compact=True)
st.caption(f"The same report as a file: `python -m sae_dist report {bench_id} --format md|csv|html`.")
