"""The order of documents: shard maths, seeded random walks, and held-out splits (pure arithmetic, no I/O)."""
