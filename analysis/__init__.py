"""Plots and tables of traces and reports (`timeline`: sim and real overlaid). Nothing here
imports matplotlib until a plot is drawn."""
