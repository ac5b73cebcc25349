"""Run the app's Overview, Monitor (both views) and Train page under Streamlit's AppTest and print what they
show as JSON: run as a separate process (`python tests/fake_nvml/app_pages.py REPO`), so that
the emulated libnvidia-ml.so.1 is found through that process's LD_LIBRARY_PATH."""

import json
import sys

from streamlit.testing.v1 import AppTest

REPO = sys.argv[1]
out = {}
at = AppTest.from_file(f"{REPO}/app.py", default_timeout=60).run()
out["overview_exception"] = [str(e.value) for e in at.exception]
out["overview_markdown"] = [m.value for m in at.markdown]
out["overview_caption"] = [c.value for c in at.caption]
for view in ("Aggregated", "Per-GPU"):
    at = AppTest.from_file(f"{REPO}/app.py", default_timeout=60).run()
    at.switch_page("pages/2_Monitor.py").run()
    if view == "Per-GPU":
        at.segmented_control(key="monitor_view").set_value("Per-GPU").run()
    out[view] = {"exception": [str(e.value) for e in at.exception],
                 "metrics": [(m.label, m.value) for m in at.metric],
                 "markdown": [m.value for m in at.markdown], "caption": [c.value for c in at.caption],
                 "warning": [w.value for w in at.warning],
                 # each chart's y axis title (its unit): a sensor nobody measured has no chart, not a line at 0
                 "chart_units": [json.loads(c.proto.spec).get("encoding", {}).get("y", {}).get("title")
                                 for c in at.get("vega_lite_chart")]}
at = AppTest.from_file(f"{REPO}/app.py", default_timeout=60).run()
at.switch_page("pages/1_Train.py").run()
at.number_input(key="tr_n_gpus").set_value(2).run()
out["train"] = {"exception": [str(e.value) for e in at.exception],
                "checked": [u for u in at.session_state["tr_uuids"] if at.checkbox(key=f"tr_dev_{u}").value]}
print(json.dumps(out))
