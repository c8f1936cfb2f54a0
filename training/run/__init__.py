"""A run's life on disk: atomic run files (files.py), the folder's lock (lock.py), checkpoints
(store.py, and dcp.py for sharded ones), resume and lineage (resume.py), run folders read back
(records.py) and what a run tells its user (report.py).
"""
