"""A run's life on disk: its folder, its checkpoints, and where a new start picks it up.

files.py (the run folder's names; atomic writes that never follow a link; JSON-lines reading),
lock.py (one live run per folder), store.py (the checkpoint store: list, verify, read lineage,
load, save atomically, prune, over both formats; dcp.py, its sharded one, is private to it),
resume.py (the resume planner: which checkpoint a start trusts, which run a folder holds, what
changed, and the checkpoint put back), lineage.py (a start written down: lineage.jsonl, what a
rewind sets aside, a start killed half-way finished), metrics.py (metrics.jsonl), records.py (run folders read back for
comparisons), report.py (what a run tells its user first and last). A checkpoint's way from a
save to a resume stays in store.py and resume.py. Imports the config, the process layer, the
parallel plan (the store asks it for the state and its format) and data's tokenizer file name;
nothing above.
"""
