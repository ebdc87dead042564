"""Plots and tables of traces and reports."""
