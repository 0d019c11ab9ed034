"""Where the PLE n-gram table lives (spec/engine.md §6, issue 22): on the device, in pinned host memory,
or in the checkpoint's files read by a separate worker process.

- placement.py: the `ple_placement` setting (argument or environment) and the disk worker's options;
- shards.py, ngram_host.py, worker.py: torch-free (the worker imports only numpy): the shard files'
  byte layout, the n-gram ids on the host, the worker process;
- table.py: the table objects the PLE layer looks rows up in; load.py: checking and loading them;
- disk.py: the GPU process's side of the worker (shared memory, the per-step protocol, the watchdog).
"""
