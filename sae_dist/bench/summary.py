"""A benchmark's points turned into its table: one row per device count. Pure functions over
plain dicts (the benchmark_points rows), so the app, the report and the tests share them."""

from __future__ import annotations

from sae_dist.bench import reliability, scaling

PROJECTED_COUNTS = (2, 4, 8)


def summarize(points: list[dict]) -> list[dict]:
    """Per device count: median DDP throughput over repeats (and its spread), speedup and
    efficiency against the 1-device median, the ceiling's median (and spread) and the efficiency
    against it, the median communication share, the largest peak memory, the mean utilisation,
    the most other load any of its points saw, and whether it can be trusted (`reliable`,
    `reason`: see sae_dist.bench.reliability)."""
    by_n: dict[int, dict[str, list[dict]]] = {}
    for p in points:
        by_n.setdefault(p["devices"], {}).setdefault(p["kind"], []).append(p)
    base = by_n.get(1, {}).get("ddp")
    base_tp = scaling.median([p["samples_per_s"] for p in base]) if base else None
    rows = []
    for n in sorted(by_n):
        ddp = by_n[n].get("ddp", [])
        if not ddp:
            continue
        tp = [p["samples_per_s"] for p in ddp]
        throughput = scaling.median(tp)
        # One device has no communication: it is its own ceiling (the same measurement).
        ceiling_points = by_n[n].get("ceiling") or (ddp if n == 1 else [])
        ceiling_tp = [p["samples_per_s"] for p in ceiling_points]
        ceiling = scaling.median(ceiling_tp) if ceiling_tp else None
        speedup = scaling.speedup(throughput, base_tp) if base_tp else None
        shares = [p["comm_share"] for p in ddp if p.get("comm_share") is not None]
        memory = [p["peak_memory"] for p in ddp if p.get("peak_memory") is not None]
        util = [p["mean_utilization_pct"] for p in ddp if p.get("mean_utilization_pct") is not None]
        rows.append({
            "devices": n, "repeats": len(ddp), "per_device_batch": ddp[0]["per_device_batch"],
            "samples_per_s": throughput, "spread": scaling.spread(tp),
            "step_s": scaling.median([p["step_s"] for p in ddp]),
            "speedup": speedup,
            "efficiency": scaling.efficiency(speedup, n) if speedup is not None else None,
            "ceiling_samples_per_s": ceiling,
            "ceiling_speedup": scaling.speedup(ceiling, base_tp) if ceiling and base_tp else None,
            "efficiency_vs_ceiling": scaling.efficiency_vs_ceiling(throughput, ceiling) if ceiling else None,
            "comm_share": scaling.median(shares) if shares else None,
            "peak_memory": max(memory) if memory else None,
            "mean_utilization_pct": sum(util) / len(util) if util else None,
            "grad_bytes": ddp[0].get("grad_bytes"),
            "allreduce_bytes_per_s": _median_known([p.get("allreduce_bytes_per_s") for p in ddp]),
            "target_speedup": scaling.TARGET_SPEEDUP.get(n),
            "ceiling_spread": scaling.spread(ceiling_tp) if n > 1 and ceiling_tp else None,
            **_other_load(ddp + by_n[n].get("ceiling", [])),
        })
    return reliability.judge(rows)


def _other_load(points: list[dict]) -> dict:
    """The most other load any of these points saw while it ran (CPU: percent of one core; GPU:
    the busiest other process's SM utilisation); None where none was recorded."""
    loads = [reliability.point_load(p.get("other_load_json")) for p in points]
    cpu = [(load["cpu_pct"], load["top"]) for load in loads if load["cpu_pct"] is not None]
    gpu = [load["gpu_pct"] for load in loads if load["gpu_pct"] is not None]
    worst = max(cpu, key=lambda c: c[0]) if cpu else (None, "")
    return {"other_cpu_pct": worst[0], "other_cpu_top": worst[1],
            "other_gpu_pct": max(gpu) if gpu else None,
            "other_gpu_unknown": max((load["gpu_unknown"] for load in loads), default=0),
            "other_jobs": sorted({(j["id"], j["name"], j["user"]) for load in loads for j in load["jobs"]})}


def best_speedup(rows: list[dict]) -> dict | None:
    """The headline: the reliable multi-device row with the highest speedup (None without one)."""
    ok = [r for r in rows if r["devices"] > 1 and r.get("reliable", True) and r["speedup"] is not None]
    return max(ok, key=lambda r: r["speedup"]) if ok else None


def _median_known(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return scaling.median(known) if known else None


def link_bandwidth(link: str, rows: list[dict] | None = None) -> tuple[str, float]:
    """(label, bytes/s) of a preset name, of `here` (the all-reduce bandwidth this benchmark
    measured on its largest device count), or of a bandwidth given in GB/s."""
    if link in scaling.LINKS:
        return scaling.LINKS[link]
    if link == "here":
        measured = [r for r in rows or [] if r.get("allreduce_bytes_per_s")]
        if not measured:
            raise ValueError("link 'here': this benchmark measured no all-reduce (it needs a point on "
                             "2 or more devices)")
        top = max(measured, key=lambda r: r["devices"])
        return (f"all-reduce measured here on {top['devices']} devices "
                f"({top['allreduce_bytes_per_s'] / 1e9:.2f} GB/s)", top["allreduce_bytes_per_s"])
    try:
        gbps = float(link)
    except ValueError:
        raise ValueError(f"link {link!r}: choose one of {', '.join(scaling.LINKS)}, here, or give a "
                         "measured all-reduce bandwidth in GB/s, e.g. 18.5") from None
    if gbps <= 0:
        raise ValueError(f"link {link!r}: the bandwidth must be positive")
    return f"measured all-reduce bandwidth {gbps:g} GB/s", gbps * 1e9


def projection_rows(rows: list[dict], mode: str, bandwidth: float,
                    counts: tuple[int, ...] = PROJECTED_COUNTS) -> list[dict]:
    """Expected speedup on `counts` devices from the 1-device row (step time, gradient size,
    batch): a model, not a measurement. Empty without a reliable 1-device row
    (`analytics.bench_tables.projection_note` says why)."""
    one = next((r for r in rows if r["devices"] == 1), None)
    if one is None or not one.get("reliable", True) or not one.get("grad_bytes"):
        return []
    out = []
    for n in counts:
        p = scaling.project(one["step_s"], one["grad_bytes"], bandwidth, n, mode)
        out.append({"devices": n, "speedup_no_overlap": p.speedup_no_overlap,
                    "speedup_overlap": p.speedup_overlap, "step_no_overlap_s": p.step_no_overlap_s,
                    "step_overlap_s": p.step_overlap_s,
                    "allreduce_s": scaling.allreduce_time(n, one["grad_bytes"], bandwidth),
                    "break_even_batch": scaling.break_even_batch(one["step_s"], one["per_device_batch"],
                                                                 one["grad_bytes"], bandwidth, n)})
    return out
