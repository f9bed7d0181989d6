"""Figures (seaborn, PNG + PDF) for the studies."""
