"""recsys: train DLRM models whose embedding tables do not fit the device.

Data flows through the packages in this order:
  data (shards, loader, jagged batches) -> embeddings (stores, cache, prefetcher,
  collection) -> model (DLRM) -> train (trainer, metrics, checkpoints).
"""
