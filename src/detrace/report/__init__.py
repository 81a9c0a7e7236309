"""Renderers of results for people: terminal.py (terminal summaries of diff and certify), html.py (the report)."""
