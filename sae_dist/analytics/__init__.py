"""What the app shows, without Streamlit: read-only queries, downsampling, formatting, charts.

The pages stay thin by calling these. This package never imports Streamlit or the
scheduler (the trainer must run without either); `charts` needs Altair and pandas, so it
is imported on its own (`from sae_dist.analytics import charts`), not from here.
"""
