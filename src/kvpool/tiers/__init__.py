"""Where KV bytes live: the storage protocol and its numpy and torch data planes, the copy plan,
the disk tier's files and manifest, and the remote store library (:mod:`~kvpool.tiers.remote`).
Tier libraries never import the block manager (:mod:`kvpool.core`)."""
