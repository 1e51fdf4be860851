"""Checkpoints: `files` (names, the newest ones in a folder, leftovers, pruning; no torch),
`state` (what a checkpoint holds, written atomically, loaded safely) and `writer` (a background
thread that writes them, so the training thread only makes a host copy)."""
