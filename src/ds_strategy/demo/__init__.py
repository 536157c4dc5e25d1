"""The main job (``python -m ds_strategy.demo``): a small GPT trained on a text corpus that ships with
every Python installation, on 2 CPU processes, showing the package at work."""
