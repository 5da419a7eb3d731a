"""Scaling studies (`megaft-scale`): the study's points (`study.py`), the command (`app.py`)
and the columns and plot `megaft-report` adds for a study's sweep dir (`report.py`)."""
