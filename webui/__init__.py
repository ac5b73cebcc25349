"""Streamlit-only helpers of the app (the page frame and its sidebar).

Kept out of `sae_dist`, which must never import Streamlit; the app's logic lives in
`sae_dist.analytics`, and this package holds only what needs `st`.
"""
