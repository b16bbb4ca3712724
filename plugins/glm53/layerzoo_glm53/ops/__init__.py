"""The plugin's own ops, one folder each (``reference.py`` plain torch; ``triton.py`` where written)."""
