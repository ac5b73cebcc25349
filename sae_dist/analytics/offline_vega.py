"""Vega-Lite charts in a standalone html file that draws them with no network: the vega,
vega-lite and vega-embed JavaScript inlined from the pinned `vl-convert-python` package
(`vl_convert.javascript_bundle`), not loaded from a CDN, so a report opened offline, or
from an archive years later, still shows its charts.

The bundle holds the Vega-Lite version Altair writes its specs for, where vl-convert has it.
"""

from __future__ import annotations

import json
import re
from typing import Any


def bundle_version(schema_version: str, available: list[str]) -> str | None:
    """The vl-convert name ("6_4") of Altair's Vega-Lite `schema_version` ("v6.4.1") when
    vl-convert bundles it (`available`: "6.4", ...); None (vl-convert's latest) otherwise."""
    major_minor = schema_version.lstrip("v").split(".")[:2]
    return "_".join(major_minor) if ".".join(major_minor) in available else None


def json_in_script(value: Any) -> str:
    """`value` as JSON safe inside an html <script> element: "</script" would end the element
    early and "<!--" change how it is read (a run's name is the user's text); "<" can only be
    in a JSON string, where "\\u003c" means the same."""
    return json.dumps(value).replace("<", "\\u003c")


def script_safe(code: str) -> str:
    """JavaScript `code` that cannot end its <script> element early (only a string can hold
    "</script"; there "<\\/script" means the same)."""
    return re.sub(r"</(script)", r"<\\/\1", code, flags=re.IGNORECASE)


def embed_calls(charts: dict[str, dict[str, Any]]) -> str:
    """JavaScript drawing each Vega-Lite spec into the element of its id, as SVG (what a test
    or a reader's tools can inspect) and without vega-embed's actions menu (it links to the
    online Vega editor)."""
    options = json.dumps({"renderer": "svg", "actions": False})
    return "\n".join(f"vegaEmbed({json.dumps('#' + element)}, {json_in_script(spec)}, {options});"
                     for element, spec in charts.items())


def javascript_bundle() -> str:
    """vega + vega-lite + vega-embed as one script defining `vegaEmbed` globally (about
    0.9 MB; built once per process, some 2 s)."""
    import altair as alt
    import vl_convert

    version = bundle_version(alt.SCHEMA_VERSION, vl_convert.get_vegalite_versions())
    return script_safe(vl_convert.javascript_bundle(vl_version=version))


def charts_script(charts: dict[str, dict[str, Any]]) -> str:
    """The <script> elements that draw `charts` ({element id: Vega-Lite spec}) offline."""
    return (f'<script type="text/javascript">\n{javascript_bundle()}\n</script>\n'
            f'<script type="text/javascript">\n{embed_calls(charts)}\n</script>')
