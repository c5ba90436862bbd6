"""The I/O half of the KV tiers: what engine/kv/ (pure bookkeeping on block ids) decides, done
on tensors and files.

- offload.py: the CPU tier's tensor and the runner's offload (carries out a KVPlan's spills,
  swap-ins, disk loads and disk writes), and `build_tiers` that assembles an engine's tiers.
- disk.py: the disk tier's files (one file per block, a manifest, a writer thread, a read cache).
- disk_dir.py: scanning the folder and keeping it within its byte budget.
- disk_warm.py: warm start, reading a restarted replica's disk blocks back in the background.
"""
