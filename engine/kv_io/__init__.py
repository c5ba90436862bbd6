"""The I/O half of the KV tiers: what engine/kv/ (pure bookkeeping on block ids) decides, done
on tensors and files.

- offload.py: the CPU tier's tensor and the runner's offload (carries out a KVPlan's spills,
  swap-ins, disk loads and disk writes), and `build_tiers` that assembles an engine's tiers.
- disk.py: the disk tier's files (one file per block read on probe, a read cache, warm start).
- disk_format.py: the manifest that binds a directory, and the block file (header, checksum).
- disk_writer.py: the writer thread (its queue of writes, deletes and mtime refreshes).
- disk_dir.py: scanning the folder and keeping it within its byte budget.
- disk_warm.py: warm start, reading a restarted replica's disk blocks back in the background.
"""
