"""Renderers of results for people: terminal.py (terminal summaries); an HTML report joins it later."""
