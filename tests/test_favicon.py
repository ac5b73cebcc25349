"""The app's favicons are local files: a ":material/name:" page icon would make the browser
fetch the icon from fonts.gstatic.com (Streamlit's frontend builds that URL), and the app
reaches no host but its own. The config keeps usage statistics off for the same reason."""

from __future__ import annotations

import tomllib

import pytest
from streamlit.commands.page_config import _get_favicon_string

from conftest import REPO
from webui.sidebar import PAGES, favicon


def test_every_page_icon_has_a_local_svg_favicon():
    for _, _, icon in PAGES:
        path = favicon(icon)
        text = open(path).read()
        assert text.startswith("<svg ") and 'xmlns="http://www.w3.org/2000/svg"' in text and "<path " in text
        # What Streamlit sends the browser for it: the picture itself, inline, not a URL to fetch.
        assert _get_favicon_string(path).startswith("data:image/svg+xml;base64,")


def test_favicon_keeps_an_emoji_and_names_a_missing_icon():
    assert favicon("🚀") == "🚀"
    with pytest.raises(ValueError, match="webui/icons/no_such_icon.svg"):
        favicon(":material/no_such_icon:")


def test_the_config_sends_no_usage_statistics():
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert config["browser"]["gatherUsageStats"] is False
